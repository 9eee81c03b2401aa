//! Adds folded into the node that makes one of their operands: an `add.Tensor` (alpha 1,
//! no broadcast) whose operand `o` is made by a product cuBLAS runs (`mm`, `addmm`) or by
//! layer norm's backward (its input gradient), and read by nothing else (through views
//! planned onto its bytes), is not run; the producer writes the add's output instead, with
//! the other operand `r` added in: a product starts from `r` (plus the bias) and
//! accumulates (cuBLAS's `beta` 1), layer norm's backward adds `r` as it writes. A
//! residual connection's add (`x + linear(...)`, the gradient through a block plus the
//! gradient around it) then costs no pass of its own.
//!
//! The producer writes the add's output earlier than the plan says, so the output's bytes
//! must not overlap anything the producer reads or writes, except `r`'s own bytes exactly
//! (each element of `r` is read where the same element of the output is written), nor
//! anything a node between the two reads or writes; and `r` must be made before the
//! producer.

use std::ops::Range;

use salus_exec::Program;
use salus_graph::{DType, Op, OpParams};

use super::fusion::{
    FusionPlan, lane_range, node_writes, overlaps, read_at_end, tensor_producers, tensor_readers,
};

/// What a producer folds in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Epilogue {
    /// The add's output: the producer writes it.
    pub out: usize,
    /// The add's other operand, added in.
    pub residual: usize,
}

/// The adds folded into their producers.
#[derive(Debug, Clone, Default)]
pub(crate) struct Epilogues {
    /// Per node: a producer's epilogue.
    into: Vec<Option<Epilogue>>,
    /// Per node: a folded add, lowered to nothing.
    skip: Vec<bool>,
}

impl Epilogues {
    /// Nothing folded.
    #[cfg(test)]
    pub(crate) fn none() -> Epilogues {
        Epilogues::default()
    }

    /// The epilogue node `index` runs, if it is a producer an add folded into.
    pub(crate) fn of(&self, index: usize) -> Option<Epilogue> {
        self.into.get(index).copied().flatten()
    }

    /// Whether node `index` is a folded add.
    pub(crate) fn skips(&self, index: usize) -> bool {
        self.skip.get(index).copied().unwrap_or(false)
    }
}

/// Whether node `p` can write a sum into its output: a product on cuBLAS, or layer norm's
/// backward for its input gradient (output 0).
fn can_add_into(program: &Program, p: usize, o: usize) -> bool {
    let graph = program.graph();
    let node = &graph.nodes[p];
    let float = |t: &usize| {
        matches!(
            graph.tensors[*t].ty.dtype,
            DType::F32 | DType::F16 | DType::Bf16
        )
    };
    match node.op {
        // As `matmul` lowers them onto cuBLAS: every operand of one float type, no empty dim.
        Op::Mm | Op::Addmm => {
            let operands: Vec<usize> = node
                .inputs
                .iter()
                .chain(&node.outputs)
                .flatten()
                .copied()
                .collect();
            let dtype = graph.tensors[o].ty.dtype;
            float(&o)
                && operands.iter().all(|&t| graph.tensors[t].ty.dtype == dtype)
                && operands
                    .iter()
                    .all(|&t| !graph.tensors[t].ty.shape.contains(&0))
        }
        Op::NativeLayerNormBackward => node.outputs.first() == Some(&Some(o)),
        _ => false,
    }
}

/// The adds of `program` to fold (see the module doc); none that `fusion` runs in a region.
pub(crate) fn plan(program: &Program, fusion: &FusionPlan) -> Epilogues {
    let graph = program.graph();
    let layouts = program.layouts();
    let readers = tensor_readers(graph);
    let at_end = read_at_end(graph);
    let producer = tensor_producers(graph);
    let writes = node_writes(program);
    let reads: Vec<Vec<Range<u64>>> = graph
        .nodes
        .iter()
        .enumerate()
        .map(|(n, node)| {
            if layouts[n].skip {
                return Vec::new();
            }
            node.inputs
                .iter()
                .flatten()
                .filter_map(|&t| lane_range(program, t))
                .collect()
        })
        .collect();
    let mut epilogues = Epilogues {
        into: vec![None; graph.nodes.len()],
        skip: vec![false; graph.nodes.len()],
    };
    for (a, add) in graph.nodes.iter().enumerate() {
        let (Op::AddTensor, OpParams::Binary { alpha }) = (add.op, program.params(a)) else {
            continue;
        };
        let (Some(Some(x)), Some(Some(y)), Some(Some(out))) =
            (add.inputs.first(), add.inputs.get(1), add.outputs.first())
        else {
            continue;
        };
        let ty = &graph.tensors[*out].ty;
        if *alpha != 1.0
            || layouts[a].skip
            || layouts[a].error.is_some()
            || fusion.region(a).is_some()
            || graph.tensors[*x].ty != *ty
            || graph.tensors[*y].ty != *ty
            || x == y
        {
            continue;
        }
        let Some(out_bytes) = lane_range(program, *out) else {
            continue;
        };
        for (operand, residual) in [(*y, *x), (*x, *y)] {
            // Back from the add through views planned onto their input's bytes, each read
            // only by the next, to the node that makes the bytes.
            let (mut o, mut between) = (operand, Vec::new());
            let made = loop {
                let Some(p) = producer[o] else { break None };
                if readers[o] != [*between.last().unwrap_or(&a)] || at_end.contains(&o) {
                    break None;
                }
                if layouts[p].skip {
                    between.push(p);
                    o = graph.nodes[p].inputs[0].unwrap_or(usize::MAX);
                    if o == usize::MAX {
                        break None;
                    }
                    continue;
                }
                break Some(p);
            };
            let Some(p) = made else { continue };
            let untouched_between = (p + 1..a).all(|m| {
                writes[m]
                    .iter()
                    .chain(&reads[m])
                    .all(|b| !overlaps(b, &out_bytes))
            });
            let residual_first = producer[residual].is_none_or(|r| r < p);
            if !untouched_between
                || !residual_first
                || epilogues.into[p].is_some()
                || layouts[p].error.is_some()
                || fusion.region(p).is_some()
                || !can_add_into(program, p, o)
            {
                continue;
            }
            // The output's bytes against everything the producer touches.
            let residual_bytes = lane_range(program, residual);
            let node = &graph.nodes[p];
            let touched = node
                .inputs
                .iter()
                .chain(&node.outputs)
                .flatten()
                .filter(|&&t| t != residual && t != o)
                .filter_map(|&t| lane_range(program, t))
                .chain(program.plan().scratch(p).map(|(off, len)| off..off + len));
            let clear = touched.into_iter().all(|b| !overlaps(&b, &out_bytes))
                && residual_bytes
                    .as_ref()
                    .is_none_or(|r| *r == out_bytes || !overlaps(r, &out_bytes));
            if clear {
                epilogues.into[p] = Some(Epilogue {
                    out: *out,
                    residual,
                });
                epilogues.skip[a] = true;
                break;
            }
        }
    }
    epilogues
}
