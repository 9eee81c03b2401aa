//! The CPU device: the arena in host memory, kernels on the host's cores.
//!
//! An iteration borrows its session's persistent block and its lane from the arena, copies
//! the feeds into the lane, runs every node with its inputs and outputs carved out of those
//! two regions at the plan's offsets (no allocation per tensor), copies the fetches out, and
//! only then writes the updates into the persistent block: an iteration that fails leaves
//! the session's state as it was.

use std::ops::Range;
use std::time::Instant;

use salus_graph::{Node, Op};

use crate::arena::Arena;
use crate::kernels::{self, Arg, Out};
use crate::{Device, ExecError, Location, Outcome, Placement, Program};

/// The CPU device.
pub struct CpuDevice {
    arena: Arena,
}

impl CpuDevice {
    /// A CPU device managing `capacity` bytes of host memory.
    pub fn new(capacity: u64) -> Result<CpuDevice, ExecError> {
        Ok(CpuDevice {
            arena: Arena::new(capacity)?,
        })
    }
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

/// Runs one node: inputs from the persistent block or the lane, outputs into the lane.
fn run_node(
    program: &Program,
    index: usize,
    node: &Node,
    persistent: &[u8],
    lane: &mut [u8],
) -> Result<(), ExecError> {
    let graph = program.graph();
    let fail = |message: String| ExecError::Node {
        index,
        name: node.name.clone(),
        op: node.op.name().to_string(),
        message,
    };
    let out_ranges: Vec<Option<Range<usize>>> = node
        .outputs
        .iter()
        .map(|o| {
            o.and_then(|id| match program.location(id) {
                Some(Location::Lane(off)) => Some(range(off, program.bytes(id))),
                _ => None,
            })
        })
        .collect();
    // A view planned onto its input's bytes already holds its value.
    if is_view(node.op)
        && let (Some(Some(input)), Some(Some(out))) = (node.inputs.first(), out_ranges.first())
        && program.location(*input) == Some(Location::Lane(out.start as u64))
    {
        return Ok(());
    }
    // Split the lane into disjoint pieces: one per output, one per run of input bytes.
    // Tensors of no bytes take no piece: the plan may put them anywhere, even at the
    // start of another tensor, and they are never in place.
    enum Piece {
        Read,
        Write(usize),
    }
    let mut cuts: Vec<(Range<usize>, Piece)> = Vec::new();
    let mut in_place = vec![false; node.inputs.len()];
    for (k, input) in node.inputs.iter().enumerate() {
        if let Some(id) = input
            && let Some(Location::Lane(off)) = program.location(*id)
        {
            let r = range(off, program.bytes(*id));
            if r.is_empty() {
                continue;
            }
            if out_ranges
                .first()
                .cloned()
                .flatten()
                .is_some_and(|o| o == r)
            {
                in_place[k] = true;
            } else {
                cuts.push((r, Piece::Read));
            }
        }
    }
    for (j, r) in out_ranges.iter().enumerate() {
        if let Some(r) = r
            && !r.is_empty()
        {
            cuts.push((r.clone(), Piece::Write(j)));
        }
    }
    cuts.sort_by_key(|(r, _)| (r.start, r.end));
    // Merge overlapping reads; any overlap involving a write is a planning error.
    let mut merged: Vec<(Range<usize>, Piece)> = Vec::new();
    for (r, piece) in cuts {
        if let Some((last, last_piece)) = merged.last_mut()
            && r.start < last.end
        {
            match (&*last_piece, &piece) {
                (Piece::Read, Piece::Read) => {
                    last.end = last.end.max(r.end);
                    continue;
                }
                _ => return Err(fail(format!("planned memory overlaps: {last:?} and {r:?}"))),
            }
        }
        merged.push((r, piece));
    }
    let mut reads: Vec<(Range<usize>, &[u8])> = Vec::new();
    let mut writes: Vec<Option<&mut [u8]>> = (0..node.outputs.len()).map(|_| None).collect();
    let mut rest: &mut [u8] = lane;
    let mut at = 0;
    for (r, piece) in merged {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (chunk, tail) = tail.split_at_mut(r.end - r.start);
        rest = tail;
        at = r.end;
        match piece {
            Piece::Read => reads.push((r, chunk)),
            Piece::Write(j) => writes[j] = Some(chunk),
        }
    }
    for (j, r) in out_ranges.iter().enumerate() {
        if r.as_ref().is_some_and(Range::is_empty) {
            writes[j] = Some(&mut []);
        }
    }
    let lookup = |r: Range<usize>| -> &[u8] {
        reads
            .iter()
            .find(|(span, _)| span.start <= r.start && r.end <= span.end)
            .map(|(span, bytes)| &bytes[r.start - span.start..r.end - span.start])
            .unwrap_or(&[])
    };
    let args: Vec<Arg<'_>> = node
        .inputs
        .iter()
        .enumerate()
        .map(|(k, input)| match input {
            None => Arg::Absent,
            Some(id) => {
                let ty = &graph.tensors[*id].ty;
                match program.location(*id) {
                    _ if in_place[k] => Arg::InOutput(ty),
                    Some(Location::Lane(off)) => {
                        Arg::Tensor(ty, lookup(range(off, program.bytes(*id))))
                    }
                    Some(Location::Persistent(off)) => {
                        Arg::Tensor(ty, &persistent[range(off, program.bytes(*id))])
                    }
                    None => Arg::Tensor(ty, &[]),
                }
            }
        })
        .collect();
    let mut outs: Vec<Option<Out<'_>>> = node
        .outputs
        .iter()
        .zip(writes)
        .map(|(o, bytes)| {
            Some(Out {
                ty: &graph.tensors[(*o)?].ty,
                bytes: bytes?,
            })
        })
        .collect();
    kernels::run(node, &args, &mut outs).map_err(fail)
}

impl Device for CpuDevice {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn capacity(&self) -> u64 {
        self.arena.len()
    }

    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), ExecError> {
        let mut region = self.arena.borrow(offset, bytes.len() as u64)?;
        region.copy_from_slice(bytes);
        Ok(())
    }

    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ExecError> {
        Ok(self.arena.borrow(offset, len)?.to_vec())
    }

    fn run(&self, program: &Program, at: Placement, feeds: &[&[u8]]) -> Result<Outcome, ExecError> {
        let start = Instant::now();
        let plan = program.plan();
        let graph = program.graph();
        program.check_feeds(feeds)?;
        let mut persistent = self.arena.borrow(at.persistent, plan.persistent_bytes)?;
        let mut lane = self.arena.borrow(at.lane, plan.ephemeral_bytes)?;
        for (&id, bytes) in program.feeds().iter().zip(feeds) {
            if let Some(Location::Lane(off)) = program.location(id) {
                lane[range(off, program.bytes(id))].copy_from_slice(bytes);
            }
        }
        for (index, node) in graph.nodes.iter().enumerate() {
            run_node(program, index, node, &persistent, &mut lane)?;
        }
        let read = |id: usize, persistent: &[u8], lane: &[u8]| -> Vec<u8> {
            match program.location(id) {
                Some(Location::Lane(off)) => lane[range(off, program.bytes(id))].to_vec(),
                Some(Location::Persistent(off)) => {
                    persistent[range(off, program.bytes(id))].to_vec()
                }
                None => Vec::new(),
            }
        };
        let fetches = graph
            .fetches
            .iter()
            .map(|&f| read(f, &persistent, &lane))
            .collect();
        for u in &graph.updates {
            // Validation guarantees targets are persistent and values are not.
            if let (Some(Location::Persistent(target)), Some(Location::Lane(value))) =
                (program.location(u.target), program.location(u.value))
            {
                persistent[range(target, program.bytes(u.target))]
                    .copy_from_slice(&lane[range(value, program.bytes(u.value))]);
            }
        }
        Ok(Outcome {
            fetches,
            duration: start.elapsed(),
        })
    }
}
