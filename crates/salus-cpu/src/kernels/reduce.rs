//! Reductions in `f64` for every dtype: `sum.dim_IntList`, `mean`, `mean.dim`, `amax`,
//! `var.correction` and `any.dim` over the dimensions a [`Reduction`] names, and softmax,
//! log-softmax, `cumsum` and `cumprod` along one dimension.

use salus_graph::{Op, Reduction, TensorType};

use super::{Arg, Out, Result, contiguous_strides, for_each_index, load, numel, store, tensor};

/// Strides mapping each element of an input of `ty` to its element of the reduced output
/// (0 along reduced dimensions).
fn to_output(ty: &TensorType, r: &Reduction) -> Vec<usize> {
    let rank = ty.rank();
    let kept: Vec<u64> = (0..rank)
        .map(|d| if r.reduces(d) { 1 } else { ty.shape[d] })
        .collect();
    let own = contiguous_strides(&kept);
    (0..rank)
        .map(|d| if r.reduces(d) { 0 } else { own[d] })
        .collect()
}

/// Elements that go into each output element.
fn reduced_count(ty: &TensorType, r: &Reduction) -> f64 {
    r.dims.iter().map(|&d| ty.shape[d]).product::<u64>() as f64
}

/// `sum.dim_IntList`, `mean`, `mean.dim` and `amax`.
pub(super) fn reduce(op: Op, r: &Reduction, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let n_out = numel(&o.ty.shape);
    // The mean of no elements is NaN (0 / 0), as in PyTorch.
    let count = reduced_count(ty, r);
    let is_max = op == Op::Amax;
    let mut acc = vec![if is_max { f64::NEG_INFINITY } else { 0.0 }; n_out];
    for_each_index(&ty.shape, &[to_output(ty, r)], |i, offs| {
        let v = load(bytes, ty.dtype, i);
        let a = &mut acc[offs[0]];
        *a = if is_max {
            if v.is_nan() || v > *a { v } else { *a }
        } else {
            *a + v
        };
    });
    let mean = matches!(op, Op::MeanDim | Op::Mean);
    for (i, a) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, if mean { a / count } else { a });
    }
    Ok(())
}

/// `var.correction`: the sum of squared deviations over `count - correction`.
pub(super) fn variance(
    r: &Reduction,
    correction: f64,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let to_out = to_output(ty, r);
    let n_out = numel(&o.ty.shape);
    let count = reduced_count(ty, r);
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

/// `any.dim`: true where any element along the reduced dimension is non-zero.
pub(super) fn any(r: &Reduction, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let mut acc = vec![false; numel(&o.ty.shape)];
    for_each_index(&ty.shape, &[to_output(ty, r)], |i, offs| {
        acc[offs[0]] |= load(bytes, ty.dtype, i) != 0.0
    });
    for (i, v) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, f64::from(u8::from(v)));
    }
    Ok(())
}

/// `_softmax` (`log` false) and `_log_softmax` along dimension `d`.
pub(super) fn softmax(d: usize, log: bool, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let len = ty.shape.get(d).copied().unwrap_or(1) as usize;
    let inner = numel(ty.shape.get(d + 1..).unwrap_or(&[]));
    let outer = numel(&ty.shape) / (len * inner).max(1);
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

/// `cumsum` (`cumprod` with `product`) along `d`: each element the sum (product) of those
/// before it and itself, accumulated in `f64` and rounded once to the output's dtype.
pub(super) fn cumulative(d: usize, product: bool, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    if ty.shape != o.ty.shape {
        return Err(format!("output {} must have the shape of input {ty}", o.ty));
    }
    let len = ty.shape.get(d).copied().unwrap_or(1) as usize;
    let inner = numel(ty.shape.get(d + 1..).unwrap_or(&[]));
    let outer = numel(&ty.shape) / (len * inner).max(1);
    for a in 0..outer {
        for b in 0..inner {
            let mut acc = if product { 1.0 } else { 0.0 };
            for j in 0..len {
                let at = (a * len + j) * inner + b;
                let v = load(bytes, ty.dtype, at);
                acc = if product { acc * v } else { acc + v };
                store(o.bytes, o.ty.dtype, at, acc);
            }
        }
    }
    Ok(())
}
