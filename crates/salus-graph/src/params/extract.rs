//! Reading a node's attributes into its [`OpParams`]: the one place in salus that reads an
//! attribute by name. Errors are plain messages naming the attribute; validation adds which
//! node they are about.

use std::collections::BTreeMap;

use super::attrs::{Attrs, Inputs, describe};
use super::geometry::{self, ConvAttrs, PoolAttrs};
use super::indexing::advanced_index;
use super::{
    AttentionParams, GeluApproximate, OpParams, Reduction, Scalar, ScatterReduction, wrap_dim,
    wrap_dims,
};
use crate::error::preview;
use crate::ir::{Attr, DType, TensorType};
use crate::op::Op;

type Result<T> = std::result::Result<T, String>;

fn nonneg(v: i64, what: &str) -> Result<u64> {
    u64::try_from(v).map_err(|_| format!("{what} must be >= 0, got {v}"))
}

/// The reduction over `dims` (every dimension when `None` or empty) of a `rank`-d input.
fn reduction(dims: Option<&[i64]>, rank: usize, keepdim: bool, dtype: DType) -> Result<Reduction> {
    let mut dims = match dims {
        Some(ds) if !ds.is_empty() => wrap_dims(ds, rank)?,
        _ => (0..rank).collect(),
    };
    // A 0-dim input has no dimension to reduce (dimension 0 or -1 names the tensor itself).
    dims.retain(|&d| d < rank);
    dims.sort_unstable();
    Ok(Reduction {
        dims,
        keepdim,
        dtype,
    })
}

/// The reduction of a `dim` list attribute with `keepdim`.
fn reduce_attrs(a: &Attrs<'_>, t: &TensorType, dtype: DType) -> Result<Reduction> {
    reduction(
        a.ints_opt("dim")?,
        t.rank(),
        a.bool_or("keepdim", false)?,
        dtype,
    )
}

fn conv_attrs<'a>(a: &Attrs<'a>, output_mask: [bool; 3]) -> Result<ConvAttrs<'a>> {
    Ok(ConvAttrs {
        stride: a.ints("stride")?,
        padding: a.ints("padding")?,
        dilation: a.ints("dilation")?,
        transposed: a.bool_or("transposed", false)?,
        output_padding: a.ints_or_empty("output_padding")?,
        groups: a.int("groups")?,
        output_mask,
    })
}

fn pool_attrs<'a>(a: &Attrs<'a>, max: bool) -> Result<PoolAttrs<'a>> {
    let (dilation, count_include_pad, divisor_override) = if max {
        (a.ints_or_empty("dilation")?, true, None)
    } else {
        let divisor = match a.get("divisor_override") {
            None => None,
            Some(_) => Some(a.int("divisor_override")?),
        };
        (&[][..], a.bool_or("count_include_pad", true)?, divisor)
    };
    Ok(PoolAttrs {
        kernel_size: a.ints("kernel_size")?,
        stride: a.ints_or_empty("stride")?,
        padding: a.ints_or_empty("padding")?,
        dilation,
        ceil_mode: a.bool_or("ceil_mode", false)?,
        count_include_pad,
        divisor_override,
    })
}

/// The view shape `size` (one entry may be -1) of `input`'s elements.
fn view_shape(input: &TensorType, size: &[i64]) -> Result<Vec<u64>> {
    let numel = input.numel().unwrap_or(u64::MAX);
    let mut inferred = None;
    let mut known = 1u64;
    let mut out = Vec::with_capacity(size.len());
    for (i, &s) in size.iter().enumerate() {
        if s == -1 {
            if inferred.replace(i).is_some() {
                return Err(format!("size {} has more than one -1", preview(size)));
            }
            out.push(0);
        } else {
            let s = nonneg(s, "a view dimension")?;
            known = known.saturating_mul(s);
            out.push(s);
        }
    }
    if let Some(i) = inferred {
        if known == 0 || !numel.is_multiple_of(known) {
            return Err(format!("cannot view {input} as {}", preview(size)));
        }
        out[i] = numel / known;
    } else if known != numel {
        return Err(format!(
            "cannot view {input} ({numel} elements) as {}",
            preview(size)
        ));
    }
    Ok(out)
}

/// The shape `size` (-1 keeps a dimension; new leading dimensions allowed) `t` expands to.
fn expand_shape(t: &TensorType, size: &[i64]) -> Result<Vec<u64>> {
    if size.len() < t.rank() {
        return Err(format!(
            "cannot expand {t} to fewer dimensions {}",
            preview(size)
        ));
    }
    let lead = size.len() - t.rank();
    let mut shape = Vec::with_capacity(size.len());
    for (i, &s) in size.iter().enumerate() {
        let current = (i >= lead).then(|| t.shape[i - lead]);
        let target = match (s, current) {
            (-1, Some(c)) => c,
            (-1, None) => {
                return Err(format!(
                    "-1 in a new leading dimension of {}",
                    preview(size)
                ));
            }
            (s, _) => nonneg(s, "an expanded dimension")?,
        };
        if let Some(c) = current
            && c != target
            && c != 1
        {
            return Err(format!(
                "cannot expand {t} to {}: dimension {i} is {c}",
                preview(size)
            ));
        }
        shape.push(target);
    }
    Ok(shape)
}

/// A dimension of a tensor that must have one (slicing, splitting, concatenating).
fn dim_of(d: i64, t: &TensorType, what: &str) -> Result<usize> {
    if t.rank() == 0 {
        return Err(format!("cannot {what} a 0-dim tensor"));
    }
    wrap_dim(d, t.rank())
}

fn layer_norm(a: &Attrs<'_>, t: &TensorType) -> Result<OpParams> {
    let normalized = a.ints("normalized_shape")?;
    if normalized.is_empty() || normalized.len() > t.rank() {
        return Err(format!(
            "normalized_shape {} does not fit input {t}",
            preview(normalized)
        ));
    }
    let axis = t.rank() - normalized.len();
    let tail: Vec<i64> = t.shape[axis..].iter().map(|&d| d as i64).collect();
    if tail != normalized {
        return Err(format!(
            "normalized_shape {} must equal the last dimensions of input {t}",
            preview(normalized)
        ));
    }
    Ok(OpParams::LayerNorm {
        normalized_shape: t.shape[axis..].to_vec(),
        axis,
        eps: a.number_or("eps", 1e-5)?,
    })
}

/// `constant_pad_nd`'s `pad` pairs (last dimension first) as per-dimension amounts.
fn constant_pad(a: &Attrs<'_>, t: &TensorType) -> Result<OpParams> {
    let pad = a.ints("pad")?;
    if pad.len() % 2 != 0 || pad.len() / 2 > t.rank() {
        return Err(format!(
            "pad {pad:?} must hold (before, after) pairs for at most the {} dimensions of {t}",
            t.rank()
        ));
    }
    let rank = t.rank();
    let (mut before, mut after) = (vec![0; rank], vec![0; rank]);
    for (k, pair) in pad.chunks_exact(2).enumerate() {
        let d = rank - 1 - k;
        (before[d], after[d]) = (pair[0], pair[1]);
        let size = t.shape[d] as i64 + pair[0] + pair[1];
        if size < 0 {
            return Err(format!(
                "padding {pair:?} leaves dimension {d} of {t} with {size} elements"
            ));
        }
    }
    Ok(OpParams::ConstantPad {
        before,
        after,
        value: a.scalar_opt("value")?.unwrap_or(Scalar::Int(0)),
    })
}

/// `reflection_pad2d`'s (left, right, top, bottom) over the last two dimensions of `t`.
fn reflection_pad(a: &Attrs<'_>, t: &TensorType) -> Result<OpParams> {
    let rank = t.rank();
    if rank != 3 && rank != 4 {
        return Err(format!("input must be 3-d or 4-d, got {t}"));
    }
    let (h, w) = (t.shape[rank - 2], t.shape[rank - 1]);
    if h == 0 || w == 0 {
        return Err(format!("input {t} must have non-empty last two dimensions"));
    }
    let given = a.ints("padding")?;
    let padding: [u64; 4] = given
        .iter()
        .map(|&p| nonneg(p, "padding"))
        .collect::<Result<Vec<u64>>>()?
        .try_into()
        .map_err(|_| format!("padding must have 4 values, got {given:?}"))?;
    let [left, right, top, bottom] = padding;
    if left >= w || right >= w || top >= h || bottom >= h {
        return Err(format!(
            "padding {given:?} must be less than the dimensions it reflects ({h}, {w}) of {t}"
        ));
    }
    Ok(OpParams::ReflectionPad {
        padding,
        planes: t.shape[..rank - 2].iter().product(),
        input: [h, w],
        output: [h + top + bottom, w + left + right],
    })
}

/// `native_group_norm`'s N, C, HxW and group, checked against the input `t`.
fn group_norm(a: &Attrs<'_>, t: &TensorType) -> Result<OpParams> {
    let batch = nonneg(a.int("N")?, "N")?;
    let channels = nonneg(a.int("C")?, "C")?;
    let inner = nonneg(a.int("HxW")?, "HxW")?;
    let groups = nonneg(a.int("group")?, "group")?;
    if t.rank() < 2 || t.shape[0] != batch || t.shape[1] != channels {
        return Err(format!(
            "input {t} must be [N, C, ...] with N = {batch} and C = {channels}"
        ));
    }
    if t.numel() != Some(batch * channels * inner) {
        return Err(format!(
            "input {t} must hold N * C * HxW = {batch} * {channels} * {inner} elements"
        ));
    }
    if groups == 0 || !channels.is_multiple_of(groups) {
        return Err(format!(
            "{channels} channels do not split into {groups} groups"
        ));
    }
    Ok(OpParams::GroupNorm {
        batch,
        channels,
        inner,
        groups,
        eps: a.number_or("eps", 1e-5)?,
    })
}

/// Batch norm's N, C and elements per channel per image from the input `t` ([N, C, *]);
/// `flag` (`training` or `train`) must be true: in eval mode the tracer writes plain
/// arithmetic instead.
fn batch_norm(a: &Attrs<'_>, t: &TensorType, flag: &str, momentum: f64) -> Result<OpParams> {
    if !a.bool_or(flag, false)? {
        return Err(format!(
            "{flag} must be true (evaluation-mode batch norm is plain arithmetic in the IR)"
        ));
    }
    if t.rank() < 2 {
        return Err(format!("input {t} must be [N, C, ...]"));
    }
    let (batch, channels) = (t.shape[0], t.shape[1]);
    let inner = t.shape[2..].iter().product::<u64>();
    if batch * inner == 0 {
        return Err(format!("input {t} has no elements to normalise over"));
    }
    Ok(OpParams::BatchNorm {
        batch,
        channels,
        inner,
        momentum,
        eps: a.number_or("eps", 1e-5)?,
    })
}

/// Which fused attention op a node is: the flash op has no dropout and one log-sum-exp
/// per query; the efficient op drops probabilities and pads each head's log-sum-exps to
/// a multiple of 32 (PyTorch's layouts for both).
#[derive(Clone, Copy, PartialEq)]
enum AttentionOp {
    Flash,
    EfficientForward,
    EfficientBackward,
}

/// Fused attention's geometry from query `q`, key `k`, value `v` and the optional
/// `mask`, and its flags.
fn attention(
    a: &Attrs<'_>,
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
    mask: Option<&TensorType>,
    op: AttentionOp,
) -> Result<OpParams> {
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(format!(
            "query {q}, key {k} and value {v} must each be [batch, heads, length, dim]"
        ));
    }
    let (batch, heads, q_len, head_dim) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (kv_len, v_dim) = (k.shape[2], v.shape[3]);
    if k.shape != [batch, heads, kv_len, head_dim] || v.shape[..3] != [batch, heads, kv_len] {
        return Err(format!(
            "key {k} must be [{batch}, {heads}, S, {head_dim}] and value {v} [{batch}, {heads}, S, Ev]"
        ));
    }
    if q.dtype != k.dtype || q.dtype != v.dtype || !q.dtype.is_float() {
        return Err(format!(
            "query {q}, key {k} and value {v} must share one float dtype"
        ));
    }
    let dropout = a.number_or("dropout_p", 0.0)?;
    if op == AttentionOp::Flash && dropout != 0.0 {
        return Err(format!(
            "dropout_p {dropout}: the flash op runs without dropout (attention with \
             dropout is the efficient op)"
        ));
    }
    if !(0.0..1.0).contains(&dropout) {
        return Err(format!("dropout_p must be in [0, 1), got {dropout}"));
    }
    if op == AttentionOp::EfficientBackward {
        let wanted = a.bools("grad_input_mask")?;
        if wanted.get(3) == Some(&true) {
            return Err(
                "the gradient of attn_bias is not supported (a bias that requires grad \
                 traces through the math decomposition)"
                    .into(),
            );
        }
    }
    let lse_stride = match op {
        AttentionOp::Flash => q_len,
        AttentionOp::EfficientForward if !a.bool_or("compute_log_sumexp", true)? => 0,
        _ => q_len.next_multiple_of(32),
    };
    let mask_strides = match mask {
        None => None,
        Some(m) => {
            if m.rank() > 4 || !(m.dtype == DType::Bool || m.dtype == q.dtype) {
                return Err(format!(
                    "attn_mask {m} must be bool or {} and broadcast to [{batch}, {heads}, {q_len}, {kv_len}]",
                    q.dtype
                ));
            }
            let mut shape = vec![1u64; 4 - m.rank()];
            shape.extend(&m.shape);
            let full = [batch, heads, q_len, kv_len];
            let mut strides = [0u64; 4];
            let mut stride = 1;
            for d in (0..4).rev() {
                if shape[d] == full[d] && full[d] != 1 {
                    strides[d] = stride;
                } else if shape[d] != 1 {
                    return Err(format!(
                        "attn_mask {m} does not broadcast to [{batch}, {heads}, {q_len}, {kv_len}]"
                    ));
                }
                stride *= shape[d];
            }
            Some(strides)
        }
    };
    let scale = match a.scalar_opt("scale")? {
        Some(s) => s.as_f64(),
        None => 1.0 / (head_dim as f64).sqrt(),
    };
    Ok(OpParams::Attention(AttentionParams {
        batch,
        heads,
        q_len,
        kv_len,
        head_dim,
        v_dim,
        causal: a.bool_or("is_causal", false)?,
        scale,
        mask_strides,
        dropout,
        lse_stride,
    }))
}

fn embedding(a: &Attrs<'_>, num_weights: u64) -> Result<OpParams> {
    let padding_idx = a.int_or("padding_idx", -1)?;
    Ok(OpParams::Embedding {
        padding_idx: u64::try_from(padding_idx).ok(),
        scale_grad_by_freq: a.bool_or("scale_grad_by_freq", false)?,
        num_weights,
    })
}

/// Reads `attrs` of a node of `op` whose inputs are `ins` into its parameters, checking
/// every attribute's type and value and the input count. Which inputs each op takes, and
/// their dtypes, is shape inference's to check; this reads only the shapes it needs.
pub(crate) fn extract(
    op: Op,
    attrs: &BTreeMap<String, Attr>,
    ins: &Inputs<'_>,
) -> Result<OpParams> {
    use Op::*;
    let a = &Attrs(attrs);
    Ok(match op {
        MulTensor
        | DivTensor
        | RandLike
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
        | Relu
        | Sigmoid
        | Tanh
        | LogicalAnd
        | LogicalNot
        | BitwiseAndTensor
        | BitwiseNot
        | WhereSelf
        | EqTensor
        | LtTensor
        | GtTensor
        | Maximum
        | Minimum
        | Clone
        | Mm
        | Bmm
        | AdaptiveAvgPool2dBackward => OpParams::None,
        AddTensor | SubTensor => OpParams::Binary {
            alpha: a.number_or("alpha", 1.0)?,
        },
        AddScalar | MulScalar | DivScalar | NeScalar | EqScalar | LeScalar | LtScalar
        | GeScalar | GtScalar | PowTensorScalar | PowScalar => {
            ins.count(1)?;
            ins.input(0)?;
            let name = match op {
                PowTensorScalar => "exponent",
                PowScalar => "self",
                _ => "other",
            };
            OpParams::WithScalar {
                scalar: a.scalar(name)?,
                alpha: if op == AddScalar {
                    a.number_or("alpha", 1.0)?
                } else {
                    1.0
                },
            }
        }
        Clamp => {
            ins.count(1)?;
            ins.input(0)?;
            let (min, max) = (a.scalar_opt("min")?, a.scalar_opt("max")?);
            if min.is_none() && max.is_none() {
                return Err("needs at least one of \"min\" and \"max\"".into());
            }
            OpParams::Clamp { min, max }
        }
        Polygamma => OpParams::Polygamma {
            n: nonneg(a.int("n")?, "n")?,
        },
        LeakyRelu => OpParams::LeakyRelu {
            negative_slope: a.number_or("negative_slope", 0.01)?,
        },
        Gelu => OpParams::Gelu {
            approximate: match a.get("approximate") {
                None => GeluApproximate::None,
                Some(Attr::Str(s)) if s == "none" => GeluApproximate::None,
                Some(Attr::Str(s)) if s == "tanh" => GeluApproximate::Tanh,
                Some(other) => {
                    return Err(format!(
                        "attribute \"approximate\" must be \"none\" or \"tanh\", got {}",
                        describe(other)
                    ));
                }
            },
        },
        ToCopy => {
            ins.count(1)?;
            let t = ins.input(0)?;
            OpParams::ToCopy {
                dtype: a.dtype_opt("dtype")?.unwrap_or(t.dtype),
            }
        }
        SumDimIntList | MeanDim | Amax => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let default = match op {
                SumDimIntList if !t.dtype.is_float() => DType::I64,
                _ => t.dtype,
            };
            let dtype = match op {
                Amax => t.dtype,
                _ => a.dtype_opt("dtype")?.unwrap_or(default),
            };
            if op == MeanDim && !dtype.is_float() {
                return Err(format!("mean needs a floating-point result, got {dtype}"));
            }
            OpParams::Reduce(reduce_attrs(a, t, dtype)?)
        }
        Mean => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let dtype = a.dtype_opt("dtype")?.unwrap_or(t.dtype);
            if !dtype.is_float() {
                return Err(format!("mean needs a floating-point result, got {dtype}"));
            }
            OpParams::Reduce(reduction(None, t.rank(), false, dtype)?)
        }
        VarCorrection => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let correction = a.number_or("correction", 1.0)?;
            OpParams::Var {
                reduction: reduce_attrs(a, t, t.dtype)?,
                correction,
            }
        }
        Argmax | Argmin => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let dim = a.int_opt("dim")?;
            let r = reduction(
                dim.as_ref().map(std::slice::from_ref),
                t.rank(),
                a.bool_or("keepdim", false)?,
                DType::I64,
            )?;
            if let Some(&d) = r.dims.iter().find(|&&d| t.shape[d] == 0) {
                return Err(format!("{op} of {t} reduces dimension {d}, which is empty"));
            }
            OpParams::Reduce(r)
        }
        AnyDim => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let d = a.int("dim")?;
            OpParams::Reduce(reduction(
                Some(&[d]),
                t.rank(),
                a.bool_or("keepdim", false)?,
                DType::Bool,
            )?)
        }
        Softmax | LogSoftmax => {
            ins.count(1)?;
            let t = ins.input(0)?;
            OpParams::Softmax {
                dim: wrap_dim(a.int("dim")?, t.rank())?,
                half_to_float: a.bool_or("half_to_float", false)?,
            }
        }
        SoftmaxBackwardData | LogSoftmaxBackwardData => {
            ins.count(2)?;
            let grad = ins.input(0)?;
            OpParams::SoftmaxBackward {
                dim: wrap_dim(a.int("dim")?, grad.rank())?,
                input_dtype: a.dtype_opt("input_dtype")?.unwrap_or(grad.dtype),
            }
        }
        Cumsum | Cumprod => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let default = if t.dtype.is_float() {
                t.dtype
            } else {
                DType::I64
            };
            OpParams::Cumsum {
                dim: wrap_dim(a.int("dim")?, t.rank())?.min(t.rank().saturating_sub(1)),
                dtype: a.dtype_opt("dtype")?.unwrap_or(default),
            }
        }
        Sort => {
            ins.count(1)?;
            let t = ins.input(0)?;
            OpParams::Sort {
                dim: wrap_dim(a.int_or("dim", -1)?, t.rank())?.min(t.rank().saturating_sub(1)),
                descending: a.bool_or("descending", false)?,
            }
        }
        Addmm => OpParams::Addmm {
            beta: a.number_or("beta", 1.0)?,
            alpha: a.number_or("alpha", 1.0)?,
        },
        Convolution => {
            ins.count(3)?;
            let (input, weight) = (ins.input(0)?, ins.input(1)?);
            OpParams::Conv(geometry::conv(&conv_attrs(a, [true; 3])?, input, weight)?)
        }
        ConvolutionBackward => {
            ins.count(3)?;
            let (input, weight) = (ins.input(1)?, ins.input(2)?);
            let mut conv = geometry::conv(&conv_attrs(a, [true; 3])?, input, weight)?;
            let mask = a.bools("output_mask")?;
            conv.output_mask = <[bool; 3]>::try_from(mask)
                .map_err(|_| format!("output_mask must have 3 entries, got {}", preview(mask)))?;
            OpParams::Conv(conv)
        }
        View => {
            ins.count(1)?;
            OpParams::Reshape {
                shape: view_shape(ins.input(0)?, a.ints("size")?)?,
            }
        }
        Expand => {
            ins.count(1)?;
            OpParams::Reshape {
                shape: expand_shape(ins.input(0)?, a.ints("size")?)?,
            }
        }
        Permute => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let dims = wrap_dims(a.ints("dims")?, t.rank())?;
            if dims.len() != t.rank() {
                return Err(format!(
                    "dims {dims:?} must name each of the {} dimensions",
                    t.rank()
                ));
            }
            OpParams::Permute { dims }
        }
        Unsqueeze => {
            ins.count(1)?;
            let t = ins.input(0)?;
            OpParams::Unsqueeze {
                dim: wrap_dim(a.int("dim")?, t.rank() + 1)?,
            }
        }
        SqueezeDims => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let mut dims = wrap_dims(a.ints("dim")?, t.rank())?;
            dims.retain(|&d| d < t.rank());
            dims.sort_unstable();
            OpParams::Squeeze { dims }
        }
        SplitWithSizes => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let dim = dim_of(a.int_or("dim", 0)?, t, "split")?;
            let given = a.ints("split_sizes")?;
            let sizes = given
                .iter()
                .map(|&s| nonneg(s, "a split size"))
                .collect::<Result<Vec<u64>>>()?;
            let total: u64 = sizes.iter().sum();
            if total != t.shape[dim] {
                return Err(format!(
                    "split sizes {} add up to {total}, but dimension {dim} of {t} is {}",
                    preview(given),
                    t.shape[dim]
                ));
            }
            OpParams::Split { dim, sizes }
        }
        Cat => {
            let count = a.list_len("tensors")?;
            ins.count(count)?;
            if count == 0 {
                return Err("needs at least one tensor".into());
            }
            let first = ins.input(0)?;
            OpParams::Cat {
                dim: dim_of(a.int_or("dim", 0)?, first, "concatenate")?,
                count,
            }
        }
        SliceTensor => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let dim = dim_of(a.int_or("dim", 0)?, t, "slice")?;
            let n = t.shape[dim] as i64;
            let step = a.int_or("step", 1)?;
            if step <= 0 {
                return Err(format!("step must be positive, got {step}"));
            }
            let clamp = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
            let start = clamp(a.int_or("start", 0)?);
            let end = clamp(a.int_or("end", n)?).max(start);
            OpParams::Slice {
                dim,
                start: start as u64,
                end: end as u64,
                step: step as u64,
                len: ((end - start + step - 1) / step) as u64,
            }
        }
        SelectInt => {
            ins.count(1)?;
            let t = ins.input(0)?;
            if t.rank() == 0 {
                return Err("cannot select from a 0-dim tensor".into());
            }
            let dim = wrap_dim(a.int("dim")?, t.rank())?;
            let index = a.int("index")?;
            let n = t.shape[dim] as i64;
            if index < -n || index >= n {
                return Err(format!(
                    "index {index} out of range for dimension {dim} of size {n}"
                ));
            }
            OpParams::Select {
                dim,
                index: if index < 0 { index + n } else { index } as u64,
            }
        }
        Flip => {
            ins.count(1)?;
            let t = ins.input(0)?;
            let mut dims = wrap_dims(a.ints("dims")?, t.rank())?;
            dims.retain(|&d| d < t.rank());
            dims.sort_unstable();
            OpParams::Flip { dims }
        }
        ConstantPadNd => {
            ins.count(1)?;
            constant_pad(a, ins.input(0)?)?
        }
        NativeGroupNorm => {
            ins.count(3)?;
            group_norm(a, ins.input(0)?)?
        }
        ScaledDotProductAttention => {
            // query, key, value, attn_mask?
            ins.count(4)?;
            let (q, k, v) = (ins.input(0)?, ins.input(1)?, ins.input(2)?);
            attention(a, q, k, v, ins.optional(3), AttentionOp::Flash)?
        }
        ScaledDotProductAttentionBackward => {
            // grad_out, query, key, value, out, logsumexp, attn_mask?
            ins.count(7)?;
            let (q, k, v) = (ins.input(1)?, ins.input(2)?, ins.input(3)?);
            attention(a, q, k, v, ins.optional(6), AttentionOp::Flash)?
        }
        EfficientAttention => {
            // query, key, value, attn_bias?, generator
            ins.count(5)?;
            let (q, k, v) = (ins.input(0)?, ins.input(1)?, ins.input(2)?);
            attention(a, q, k, v, ins.optional(3), AttentionOp::EfficientForward)?
        }
        EfficientAttentionBackward => {
            // grad_out, query, key, value, attn_bias?, out, logsumexp, philox_seed,
            // philox_offset
            ins.count(9)?;
            let (q, k, v) = (ins.input(1)?, ins.input(2)?, ins.input(3)?);
            attention(a, q, k, v, ins.optional(4), AttentionOp::EfficientBackward)?
        }
        NativeBatchNorm => {
            // input, weight?, bias?, running_mean, running_var
            ins.count(5)?;
            batch_norm(a, ins.input(0)?, "training", a.number_or("momentum", 0.1)?)?
        }
        NativeBatchNormBackward => {
            // grad_out, input, weight?, running_mean?, running_var?, save_mean, save_invstd
            ins.count(7)?;
            batch_norm(a, ins.input(1)?, "train", 0.0)?
        }
        ReflectionPad2d => {
            ins.count(1)?;
            reflection_pad(a, ins.input(0)?)?
        }
        ReflectionPad2dBackward => {
            ins.count(2)?;
            reflection_pad(a, ins.input(1)?)?
        }
        IndexTensor => {
            let count = a.list_len("indices")?;
            ins.count(count + 1)?;
            let t = ins.input(0)?;
            let indices: Vec<_> = (1..=count).map(|i| ins.optional(i)).collect();
            match advanced_index(t, &indices)? {
                Some(index) => OpParams::AdvancedIndex(index),
                None => {
                    return Err(
                        "bool (mask) indices are not supported: what a mask selects \
                         depends on its values, so the result has no static shape"
                            .into(),
                    );
                }
            }
        }
        NativeLayerNorm => {
            ins.count(3)?;
            layer_norm(a, ins.input(0)?)?
        }
        NativeLayerNormBackward => {
            ins.count(6)?;
            layer_norm(a, ins.input(1)?)?
        }
        MaxPool2dWithIndices | AvgPool2d => {
            ins.count(1)?;
            OpParams::Pool(geometry::pool(
                &pool_attrs(a, op == MaxPool2dWithIndices)?,
                ins.input(0)?,
            )?)
        }
        MaxPool2dWithIndicesBackward | AvgPool2dBackward => {
            ins.count(if op == AvgPool2dBackward { 2 } else { 3 })?;
            OpParams::Pool(geometry::pool(
                &pool_attrs(a, op == MaxPool2dWithIndicesBackward)?,
                ins.input(1)?,
            )?)
        }
        AdaptiveAvgPool2d => {
            ins.count(1)?;
            let t = ins.input(0)?;
            if t.rank() != 3 && t.rank() != 4 {
                return Err(format!("input must be 3-d or 4-d, got {t}"));
            }
            let size = geometry::spatial(a.ints("output_size")?, 2, "output_size", None)?;
            OpParams::AdaptivePool {
                output_size: [
                    nonneg(size[0], "output_size")?,
                    nonneg(size[1], "output_size")?,
                ],
            }
        }
        Embedding => embedding(a, 0)?,
        EmbeddingDenseBackward => {
            let rows = nonneg(a.int("num_weights")?, "num_weights")?;
            embedding(a, rows)?
        }
        Gather | ScatterAdd | ScatterSrc | IndexSelect => {
            ins.count(if matches!(op, ScatterAdd | ScatterSrc) {
                3
            } else {
                2
            })?;
            let t = ins.input(0)?;
            OpParams::Index {
                dim: wrap_dim(a.int("dim")?, t.rank())?,
            }
        }
        ScatterReduce => {
            ins.count(3)?;
            let t = ins.input(0)?;
            let reduce = match a.get("reduce") {
                Some(Attr::Str(s)) if s == "prod" => ScatterReduction::Prod,
                Some(Attr::Str(s)) if s == "amax" => ScatterReduction::Amax,
                Some(Attr::Str(s)) if s == "amin" => ScatterReduction::Amin,
                other => {
                    return Err(format!(
                        "attribute \"reduce\" must be \"prod\", \"amax\" or \"amin\" (the \
                         adaptors write \"sum\" and \"mean\" as scatter_add), got {}",
                        other.map_or("nothing".to_string(), describe)
                    ));
                }
            };
            if !a.bool_or("include_self", true)? {
                return Err(
                    "include_self must be true (the adaptors write include_self=False \
                            as a scatter.value of the reduction's identity first)"
                        .into(),
                );
            }
            OpParams::ScatterReduce {
                dim: wrap_dim(a.int("dim")?, t.rank())?,
                reduce,
            }
        }
        ScatterValue => {
            ins.count(2)?;
            let t = ins.input(0)?;
            OpParams::Scatter {
                dim: wrap_dim(a.int("dim")?, t.rank())?,
                value: a.scalar("value")?,
            }
        }
        IndexPut => {
            let count = a.list_len("indices")?;
            ins.count(count + 2)?;
            let t = ins.input(0)?;
            let indices: Vec<_> = (1..=count).map(|i| ins.optional(i)).collect();
            OpParams::IndexPut {
                count,
                accumulate: a.bool_or("accumulate", false)?,
                index: advanced_index(t, &indices)?,
            }
        }
        Full => {
            ins.count(0)?;
            let shape = a
                .ints("size")?
                .iter()
                .map(|&s| nonneg(s, "a dimension"))
                .collect::<Result<_>>()?;
            let value = a.scalar("fill_value")?;
            let dtype = a.dtype_opt("dtype")?.unwrap_or(match value {
                Scalar::Float(_) => DType::F32,
                Scalar::Int(_) => DType::I64,
                Scalar::Bool(_) => DType::Bool,
            });
            OpParams::Fill {
                value,
                dtype,
                shape,
            }
        }
        FullLike => {
            ins.count(1)?;
            let t = ins.input(0)?;
            OpParams::Fill {
                value: a.scalar("fill_value")?,
                dtype: a.dtype_opt("dtype")?.unwrap_or(t.dtype),
                shape: t.shape.clone(),
            }
        }
        ScalarTensor => {
            ins.count(0)?;
            OpParams::Fill {
                value: a.scalar("s")?,
                dtype: a.dtype_opt("dtype")?.unwrap_or(DType::F32),
                shape: vec![],
            }
        }
        ArangeStartStep => {
            ins.count(0)?;
            let (start, end) = (a.scalar("start")?, a.scalar("end")?);
            let step = a.scalar_opt("step")?.unwrap_or(Scalar::Int(1));
            let (x, y, s) = (start.as_f64(), end.as_f64(), step.as_f64());
            if s == 0.0 || !x.is_finite() || !y.is_finite() || !s.is_finite() {
                return Err(format!(
                    "start {x}, end {y} and step {s} must be finite, step non-zero"
                ));
            }
            if (y - x) / s < 0.0 {
                return Err(format!("step {s} goes away from end {y} starting at {x}"));
            }
            let all_int = [start, end, step]
                .iter()
                .all(|v| matches!(v, Scalar::Int(_)));
            let default = if all_int { DType::I64 } else { DType::F32 };
            OpParams::Arange {
                start,
                end,
                step,
                len: ((y - x) / s).ceil() as u64,
                dtype: a.dtype_opt("dtype")?.unwrap_or(default),
            }
        }
        AssertAsyncMsg => OpParams::Assert {
            message: match a.get("assert_msg") {
                Some(Attr::Str(s)) => s.clone(),
                None => String::new(),
                Some(other) => return Err(format!("assert_msg must be a string, got {other:?}")),
            },
        },
        BernoulliP => {
            let p = a.scalar("p")?.as_f64();
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("p must be in [0, 1], got {p}"));
            }
            OpParams::Bernoulli { p }
        }
    })
}
