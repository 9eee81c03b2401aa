//! Lowering: every node of a [`Program`] at one placement becomes a list of device
//! [`Command`]s (kernel launches with their argument structs, memsets, cuBLAS products)
//! with absolute device addresses. A list is built once per (program, placement), run
//! eagerly or captured into a CUDA graph, and replayed.
//!
//! Each node's non-tensor arguments come from its typed parameters
//! ([`Program::params`]); the kernels' argument structs and codes from [`crate::abi`].
//! One file per op family: `elementwise` (pointwise ops, copies, views, flips and
//! constant padding), `reduce` (reductions, cumulative sums, softmax, layer and group
//! norm), `matmul`, `conv`, `pool` (pooling and reflection padding), `index` (indexing
//! and random draws).

pub(crate) mod attention;
pub(crate) mod batch;
pub(crate) mod batch_norm;
mod conv;
mod elementwise;
pub(crate) mod epilogues;
pub(crate) mod folds;
pub(crate) mod fusion;
mod index;
mod matmul;
mod order;
mod pool;
pub(crate) mod reduce;

use std::sync::Arc;

use salus_exec::{Location, Program};
use salus_graph::{DType, GeluApproximate, Node, Op, OpParams, ScatterReduction, TensorType};

use crate::abi::{
    AlongDimMode, BLOCK, DeviceDType, ElementwiseOp, GuardedCopyArgs, Kernel, KernelArgs,
    LaunchArgs, ReduceOp, UPDATE_SEGMENTS,
};
use crate::cudnn::Dnn;
use crate::driver::Gemm;
use crate::driver::cudnn::DnnConv;

/// One kernel launch: the kernel, its grid (x, y), threads per block and its argument
/// struct, which the driver passes by value.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub kernel: Kernel,
    pub grid: (u32, u32),
    pub block: u32,
    pub args: Arc<dyn LaunchArgs>,
}

impl Launch {
    fn new<A: KernelArgs>(kernel: Kernel, grid: (u32, u32), args: A) -> Launch {
        debug_assert_eq!(
            kernel.args_struct(),
            args.struct_name(),
            "{}",
            kernel.name()
        );
        Launch {
            kernel,
            grid,
            block: BLOCK,
            args: Arc::new(args),
        }
    }
}

/// One device command.
#[derive(Debug, Clone)]
pub(crate) enum Command {
    Launch(Launch),
    Zero {
        ptr: u64,
        bytes: u64,
    },
    Gemm(Gemm),
    /// A generated kernel of a fused region (`fusion`).
    Fused(fusion::FusedLaunch),
    /// Launches of one generated kernel, side by side (`batch`).
    FusedBatch(batch::FusedBatchLaunch),
    /// A cuDNN convolution call.
    Dnn(DnnConv),
}

/// Most blocks of a grid dimension the lowering asks for (kernels loop over the rest).
const MAX_GRID: u64 = 65_535;

/// Blocks for one thread per element of `n`.
fn grid_for(n: u64) -> u32 {
    n.div_ceil(u64::from(BLOCK)).clamp(1, MAX_GRID) as u32
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Row-major strides (in elements) of `shape`.
fn contiguous(shape: &[u64]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1] as i64;
    }
    s
}

/// Strides that read a tensor of `shape` broadcast to `out` (0 along broadcast dims).
fn broadcast(shape: &[u64], out: &[u64]) -> Vec<i64> {
    let own = contiguous(shape);
    let lead = out.len() - shape.len().min(out.len());
    (0..out.len())
        .map(|d| {
            if d < lead || shape[d - lead] == 1 {
                0
            } else {
                own[d - lead]
            }
        })
        .collect()
}

/// `v` in a kernel's fixed-size array, the rest 0.
fn padded<const N: usize>(v: &[i64]) -> [i64; N] {
    let mut out = [0; N];
    for (o, x) in out.iter_mut().zip(v) {
        *o = *x;
    }
    out
}

/// A shape as the kernels' signed sizes.
fn signed(shape: &[u64]) -> Vec<i64> {
    shape.iter().map(|&x| x as i64).collect()
}

/// A tensor operand of a node: its type and absolute device address.
#[derive(Debug, Clone)]
struct Operand {
    ty: TensorType,
    ptr: u64,
}

impl Operand {
    fn shape(&self) -> &[u64] {
        &self.ty.shape
    }

    /// The dtype's code in the kernels.
    fn dt(&self) -> i64 {
        DeviceDType::of(self.ty.dtype).code()
    }

    fn numel(&self) -> u64 {
        numel(&self.ty.shape)
    }

    /// Bytes per element.
    fn elem_size(&self) -> u64 {
        self.ty.dtype.size()
    }

    /// The same bytes as another type (a flat or reshaped view).
    fn viewed_as(&self, dtype: DType, shape: Vec<u64>) -> Operand {
        Operand {
            ty: TensorType::new(dtype, shape),
            ptr: self.ptr,
        }
    }
}

/// (address, dtype code) of an optional operand; (0, 0) when absent.
fn address(t: Option<&Operand>) -> (u64, i64) {
    t.map_or((0, 0), |t| (t.ptr, t.dt()))
}

/// Builds the command list of a program's nodes, one node at a time.
pub(crate) struct Lowering<'a> {
    pub program: &'a Program,
    /// Device address of the program's persistent block.
    pub persistent: u64,
    /// Device address of the lane.
    pub lane: u64,
    /// Device address of the lane's error block.
    pub err: u64,
    /// The device's cuDNN, when it has one.
    pub dnn: Option<&'a Dnn>,
    /// The node being lowered.
    pub index: usize,
    pub commands: Vec<Command>,
    /// The program's fused regions ([`fusion::FusionPlan::none`] for none).
    pub fusion: &'a fusion::FusionPlan,
    /// The transposes folded into products ([`folds::Folds::none`] for none).
    pub folds: &'a folds::Folds,
    /// The adds folded into their producers ([`epilogues::Epilogues::none`] for none).
    pub epilogues: &'a epilogues::Epilogues,
    /// The generated kernels the commands launch, (name, source), each once.
    pub kernels: Vec<(String, String)>,
    /// f32 attention's forward in register tiles rather than through cuBLAS.
    pub tiled_attention: bool,
}

/// A node lowered, or why it cannot run on this device.
type Lowered = Result<(), String>;

impl<'a> Lowering<'a> {
    fn at(&self, id: usize) -> u64 {
        match self.program.location(id) {
            Some(Location::Persistent(off)) => self.persistent + off,
            Some(Location::Lane(off)) => self.lane + off,
            None => 0,
        }
    }

    fn operand(&self, id: usize) -> Operand {
        Operand {
            ty: self.program.graph().tensors[id].ty.clone(),
            ptr: self.at(id),
        }
    }

    fn input(&self, node: &Node, k: usize) -> Option<Operand> {
        let id = node.inputs.get(k).copied().flatten()?;
        Some(self.operand(id))
    }

    fn need(&self, node: &Node, k: usize) -> Result<Operand, String> {
        self.input(node, k)
            .ok_or_else(|| format!("input {k} must be a tensor of its own"))
    }

    fn output(&self, node: &Node, k: usize) -> Option<Operand> {
        let id = node.outputs.get(k).copied().flatten()?;
        Some(self.operand(id))
    }

    /// The node's typed parameters.
    fn params(&self) -> &'a OpParams {
        self.program.params(self.index)
    }

    /// The node's scratch in the lane: (address, bytes); (0, 0) without any.
    fn scratch(&self) -> (u64, u64) {
        self.program
            .plan()
            .scratch(self.index)
            .map_or((0, 0), |(off, len)| (self.lane + off, len))
    }

    /// Launches `kernel` with a thread per element of `n` (nothing when `n` is 0).
    fn launch<A: KernelArgs>(&mut self, kernel: Kernel, n: u64, args: A) {
        if n > 0 {
            let launch = Launch::new(kernel, (grid_for(n), 1), args);
            self.commands.push(Command::Launch(launch));
        }
    }

    /// Launches `kernel` with a block per row of `blocks` (nothing when 0).
    fn launch_blocks<A: KernelArgs>(&mut self, kernel: Kernel, blocks: u64, args: A) {
        if blocks > 0 {
            let grid = blocks.clamp(1, MAX_GRID) as u32;
            let launch = Launch::new(kernel, (grid, 1), args);
            self.commands.push(Command::Launch(launch));
        }
    }

    fn zero(&mut self, t: &Operand) {
        let bytes = t.numel() * t.elem_size();
        if bytes > 0 {
            self.commands.push(Command::Zero { ptr: t.ptr, bytes });
        }
    }

    /// Lowers one node.
    pub(crate) fn node(&mut self, node: &Node) -> Lowered {
        use Op::*;
        let layout = &self.program.layouts()[self.index];
        if let Some(error) = &layout.error {
            return Err(error.clone());
        }
        if layout.skip || self.folds.skips(self.index) || self.epilogues.skips(self.index) {
            return Ok(());
        }
        let fusion = self.fusion;
        if let Some(region) = fusion.region(self.index) {
            return self.fused(region);
        }
        match node.op {
            ConvolutionBackward => return self.convolution_backward(node),
            MaxPool2dWithIndices => return self.max_pool(node),
            NativeLayerNorm => return self.layer_norm(node),
            NativeLayerNormBackward => return self.layer_norm_backward(node),
            NativeGroupNorm => return self.group_norm(node),
            NativeBatchNorm => return self.batch_norm(node),
            NativeBatchNormBackward => return self.batch_norm_backward(node),
            ScaledDotProductAttention | EfficientAttention => return self.attention(node),
            ScaledDotProductAttentionBackward | EfficientAttentionBackward => {
                return self.attention_backward(node);
            }
            SplitWithSizes => return self.split(node),
            BernoulliP => return self.bernoulli(node),
            RandLike => return self.rand_like(node),
            AssertAsyncMsg => return self.assert_true(node),
            Sort => return self.sort(node),
            _ => {}
        }
        let o = self.output(node, 0).ok_or("output 0 is unused")?;
        let params = self.params();
        let none = [0.0; 3];
        match (node.op, params) {
            (AddTensor | SubTensor, &OpParams::Binary { alpha }) => {
                let sign = if node.op == SubTensor { -1.0 } else { 1.0 };
                let (a, b) = (self.need(node, 0)?, self.need(node, 1)?);
                self.ew(ElementwiseOp::Add, &o, &[&a, &b], [sign * alpha, 0.0, 0.0])
            }
            (MulTensor, _) => self.binary(ElementwiseOp::Mul, node, &o),
            (DivTensor, _) => self.binary(ElementwiseOp::Div, node, &o),
            (LogicalAnd, _) => self.binary(ElementwiseOp::LogicalAnd, node, &o),
            (Maximum, _) => self.binary(ElementwiseOp::Maximum, node, &o),
            (Minimum, _) => self.binary(ElementwiseOp::Minimum, node, &o),
            (EqTensor, _) => self.binary(ElementwiseOp::EqTensor, node, &o),
            (LtTensor, _) => self.binary(ElementwiseOp::LtTensor, node, &o),
            (GtTensor, _) => self.binary(ElementwiseOp::GtTensor, node, &o),
            (BitwiseAndTensor, _) => self.binary(ElementwiseOp::BitwiseAnd, node, &o),
            (
                AddScalar | MulScalar | DivScalar | PowTensorScalar | PowScalar | EqScalar
                | NeScalar | LtScalar | LeScalar | GtScalar | GeScalar,
                &OpParams::WithScalar { scalar, alpha },
            ) => {
                let op = match node.op {
                    AddScalar => ElementwiseOp::AddScalar,
                    MulScalar => ElementwiseOp::MulScalar,
                    DivScalar => ElementwiseOp::DivScalar,
                    PowTensorScalar => ElementwiseOp::PowTensorScalar,
                    PowScalar => ElementwiseOp::PowScalar,
                    EqScalar => ElementwiseOp::Eq,
                    NeScalar => ElementwiseOp::Ne,
                    LtScalar => ElementwiseOp::Lt,
                    LeScalar => ElementwiseOp::Le,
                    GtScalar => ElementwiseOp::Gt,
                    _ => ElementwiseOp::Ge,
                };
                // alpha is 1 for every op but add.Scalar.
                self.unary(op, node, &o, [alpha * scalar.as_f64(), 0.0, 0.0])
            }
            (Neg, _) => self.unary(ElementwiseOp::Neg, node, &o, none),
            (Abs, _) => self.unary(ElementwiseOp::Abs, node, &o, none),
            (Sign, _) => self.unary(ElementwiseOp::Sign, node, &o, none),
            (Exp, _) => self.unary(ElementwiseOp::Exp, node, &o, none),
            (Log, _) => self.unary(ElementwiseOp::Log, node, &o, none),
            (Sqrt, _) => self.unary(ElementwiseOp::Sqrt, node, &o, none),
            (Rsqrt, _) => self.unary(ElementwiseOp::Rsqrt, node, &o, none),
            (Reciprocal, _) => self.unary(ElementwiseOp::Reciprocal, node, &o, none),
            (Sigmoid, _) => self.unary(ElementwiseOp::Sigmoid, node, &o, none),
            (Tanh, _) => self.unary(ElementwiseOp::Tanh, node, &o, none),
            (Relu, _) => self.unary(ElementwiseOp::Relu, node, &o, none),
            (Erf, _) => self.unary(ElementwiseOp::Erf, node, &o, none),
            (Erfc, _) => self.unary(ElementwiseOp::Erfc, node, &o, none),
            (Erfinv, _) => self.unary(ElementwiseOp::Erfinv, node, &o, none),
            (Lgamma, _) => self.unary(ElementwiseOp::Lgamma, node, &o, none),
            (Digamma, _) => self.unary(ElementwiseOp::Digamma, node, &o, none),
            (Polygamma, &OpParams::Polygamma { n }) => {
                self.unary(ElementwiseOp::Polygamma, node, &o, [n as f64, 0.0, 0.0])
            }
            (Log1p, _) => self.unary(ElementwiseOp::Log1p, node, &o, none),
            (Expm1, _) => self.unary(ElementwiseOp::Expm1, node, &o, none),
            (Sin, _) => self.unary(ElementwiseOp::Sin, node, &o, none),
            (Cos, _) => self.unary(ElementwiseOp::Cos, node, &o, none),
            (Floor, _) => self.unary(ElementwiseOp::Floor, node, &o, none),
            (Ceil, _) => self.unary(ElementwiseOp::Ceil, node, &o, none),
            (Round, _) => self.unary(ElementwiseOp::Round, node, &o, none),
            (Trunc, _) => self.unary(ElementwiseOp::Trunc, node, &o, none),
            (Atan, _) => self.unary(ElementwiseOp::Atan, node, &o, none),
            (Atan2, _) => self.binary(ElementwiseOp::Atan2, node, &o),
            (RemainderTensor, _) => self.binary(ElementwiseOp::Remainder, node, &o),
            (FmodTensor, _) => self.binary(ElementwiseOp::Fmod, node, &o),
            (PowTensorTensor, _) => self.binary(ElementwiseOp::PowTensorTensor, node, &o),
            (LeakyRelu, &OpParams::LeakyRelu { negative_slope }) => self.unary(
                ElementwiseOp::LeakyRelu,
                node,
                &o,
                [negative_slope, 0.0, 0.0],
            ),
            (Gelu, &OpParams::Gelu { approximate }) => {
                let op = match approximate {
                    GeluApproximate::Tanh => ElementwiseOp::GeluTanh,
                    GeluApproximate::None => ElementwiseOp::Gelu,
                };
                self.unary(op, node, &o, none)
            }
            (Clamp, &OpParams::Clamp { min, max }) => {
                let lo = min.map_or(f64::NEG_INFINITY, |v| v.as_f64());
                let hi = max.map_or(f64::INFINITY, |v| v.as_f64());
                self.unary(ElementwiseOp::Clamp, node, &o, [lo, hi, 0.0])
            }
            (LogicalNot, _) => self.unary(ElementwiseOp::LogicalNot, node, &o, none),
            (BitwiseNot, _) if o.ty.dtype == DType::Bool => {
                self.unary(ElementwiseOp::LogicalNot, node, &o, none)
            }
            (BitwiseNot, _) => self.unary(ElementwiseOp::BitwiseNot, node, &o, none),
            (WhereSelf, _) => {
                let (c, a, b) = (
                    self.need(node, 0)?,
                    self.need(node, 1)?,
                    self.need(node, 2)?,
                );
                self.ew(ElementwiseOp::Where, &o, &[&c, &a, &b], none)
            }
            (ToCopy | Clone, _) => {
                let a = self.need(node, 0)?;
                if a.ptr == o.ptr && a.ty.dtype == o.ty.dtype {
                    return Ok(());
                }
                self.ew(ElementwiseOp::Copy, &o, &[&a], none)
            }
            (Full | FullLike | ScalarTensor, &OpParams::Fill { value, .. }) => {
                self.ew(ElementwiseOp::Fill, &o, &[], [value.as_f64(), 0.0, 0.0])
            }
            (ArangeStartStep, &OpParams::Arange { start, step, .. }) => {
                let flat = o.viewed_as(o.ty.dtype, vec![o.numel()]);
                let s = [start.as_f64(), step.as_f64(), 0.0];
                self.ew(ElementwiseOp::Arange, &flat, &[], s)
            }
            (View | Unsqueeze | SqueezeDims, _) => {
                let a = self.need(node, 0)?;
                self.copy_flat(&o, &a)
            }
            (Permute, OpParams::Permute { dims }) => self.permute(node, dims, &o),
            (Expand, _) => self.expand(node, &o),
            (
                SliceTensor,
                &OpParams::Slice {
                    dim, start, step, ..
                },
            ) => self.slice(node, dim, start, step, &o),
            (SelectInt, &OpParams::Select { dim, index }) => self.select(node, dim, index, &o),
            (Cat, &OpParams::Cat { dim, .. }) => self.cat(node, dim, &o),
            (Flip, OpParams::Flip { dims }) => self.flip(node, dims, &o),
            (ConstantPadNd, OpParams::ConstantPad { before, value, .. }) => {
                self.constant_pad(node, before, value.as_f64(), &o)
            }
            (Cumsum | Cumprod, &OpParams::Cumsum { dim, .. }) => {
                let a = self.need(node, 0)?;
                self.cumulative(dim, node.op == Cumprod, &a, &o)
            }
            (SumDimIntList | MeanDim | Amax | Mean | AnyDim, OpParams::Reduce(r)) => {
                let a = self.need(node, 0)?;
                let op = match node.op {
                    SumDimIntList => ReduceOp::Sum,
                    Amax => ReduceOp::Amax,
                    AnyDim => ReduceOp::Any,
                    _ => ReduceOp::Mean,
                };
                self.reduce(op, &a, &r.dims, &o, 0.0)
            }
            (Argmax | Argmin, OpParams::Reduce(r)) => {
                let a = self.need(node, 0)?;
                self.arg_extreme(node.op == Argmax, &a, r, &o)
            }
            (
                VarCorrection,
                OpParams::Var {
                    reduction,
                    correction,
                },
            ) => {
                let a = self.need(node, 0)?;
                self.reduce(ReduceOp::Var, &a, &reduction.dims, &o, *correction)
            }
            (Softmax | LogSoftmax, &OpParams::Softmax { dim, .. }) => {
                let a = self.need(node, 0)?;
                self.softmax(dim, &a, None, &o, node.op == LogSoftmax)
            }
            (
                SoftmaxBackwardData | LogSoftmaxBackwardData,
                &OpParams::SoftmaxBackward { dim, .. },
            ) => {
                let (g, y) = (self.need(node, 0)?, self.need(node, 1)?);
                if g.shape() != y.shape() || o.shape() != g.shape() {
                    return Err(format!(
                        "grad_output {}, output {} and grad_input {} must have one shape",
                        g.ty, y.ty, o.ty
                    ));
                }
                let log = node.op == LogSoftmaxBackwardData;
                self.softmax(dim, &y, Some(&g), &o, log)
            }
            (Mm | Bmm, _) => self.matmul(node, 1.0, 1.0, &o),
            (Addmm, &OpParams::Addmm { beta, alpha }) => self.matmul(node, alpha, beta, &o),
            (Convolution, OpParams::Conv(conv)) => self.convolution(node, conv, &o),
            (MaxPool2dWithIndicesBackward, OpParams::Pool(pool)) => {
                self.max_pool_backward(node, pool, &o)
            }
            (AvgPool2d | AvgPool2dBackward, OpParams::Pool(pool)) => {
                self.avg_pool(node, Some(pool), &o)
            }
            (AdaptiveAvgPool2d | AdaptiveAvgPool2dBackward, _) => self.avg_pool(node, None, &o),
            (
                ReflectionPad2d | ReflectionPad2dBackward,
                &OpParams::ReflectionPad {
                    padding,
                    planes,
                    input,
                    output,
                },
            ) => self.reflection_pad(node, padding, planes, input, output, &o),
            (Embedding, _) => self.embedding(node, &o),
            (IndexSelect, &OpParams::Index { dim }) => self.index_select(node, dim, &o),
            (Gather, &OpParams::Index { dim }) => {
                self.along(node, dim, AlongDimMode::Gather, 0.0, &o)
            }
            (ScatterAdd, &OpParams::Index { dim }) => {
                self.along(node, dim, AlongDimMode::ScatterAdd, 0.0, &o)
            }
            (ScatterSrc, &OpParams::Index { dim }) => {
                self.along(node, dim, AlongDimMode::ScatterSrc, 0.0, &o)
            }
            (ScatterReduce, &OpParams::ScatterReduce { dim, reduce }) => {
                let mode = match reduce {
                    ScatterReduction::Prod => AlongDimMode::ScatterProd,
                    ScatterReduction::Amax => AlongDimMode::ScatterAmax,
                    ScatterReduction::Amin => AlongDimMode::ScatterAmin,
                };
                self.along(node, dim, mode, 0.0, &o)
            }
            (ScatterValue, &OpParams::Scatter { dim, value }) => {
                let value = value.as_f64();
                self.along(node, dim, AlongDimMode::ScatterValue, value, &o)
            }
            (
                EmbeddingDenseBackward,
                &OpParams::Embedding {
                    padding_idx,
                    scale_grad_by_freq,
                    ..
                },
            ) => self.embedding_backward(node, padding_idx, scale_grad_by_freq, &o),
            (IndexTensor, OpParams::AdvancedIndex(index)) => self.index_gather(node, index, &o),
            (
                IndexPut,
                OpParams::IndexPut {
                    count,
                    accumulate,
                    index,
                },
            ) => self.index_put(node, *count, *accumulate, index.as_ref(), &o),
            (op, _) => Err(format!("the CUDA device has no kernel for {op} yet")),
        }
    }
}

/// A program's command list at one placement.
pub(crate) struct CommandList {
    pub commands: Vec<Command>,
    /// The commands of each node, by node index (empty for a node that issues none).
    pub spans: Vec<std::ops::Range<usize>>,
    /// The generated kernels the commands launch, (name, source), each once.
    pub kernels: Vec<(String, String)>,
    /// The guarded copies that write the updates, after the fetches are read.
    pub updates: Vec<Command>,
}

/// Lowers every node of `program` with its persistent block, lane and error block at
/// device addresses `(persistent, lane, err)`, fusing the regions of `fusion`, then
/// batches adjacent fused launches (`batch`).
pub(crate) fn lower_program(
    program: &Program,
    (persistent, lane, err): (u64, u64, u64),
    dnn: Option<&Dnn>,
    fusion: &fusion::FusionPlan,
    tiled_attention: bool,
) -> Result<CommandList, salus_exec::ExecError> {
    let graph = program.graph();
    let epilogues = epilogues::plan(program, fusion);
    let folds = folds::plan(program, &epilogues);
    let mut lower = Lowering {
        program,
        persistent,
        lane,
        err,
        dnn,
        index: 0,
        commands: Vec::new(),
        fusion,
        folds: &folds,
        epilogues: &epilogues,
        kernels: Vec::new(),
        tiled_attention,
    };
    let mut spans = Vec::with_capacity(graph.nodes.len());
    for (index, node) in graph.nodes.iter().enumerate() {
        lower.index = index;
        let start = lower.commands.len();
        lower
            .node(node)
            .map_err(|message| salus_exec::ExecError::Node {
                index,
                name: node.name.clone(),
                op: node.op.name().to_string(),
                message,
            })?;
        spans.push(start..lower.commands.len());
    }
    let (commands, batches) = batch::batch_fused(lower.commands, &mut spans);
    let mut kernels = lower.kernels;
    kernels.extend(batches);
    let mut updates = Vec::new();
    for u in &graph.updates {
        if let (Some(Location::Persistent(target)), Some(Location::Lane(value))) =
            (program.location(u.target), program.location(u.value))
        {
            updates.push((persistent + target, lane + value, program.bytes(u.target)));
        }
    }
    Ok(CommandList {
        commands,
        spans,
        kernels,
        updates: guarded_copies(&updates, err),
    })
}

/// The updates of an iteration, `(dst, src, bytes)` each, as launches of the guarded copy
/// kernel: skipped on the device when the iteration reported an error.
pub(crate) fn guarded_copies(updates: &[(u64, u64, u64)], err: u64) -> Vec<Command> {
    updates
        .chunks(UPDATE_SEGMENTS)
        .map(|chunk| {
            let mut args = GuardedCopyArgs {
                err,
                count: chunk.len() as u64,
                seg: [0; 3 * UPDATE_SEGMENTS],
            };
            for (k, &(dst, src, bytes)) in chunk.iter().enumerate() {
                args.seg[3 * k..3 * k + 3].copy_from_slice(&[dst, src, bytes]);
            }
            let largest = chunk.iter().map(|u| u.2).max().unwrap_or(0);
            let grid = (grid_for(largest / 4 + 1).min(256), chunk.len() as u32);
            Command::Launch(Launch::new(Kernel::GuardedCopies, grid, args))
        })
        .collect()
}

#[cfg(test)]
mod tests;
