//! Inference for matrix products, convolution, shape ops, neural-network ops, indexing and
//! creation.

use super::{Result, broadcast, mismatch, promote_types, require_float, require_index, same};
use crate::ir::{DType, TensorType};
use crate::op::Op;
use crate::params::{Inputs, OpParams};

fn matmul_2d(a: &TensorType, b: &TensorType) -> Result<TensorType> {
    if a.rank() != 2 || b.rank() != 2 || a.shape[1] != b.shape[0] {
        return Err(format!("needs [n, k] and [k, m], got {a} and {b}"));
    }
    if a.dtype != b.dtype {
        return Err(format!("operands differ in dtype: {a} and {b}"));
    }
    Ok(TensorType::new(a.dtype, vec![a.shape[0], b.shape[1]]))
}

/// Everything but elementwise ops and reductions (see [`super::infer`]).
pub(super) fn infer(op: Op, p: &OpParams, ins: &Inputs<'_>) -> Result<Vec<TensorType>> {
    use Op::*;
    match (op, p) {
        (Mm, _) => {
            ins.count(2)?;
            let (a, b) = (ins.input(0)?, ins.input(1)?);
            matmul_2d(a, b).map(|t| vec![t])
        }
        (Addmm, _) => {
            ins.count(3)?;
            let (bias, a, b) = (ins.input(0)?, ins.input(1)?, ins.input(2)?);
            let out = matmul_2d(a, b)?;
            if broadcast(&bias.shape, &out.shape)? != out.shape {
                return Err(format!(
                    "bias {bias} does not broadcast to the product's {out}"
                ));
            }
            Ok(vec![out])
        }
        (Bmm, _) => {
            ins.count(2)?;
            let (a, b) = (ins.input(0)?, ins.input(1)?);
            if a.rank() != 3
                || b.rank() != 3
                || a.shape[0] != b.shape[0]
                || a.shape[2] != b.shape[1]
            {
                return Err(format!(
                    "bmm needs [b, n, k] and [b, k, m], got {a} and {b}"
                ));
            }
            if a.dtype != b.dtype {
                return Err(format!("operands differ in dtype: {a} and {b}"));
            }
            Ok(vec![TensorType::new(
                a.dtype,
                vec![a.shape[0], a.shape[1], b.shape[2]],
            )])
        }
        (Convolution, OpParams::Conv(c)) => {
            let input = ins.input(0)?;
            require_float(input, "input")?;
            let shape = c.output_shape();
            if let Some(bias) = ins.optional(2)
                && bias.shape != [c.out_channels]
            {
                return Err(format!("bias {bias} must be [{}]", c.out_channels));
            }
            Ok(vec![TensorType::new(input.dtype, shape)])
        }
        (ConvolutionBackward, OpParams::Conv(c)) => {
            let (grad, input, weight) = (ins.input(0)?, ins.input(1)?, ins.input(2)?);
            let expected = c.output_shape();
            if grad.shape != expected {
                return Err(format!(
                    "grad_output {grad} does not match the convolution's output {expected:?}"
                ));
            }
            Ok(vec![
                input.clone(),
                weight.clone(),
                TensorType::new(grad.dtype, vec![c.out_channels]),
            ])
        }
        (View | Expand, OpParams::Reshape { shape }) => {
            Ok(vec![TensorType::new(ins.input(0)?.dtype, shape.clone())])
        }
        (Permute, OpParams::Permute { dims }) => {
            let t = ins.input(0)?;
            Ok(vec![TensorType::new(
                t.dtype,
                dims.iter().map(|&d| t.shape[d]).collect(),
            )])
        }
        (Unsqueeze, OpParams::Unsqueeze { dim }) => {
            let t = ins.input(0)?;
            let mut shape = t.shape.clone();
            shape.insert(*dim, 1);
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (SqueezeDims, OpParams::Squeeze { dims }) => {
            let t = ins.input(0)?;
            let shape = t
                .shape
                .iter()
                .enumerate()
                .filter(|&(i, &n)| !(dims.contains(&i) && n == 1))
                .map(|(_, &n)| n)
                .collect();
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (SplitWithSizes, OpParams::Split { dim, sizes }) => {
            let t = ins.input(0)?;
            Ok(sizes
                .iter()
                .map(|&s| {
                    let mut shape = t.shape.clone();
                    shape[*dim] = s;
                    TensorType::new(t.dtype, shape)
                })
                .collect())
        }
        (Cat, &OpParams::Cat { dim, count }) => {
            let first = ins.input(0)?;
            let mut shape = first.shape.clone();
            let mut dtype = first.dtype;
            for i in 1..count {
                let t = ins.input(i)?;
                if t.rank() != first.rank()
                    || t.shape
                        .iter()
                        .enumerate()
                        .any(|(j, &s)| j != dim && s != first.shape[j])
                {
                    return Err(format!(
                        "tensor {i} {t} does not match tensor 0 {first} outside dimension {dim}"
                    ));
                }
                shape[dim] += t.shape[dim];
                dtype = promote_types(dtype, t.dtype);
            }
            Ok(vec![TensorType::new(dtype, shape)])
        }
        (SliceTensor, &OpParams::Slice { dim, len, .. }) => {
            let t = ins.input(0)?;
            let mut shape = t.shape.clone();
            shape[dim] = len;
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (SelectInt, &OpParams::Select { dim, .. }) => {
            let t = ins.input(0)?;
            let mut shape = t.shape.clone();
            shape.remove(dim);
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (
            NativeLayerNorm,
            OpParams::LayerNorm {
                normalized_shape,
                axis,
                ..
            },
        ) => {
            let t = ins.input(0)?;
            require_float(t, "input")?;
            for (i, what) in [(1, "weight"), (2, "bias")] {
                if let Some(p) = ins.optional(i)
                    && p.shape != *normalized_shape
                {
                    return Err(format!(
                        "{what} {p} must have the normalized shape {normalized_shape:?}"
                    ));
                }
            }
            let mut stats = t.shape[..*axis].to_vec();
            stats.extend(std::iter::repeat_n(1, t.rank() - axis));
            Ok(vec![
                t.clone(),
                TensorType::new(t.dtype, stats.clone()),
                TensorType::new(t.dtype, stats),
            ])
        }
        (
            NativeLayerNormBackward,
            OpParams::LayerNorm {
                normalized_shape, ..
            },
        ) => {
            // grad_out, input, mean, rstd, weight?, bias?
            let (grad, t) = (ins.input(0)?, ins.input(1)?);
            if grad.shape != t.shape {
                return Err(format!("grad_out {grad} and input {t} must have one shape"));
            }
            let param = TensorType::new(t.dtype, normalized_shape.clone());
            Ok(vec![t.clone(), param.clone(), param])
        }
        (
            NativeGroupNorm,
            &OpParams::GroupNorm {
                channels, groups, ..
            },
        ) => {
            let t = ins.input(0)?;
            require_float(t, "input")?;
            for (i, what) in [(1, "weight"), (2, "bias")] {
                if let Some(p) = ins.optional(i)
                    && p.shape != [channels]
                {
                    return Err(format!("{what} {p} must be [{channels}]"));
                }
            }
            let stats = TensorType::new(t.dtype, vec![t.shape[0], groups]);
            Ok(vec![t.clone(), stats.clone(), stats])
        }
        (ScaledDotProductAttention, OpParams::Attention(p)) => {
            let q = ins.input(0)?;
            let out = TensorType::new(q.dtype, vec![p.batch, p.heads, p.q_len, p.v_dim]);
            let lse = TensorType::new(DType::F32, vec![p.batch, p.heads, p.q_len]);
            Ok(vec![out, lse])
        }
        (EfficientAttention, OpParams::Attention(p)) => {
            // The generator's state, as for every op that draws; the seed it gives the
            // keep-flags is an output for the backward, the offset always 0.
            let (q, generator) = (ins.input(0)?, ins.input(4)?);
            if generator.dtype != DType::I64 || !generator.shape.is_empty() {
                return Err(format!(
                    "the generator (input 4) must be an i64 scalar, got {generator}"
                ));
            }
            let out = TensorType::new(q.dtype, vec![p.batch, p.heads, p.q_len, p.v_dim]);
            let lse = TensorType::new(DType::F32, vec![p.batch, p.heads, p.lse_stride]);
            let seed = TensorType::new(DType::I64, vec![]);
            Ok(vec![out, lse, seed.clone(), seed])
        }
        (EfficientAttentionBackward, OpParams::Attention(p)) => {
            let (q, k, v) = (ins.input(1)?, ins.input(2)?, ins.input(3)?);
            let out = [p.batch, p.heads, p.q_len, p.v_dim];
            let lse = [p.batch, p.heads, p.lse_stride];
            for (i, what, shape, dtype) in [
                (0, "grad_out", &out[..], q.dtype),
                (5, "out", &out[..], q.dtype),
                (6, "logsumexp", &lse[..], DType::F32),
                (7, "philox_seed", &[][..], DType::I64),
                (8, "philox_offset", &[][..], DType::I64),
            ] {
                let t = ins.input(i)?;
                if t.shape != shape || t.dtype != dtype {
                    return Err(format!("{what} {t} must be {dtype}{shape:?}"));
                }
            }
            let bias = ins
                .optional(4)
                .cloned()
                .unwrap_or_else(|| TensorType::new(q.dtype, vec![0]));
            Ok(vec![q.clone(), k.clone(), v.clone(), bias])
        }
        (ScaledDotProductAttentionBackward, OpParams::Attention(p)) => {
            let (q, k, v) = (ins.input(1)?, ins.input(2)?, ins.input(3)?);
            let out = [p.batch, p.heads, p.q_len, p.v_dim];
            for (i, what, shape, dtype) in [
                (0, "grad_out", &out[..], q.dtype),
                (4, "out", &out[..], q.dtype),
                (5, "logsumexp", &out[..3], DType::F32),
            ] {
                let t = ins.input(i)?;
                if t.shape != shape || t.dtype != dtype {
                    return Err(format!("{what} {t} must be {dtype}{shape:?}"));
                }
            }
            Ok(vec![q.clone(), k.clone(), v.clone()])
        }
        (NativeBatchNorm, &OpParams::BatchNorm { channels, .. }) => {
            let t = ins.input(0)?;
            require_float(t, "input")?;
            // The statistics' dtype: running_mean's (the input's, or f32 beside a 16-bit
            // input, as under autocast).
            let stats = ins.input(3)?.dtype;
            per_channel_params(
                t,
                stats,
                channels,
                &[
                    (ins.optional(1), "weight"),
                    (ins.optional(2), "bias"),
                    (Some(ins.input(3)?), "running_mean"),
                    (Some(ins.input(4)?), "running_var"),
                ],
            )?;
            let stat = TensorType::new(stats, vec![channels]);
            Ok(vec![
                t.clone(),
                stat.clone(),
                stat.clone(),
                stat.clone(),
                stat,
            ])
        }
        (NativeBatchNormBackward, &OpParams::BatchNorm { channels, .. }) => {
            let (grad, t) = (ins.input(0)?, ins.input(1)?);
            require_float(t, "input")?;
            if grad.shape != t.shape || grad.dtype != t.dtype {
                return Err(format!("grad_out {grad} and input {t} must have one type"));
            }
            let stats = ins.input(5)?.dtype;
            per_channel_params(
                t,
                stats,
                channels,
                &[
                    (ins.optional(2), "weight"),
                    (Some(ins.input(5)?), "save_mean"),
                    (Some(ins.input(6)?), "save_invstd"),
                ],
            )?;
            let param = TensorType::new(stats, vec![channels]);
            Ok(vec![t.clone(), param.clone(), param])
        }
        (Flip, OpParams::Flip { .. }) => Ok(same(ins.input(0)?)),
        (ConstantPadNd, OpParams::ConstantPad { before, after, .. }) => {
            let t = ins.input(0)?;
            let shape = t
                .shape
                .iter()
                .zip(before.iter().zip(after))
                .map(|(&n, (b, a))| (n as i64 + b + a) as u64)
                .collect();
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (ReflectionPad2d, OpParams::ReflectionPad { output, .. }) => {
            let t = ins.input(0)?;
            let mut shape = t.shape.clone();
            let rank = shape.len();
            shape[rank - 2..].copy_from_slice(output);
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (ReflectionPad2dBackward, OpParams::ReflectionPad { output, .. }) => {
            let (grad, t) = (ins.input(0)?, ins.input(1)?);
            let mut shape = t.shape.clone();
            let rank = shape.len();
            shape[rank - 2..].copy_from_slice(output);
            if grad.shape != shape || grad.dtype != t.dtype {
                return Err(format!(
                    "grad_output {grad} must be the padded {} of {t}",
                    TensorType::new(t.dtype, shape)
                ));
            }
            Ok(same(t))
        }
        (MaxPool2dWithIndices | AvgPool2d, OpParams::Pool(pool)) => {
            let t = ins.input(0)?;
            let mut shape = t.shape.clone();
            let rank = shape.len();
            shape[rank - 2..].copy_from_slice(&pool.output);
            let out = TensorType::new(t.dtype, shape.clone());
            if op == AvgPool2d {
                return Ok(vec![out]);
            }
            Ok(vec![out, TensorType::new(DType::I64, shape)])
        }
        (MaxPool2dWithIndicesBackward | AvgPool2dBackward, OpParams::Pool(pool)) => {
            let (grad, t) = (ins.input(0)?, ins.input(1)?);
            let mut shape = t.shape.clone();
            let rank = shape.len();
            shape[rank - 2..].copy_from_slice(&pool.output);
            if op == AvgPool2dBackward {
                if grad.shape != shape {
                    return Err(format!(
                        "grad_output {grad} must match the pooled shape {shape:?}"
                    ));
                }
                return Ok(same(t));
            }
            let indices = ins.input(2)?;
            if grad.shape != shape || indices.shape != shape {
                return Err(format!(
                    "grad_output {grad} and indices {indices} must match the pooled shape {shape:?}"
                ));
            }
            require_index(indices, "indices")?;
            Ok(same(t))
        }
        (AdaptiveAvgPool2d, OpParams::AdaptivePool { output_size }) => {
            let t = ins.input(0)?;
            let mut shape = t.shape.clone();
            let rank = shape.len();
            shape[rank - 2..].copy_from_slice(output_size);
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (AdaptiveAvgPool2dBackward, _) => {
            ins.count(2)?;
            let (grad, t) = (ins.input(0)?, ins.input(1)?);
            if grad.rank() != t.rank()
                || t.rank() < 2
                || grad.shape[..t.rank() - 2] != t.shape[..t.rank() - 2]
            {
                return Err(format!("grad_output {grad} does not fit input {t}"));
            }
            Ok(same(t))
        }
        (Embedding, _) => {
            ins.count(2)?;
            let (weight, indices) = (ins.input(0)?, ins.input(1)?);
            if weight.rank() != 2 {
                return Err(format!("weight must be 2-d, got {weight}"));
            }
            require_index(indices, "indices")?;
            let mut shape = indices.shape.clone();
            shape.push(weight.shape[1]);
            Ok(vec![TensorType::new(weight.dtype, shape)])
        }
        (EmbeddingDenseBackward, &OpParams::Embedding { num_weights, .. }) => {
            ins.count(2)?;
            let (grad, indices) = (ins.input(0)?, ins.input(1)?);
            require_index(indices, "indices")?;
            let width = *grad
                .shape
                .last()
                .ok_or("grad_output must have a dimension")?;
            Ok(vec![TensorType::new(grad.dtype, vec![num_weights, width])])
        }
        (Gather, OpParams::Index { .. }) => {
            let (t, index) = (ins.input(0)?, ins.input(1)?);
            require_index(index, "index")?;
            if index.rank() != t.rank() {
                return Err(format!("index {index} must have the rank of input {t}"));
            }
            Ok(vec![TensorType::new(t.dtype, index.shape.clone())])
        }
        (ScatterValue, OpParams::Scatter { .. }) => {
            let (t, index) = (ins.input(0)?, ins.input(1)?);
            require_index(index, "index")?;
            Ok(same(t))
        }
        (ScatterAdd | ScatterSrc, OpParams::Index { .. })
        | (ScatterReduce, OpParams::ScatterReduce { .. }) => {
            let (t, index, src) = (ins.input(0)?, ins.input(1)?, ins.input(2)?);
            require_index(index, "index")?;
            if index.rank() != t.rank() || src.rank() != t.rank() {
                return Err(format!(
                    "index {index} and src {src} must have the rank of {t}"
                ));
            }
            Ok(same(t))
        }
        (IndexTensor, OpParams::AdvancedIndex(index)) => Ok(vec![TensorType::new(
            ins.input(0)?.dtype,
            index.shape.clone(),
        )]),
        (
            IndexPut,
            OpParams::IndexPut {
                count: n, index, ..
            },
        ) => {
            let t = ins.input(0)?;
            let values = ins.input(n + 1)?;
            if values.dtype != t.dtype {
                return Err(format!("values {values} must have the dtype of {t}"));
            }
            if let Some(index) = index
                && broadcast(&values.shape, &index.shape)? != index.shape
            {
                return Err(format!(
                    "values {values} do not broadcast to the indexed shape {:?}",
                    index.shape
                ));
            }
            Ok(same(t))
        }
        (IndexSelect, &OpParams::Index { dim }) => {
            let (t, index) = (ins.input(0)?, ins.input(1)?);
            require_index(index, "index")?;
            if index.rank() > 1 {
                return Err(format!("index must be 0-d or 1-d, got {index}"));
            }
            let mut shape = t.shape.clone();
            if !shape.is_empty() {
                shape[dim] = index.numel().unwrap_or(0);
            }
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        (Full | FullLike | ScalarTensor, OpParams::Fill { dtype, shape, .. }) => {
            Ok(vec![TensorType::new(*dtype, shape.clone())])
        }
        (ArangeStartStep, &OpParams::Arange { len, dtype, .. }) => {
            Ok(vec![TensorType::new(dtype, vec![len])])
        }
        (AssertAsyncMsg, OpParams::Assert { .. }) => {
            // A check: its condition (one element), no outputs.
            ins.count(1)?;
            let cond = ins.input(0)?;
            if cond.numel() != Some(1) {
                return Err(format!("the condition must have one element, got {cond}"));
            }
            Ok(vec![])
        }
        (BernoulliP, OpParams::Bernoulli { .. }) | (RandLike, OpParams::None) => {
            // self, then the session's generator: an i64 scalar STATE tensor that the
            // graph advances every iteration, so each iteration draws new values.
            ins.count(2)?;
            let t = ins.input(0)?;
            let generator = ins.input(1)?;
            if generator.dtype != DType::I64 || !generator.shape.is_empty() {
                return Err(format!(
                    "the generator (input 1) must be an i64 scalar, got {generator}"
                ));
            }
            if op == RandLike && !t.dtype.is_float() {
                return Err(format!("rand_like draws floats, not {}", t.dtype));
            }
            Ok(same(t))
        }
        _ => Err(mismatch(op, p)),
    }
}

/// Batch norm's per-channel tensors: each `[channels]` of dtype `stats`, which is the
/// input's, or f32 beside a 16-bit input (PyTorch's mixed batch norm, as autocast runs it).
fn per_channel_params(
    t: &TensorType,
    stats: DType,
    channels: u64,
    params: &[(Option<&TensorType>, &str)],
) -> Result<()> {
    if !(stats == t.dtype || (stats == DType::F32 && matches!(t.dtype, DType::F16 | DType::Bf16))) {
        return Err(format!(
            "the statistics are {stats}: they must be the input's dtype ({}), or f32 beside a 16-bit input",
            t.dtype
        ));
    }
    for (p, what) in params {
        if let Some(p) = p
            && (p.shape != [channels] || p.dtype != stats)
        {
            return Err(format!("{what} {p} must be [{channels}] of {stats}"));
        }
    }
    Ok(())
}
