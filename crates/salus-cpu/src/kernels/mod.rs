//! CPU kernels: one function per op family, over contiguous row-major tensors.
//!
//! Every op of `docs/ops.md` has a kernel here. Typed f32 kernels (`fast`: contiguous
//! inner loops, the bounded thread pool, planned scratch) run the hot ops of the target
//! models' training steps; the generic paths go through `f64` for every dtype and cover
//! the rest, by family: `elementwise` (the broadcasting engine), `reduce` (sums, means,
//! maxima, variance, `any`, softmax, `cumsum`), `order` (`argmax`, `argmin`, `sort`), `matmul`, `conv`, `pool`, `pad` (constant
//! and reflection padding), `norm` (layer and group norm, the softmax backwards), `shape`
//! (views, permutes, expands, flips, concatenation, splits), `index` (slicing, gathers,
//! scatters, embeddings, advanced indexing, `index_put`) and `random`; 16-bit 2-d
//! convolutions go through the f32 kernel (`widened`). f16 and bf16 are
//! loaded and stored through f32: a result is rounded to f32, then to the half type
//! (round to nearest even), as PyTorch's CPU kernels round what they compute in f32.
//!
//! Kernels read a node's typed parameters ([`OpParams`], from `Program::params`), which
//! validation checked and normalised once: dimensions are in range, defaults filled in,
//! convolution and pooling geometry derived. No kernel reads an attribute.

use salus_graph::{
    DType, GeluApproximate, Node, Op, OpParams, Scalar, ScatterReduction, TensorType,
};

mod attention;
mod conv;
mod elementwise;
mod fast;
mod index;
mod matmul;
mod norm;
mod order;
mod pad;
mod pool;
mod random;
mod reduce;
mod shape;
mod special;
mod widened;

use elementwise::{elementwise, erf};

type Result<T> = std::result::Result<T, String>;

/// A tensor argument as a kernel sees it.
pub(crate) enum Arg<'a> {
    /// An optional tensor given as `None`.
    Absent,
    /// A tensor in memory of its own.
    Tensor(&'a TensorType, &'a [u8]),
    /// An input whose bytes are already in output 0: the node runs in place over it.
    InOutput(&'a TensorType),
}

/// An output buffer.
pub(crate) struct Out<'a> {
    pub ty: &'a TensorType,
    pub bytes: &'a mut [u8],
}

pub(crate) fn load(bytes: &[u8], dtype: DType, i: usize) -> f64 {
    match dtype {
        DType::F32 => f64::from(f32::from_le_bytes(word(bytes, i))),
        DType::I64 => i64::from_le_bytes(word(bytes, i)) as f64,
        DType::I32 => f64::from(i32::from_le_bytes(word(bytes, i))),
        DType::Bool => f64::from(u8::from(bytes[i] != 0)),
        DType::F16 => f64::from(half::f16::from_bits(u16::from_le_bytes(word(bytes, i))).to_f32()),
        DType::Bf16 => {
            f64::from(half::bf16::from_bits(u16::from_le_bytes(word(bytes, i))).to_f32())
        }
    }
}

fn word<const N: usize>(bytes: &[u8], i: usize) -> [u8; N] {
    let mut w = [0u8; N];
    w.copy_from_slice(&bytes[i * N..(i + 1) * N]);
    w
}

pub(crate) fn store(bytes: &mut [u8], dtype: DType, i: usize, v: f64) {
    match dtype {
        DType::F32 => bytes[i * 4..(i + 1) * 4].copy_from_slice(&(v as f32).to_le_bytes()),
        DType::I64 => bytes[i * 8..(i + 1) * 8].copy_from_slice(&(v as i64).to_le_bytes()),
        DType::I32 => bytes[i * 4..(i + 1) * 4].copy_from_slice(&(v as i32).to_le_bytes()),
        DType::Bool => bytes[i] = u8::from(v != 0.0),
        // PyTorch computes half-precision ops in f32 and rounds that f32 result to
        // nearest even; rounding the f64 value directly would differ where the f32
        // result lands exactly halfway between two half-precision values.
        DType::F16 => bytes[i * 2..(i + 1) * 2]
            .copy_from_slice(&half::f16::from_f32(v as f32).to_bits().to_le_bytes()),
        DType::Bf16 => bytes[i * 2..(i + 1) * 2]
            .copy_from_slice(&half::bf16::from_f32(v as f32).to_bits().to_le_bytes()),
    }
}

/// Fills `bytes` with copies of the element `one` (of 1, 2, 4 or 8 bytes).
fn fill(bytes: &mut [u8], one: &[u8]) {
    fn words<W: bytemuck::Pod>(bytes: &mut [u8], one: &[u8]) -> bool {
        match (
            bytemuck::try_cast_slice_mut::<u8, W>(bytes),
            bytemuck::try_pod_read_unaligned::<W>(one),
        ) {
            (Ok(words), Ok(word)) => {
                words.fill(word);
                true
            }
            _ => false,
        }
    }
    let done = match one.len() {
        1 => words::<u8>(bytes, one),
        2 => words::<u16>(bytes, one),
        4 => words::<u32>(bytes, one),
        8 => words::<u64>(bytes, one),
        _ => false,
    };
    if !done {
        for element in bytes.chunks_exact_mut(one.len()) {
            element.copy_from_slice(one);
        }
    }
}

/// The bytes as `f32`s, when the dtype is f32 (always aligned: the arena is 16-byte
/// aligned and the plan's offsets are multiples of 256).
fn as_f32(bytes: &[u8], dtype: DType) -> Option<&[f32]> {
    (dtype == DType::F32)
        .then(|| bytemuck::try_cast_slice(bytes).ok())
        .flatten()
}

fn as_f32_mut(bytes: &mut [u8], dtype: DType) -> Option<&mut [f32]> {
    (dtype == DType::F32)
        .then(|| bytemuck::try_cast_slice_mut(bytes).ok())
        .flatten()
}

fn numel(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize
}

fn contiguous_strides(shape: &[u64]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1] as usize;
    }
    strides
}

/// Strides that read a tensor of `shape` broadcast to `out` (0 along broadcast dims).
fn broadcast_strides(shape: &[u64], out: &[u64]) -> Vec<usize> {
    let own = contiguous_strides(shape);
    let lead = out.len() - shape.len();
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

/// Calls `f(out_index, source_offsets)` for every element of `out_shape`, where each
/// source offset follows that source's strides.
fn for_each_index(out_shape: &[u64], strides: &[Vec<usize>], mut f: impl FnMut(usize, &[usize])) {
    let n = numel(out_shape);
    let rank = out_shape.len();
    let mut index = vec![0u64; rank];
    let mut offsets = vec![0usize; strides.len()];
    for linear in 0..n {
        f(linear, &offsets);
        for d in (0..rank).rev() {
            index[d] += 1;
            for (o, s) in offsets.iter_mut().zip(strides) {
                *o += s[d];
            }
            if index[d] < out_shape[d] {
                break;
            }
            for (o, s) in offsets.iter_mut().zip(strides) {
                *o -= s[d] * out_shape[d] as usize;
            }
            index[d] = 0;
        }
    }
}

/// Writes each of `results` into the output of its index, where that output is used, each
/// checked to hold as many elements: for ops of several results.
fn store_results(results: Vec<Vec<f64>>, outs: &mut [Option<Out<'_>>]) -> Result<()> {
    for (k, data) in results.into_iter().enumerate() {
        if let Some(Some(out)) = outs.get_mut(k) {
            if numel(&out.ty.shape) != data.len() {
                return Err(format!(
                    "output {k} {} must have {} elements",
                    out.ty,
                    data.len()
                ));
            }
            for (i, v) in data.into_iter().enumerate() {
                store(out.bytes, out.ty.dtype, i, v);
            }
        }
    }
    Ok(())
}

fn tensor<'a>(args: &'a [Arg<'a>], i: usize) -> Result<(&'a TensorType, &'a [u8])> {
    match args.get(i) {
        Some(Arg::Tensor(ty, bytes)) => Ok((ty, bytes)),
        _ => Err(format!("input {i} must be a tensor of its own")),
    }
}

/// Element `i` of an integer index tensor as a position in a dimension of `size`
/// (negative counting from the end), checked: a bad index fails the node, naming `what`.
fn index_at(bytes: &[u8], dtype: DType, i: usize, size: u64, what: &str) -> Result<usize> {
    let v = match dtype {
        DType::I64 => i64::from_le_bytes(word(bytes, i)),
        DType::I32 => i64::from(i32::from_le_bytes(word(bytes, i))),
        _ => return Err(format!("{what} must be an integer tensor")),
    };
    let wrapped = if v < 0 { v + size as i64 } else { v };
    if wrapped < 0 || wrapped >= size as i64 {
        return Err(format!(
            "{what} {v} is out of range for a dimension of size {size}"
        ));
    }
    Ok(wrapped as usize)
}

/// `maximum` as PyTorch computes it: NaN when either is NaN, else the larger (`a` on a
/// tie, as `std::max`).
fn maximum(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        a + b
    } else if a < b {
        b
    } else {
        a
    }
}

/// `remainder` as PyTorch computes it: C's `fmod` (exact, the sign of `a`), then `b` added
/// to a non-zero remainder whose sign is not `b`'s, so that the result takes `b`'s sign.
fn remainder(a: f64, b: f64) -> f64 {
    let m = a % b;
    if m != 0.0 && (b < 0.0) != (m < 0.0) {
        m + b
    } else {
        m
    }
}

/// `minimum`: NaN when either is NaN, else the smaller (`a` on a tie).
fn minimum(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        a + b
    } else if b < a {
        b
    } else {
        a
    }
}

/// A number parameter's value, or `default` when the op's parameters leave it out.
fn number_or(value: Option<Scalar>, default: f64) -> f64 {
    value.map_or(default, Scalar::as_f64)
}

/// Runs one node with its parameters. `outs` holds the node's outputs (`None` for unused
/// ones); `scratch` is the lane memory the plan reserved for it
/// (`salus_graph::plan::scratch_bytes`).
pub(crate) fn run(
    node: &Node,
    params: &OpParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
    scratch: &mut [u8],
) -> Result<()> {
    use Op::*;
    // Typed f32 kernels first (16-bit convolutions widened to f32 for them); the generic
    // paths below cover every other case.
    if let Some(done) = fast::run(node.op, params, args, outs, scratch) {
        return done;
    }
    if matches!(node.op, Convolution | ConvolutionBackward)
        && let Some(done) = widened::run(node.op, params, args, outs, scratch)
    {
        return done;
    }
    // Ops with several results fill whichever of them are used.
    match (node.op, params) {
        (AssertAsyncMsg, OpParams::Assert { message }) => {
            let (ty, bytes) = tensor(args, 0)?;
            return if load(bytes, ty.dtype, 0) != 0.0 {
                Ok(())
            } else if message.is_empty() {
                Err("an assertion of the step failed".into())
            } else {
                Err(message.clone())
            };
        }
        (ConvolutionBackward, OpParams::Conv(conv)) => {
            return conv::convolution_backward(conv, args, outs);
        }
        (MaxPool2dWithIndices, OpParams::Pool(pool)) => return pool::max_pool2d(pool, args, outs),
        (Sort, &OpParams::Sort { dim, descending }) => {
            return order::sort(dim, descending, args, outs);
        }
        (
            NativeLayerNorm,
            OpParams::LayerNorm {
                normalized_shape,
                eps,
                ..
            },
        ) => {
            return norm::layer_norm(normalized_shape, *eps, args, outs);
        }
        (
            NativeLayerNormBackward,
            OpParams::LayerNorm {
                normalized_shape, ..
            },
        ) => {
            return norm::layer_norm_backward(normalized_shape, args, outs);
        }
        (SplitWithSizes, OpParams::Split { dim, sizes }) => {
            return shape::split(*dim, sizes, args, outs);
        }
        (
            NativeGroupNorm,
            &OpParams::GroupNorm {
                batch,
                channels,
                inner,
                groups,
                eps,
            },
        ) => {
            let geometry = norm::GroupNorm {
                batch: batch as usize,
                channels: channels as usize,
                inner: inner as usize,
                groups: groups as usize,
                eps,
            };
            return norm::group_norm(&geometry, args, outs);
        }
        (ScaledDotProductAttention, OpParams::Attention(p)) => {
            let layout = attention::Layout::FLASH_FORWARD;
            return attention::attention(p, layout, attention::Dropout::NONE, args, outs);
        }
        (ScaledDotProductAttentionBackward, OpParams::Attention(p)) => {
            let (layout, drop) = (attention::Layout::FLASH_BACKWARD, attention::Dropout::NONE);
            return attention::attention_backward(p, layout, drop, args, outs);
        }
        (EfficientAttention | EfficientAttentionBackward, OpParams::Attention(p)) => {
            return attention::efficient(node, p, args, outs);
        }
        (
            NativeBatchNorm | NativeBatchNormBackward,
            &OpParams::BatchNorm {
                batch,
                channels,
                inner,
                momentum,
                eps,
            },
        ) => {
            let geometry = norm::BatchNorm {
                batch: batch as usize,
                channels: channels as usize,
                inner: inner as usize,
                momentum,
                eps,
            };
            return if node.op == NativeBatchNorm {
                norm::batch_norm(&geometry, args, outs)
            } else {
                norm::batch_norm_backward(&geometry, args, outs)
            };
        }
        _ => {}
    }
    let Some(Some(o)) = outs.first_mut() else {
        return Err("output 0 is unused".into());
    };
    match (node.op, params) {
        (AddTensor | SubTensor, &OpParams::Binary { alpha }) => {
            let sign = if node.op == SubTensor { -1.0 } else { 1.0 };
            elementwise(args, o, |v| v[0] + sign * alpha * v[1])
        }
        (MulTensor, _) => elementwise(args, o, |v| v[0] * v[1]),
        (DivTensor, _) => elementwise(args, o, |v| v[0] / v[1]),
        (AddScalar, &OpParams::WithScalar { scalar, alpha }) => {
            let other = scalar.as_f64();
            elementwise(args, o, |v| v[0] + alpha * other)
        }
        (MulScalar, &OpParams::WithScalar { scalar, .. }) => {
            let other = scalar.as_f64();
            elementwise(args, o, |v| v[0] * other)
        }
        (DivScalar, &OpParams::WithScalar { scalar, .. }) => {
            let other = scalar.as_f64();
            elementwise(args, o, |v| v[0] / other)
        }
        (Neg, _) => elementwise(args, o, |v| -v[0]),
        (Abs, _) => elementwise(args, o, |v| v[0].abs()),
        (Sign, _) => elementwise(args, o, |v| {
            if v[0].is_nan() {
                v[0]
            } else if v[0] > 0.0 {
                1.0
            } else if v[0] < 0.0 {
                -1.0
            } else {
                0.0
            }
        }),
        (Exp, _) => elementwise(args, o, |v| v[0].exp()),
        (Log, _) => elementwise(args, o, |v| v[0].ln()),
        (Sqrt, _) => elementwise(args, o, |v| v[0].sqrt()),
        (Rsqrt, _) => elementwise(args, o, |v| 1.0 / v[0].sqrt()),
        (Reciprocal, _) => elementwise(args, o, |v| 1.0 / v[0]),
        (Sigmoid, _) => elementwise(args, o, |v| 1.0 / (1.0 + (-v[0]).exp())),
        (Tanh, _) => elementwise(args, o, |v| v[0].tanh()),
        // NaN propagates, as in PyTorch (f64::max would give 0).
        (Relu, _) => elementwise(
            args,
            o,
            |v| if v[0].is_nan() { v[0] } else { v[0].max(0.0) },
        ),
        (LeakyRelu, &OpParams::LeakyRelu { negative_slope }) => elementwise(args, o, |v| {
            if v[0] > 0.0 {
                v[0]
            } else {
                negative_slope * v[0]
            }
        }),
        (Gelu, OpParams::Gelu { approximate }) => match approximate {
            GeluApproximate::Tanh => elementwise(args, o, |v| {
                let x = v[0];
                0.5 * x
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
            }),
            GeluApproximate::None => elementwise(args, o, |v| {
                0.5 * v[0] * (1.0 + erf(v[0] / std::f64::consts::SQRT_2))
            }),
        },
        (Erf, _) => elementwise(args, o, |v| erf(v[0])),
        (Erfc, _) => elementwise(args, o, |v| libm::erfc(v[0])),
        (Erfinv, _) => elementwise(args, o, |v| special::erfinv(v[0])),
        (Lgamma, _) => elementwise(args, o, |v| special::lgamma(v[0])),
        (Digamma, _) => elementwise(args, o, |v| special::digamma(v[0])),
        (Polygamma, &OpParams::Polygamma { n }) => {
            elementwise(args, o, |v| special::polygamma(n, v[0]))
        }
        (Log1p, _) => elementwise(args, o, |v| v[0].ln_1p()),
        (Expm1, _) => elementwise(args, o, |v| v[0].exp_m1()),
        (Sin, _) => elementwise(args, o, |v| v[0].sin()),
        (Cos, _) => elementwise(args, o, |v| v[0].cos()),
        (Atan, _) => elementwise(args, o, |v| v[0].atan()),
        (Atan2, _) => elementwise(args, o, |v| v[0].atan2(v[1])),
        (RemainderTensor, _) => elementwise(args, o, |v| remainder(v[0], v[1])),
        (FmodTensor, _) => elementwise(args, o, |v| v[0] % v[1]),
        (PowTensorTensor, _) => elementwise(args, o, |v| v[0].powf(v[1])),
        (Floor, _) => elementwise(args, o, |v| v[0].floor()),
        (Ceil, _) => elementwise(args, o, |v| v[0].ceil()),
        (Round, _) => elementwise(args, o, |v| v[0].round_ties_even()),
        (Trunc, _) => elementwise(args, o, |v| v[0].trunc()),
        (PowTensorScalar, &OpParams::WithScalar { scalar, .. }) => {
            let e = scalar.as_f64();
            elementwise(args, o, |v| v[0].powf(e))
        }
        (PowScalar, &OpParams::WithScalar { scalar, .. }) => {
            let base = scalar.as_f64();
            elementwise(args, o, |v| base.powf(v[0]))
        }
        (Clamp, &OpParams::Clamp { min, max }) => {
            let (lo, hi) = (
                number_or(min, f64::NEG_INFINITY),
                number_or(max, f64::INFINITY),
            );
            elementwise(args, o, |v| {
                if v[0].is_nan() {
                    v[0]
                } else {
                    v[0].max(lo).min(hi)
                }
            })
        }
        (
            EqScalar | NeScalar | LtScalar | LeScalar | GtScalar | GeScalar,
            &OpParams::WithScalar { scalar, .. },
        ) => {
            let other = scalar.as_f64();
            let op = node.op;
            elementwise(args, o, move |v| {
                let x = v[0];
                f64::from(u8::from(match op {
                    EqScalar => x == other,
                    NeScalar => x != other,
                    LtScalar => x < other,
                    LeScalar => x <= other,
                    GtScalar => x > other,
                    _ => x >= other,
                }))
            })
        }
        (EqTensor | LtTensor | GtTensor, _) => {
            let op = node.op;
            elementwise(args, o, move |v| {
                f64::from(u8::from(match op {
                    EqTensor => v[0] == v[1],
                    LtTensor => v[0] < v[1],
                    _ => v[0] > v[1],
                }))
            })
        }
        (Maximum, _) => elementwise(args, o, |v| maximum(v[0], v[1])),
        (Minimum, _) => elementwise(args, o, |v| minimum(v[0], v[1])),
        (LogicalAnd, _) => {
            elementwise(args, o, |v| f64::from(u8::from(v[0] != 0.0 && v[1] != 0.0)))
        }
        (LogicalNot, _) => elementwise(args, o, |v| f64::from(u8::from(v[0] == 0.0))),
        (BitwiseNot, _) if o.ty.dtype == DType::Bool => {
            elementwise(args, o, |v| f64::from(u8::from(v[0] == 0.0)))
        }
        (BitwiseNot, _) => elementwise(args, o, |v| !(v[0] as i64) as f64),
        (BitwiseAndTensor, _) => elementwise(args, o, |v| ((v[0] as i64) & (v[1] as i64)) as f64),
        (WhereSelf, _) => elementwise(args, o, |v| if v[0] != 0.0 { v[1] } else { v[2] }),
        (ToCopy | Clone, _) => elementwise(args, o, |v| v[0]),
        (FullLike | Full | ScalarTensor, &OpParams::Fill { value, .. }) => {
            // One element's bytes, repeated.
            let mut one = [0u8; 8];
            store(&mut one, o.ty.dtype, 0, value.as_f64());
            fill(o.bytes, &one[..o.ty.dtype.size() as usize]);
            Ok(())
        }
        (ArangeStartStep, &OpParams::Arange { start, step, .. }) => {
            let (start, step) = (start.as_f64(), step.as_f64());
            for i in 0..numel(&o.ty.shape) {
                store(o.bytes, o.ty.dtype, i, start + step * i as f64);
            }
            Ok(())
        }
        (View | Unsqueeze | SqueezeDims, _) => shape::view(args, o),
        (Permute, OpParams::Permute { dims }) => shape::permute(dims, args, o),
        (Expand, _) => shape::expand(args, o),
        (Cat, &OpParams::Cat { dim, .. }) => shape::cat(dim, args, o),
        (SumDimIntList | MeanDim | Amax | Mean, OpParams::Reduce(r)) => {
            reduce::reduce(node.op, r, args, o)
        }
        (
            VarCorrection,
            OpParams::Var {
                reduction,
                correction,
            },
        ) => reduce::variance(reduction, *correction, args, o),
        (AnyDim, OpParams::Reduce(r)) => reduce::any(r, args, o),
        (Argmax | Argmin, OpParams::Reduce(r)) => order::arg_extreme(node.op == Argmax, r, args, o),
        (Softmax | LogSoftmax, &OpParams::Softmax { dim, .. }) => {
            reduce::softmax(dim, node.op == LogSoftmax, args, o)
        }
        (Cumsum | Cumprod, &OpParams::Cumsum { dim, .. }) => {
            reduce::cumulative(dim, node.op == Cumprod, args, o)
        }
        (Flip, OpParams::Flip { dims }) => shape::flip(dims, args, o),
        (ConstantPadNd, OpParams::ConstantPad { before, value, .. }) => {
            pad::constant(before, *value, args, o)
        }
        (
            ReflectionPad2d | ReflectionPad2dBackward,
            &OpParams::ReflectionPad {
                padding,
                planes,
                input,
                output,
            },
        ) => {
            let geometry = pad::Reflection {
                planes: planes as usize,
                input,
                output,
                left: padding[0],
                top: padding[2],
            };
            if node.op == ReflectionPad2d {
                pad::reflection(&geometry, args, o)
            } else {
                pad::reflection_backward(&geometry, args, o)
            }
        }
        (Mm, _) => matmul::matmul(None, 1.0, args, o),
        (Addmm, &OpParams::Addmm { beta, alpha }) => matmul::matmul(Some(beta), alpha, args, o),
        (Bmm, _) => matmul::bmm(args, o),
        (Convolution, OpParams::Conv(conv)) => conv::convolution(conv, args, o),
        (MaxPool2dWithIndicesBackward, OpParams::Pool(pool)) => {
            pool::max_pool2d_backward(pool, args, o)
        }
        (AvgPool2d, OpParams::Pool(pool)) => pool::avg_pool2d(pool, args, o),
        (AvgPool2dBackward, OpParams::Pool(pool)) => pool::avg_pool2d_backward(pool, args, o),
        (AdaptiveAvgPool2d, _) => pool::adaptive_avg_pool2d(args, o),
        (AdaptiveAvgPool2dBackward, _) => pool::adaptive_avg_pool2d_backward(args, o),
        (SoftmaxBackwardData | LogSoftmaxBackwardData, &OpParams::SoftmaxBackward { dim, .. }) => {
            norm::softmax_backward(dim, node.op == LogSoftmaxBackwardData, args, o)
        }
        (
            SliceTensor,
            &OpParams::Slice {
                dim,
                start,
                step,
                len,
                ..
            },
        ) => index::slice(dim, start, step, len, args, o),
        (SelectInt, &OpParams::Select { dim, index }) => index::select(dim, index, args, o),
        (IndexSelect, &OpParams::Index { dim }) => index::index_select(dim, args, o),
        (Gather, &OpParams::Index { dim }) => index::gather(dim, args, o),
        (ScatterAdd, &OpParams::Index { dim }) => index::scatter(dim, |a, v| a + v, args, o),
        (ScatterSrc, &OpParams::Index { dim }) => index::scatter(dim, |_, v| v, args, o),
        (ScatterReduce, &OpParams::ScatterReduce { dim, reduce }) => {
            // NaN wins and a tie keeps the place's value, as in PyTorch's kernels.
            let combine: fn(f64, f64) -> f64 = match reduce {
                ScatterReduction::Prod => |a, v| a * v,
                ScatterReduction::Amax => maximum,
                ScatterReduction::Amin => minimum,
            };
            index::scatter(dim, combine, args, o)
        }
        (ScatterValue, &OpParams::Scatter { dim, value }) => {
            index::scatter_value(dim, value.as_f64(), args, o)
        }
        (IndexTensor, OpParams::AdvancedIndex(selection)) => index::index(selection, args, o),
        (
            IndexPut,
            OpParams::IndexPut {
                accumulate,
                index: selection,
                ..
            },
        ) => index::index_put(*accumulate, selection.as_ref(), args, o),
        (Embedding, _) => index::embedding(args, o),
        (
            EmbeddingDenseBackward,
            &OpParams::Embedding {
                padding_idx,
                scale_grad_by_freq,
                ..
            },
        ) => index::embedding_backward(padding_idx, scale_grad_by_freq, args, o),
        (BernoulliP, &OpParams::Bernoulli { p }) => random::bernoulli(node, p, args, o),
        (RandLike, _) => random::rand_like(node, args, o),
        (op, params) => Err(format!(
            "the CPU device has no kernel for {op} with parameters {params:?}"
        )),
    }
}
