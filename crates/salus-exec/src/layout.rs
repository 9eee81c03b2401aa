//! Where each node's operands lie, worked out once per [`crate::Program`]: byte ranges of
//! the inputs (persistent block or lane), of the outputs and of the scratch in the lane,
//! and the lane's cut into disjoint pieces. An iteration then only slices; it computes
//! no location and allocates nothing per node.
//!
//! Backends read a program's layouts through [`crate::Program::layouts`]; only the program
//! builds them.

use std::ops::Range;

use salus_graph::{Graph, MemoryPlan, Op};

/// Where one input of a node is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InputAt {
    /// An optional tensor given as `None`.
    Absent,
    /// In the lane, at these bytes of it.
    Lane(Range<usize>),
    /// In the persistent block, at these bytes of it.
    Persistent(Range<usize>),
    /// In output 0's bytes: the node runs in place over it.
    InOutput,
    /// A tensor without memory (no bytes).
    Empty,
}

/// What a piece of the lane is to a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// Inputs read there.
    Read,
    /// Output `j` is written there.
    Write(usize),
    /// The kernel's scratch.
    Scratch,
}

/// One node's operands.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct NodeLayout {
    /// A view planned onto its input's bytes: they already hold its value.
    pub skip: bool,
    /// Where each input is, in the node's input order.
    pub inputs: Vec<InputAt>,
    /// The lane cut into disjoint, sorted pieces (byte ranges of the lane).
    pub cuts: Vec<(Range<usize>, Piece)>,
    /// Outputs of no bytes: they take no piece of the lane (the plan may put them
    /// anywhere, even at the start of another tensor) and get an empty slice.
    pub empty_outputs: Vec<usize>,
    /// Why the node cannot run (its planned memory overlaps), reported when it runs.
    pub error: Option<String>,
}

fn range(offset: u64, len: u64) -> Range<usize> {
    offset as usize..(offset + len) as usize
}

/// Ops whose output may be planned onto an input's bytes holding the same value.
fn is_view(op: Op) -> bool {
    matches!(
        op,
        Op::View | Op::Unsqueeze | Op::SqueezeDims | Op::Clone | Op::ToCopy
    )
}

/// Every node's layout under `plan`.
pub(crate) fn layouts(graph: &Graph, plan: &MemoryPlan) -> Vec<NodeLayout> {
    let bytes = |id: usize| graph.tensors[id].ty.bytes().unwrap_or(0);
    let persistent = |id: usize| plan.persistent_offsets.get(id).copied().flatten();
    let lane = |id: usize| {
        if persistent(id).is_some() {
            None
        } else {
            plan.lane_offset(id)
        }
    };
    graph
        .nodes
        .iter()
        .enumerate()
        .map(|(index, node)| {
            let outputs: Vec<Option<Range<usize>>> = node
                .outputs
                .iter()
                .map(|o| o.and_then(|id| lane(id).map(|off| range(off, bytes(id)))))
                .collect();
            let out0 = outputs.first().cloned().flatten();
            let skip = is_view(node.op)
                && node
                    .inputs
                    .first()
                    .copied()
                    .flatten()
                    .zip(out0.clone())
                    .is_some_and(|(input, out)| lane(input) == Some(out.start as u64));
            let mut cuts: Vec<(Range<usize>, Piece)> = Vec::new();
            let inputs = node
                .inputs
                .iter()
                .map(|input| {
                    let Some(id) = *input else {
                        return InputAt::Absent;
                    };
                    if let Some(off) = lane(id) {
                        let r = range(off, bytes(id));
                        // Tensors of no bytes are never in place and take no piece.
                        if r.is_empty() {
                            return InputAt::Empty;
                        }
                        if out0.as_ref().is_some_and(|o| *o == r) {
                            return InputAt::InOutput;
                        }
                        cuts.push((r.clone(), Piece::Read));
                        InputAt::Lane(r)
                    } else if let Some(off) = persistent(id) {
                        InputAt::Persistent(range(off, bytes(id)))
                    } else {
                        InputAt::Empty
                    }
                })
                .collect();
            let mut empty_outputs = Vec::new();
            for (j, r) in outputs.iter().enumerate() {
                match r {
                    Some(r) if r.is_empty() => empty_outputs.push(j),
                    Some(r) => cuts.push((r.clone(), Piece::Write(j))),
                    None => {}
                }
            }
            if let Some((off, len)) = plan.scratch(index) {
                cuts.push((range(off, len), Piece::Scratch));
            }
            cuts.sort_by_key(|(r, _)| (r.start, r.end));
            // Merge overlapping reads; any other overlap is a planning error.
            let mut merged: Vec<(Range<usize>, Piece)> = Vec::new();
            let mut error = None;
            for (r, piece) in cuts {
                if let Some((last, last_piece)) = merged.last_mut()
                    && r.start < last.end
                {
                    if *last_piece == Piece::Read && piece == Piece::Read {
                        last.end = last.end.max(r.end);
                        continue;
                    }
                    error.get_or_insert(format!("planned memory overlaps: {last:?} and {r:?}"));
                }
                merged.push((r, piece));
            }
            NodeLayout {
                skip,
                inputs,
                cuts: merged,
                empty_outputs,
                error,
            }
        })
        .collect()
}
