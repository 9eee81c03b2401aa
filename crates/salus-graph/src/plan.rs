//! Static memory planning: where every tensor of a validated graph lives.
//!
//! Persistent tensors (parameters, state, constants) are laid out one after another in the
//! session's persistent block: their sum is P. Feeds and intermediates live in the lane at
//! offsets fixed ahead of time, so an iteration allocates nothing. Tensors share memory
//! three ways:
//!
//! - **lifetimes**: a tensor is live from the step that writes it to its last reader (the
//!   end of the iteration for fetches and update values); tensors whose lifetimes do not
//!   overlap may take the same bytes;
//! - **views**: `view`, `unsqueeze`, `squeeze.dims`, and `clone` or `_to_copy` to the same
//!   dtype produce exactly the bytes of their input (every tensor is contiguous), so their
//!   output shares the input's buffer;
//! - **in place**: an elementwise op whose output has the shape and dtype of an input read
//!   for the last time at that node writes over that input. Kernels of those ops must read
//!   each element before writing the same element.
//!
//! Some kernels also need working memory while they run (a convolution unfolds one image
//! into a matrix before its product). Every byte of it is planned too, as a **scratch**
//! buffer live only at its node's step ([`scratch_bytes`] is the contract between this
//! planner and the kernels): E covers all the memory an iteration touches, the daemon knows
//! it exactly before the first iteration, and kernels allocate nothing while they run.
//! Scratch only overlaps buffers live at the same step, so it costs E little; it counts in
//! the lower bound like any other live byte, and [`MemoryPlan::scratch_bytes`] reports the
//! largest one on its own.
//!
//! Buffers are then placed greedily, largest first, each in the smallest gap among the
//! buffers whose lifetimes overlap it. E is the highest byte used; the lower bound is the
//! most bytes live at any one step, which no placement can beat.

use serde::Serialize;

use crate::ir::{DType, Graph, Node, Role, TensorId, TensorType};
use crate::op::Op;
use crate::params::OpParams;
use crate::validate::Producer;

/// Offsets and sizes are multiples of this (what CUDA allocations guarantee).
pub const ALIGNMENT: u64 = 256;

fn align(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// A stretch of lane memory shared by tensors that alias it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Buffer {
    /// Offset inside the lane.
    pub offset: u64,
    /// Aligned size.
    pub size: u64,
    /// First step it is live (0: before the first node; node i writes at step i + 1).
    pub first: usize,
    /// Last step it is live.
    pub last: usize,
}

/// Where everything of one graph lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemoryPlan {
    /// P: bytes of the persistent block.
    pub persistent_bytes: u64,
    /// E: bytes of lane the iteration needs.
    pub ephemeral_bytes: u64,
    /// The most bytes live at any one step: no plan can need less than this.
    pub lower_bound: u64,
    /// Per tensor: offset in the persistent block (persistent tensors only).
    pub persistent_offsets: Vec<Option<u64>>,
    /// Per tensor: its buffer (feeds and intermediates that are ever written).
    pub buffer_of: Vec<Option<usize>>,
    /// The lane's buffers.
    pub buffers: Vec<Buffer>,
    /// Per node: its scratch buffer, when its kernel needs working memory.
    pub scratch_of: Vec<Option<usize>>,
    /// The largest scratch buffer of one node (part of E, reported on its own).
    pub scratch_bytes: u64,
}

impl MemoryPlan {
    /// Offset of a feed or intermediate inside the lane.
    pub fn lane_offset(&self, tensor: TensorId) -> Option<u64> {
        Some(self.buffers[self.buffer_of.get(tensor).copied().flatten()?].offset)
    }

    /// Offset and size of a node's scratch inside the lane.
    pub fn scratch(&self, node: usize) -> Option<(u64, u64)> {
        let b = &self.buffers[self.scratch_of.get(node).copied().flatten()?];
        Some((b.offset, b.size))
    }

    /// `ephemeral_bytes / lower_bound`: how far the placement is from perfect.
    pub fn overhead(&self) -> f64 {
        if self.lower_bound == 0 {
            1.0
        } else {
            self.ephemeral_bytes as f64 / self.lower_bound as f64
        }
    }
}

fn aliases_input(op: Op, graph: &Graph, input: TensorId, output: TensorId) -> bool {
    let same_bytes = graph.tensors[input].ty.dtype == graph.tensors[output].ty.dtype;
    match op {
        Op::View | Op::Unsqueeze | Op::SqueezeDims | Op::Clone => true,
        Op::ToCopy => same_bytes,
        _ => false,
    }
}

fn elementwise(op: Op) -> bool {
    use Op::*;
    matches!(
        op,
        AddTensor
            | AddScalar
            | SubTensor
            | MulTensor
            | MulScalar
            | DivTensor
            | DivScalar
            | Neg
            | Abs
            | Sign
            | Exp
            | Log
            | Sqrt
            | Rsqrt
            | Reciprocal
            | Erf
            | Erfc
            | Erfinv
            | Lgamma
            | Digamma
            | Polygamma
            | Log1p
            | Expm1
            | Sin
            | Cos
            | Atan
            | Atan2
            | RemainderTensor
            | FmodTensor
            | PowTensorTensor
            | Floor
            | Ceil
            | Round
            | Trunc
            | PowTensorScalar
            | Clamp
            | Relu
            | LeakyRelu
            | Gelu
            | Sigmoid
            | Tanh
            | Maximum
            | Minimum
            | LogicalNot
            | BitwiseNot
            | WhereSelf
    )
}

/// What one device's kernels need of the memory plan: the planner asks it how much scratch
/// each node needs, so that E includes the working memory of the kernels (or library
/// calls) that device will run, and which tensors its nodes read besides their inputs.
/// The CPU and sim devices use [`PortableScratch`]; a device whose kernels need other
/// working memory (the CUDA device's cuDNN workspaces) brings its own.
pub trait ScratchSizer {
    /// Bytes of lane scratch node `node` of `graph` works in (0: none).
    fn scratch_bytes(&self, graph: &Graph, node: usize, params: &OpParams) -> u64;

    /// `(node, tensor)` pairs where the device may have `node` read `tensor`'s bytes in
    /// place of a copy of them it then skips (a layout copy folded into its reader): the
    /// planner keeps `tensor` live until `node`, so nothing is placed over it meanwhile.
    /// None by default.
    fn extra_reads(&self, graph: &Graph, params: &[OpParams]) -> Vec<(usize, TensorId)> {
        let _ = (graph, params);
        Vec::new()
    }
}

/// The portable kernels' scratch, [`scratch_bytes`].
#[derive(Debug, Clone, Copy, Default)]
pub struct PortableScratch;

impl ScratchSizer for PortableScratch {
    fn scratch_bytes(&self, graph: &Graph, node: usize, params: &OpParams) -> u64 {
        scratch_bytes(graph, &graph.nodes[node], params)
    }
}

/// Plans a graph that [`crate::validate`] accepted, given its producers and its nodes'
/// parameters, with the portable kernels' scratch.
pub fn plan(graph: &Graph, producers: &[Producer], params: &[OpParams]) -> MemoryPlan {
    plan_with(graph, producers, params, &PortableScratch)
}

/// [`plan`] with each node's scratch as `sizer` gives it.
pub fn plan_with(
    graph: &Graph,
    producers: &[Producer],
    params: &[OpParams],
    sizer: &dyn ScratchSizer,
) -> MemoryPlan {
    let n = graph.tensors.len();
    let end = graph.nodes.len() + 1;

    let mut persistent_offsets = vec![None; n];
    let mut persistent_bytes = 0;
    for (id, t) in graph.tensors.iter().enumerate() {
        if t.role.is_persistent() {
            persistent_offsets[id] = Some(persistent_bytes);
            persistent_bytes += align(t.ty.bytes().unwrap_or(0));
        }
    }

    // Last step each tensor is read.
    let mut last_use = vec![0usize; n];
    for (i, node) in graph.nodes.iter().enumerate() {
        for &input in node.inputs.iter().flatten() {
            last_use[input] = last_use[input].max(i + 1);
        }
    }
    for (node, input) in sizer.extra_reads(graph, params) {
        if node < graph.nodes.len() && input < n {
            last_use[input] = last_use[input].max(node + 1);
        }
    }
    for &f in &graph.fetches {
        last_use[f] = end;
    }
    for u in &graph.updates {
        last_use[u.value] = end;
    }

    let mut buffer_of: Vec<Option<usize>> = vec![None; n];
    let mut buffers: Vec<Buffer> = Vec::new();
    let size_of = |id: TensorId| align(graph.tensors[id].ty.bytes().unwrap_or(0));
    for (id, t) in graph.tensors.iter().enumerate() {
        if t.role == Role::Feed {
            buffer_of[id] = Some(buffers.len());
            buffers.push(Buffer {
                offset: 0,
                size: size_of(id),
                first: 0,
                last: last_use[id],
            });
        }
    }
    for (i, node) in graph.nodes.iter().enumerate() {
        let step = i + 1;
        for &output in node.outputs.iter().flatten() {
            debug_assert!(matches!(producers[output], Producer::Node { node, .. } if node == i));
            let ephemeral_input = |input: TensorId| {
                buffer_of[input].filter(|_| {
                    graph.tensors[input].role == Role::Intermediate
                        || graph.tensors[input].role == Role::Feed
                })
            };
            // A view shares its input's buffer, which then lives as long as either.
            let view = node.inputs.first().copied().flatten().and_then(|input| {
                aliases_input(node.op, graph, input, output)
                    .then(|| ephemeral_input(input))
                    .flatten()
            });
            // In place: an input of the same type whose buffer is read for the last time here.
            let in_place = || {
                if !elementwise(node.op) {
                    return None;
                }
                node.inputs.iter().flatten().find_map(|&input| {
                    let b = ephemeral_input(input)?;
                    let reusable = graph.tensors[input].ty == graph.tensors[output].ty
                        && buffers[b].last == step
                        && node.outputs.iter().flatten().count() == 1;
                    reusable.then_some(b)
                })
            };
            match view.or_else(in_place) {
                Some(b) => {
                    buffer_of[output] = Some(b);
                    buffers[b].last = buffers[b].last.max(last_use[output]).max(step);
                }
                None => {
                    buffer_of[output] = Some(buffers.len());
                    buffers.push(Buffer {
                        offset: 0,
                        size: size_of(output),
                        first: step,
                        last: last_use[output].max(step),
                    });
                }
            }
        }
    }

    let mut scratch_of = vec![None; graph.nodes.len()];
    let mut largest_scratch = 0;
    for (i, p) in params.iter().enumerate().take(graph.nodes.len()) {
        let bytes = sizer.scratch_bytes(graph, i, p);
        if bytes > 0 {
            scratch_of[i] = Some(buffers.len());
            largest_scratch = largest_scratch.max(align(bytes));
            buffers.push(Buffer {
                offset: 0,
                size: align(bytes),
                first: i + 1,
                last: i + 1,
            });
        }
    }

    let lower_bound = peak_live(&buffers, end);
    let ephemeral_bytes = place(&mut buffers);
    MemoryPlan {
        persistent_bytes,
        ephemeral_bytes,
        lower_bound,
        persistent_offsets,
        buffer_of,
        buffers,
        scratch_of,
        scratch_bytes: largest_scratch,
    }
}

/// Unfolding buffers a convolution's scratch holds at most: groups of images unfold on
/// different cores at once, each in its own buffer. A constant, not the machine's core
/// count, so that E is a property of the graph alone.
pub const CONV_SLOTS: u64 = 4;

/// Bytes of lane scratch the kernel of `node` works in: the contract between the planner
/// and the kernels, which check that what they are given is this large.
///
/// A 2-d f32 convolution runs its batch in products of `m` = [`crate::ConvParams::fold`]
/// images side by side, split over `slots` = [`conv_slots`] tasks, each with its own
/// scratch. With `k`, `l` and `direct` as [`crate::ConvParams::unfold_2d`] gives them,
/// `cols = m l` and `C_out/groups` output channels per group, per slot:
/// - `convolution` (f32): the unfolded input of one product and group, `k x cols` f32
///   (none when direct and `m` = 1), and, when `m` > 1, its result before it is spread
///   over the images, `C_out/groups x cols`;
/// - `convolution_backward` (f32): twice the unfolded input (it and its gradient), the
///   output gradient of one product and group gathered when `m` > 1, and a partial
///   weight gradient (`C_out k` f32);
/// - a transposed one (f32), either way: what its adjoint's backward needs
///   ([`crate::ConvParams::adjoint`]);
/// - either over f16 or bf16 (every operand and result of one 16-bit type): its operands
///   and results widened to f32 and the f32 kernel's scratch ([`widened_conv_bytes`]).
pub fn scratch_bytes(graph: &Graph, node: &Node, params: &OpParams) -> u64 {
    let Some(conv) = params.conv() else {
        return 0;
    };
    if !matches!(node.op, Op::Convolution | Op::ConvolutionBackward) {
        return 0;
    }
    let ty = |id: Option<TensorId>| id.map(|id| &graph.tensors[id].ty);
    let inputs: Vec<Option<&TensorType>> = node.inputs.iter().map(|&i| ty(i)).collect();
    let outputs: Vec<Option<&TensorType>> = node.outputs.iter().map(|&o| ty(o)).collect();
    if let Some(bytes) = widened_conv_bytes(node.op, conv, &inputs, &outputs) {
        return bytes;
    }
    let f32_only = |tys: &[Option<&TensorType>]| {
        !tys.is_empty() && tys.iter().all(|t| t.is_some_and(|t| t.dtype == DType::F32))
    };
    let operands = if node.op == Op::Convolution { 2 } else { 3 };
    if inputs.len() < operands || !f32_only(&inputs[..operands]) {
        return 0;
    }
    if node.op == Op::Convolution && outputs.first().copied().flatten().is_none() {
        return 0;
    }
    let weight_rows = inputs[operands - 1].map_or(0, |w| w.shape[0]);
    conv_f32_scratch_bytes(node.op, conv, weight_rows)
}

/// Tasks a 2-d f32 convolution's batch is split over, each in its own slot of scratch:
/// one per product of [`crate::ConvParams::fold`] images, at most [`CONV_SLOTS`].
pub fn conv_slots(conv: &crate::ConvParams) -> u64 {
    conv.batch.div_ceil(conv.fold()).min(CONV_SLOTS)
}

/// The f32 kernel's scratch of a 2-d convolution or its backward (see [`scratch_bytes`]);
/// `weight_rows` is the weight's first dimension.
fn conv_f32_scratch_bytes(op: Op, conv: &crate::ConvParams, weight_rows: u64) -> u64 {
    if conv.transposed {
        // Either runs as its adjoint's gradients, whose backward needs the most.
        return conv.adjoint().map_or(0, |adjoint| {
            conv_f32_scratch_bytes(Op::ConvolutionBackward, &adjoint, weight_rows)
        });
    }
    let Some((k, l, direct)) = conv.unfold_2d() else {
        return 0;
    };
    let m = conv.fold();
    let cols = m * l;
    let unfold = if direct && m == 1 { 0 } else { k * cols };
    let gathered = if m > 1 {
        conv.out_per_group() * cols
    } else {
        0
    };
    let slot = match op {
        Op::Convolution => unfold + gathered,
        Op::ConvolutionBackward => 2 * unfold + gathered + weight_rows * k,
        _ => return 0,
    };
    conv_slots(conv) * slot * 4
}

/// The scratch of a 2-d, not transposed `convolution` or `convolution_backward` whose
/// operands (`inputs`, absent ones `None`) and used results (`outputs`) are all of one
/// 16-bit type, which the CPU device runs with its f32 kernel: each present input, then
/// each used output, widened to f32 one after another (`4 * numel` bytes each), then the
/// f32 kernel's own scratch. `None` for any other node (a batch of 0 included).
pub fn widened_conv_bytes(
    op: Op,
    conv: &crate::ConvParams,
    inputs: &[Option<&TensorType>],
    outputs: &[Option<&TensorType>],
) -> Option<u64> {
    if !matches!(op, Op::Convolution | Op::ConvolutionBackward)
        || conv.unfold_2d().is_none()
        || conv.batch == 0
    {
        return None;
    }
    let present: Vec<&TensorType> = inputs.iter().chain(outputs).flatten().copied().collect();
    let dtype = present.first()?.dtype;
    if !matches!(dtype, DType::F16 | DType::Bf16) || present.iter().any(|t| t.dtype != dtype) {
        return None;
    }
    let weight = inputs
        .get(if op == Op::Convolution { 1 } else { 2 })?
        .as_ref()?;
    let widened = present
        .iter()
        .map(|t| t.numel().and_then(|n| n.checked_mul(4)))
        .sum::<Option<u64>>()?;
    Some(widened + conv_f32_scratch_bytes(op, conv, weight.shape[0]))
}

/// The most bytes live at any one step.
fn peak_live(buffers: &[Buffer], end: usize) -> u64 {
    let mut delta = vec![0i128; end + 2];
    for b in buffers {
        delta[b.first] += i128::from(b.size);
        delta[b.last + 1] -= i128::from(b.size);
    }
    let mut live = 0i128;
    let mut peak = 0i128;
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    peak as u64
}

/// Assigns offsets: largest buffer first, each into the smallest gap left by the already
/// placed buffers whose lifetimes overlap it (or above them all). Returns the bytes used.
pub fn place(buffers: &mut [Buffer]) -> u64 {
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by(|&a, &b| {
        buffers[b]
            .size
            .cmp(&buffers[a].size)
            .then(buffers[a].first.cmp(&buffers[b].first))
            .then(a.cmp(&b))
    });
    let mut placed: Vec<usize> = Vec::with_capacity(buffers.len());
    let mut top = 0;
    let mut neighbours: Vec<(u64, u64)> = Vec::new();
    for &i in &order {
        let b = &buffers[i];
        neighbours.clear();
        neighbours.extend(
            placed
                .iter()
                .map(|&j| &buffers[j])
                .filter(|o| o.first <= b.last && b.first <= o.last)
                .map(|o| (o.offset, o.offset + o.size)),
        );
        neighbours.sort_unstable();
        let mut best: Option<(u64, u64)> = None; // (gap size, offset)
        let mut cursor = 0;
        for &(start, stop) in &neighbours {
            if start > cursor {
                let gap = start - cursor;
                if gap >= b.size && best.is_none_or(|(g, _)| gap < g) {
                    best = Some((gap, cursor));
                }
            }
            cursor = cursor.max(stop);
        }
        let offset = best.map_or(cursor, |(_, offset)| offset);
        buffers[i].offset = offset;
        top = top.max(offset + buffers[i].size);
        placed.push(i);
    }
    top
}
