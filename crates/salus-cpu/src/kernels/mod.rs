//! CPU kernels: one function per op family, over contiguous row-major tensors.
//!
//! This set covers every op of the four target models' training steps (MLP, small CNN,
//! GPT-style decoder, resnet18): elementwise ops with broadcasting, reductions, matrix
//! products, 2-d convolution and its backward, max pooling, layer norm, softmax, shape
//! copies, embedding, gather, scatter and index_put. Typed f32 kernels (`fast`: contiguous
//! inner loops, the bounded thread pool, planned scratch) run the hot ops; the generic
//! paths here go through `f64` for every dtype and cover the rest. The other ops of
//! `docs/ops.md` live in the submodules (`conv`: convolutions other than 2-d f32; `pool`,
//! `index`, `norm`, `random`); f16 and bf16 are loaded and stored through f32.

use salus_graph::{Attr, DType, Node, Op, TensorType};

use crate::blas::{Mat, sgemm};

mod conv;
mod fast;
mod index;
mod norm;
mod pool;
mod random;

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
        DType::F16 => bytes[i * 2..(i + 1) * 2]
            .copy_from_slice(&half::f16::from_f64(v).to_bits().to_le_bytes()),
        DType::Bf16 => bytes[i * 2..(i + 1) * 2]
            .copy_from_slice(&half::bf16::from_f64(v).to_bits().to_le_bytes()),
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

/// An elementwise op over broadcast inputs: `f(values) -> value`, written to output 0.
fn elementwise(args: &[Arg<'_>], out: &mut Out<'_>, f: impl Fn(&[f64]) -> f64) -> Result<()> {
    let out_ty = out.ty;
    let mut strides = Vec::with_capacity(args.len());
    let mut sources: Vec<Option<(&[u8], DType)>> = Vec::with_capacity(args.len());
    for arg in args {
        match arg {
            Arg::Tensor(ty, bytes) => {
                strides.push(broadcast_strides(&ty.shape, &out_ty.shape));
                sources.push(Some((bytes, ty.dtype)));
            }
            Arg::InOutput(ty) => {
                if ty.shape != out_ty.shape {
                    return Err("in-place input must have the output's shape".into());
                }
                strides.push(contiguous_strides(&out_ty.shape));
                sources.push(None);
            }
            Arg::Absent => return Err("elementwise op with an absent input".into()),
        }
    }
    let in_place_dtype = args.iter().find_map(|a| match a {
        Arg::InOutput(ty) => Some(ty.dtype),
        _ => None,
    });
    let mut values = vec![0.0; args.len()];
    let typed: Option<Vec<Option<&[f32]>>> = sources
        .iter()
        .map(|s| match s {
            Some((b, dtype)) => as_f32(b, *dtype).map(Some),
            None => (in_place_dtype == Some(DType::F32)).then_some(None),
        })
        .collect();
    let contiguous = args.iter().all(|a| match a {
        Arg::Tensor(ty, _) => ty.shape == out_ty.shape,
        _ => true,
    });
    if let (Some(typed), Some(dst), true) = (
        typed.as_ref(),
        as_f32_mut(out.bytes, out_ty.dtype),
        contiguous,
    ) {
        // f32, no broadcasting: one pass over the elements.
        for i in 0..dst.len() {
            for (k, source) in typed.iter().enumerate() {
                values[k] = f64::from(match source {
                    Some(src) => src[i],
                    None => dst[i],
                });
            }
            dst[i] = f(&values) as f32;
        }
        return Ok(());
    }
    if let (Some(typed), Some(dst)) = (typed, as_f32_mut(out.bytes, out_ty.dtype)) {
        // f32 throughout: typed loads and stores, same arithmetic.
        for_each_index(&out_ty.shape, &strides, |i, offsets| {
            for (k, source) in typed.iter().enumerate() {
                values[k] = f64::from(match source {
                    Some(src) => src[offsets[k]],
                    None => dst[i],
                });
            }
            dst[i] = f(&values) as f32;
        });
        return Ok(());
    }
    let bytes = &mut *out.bytes;
    for_each_index(&out_ty.shape, &strides, |i, offsets| {
        for (k, source) in sources.iter().enumerate() {
            values[k] = match source {
                Some((b, dtype)) => load(b, *dtype, offsets[k]),
                None => load(bytes, in_place_dtype.unwrap_or(out_ty.dtype), i),
            };
        }
        store(bytes, out_ty.dtype, i, f(&values));
    });
    Ok(())
}

fn attr_f64(node: &Node, name: &str, default: Option<f64>) -> Result<f64> {
    match node.attrs.get(name) {
        Some(Attr::Float(v)) => Ok(*v),
        Some(Attr::Int(v)) => Ok(*v as f64),
        Some(Attr::Bool(v)) => Ok(f64::from(u8::from(*v))),
        None => default.ok_or_else(|| format!("attribute {name:?} is missing")),
        Some(other) => Err(format!("attribute {name:?} is not a number: {other:?}")),
    }
}

fn attr_ints<'a>(node: &'a Node, name: &str) -> Option<&'a [i64]> {
    match node.attrs.get(name) {
        Some(Attr::Ints(v)) => Some(v),
        _ => None,
    }
}

fn attr_int(node: &Node, name: &str, default: i64) -> i64 {
    match node.attrs.get(name) {
        Some(Attr::Int(v)) => *v,
        _ => default,
    }
}

fn attr_bool(node: &Node, name: &str) -> bool {
    matches!(node.attrs.get(name), Some(Attr::Bool(true)))
}

fn wrap(d: i64, rank: usize) -> usize {
    let r = rank.max(1) as i64;
    (if d < 0 { d + r } else { d }) as usize
}

fn tensor<'a>(args: &'a [Arg<'a>], i: usize) -> Result<(&'a TensorType, &'a [u8])> {
    match args.get(i) {
        Some(Arg::Tensor(ty, bytes)) => Ok((ty, bytes)),
        _ => Err(format!("input {i} must be a tensor of its own")),
    }
}

/// Runs one node. `outs` holds the node's outputs (`None` for unused ones); `scratch` is
/// the lane memory the plan reserved for it (`salus_graph::plan::scratch_bytes`).
pub(crate) fn run(
    node: &Node,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
    scratch: &mut [u8],
) -> Result<()> {
    use Op::*;
    // Typed f32 kernels first; the generic paths below cover every other case.
    if let Some(done) = fast::run(node, args, outs, scratch) {
        return done;
    }
    // Ops with several results fill whichever of them are used.
    match node.op {
        ConvolutionBackward if conv::is_generic(node, args) => {
            return conv::convolution_backward(node, args, outs);
        }
        MaxPool2dWithIndices if pool::is_unbatched(args, 0) => {
            return pool::max_pool2d(node, args, outs);
        }
        NativeLayerNormBackward => return norm::layer_norm_backward(node, args, outs),
        ConvolutionBackward => return convolution_backward(node, args, outs),
        MaxPool2dWithIndices => return max_pool2d(node, args, outs),
        NativeLayerNorm => return layer_norm(node, args, outs),
        SplitWithSizes => return split(node, args, outs),
        _ => {}
    }
    let Some(Some(o)) = outs.first_mut() else {
        return Err("output 0 is unused".into());
    };
    let gelu_tanh = matches!(node.attrs.get("approximate"), Some(Attr::Str(s)) if s == "tanh");
    match node.op {
        AddTensor | SubTensor => {
            let alpha = attr_f64(node, "alpha", Some(1.0))?;
            let sign = if node.op == SubTensor { -1.0 } else { 1.0 };
            elementwise(args, o, |v| v[0] + sign * alpha * v[1])
        }
        MulTensor => elementwise(args, o, |v| v[0] * v[1]),
        DivTensor => elementwise(args, o, |v| v[0] / v[1]),
        AddScalar => {
            let other = attr_f64(node, "other", None)?;
            let alpha = attr_f64(node, "alpha", Some(1.0))?;
            elementwise(args, o, |v| v[0] + alpha * other)
        }
        MulScalar => {
            let other = attr_f64(node, "other", None)?;
            elementwise(args, o, |v| v[0] * other)
        }
        DivScalar => {
            let other = attr_f64(node, "other", None)?;
            elementwise(args, o, |v| v[0] / other)
        }
        Neg => elementwise(args, o, |v| -v[0]),
        Abs => elementwise(args, o, |v| v[0].abs()),
        Sign => elementwise(args, o, |v| {
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
        Exp => elementwise(args, o, |v| v[0].exp()),
        Log => elementwise(args, o, |v| v[0].ln()),
        Sqrt => elementwise(args, o, |v| v[0].sqrt()),
        Rsqrt => elementwise(args, o, |v| 1.0 / v[0].sqrt()),
        Reciprocal => elementwise(args, o, |v| 1.0 / v[0]),
        Sigmoid => elementwise(args, o, |v| 1.0 / (1.0 + (-v[0]).exp())),
        Tanh => elementwise(args, o, |v| v[0].tanh()),
        // NaN propagates, as in PyTorch (f64::max would give 0).
        Relu => elementwise(
            args,
            o,
            |v| if v[0].is_nan() { v[0] } else { v[0].max(0.0) },
        ),
        LeakyRelu => {
            let slope = attr_f64(node, "negative_slope", Some(0.01))?;
            elementwise(args, o, |v| if v[0] > 0.0 { v[0] } else { slope * v[0] })
        }
        Gelu if gelu_tanh => elementwise(args, o, |v| {
            let x = v[0];
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        }),
        Gelu => elementwise(args, o, |v| {
            0.5 * v[0] * (1.0 + erf(v[0] / std::f64::consts::SQRT_2))
        }),
        Erf => elementwise(args, o, |v| erf(v[0])),
        PowTensorScalar => {
            let e = attr_f64(node, "exponent", None)?;
            elementwise(args, o, |v| v[0].powf(e))
        }
        PowScalar => {
            let base = attr_f64(node, "self", None)?;
            elementwise(args, o, |v| base.powf(v[0]))
        }
        Clamp => {
            let lo = attr_f64(node, "min", Some(f64::NEG_INFINITY))?;
            let hi = attr_f64(node, "max", Some(f64::INFINITY))?;
            elementwise(args, o, |v| {
                if v[0].is_nan() {
                    v[0]
                } else {
                    v[0].max(lo).min(hi)
                }
            })
        }
        EqScalar | NeScalar | LtScalar | LeScalar | GtScalar | GeScalar => {
            let other = attr_f64(node, "other", None)?;
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
        LogicalAnd => elementwise(args, o, |v| f64::from(u8::from(v[0] != 0.0 && v[1] != 0.0))),
        LogicalNot => elementwise(args, o, |v| f64::from(u8::from(v[0] == 0.0))),
        BitwiseNot if o.ty.dtype == DType::Bool => {
            elementwise(args, o, |v| f64::from(u8::from(v[0] == 0.0)))
        }
        BitwiseNot => elementwise(args, o, |v| !(v[0] as i64) as f64),
        BitwiseAndTensor => elementwise(args, o, |v| ((v[0] as i64) & (v[1] as i64)) as f64),
        WhereSelf => elementwise(args, o, |v| if v[0] != 0.0 { v[1] } else { v[2] }),
        ToCopy | Clone => elementwise(args, o, |v| v[0]),
        FullLike | Full => {
            let fill = attr_f64(node, "fill_value", None)?;
            let n = numel(&o.ty.shape);
            for i in 0..n {
                store(o.bytes, o.ty.dtype, i, fill);
            }
            Ok(())
        }
        ScalarTensor => {
            let s = attr_f64(node, "s", None)?;
            store(o.bytes, o.ty.dtype, 0, s);
            Ok(())
        }
        View | Unsqueeze | SqueezeDims => {
            let (_, bytes) = tensor(args, 0)?;
            o.bytes.copy_from_slice(&bytes[..o.bytes.len()]);
            Ok(())
        }
        Permute => {
            let (ty, bytes) = tensor(args, 0)?;
            let dims = attr_ints(node, "dims").ok_or("attribute \"dims\" is missing")?;
            let own = contiguous_strides(&ty.shape);
            let strides: Vec<usize> = dims.iter().map(|&d| own[wrap(d, ty.rank())]).collect();
            let size = ty.dtype.size() as usize;
            for_each_index(&o.ty.shape, &[strides], |i, offs| {
                o.bytes[i * size..(i + 1) * size]
                    .copy_from_slice(&bytes[offs[0] * size..(offs[0] + 1) * size]);
            });
            Ok(())
        }
        Expand => {
            let (ty, bytes) = tensor(args, 0)?;
            let strides = broadcast_strides(&ty.shape, &o.ty.shape);
            let size = ty.dtype.size() as usize;
            for_each_index(&o.ty.shape, &[strides], |i, offs| {
                o.bytes[i * size..(i + 1) * size]
                    .copy_from_slice(&bytes[offs[0] * size..(offs[0] + 1) * size]);
            });
            Ok(())
        }
        SumDimIntList | MeanDim | Amax | Mean => reduce(node, args, o),
        Mm | Addmm => matmul(node, args, o),
        Softmax | LogSoftmax => softmax(node, args, o),
        Gather => gather(node, args, o),
        ScatterValue => scatter_value(node, args, o),
        VarCorrection => variance(node, args, o),
        Convolution if conv::is_generic(node, args) => conv::convolution(node, args, o),
        Convolution => convolution(node, args, o),
        MaxPool2dWithIndicesBackward if pool::is_unbatched(args, 1) => {
            pool::max_pool2d_backward(args, o)
        }
        MaxPool2dWithIndicesBackward => max_pool2d_backward(args, o),
        SoftmaxBackwardData | LogSoftmaxBackwardData => norm::softmax_backward(node, args, o),
        AvgPool2d => pool::avg_pool2d(node, args, o),
        AvgPool2dBackward => pool::avg_pool2d_backward(node, args, o),
        AdaptiveAvgPool2d => pool::adaptive_avg_pool2d(args, o),
        AdaptiveAvgPool2dBackward => pool::adaptive_avg_pool2d_backward(args, o),
        SliceTensor => index::slice(node, args, o),
        SelectInt => index::select(node, args, o),
        IndexSelect => index::index_select(node, args, o),
        ScatterAdd => index::scatter_add(node, args, o),
        EmbeddingDenseBackward => index::embedding_backward(node, args, o),
        BernoulliP => random::bernoulli(node, args, o),
        ArangeStartStep => {
            let start = attr_f64(node, "start", None)?;
            let step = attr_f64(node, "step", Some(1.0))?;
            for i in 0..numel(&o.ty.shape) {
                store(o.bytes, o.ty.dtype, i, start + step * i as f64);
            }
            Ok(())
        }
        Embedding => embedding(args, o),
        Bmm => bmm(args, o),
        Cat => cat(node, args, o),
        AnyDim => any_dim(node, args, o),
        IndexPut => index_put(node, args, o),
        op => Err(format!("the CPU device has no kernel for {op} yet")),
    }
}

/// Abramowitz and Stegun 7.1.26 is not exact enough for parity; this uses the
/// series/continued-fraction pair with double precision.
fn erf(x: f64) -> f64 {
    if x.abs() < 2.5 {
        // Maclaurin series: converges quickly for |x| < 2.5.
        let mut sum = x;
        let mut term = x;
        let x2 = x * x;
        for n in 1..200 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // Continued fraction for erfc.
        let ax = x.abs();
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (ax + f);
        }
        let erfc = (-ax * ax).exp() / std::f64::consts::PI.sqrt() / (ax + f);
        (1.0 - erfc).copysign(x)
    }
}

fn reduce(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let rank = ty.rank();
    let reduced: Vec<usize> = match (node.op, attr_ints(node, "dim")) {
        (Op::Mean, _) | (_, None) => (0..rank).collect(),
        (_, Some([])) => (0..rank).collect(),
        (_, Some(ds)) => ds.iter().map(|&d| wrap(d, rank)).collect(),
    };
    // Strides mapping each input element to its output element.
    let out_strides_full = {
        let kept: Vec<u64> = (0..rank)
            .map(|d| if reduced.contains(&d) { 1 } else { ty.shape[d] })
            .collect();
        let own = contiguous_strides(&kept);
        (0..rank)
            .map(|d| if reduced.contains(&d) { 0 } else { own[d] })
            .collect::<Vec<_>>()
    };
    let n_out = numel(&o.ty.shape);
    // The mean of no elements is NaN (0 / 0), as in PyTorch.
    let count = reduced.iter().map(|&d| ty.shape[d]).product::<u64>() as f64;
    let is_max = node.op == Op::Amax;
    let mut acc = vec![if is_max { f64::NEG_INFINITY } else { 0.0 }; n_out];
    for_each_index(&ty.shape, &[out_strides_full], |i, offs| {
        let v = load(bytes, ty.dtype, i);
        let a = &mut acc[offs[0]];
        *a = if is_max {
            if v.is_nan() || v > *a { v } else { *a }
        } else {
            *a + v
        };
    });
    let mean = matches!(node.op, Op::MeanDim | Op::Mean);
    for (i, a) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, if mean { a / count } else { a });
    }
    Ok(())
}

fn matmul(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (a, b, bias) = if node.op == Op::Addmm {
        (tensor(args, 1)?, tensor(args, 2)?, Some(tensor(args, 0)?))
    } else {
        (tensor(args, 0)?, tensor(args, 1)?, None)
    };
    let (n, k, m) = (
        a.0.shape[0] as usize,
        a.0.shape[1] as usize,
        b.0.shape[1] as usize,
    );
    let beta = attr_f64(node, "beta", Some(1.0))?;
    let alpha = attr_f64(node, "alpha", Some(1.0))?;
    if let (Some(av), Some(bv), Some(dst)) = (
        as_f32(a.1, a.0.dtype),
        as_f32(b.1, b.0.dtype),
        as_f32_mut(o.bytes, o.ty.dtype),
    ) {
        let accumulate = match bias {
            Some((bty, bbytes)) => {
                let strides = broadcast_strides(&bty.shape, &o.ty.shape);
                for_each_index(&o.ty.shape, &[strides], |i, offs| {
                    dst[i] = (beta * load(bbytes, bty.dtype, offs[0])) as f32;
                });
                true
            }
            None => false,
        };
        return sgemm(
            Mat {
                data: av,
                rows: n,
                cols: k,
                row_stride: k,
                col_stride: 1,
            },
            Mat {
                data: bv,
                rows: k,
                cols: m,
                row_stride: m,
                col_stride: 1,
            },
            dst,
            accumulate,
            alpha as f32,
        );
    }
    let av: Vec<f64> = (0..n * k).map(|i| load(a.1, a.0.dtype, i)).collect();
    let bv: Vec<f64> = (0..k * m).map(|i| load(b.1, b.0.dtype, i)).collect();
    let mut c = vec![0.0f64; n * m];
    for i in 0..n {
        for p in 0..k {
            let x = av[i * k + p];
            if x == 0.0 {
                continue;
            }
            let row = &bv[p * m..(p + 1) * m];
            for (cj, bj) in c[i * m..(i + 1) * m].iter_mut().zip(row) {
                *cj += x * bj;
            }
        }
    }
    if let Some((bty, bbytes)) = bias {
        let strides = broadcast_strides(&bty.shape, &o.ty.shape);
        for_each_index(&o.ty.shape, &[strides], |i, offs| {
            c[i] = beta * load(bbytes, bty.dtype, offs[0]) + alpha * c[i];
        });
    }
    for (i, v) in c.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

fn softmax(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let d = wrap(attr_int(node, "dim", -1), ty.rank());
    let len = ty.shape.get(d).copied().unwrap_or(1) as usize;
    let inner: usize = ty.shape[d + 1..].iter().product::<u64>() as usize;
    let outer = numel(&ty.shape) / (len * inner).max(1);
    let log = node.op == Op::LogSoftmax;
    for a in 0..outer {
        for b in 0..inner {
            let idx = |j: usize| (a * len + j) * inner + b;
            let max = (0..len)
                .map(|j| load(bytes, ty.dtype, idx(j)))
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = (0..len)
                .map(|j| (load(bytes, ty.dtype, idx(j)) - max).exp())
                .sum();
            for j in 0..len {
                let x = load(bytes, ty.dtype, idx(j)) - max;
                let v = if log { x - sum.ln() } else { x.exp() / sum };
                store(o.bytes, o.ty.dtype, idx(j), v);
            }
        }
    }
    Ok(())
}

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

/// Calls `f(self_offset, index_position)` for every element of `index` along `dim`.
fn along_dim(
    self_shape: &[u64],
    index_ty: &TensorType,
    index: &[u8],
    dim: usize,
    mut f: impl FnMut(usize, usize),
) -> Result<()> {
    let strides = contiguous_strides(self_shape);
    let index_strides = contiguous_strides(&index_ty.shape);
    let mut error = None;
    for i in 0..numel(&index_ty.shape) {
        let mut offset = 0;
        let mut rest = i;
        for d in 0..index_ty.rank() {
            let coord = rest / index_strides[d];
            rest %= index_strides[d];
            let coord = if d == dim {
                match index_at(index, index_ty.dtype, i, self_shape[d], "index") {
                    Ok(c) => c,
                    Err(e) => {
                        error.get_or_insert(e);
                        0
                    }
                }
            } else if coord as u64 >= self_shape[d] {
                error.get_or_insert(format!(
                    "index shape {:?} exceeds input shape {self_shape:?}",
                    index_ty.shape
                ));
                0
            } else {
                coord
            };
            offset += coord * strides[d];
        }
        if error.is_some() {
            break;
        }
        f(offset, i);
    }
    error.map_or(Ok(()), Err)
}

fn gather(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let (ity, index) = tensor(args, 1)?;
    let dim = wrap(attr_int(node, "dim", 0), ty.rank());
    along_dim(&ty.shape, ity, index, dim, |src, i| {
        store(o.bytes, o.ty.dtype, i, load(bytes, ty.dtype, src));
    })
}

fn scatter_value(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let (ity, index) = tensor(args, 1)?;
    let dim = wrap(attr_int(node, "dim", 0), ty.rank());
    let value = attr_f64(node, "value", None)?;
    o.bytes.copy_from_slice(bytes);
    let out_bytes = &mut *o.bytes;
    let dtype = o.ty.dtype;
    along_dim(&ty.shape, ity, index, dim, |dst, _| {
        store(out_bytes, dtype, dst, value)
    })
}

fn variance(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let rank = ty.rank();
    let reduced: Vec<usize> = match attr_ints(node, "dim") {
        None | Some([]) => (0..rank).collect(),
        Some(ds) => ds.iter().map(|&d| wrap(d, rank)).collect(),
    };
    let kept: Vec<u64> = (0..rank)
        .map(|d| if reduced.contains(&d) { 1 } else { ty.shape[d] })
        .collect();
    let own = contiguous_strides(&kept);
    let to_out: Vec<usize> = (0..rank)
        .map(|d| if reduced.contains(&d) { 0 } else { own[d] })
        .collect();
    let n_out = numel(&o.ty.shape);
    let count = reduced.iter().map(|&d| ty.shape[d]).product::<u64>() as f64;
    let correction = attr_f64(node, "correction", Some(1.0))?;
    let mut sum = vec![0.0; n_out];
    for_each_index(&ty.shape, std::slice::from_ref(&to_out), |i, offs| {
        sum[offs[0]] += load(bytes, ty.dtype, i)
    });
    let mean: Vec<f64> = sum.iter().map(|s| s / count).collect();
    let mut sq = vec![0.0; n_out];
    for_each_index(&ty.shape, &[to_out], |i, offs| {
        let d = load(bytes, ty.dtype, i) - mean[offs[0]];
        sq[offs[0]] += d * d;
    });
    let divisor = (count - correction).max(0.0);
    for (i, v) in sq.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v / divisor);
    }
    Ok(())
}

/// The geometry of a 2-d convolution, from its attributes and operand shapes.
struct Conv {
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    groups: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

impl Conv {
    fn new(
        node: &Node,
        input: &TensorType,
        weight: &TensorType,
        out_hw: (usize, usize),
    ) -> Result<Conv> {
        if input.rank() != 4 || attr_bool(node, "transposed") {
            return Err("the CPU device runs 2-d, non-transposed convolutions only so far".into());
        }
        let pair = |name: &str, default: usize| -> [usize; 2] {
            match attr_ints(node, name) {
                Some([a]) => [*a as usize; 2],
                Some([a, b, ..]) => [*a as usize, *b as usize],
                _ => [default; 2],
            }
        };
        let s = |i: usize| input.shape[i] as usize;
        Ok(Conv {
            n: s(0),
            c_in: s(1),
            h: s(2),
            w: s(3),
            c_out: weight.shape[0] as usize,
            kh: weight.shape[2] as usize,
            kw: weight.shape[3] as usize,
            oh: out_hw.0,
            ow: out_hw.1,
            groups: attr_int(node, "groups", 1).max(1) as usize,
            stride: pair("stride", 1),
            padding: pair("padding", 0),
            dilation: pair("dilation", 1),
        })
    }

    fn cin_g(&self) -> usize {
        self.c_in / self.groups
    }

    fn cout_g(&self) -> usize {
        self.c_out / self.groups
    }

    /// Rows of the unfolded input: one per (input channel of a group, ky, kx).
    fn k(&self) -> usize {
        self.cin_g() * self.kh * self.kw
    }

    /// For image `n` and group `g`, calls `f(col_index, input_index)` for every element
    /// of the `k() x oh*ow` unfolded input that lies inside the (unpadded) input.
    fn unfold(&self, n: usize, g: usize, mut f: impl FnMut(usize, usize)) {
        let l = self.oh * self.ow;
        for ci in 0..self.cin_g() {
            let c = g * self.cin_g() + ci;
            for ky in 0..self.kh {
                for kx in 0..self.kw {
                    let row = (ci * self.kh + ky) * self.kw + kx;
                    for oy in 0..self.oh {
                        let iy = (oy * self.stride[0] + ky * self.dilation[0]) as isize
                            - self.padding[0] as isize;
                        if iy < 0 || iy >= self.h as isize {
                            continue;
                        }
                        for ox in 0..self.ow {
                            let ix = (ox * self.stride[1] + kx * self.dilation[1]) as isize
                                - self.padding[1] as isize;
                            if ix < 0 || ix >= self.w as isize {
                                continue;
                            }
                            let i =
                                ((n * self.c_in + c) * self.h + iy as usize) * self.w + ix as usize;
                            f(row * l + oy * self.ow + ox, i);
                        }
                    }
                }
            }
        }
    }
}

fn convolution(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ity, ibytes) = tensor(args, 0)?;
    let (wty, wbytes) = tensor(args, 1)?;
    let conv = Conv::new(
        node,
        ity,
        wty,
        (o.ty.shape[2] as usize, o.ty.shape[3] as usize),
    )?;
    if let (Some(x), Some(w), Some(dst)) = (
        as_f32(ibytes, ity.dtype),
        as_f32(wbytes, wty.dtype),
        as_f32_mut(o.bytes, o.ty.dtype),
    ) {
        return convolution_f32(&conv, x, w, args.get(2), dst);
    }
    Err(f32_only(ity))
}

/// Convolutions run through `f32` matrix products; f16 and bf16 come with half storage.
fn f32_only(input: &TensorType) -> String {
    format!("the CPU device runs f32 convolutions only so far, got {input}")
}

fn convolution_backward(node: &Node, args: &[Arg<'_>], outs: &mut [Option<Out<'_>>]) -> Result<()> {
    let (gty, gbytes) = tensor(args, 0)?;
    let (ity, ibytes) = tensor(args, 1)?;
    let (wty, wbytes) = tensor(args, 2)?;
    let conv = Conv::new(
        node,
        ity,
        wty,
        (gty.shape[2] as usize, gty.shape[3] as usize),
    )?;
    if let (Some(g), Some(x), Some(w)) = (
        as_f32(gbytes, gty.dtype),
        as_f32(ibytes, ity.dtype),
        as_f32(wbytes, wty.dtype),
    ) {
        return convolution_backward_f32(&conv, g, x, w, outs);
    }
    Err(f32_only(ity))
}

/// Window geometry of a 2-d max pool.
fn pool_windows(
    node: &Node,
    input: &TensorType,
    out: &TensorType,
    mut f: impl FnMut(usize, usize, &[usize]),
) -> Result<()> {
    if input.rank() != 4 {
        return Err("the CPU device pools 4-d inputs only so far".into());
    }
    let pair = |name: &str, default: [usize; 2]| -> [usize; 2] {
        match attr_ints(node, name) {
            Some([a]) => [*a as usize; 2],
            Some([a, b, ..]) => [*a as usize, *b as usize],
            _ => default,
        }
    };
    let kernel = pair("kernel_size", [1, 1]);
    let stride = pair("stride", kernel);
    let padding = pair("padding", [0, 0]);
    let dilation = pair("dilation", [1, 1]);
    let (h, w) = (input.shape[2] as usize, input.shape[3] as usize);
    let (oh, ow) = (out.shape[2] as usize, out.shape[3] as usize);
    let planes = (input.shape[0] * input.shape[1]) as usize;
    let mut window = Vec::with_capacity(kernel[0] * kernel[1]);
    for plane in 0..planes {
        for oy in 0..oh {
            for ox in 0..ow {
                window.clear();
                for ky in 0..kernel[0] {
                    let iy = (oy * stride[0] + ky * dilation[0]) as isize - padding[0] as isize;
                    for kx in 0..kernel[1] {
                        let ix = (ox * stride[1] + kx * dilation[1]) as isize - padding[1] as isize;
                        if iy >= 0 && (iy as usize) < h && ix >= 0 && (ix as usize) < w {
                            window.push(iy as usize * w + ix as usize);
                        }
                    }
                }
                f(plane, (plane * oh + oy) * ow + ox, &window);
            }
        }
    }
    Ok(())
}

fn max_pool2d(node: &Node, args: &[Arg<'_>], outs: &mut [Option<Out<'_>>]) -> Result<()> {
    let (ity, ibytes) = tensor(args, 0)?;
    let out_ty = outs
        .iter()
        .flatten()
        .next()
        .map(|o| o.ty.clone())
        .ok_or("both outputs are unused")?;
    let plane_len = (ity.shape[2] * ity.shape[3]) as usize;
    let mut values = vec![0.0; numel(&out_ty.shape)];
    let mut indices = vec![0.0; values.len()];
    pool_windows(node, ity, &out_ty, |plane, o, window| {
        let mut best = f64::NEG_INFINITY;
        let mut at = window.first().copied().unwrap_or(0);
        for &p in window {
            let v = load(ibytes, ity.dtype, plane * plane_len + p);
            if v > best || v.is_nan() {
                best = v;
                at = p;
                if v.is_nan() {
                    break;
                }
            }
        }
        values[o] = best;
        indices[o] = at as f64;
    })?;
    for (k, data) in [values, indices].into_iter().enumerate() {
        if let Some(Some(out)) = outs.get_mut(k) {
            for (i, v) in data.into_iter().enumerate() {
                store(out.bytes, out.ty.dtype, i, v);
            }
        }
    }
    Ok(())
}

fn max_pool2d_backward(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (gty, gbytes) = tensor(args, 0)?;
    let (ity, _) = tensor(args, 1)?;
    let (xty, xbytes) = tensor(args, 2)?;
    let plane_len = (ity.shape[2] * ity.shape[3]) as usize;
    let out_plane = (gty.shape[2] * gty.shape[3]) as usize;
    let mut grad = vec![0.0; numel(&ity.shape)];
    for i in 0..numel(&gty.shape) {
        let at = index_at(xbytes, xty.dtype, i, plane_len as u64, "pooling index")?;
        grad[(i / out_plane) * plane_len + at] += load(gbytes, gty.dtype, i);
    }
    for (i, v) in grad.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

fn embedding(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (wty, wbytes) = tensor(args, 0)?;
    let (ity, ibytes) = tensor(args, 1)?;
    let (rows, width) = (wty.shape[0], wty.shape[1] as usize);
    let size = wty.dtype.size() as usize;
    for i in 0..numel(&ity.shape) {
        let row = index_at(ibytes, ity.dtype, i, rows, "embedding index")?;
        o.bytes[i * width * size..(i + 1) * width * size]
            .copy_from_slice(&wbytes[row * width * size..(row + 1) * width * size]);
    }
    Ok(())
}

fn bmm(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (aty, a) = tensor(args, 0)?;
    let (bty, b) = tensor(args, 1)?;
    let (batches, n, k, m) = (
        aty.shape[0] as usize,
        aty.shape[1] as usize,
        aty.shape[2] as usize,
        bty.shape[2] as usize,
    );
    if let (Some(av), Some(bv), Some(dst)) = (
        as_f32(a, aty.dtype),
        as_f32(b, bty.dtype),
        as_f32_mut(o.bytes, o.ty.dtype),
    ) {
        for bi in 0..batches {
            sgemm(
                Mat {
                    data: &av[bi * n * k..(bi + 1) * n * k],
                    rows: n,
                    cols: k,
                    row_stride: k,
                    col_stride: 1,
                },
                Mat {
                    data: &bv[bi * k * m..(bi + 1) * k * m],
                    rows: k,
                    cols: m,
                    row_stride: m,
                    col_stride: 1,
                },
                &mut dst[bi * n * m..(bi + 1) * n * m],
                false,
                1.0,
            )?;
        }
        return Ok(());
    }
    for bi in 0..batches {
        for i in 0..n {
            let mut row = vec![0.0; m];
            for p in 0..k {
                let x = load(a, aty.dtype, (bi * n + i) * k + p);
                for (j, r) in row.iter_mut().enumerate() {
                    *r += x * load(b, bty.dtype, (bi * k + p) * m + j);
                }
            }
            for (j, v) in row.into_iter().enumerate() {
                store(o.bytes, o.ty.dtype, (bi * n + i) * m + j, v);
            }
        }
    }
    Ok(())
}

/// Copies `count` blocks of `block` elements from `src` (one block every `src_stride`
/// elements) into `dst` at `dst_offset`, one block every `dst_stride` elements.
fn cat(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let rank = o.ty.rank();
    let d = wrap(attr_int(node, "dim", 0), rank);
    let outer: usize = o.ty.shape[..d].iter().product::<u64>() as usize;
    let inner: usize = o.ty.shape[d + 1..].iter().product::<u64>() as usize;
    let out_len = o.ty.shape[d] as usize;
    let mut at = 0;
    for arg in args {
        let (ty, bytes) = match arg {
            Arg::Tensor(ty, bytes) => (*ty, *bytes),
            _ => return Err("cat inputs must be tensors".into()),
        };
        let len = ty.shape[d] as usize;
        for a in 0..outer {
            for j in 0..len * inner {
                let v = load(bytes, ty.dtype, a * len * inner + j);
                store(o.bytes, o.ty.dtype, a * out_len * inner + at * inner + j, v);
            }
        }
        at += len;
    }
    Ok(())
}

fn split(node: &Node, args: &[Arg<'_>], outs: &mut [Option<Out<'_>>]) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let d = wrap(attr_int(node, "dim", 0), ty.rank());
    let outer: usize = ty.shape[..d].iter().product::<u64>() as usize;
    let inner: usize = ty.shape[d + 1..].iter().product::<u64>() as usize;
    let total = ty.shape[d] as usize;
    let size = ty.dtype.size() as usize;
    let sizes = attr_ints(node, "split_sizes").ok_or("attribute \"split_sizes\" is missing")?;
    let mut at = 0;
    for (out, &len) in outs.iter_mut().zip(sizes) {
        let len = len as usize;
        if let Some(out) = out {
            for a in 0..outer {
                let src = (a * total + at) * inner * size;
                let dst = a * len * inner * size;
                out.bytes[dst..dst + len * inner * size]
                    .copy_from_slice(&bytes[src..src + len * inner * size]);
            }
        }
        at += len;
    }
    Ok(())
}

fn any_dim(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let rank = ty.rank();
    let d = wrap(attr_int(node, "dim", 0), rank);
    let kept: Vec<u64> = (0..rank)
        .map(|i| if i == d { 1 } else { ty.shape[i] })
        .collect();
    let own = contiguous_strides(&kept);
    let to_out: Vec<usize> = (0..rank).map(|i| if i == d { 0 } else { own[i] }).collect();
    let mut acc = vec![false; numel(&o.ty.shape)];
    for_each_index(&ty.shape, &[to_out], |i, offs| {
        acc[offs[0]] |= load(bytes, ty.dtype, i) != 0.0
    });
    for (i, v) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, f64::from(u8::from(v)));
    }
    Ok(())
}

fn index_put(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let n = args.len() - 2;
    let (vty, vbytes) = tensor(args, n + 1)?;
    let accumulate = attr_bool(node, "accumulate");
    o.bytes.copy_from_slice(bytes);
    // Supported form: leading integer indices of one shape, the rest of the dims sliced.
    let mut index_shape: Option<&[u64]> = None;
    for k in 0..n {
        match &args[1 + k] {
            Arg::Tensor(ity, _) if ity.dtype.is_int() => match index_shape {
                None => index_shape = Some(&ity.shape),
                Some(s) if s == ity.shape.as_slice() => {}
                Some(_) => {
                    return Err(
                        "index_put with indices of different shapes is not supported yet".into(),
                    );
                }
            },
            _ => return Err("index_put supports leading integer indices only so far".into()),
        }
    }
    let count = index_shape.map_or(1, numel);
    let inner: usize = ty.shape[n..].iter().product::<u64>() as usize;
    let strides = contiguous_strides(&ty.shape);
    // Values are either one per indexed element, one row shared by all, or a scalar.
    let value_strides = match numel(&vty.shape) {
        n if n == count * inner => [inner, 1],
        n if n == inner => [0, 1],
        1 => [0, 0],
        _ => {
            return Err(format!(
                "values {vty} do not fit {count} indexed rows of {inner}"
            ));
        }
    };
    for i in 0..count {
        let mut base = 0;
        for (k, (&size, &stride)) in ty.shape.iter().zip(&strides).take(n).enumerate() {
            let (ity, ib) = tensor(args, 1 + k)?;
            base += index_at(ib, ity.dtype, i, size, "index_put index")? * stride;
        }
        for j in 0..inner {
            let v = load(
                vbytes,
                vty.dtype,
                i * value_strides[0] + j * value_strides[1],
            );
            let cur = if accumulate {
                load(o.bytes, o.ty.dtype, base + j)
            } else {
                0.0
            };
            store(o.bytes, o.ty.dtype, base + j, cur + v);
        }
    }
    Ok(())
}

fn layer_norm(node: &Node, args: &[Arg<'_>], outs: &mut [Option<Out<'_>>]) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let normalized =
        attr_ints(node, "normalized_shape").ok_or("attribute \"normalized_shape\" is missing")?;
    let eps = attr_f64(node, "eps", Some(1e-5))?;
    let inner: usize = normalized.iter().product::<i64>() as usize;
    let outer = numel(&ty.shape) / inner.max(1);
    let param = |k: usize| match args.get(k) {
        Some(Arg::Tensor(pty, pb)) => Some((*pty, *pb)),
        _ => None,
    };
    let (weight, bias) = (param(1), param(2));
    let mut y = vec![0.0; numel(&ty.shape)];
    let mut means = vec![0.0; outer];
    let mut rstds = vec![0.0; outer];
    for a in 0..outer {
        let row: Vec<f64> = (0..inner)
            .map(|j| load(bytes, ty.dtype, a * inner + j))
            .collect();
        let mean = row.iter().sum::<f64>() / inner as f64;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / inner as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for (j, x) in row.iter().enumerate() {
            let mut v = (x - mean) * rstd;
            if let Some((wty, wb)) = weight {
                v *= load(wb, wty.dtype, j);
            }
            if let Some((bty, bb)) = bias {
                v += load(bb, bty.dtype, j);
            }
            y[a * inner + j] = v;
        }
        means[a] = mean;
        rstds[a] = rstd;
    }
    for (k, data) in [y, means, rstds].into_iter().enumerate() {
        if let Some(Some(out)) = outs.get_mut(k) {
            for (i, v) in data.into_iter().enumerate() {
                store(out.bytes, out.ty.dtype, i, v);
            }
        }
    }
    Ok(())
}

/// Convolution as one matrix product per image and group over the unfolded input (im2col).
fn convolution_f32(
    conv: &Conv,
    x: &[f32],
    w: &[f32],
    bias: Option<&Arg<'_>>,
    dst: &mut [f32],
) -> Result<()> {
    let (k, l, cout_g) = (conv.k(), conv.oh * conv.ow, conv.cout_g());
    let mut col = vec![0.0f32; k * l];
    for n in 0..conv.n {
        for g in 0..conv.groups {
            col.fill(0.0);
            conv.unfold(n, g, |c, i| col[c] = x[i]);
            let out_at = (n * conv.c_out + g * cout_g) * l;
            sgemm(
                Mat {
                    data: &w[g * cout_g * k..(g + 1) * cout_g * k],
                    rows: cout_g,
                    cols: k,
                    row_stride: k,
                    col_stride: 1,
                },
                Mat {
                    data: &col,
                    rows: k,
                    cols: l,
                    row_stride: l,
                    col_stride: 1,
                },
                &mut dst[out_at..out_at + cout_g * l],
                false,
                1.0,
            )?;
        }
    }
    if let Some(Arg::Tensor(bty, bbytes)) = bias {
        for (oi, v) in dst.iter_mut().enumerate() {
            *v += load(bbytes, bty.dtype, (oi / l) % conv.c_out) as f32;
        }
    }
    Ok(())
}

/// The three gradients of a convolution through the same unfolding: grad_weight +=
/// G x col^T, grad_input = fold(W^T x G), grad_bias = the sums of G.
fn convolution_backward_f32(
    conv: &Conv,
    g: &[f32],
    x: &[f32],
    w: &[f32],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (k, l, cout_g) = (conv.k(), conv.oh * conv.ow, conv.cout_g());
    let mut col = vec![0.0f32; k * l];
    let mut grad_col = vec![0.0f32; k * l];
    let (first, rest) = outs.split_at_mut(1);
    let (second, third) = rest.split_at_mut(1);
    let mut grad_input = first[0]
        .as_mut()
        .and_then(|o| as_f32_mut(o.bytes, o.ty.dtype));
    let mut grad_weight = second[0]
        .as_mut()
        .and_then(|o| as_f32_mut(o.bytes, o.ty.dtype));
    if let Some(gi) = grad_input.as_deref_mut() {
        gi.fill(0.0);
    }
    if let Some(gw) = grad_weight.as_deref_mut() {
        gw.fill(0.0);
    }
    for n in 0..conv.n {
        for grp in 0..conv.groups {
            let g_at = (n * conv.c_out + grp * cout_g) * l;
            let g_mat = Mat {
                data: &g[g_at..g_at + cout_g * l],
                rows: cout_g,
                cols: l,
                row_stride: l,
                col_stride: 1,
            };
            let w_g = &w[grp * cout_g * k..(grp + 1) * cout_g * k];
            if let Some(gw) = grad_weight.as_deref_mut() {
                col.fill(0.0);
                conv.unfold(n, grp, |c, i| col[c] = x[i]);
                sgemm(
                    g_mat,
                    Mat {
                        data: &col,
                        rows: l,
                        cols: k,
                        row_stride: 1,
                        col_stride: l,
                    },
                    &mut gw[grp * cout_g * k..(grp + 1) * cout_g * k],
                    true,
                    1.0,
                )?;
            }
            if let Some(gi) = grad_input.as_deref_mut() {
                sgemm(
                    Mat {
                        data: w_g,
                        rows: k,
                        cols: cout_g,
                        row_stride: 1,
                        col_stride: k,
                    },
                    g_mat,
                    &mut grad_col,
                    false,
                    1.0,
                )?;
                conv.unfold(n, grp, |c, i| gi[i] += grad_col[c]);
            }
        }
    }
    if let Some(Some(out)) = third.first_mut() {
        let mut gb = vec![0.0f64; conv.c_out];
        for (oi, v) in g.iter().enumerate() {
            gb[(oi / l) % conv.c_out] += f64::from(*v);
        }
        for (i, v) in gb.into_iter().enumerate() {
            store(out.bytes, out.ty.dtype, i, v);
        }
    }
    Ok(())
}
