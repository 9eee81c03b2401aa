//! Pooling in `f64` for every dtype: average pooling (fixed and adaptive windows) and max
//! pooling, forward and backward. Inputs are `[N?, C, H, W]`: every leading dimension
//! counts as one more plane of `H x W`. Fixed windows come from the node's [`PoolParams`].

use salus_graph::{PoolParams, TensorType};

use super::{Arg, Out, Result, index_at, load, numel, store, tensor};

/// `(planes, h, w)` of a 3-d or 4-d tensor.
fn planes(t: &TensorType) -> Result<(usize, usize, usize)> {
    let rank = t.rank();
    if rank != 3 && rank != 4 {
        return Err(format!("pooling needs a 3-d or 4-d tensor, got {t}"));
    }
    let (h, w) = (t.shape[rank - 2] as usize, t.shape[rank - 1] as usize);
    let planes = t.shape[..rank - 2].iter().product::<u64>() as usize;
    Ok((planes, h, w))
}

/// A fixed-window pooling's planes, input `[h, w]` and output `[oh, ow]`.
fn geometry(pool: &PoolParams) -> (usize, [usize; 2], [usize; 2]) {
    let size = |v: [u64; 2]| v.map(|x| x as usize);
    (pool.planes as usize, size(pool.input), size(pool.output))
}

/// The output's `(oh, ow)`, checked to pool the same planes as the input.
fn pooled(input: &TensorType, out: &TensorType) -> Result<(usize, usize)> {
    let (p, _, _) = planes(input)?;
    let (q, oh, ow) = planes(out)?;
    if p != q || input.rank() != out.rank() {
        return Err(format!("{out} does not pool the planes of {input}"));
    }
    Ok((oh, ow))
}

/// The windows of an `avg_pool2d`: for each output element, the clipped input window and
/// the divisor of its sum.
struct AvgWindows {
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    count_include_pad: bool,
    divisor: Option<i64>,
}

impl AvgWindows {
    fn new(pool: &PoolParams) -> AvgWindows {
        let signed = |v: [u64; 2]| v.map(|x| x as i64);
        AvgWindows {
            kernel: signed(pool.kernel),
            stride: signed(pool.stride),
            padding: signed(pool.padding),
            count_include_pad: pool.count_include_pad,
            divisor: pool.divisor_override,
        }
    }

    /// The window of output `(oy, ox)` on an `h x w` plane as `(y0..y1, x0..x1, divisor)`,
    /// following ATen: the divisor counts padding inside the padded input unless
    /// `count_include_pad` is false, and `divisor_override` replaces it.
    fn window(&self, oy: usize, ox: usize, h: usize, w: usize) -> ([usize; 4], f64) {
        let axis = |o: usize, d: usize, size: usize| {
            let start = o as i64 * self.stride[d] - self.padding[d];
            let end = (start + self.kernel[d]).min(size as i64 + self.padding[d]);
            let padded = end - start;
            let (start, end) = (start.max(0), end.min(size as i64));
            (start as usize, end.max(start) as usize, padded)
        };
        let (y0, y1, ph) = axis(oy, 0, h);
        let (x0, x1, pw) = axis(ox, 1, w);
        let divisor = match (self.divisor, self.count_include_pad) {
            (Some(d), _) => d as f64,
            (None, true) => (ph * pw) as f64,
            (None, false) => ((y1 - y0) * (x1 - x0)) as f64,
        };
        ([y0, y1, x0, x1], divisor)
    }
}

/// `avg_pool2d`.
pub(super) fn avg_pool2d(pool: &PoolParams, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ity, x) = tensor(args, 0)?;
    let (planes, [h, w], [oh, ow]) = geometry(pool);
    let windows = AvgWindows::new(pool);
    for p in 0..planes {
        for oy in 0..oh {
            for ox in 0..ow {
                let ([y0, y1, x0, x1], divisor) = windows.window(oy, ox, h, w);
                let mut sum = 0.0;
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        sum += load(x, ity.dtype, (p * h + iy) * w + ix);
                    }
                }
                let v = if y0 < y1 && x0 < x1 {
                    sum / divisor
                } else {
                    0.0
                };
                store(o.bytes, o.ty.dtype, (p * oh + oy) * ow + ox, v);
            }
        }
    }
    Ok(())
}

/// `avg_pool2d_backward(grad_output, self)`: each output gradient spread evenly (by the
/// forward's divisor) over its window.
pub(super) fn avg_pool2d_backward(
    pool: &PoolParams,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (gty, g) = tensor(args, 0)?;
    let (ity, _) = tensor(args, 1)?;
    let (planes, [h, w], [oh, ow]) = geometry(pool);
    let windows = AvgWindows::new(pool);
    let mut grad = vec![0.0; numel(&ity.shape)];
    for p in 0..planes {
        for oy in 0..oh {
            for ox in 0..ow {
                let ([y0, y1, x0, x1], divisor) = windows.window(oy, ox, h, w);
                let share = load(g, gty.dtype, (p * oh + oy) * ow + ox) / divisor;
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        grad[(p * h + iy) * w + ix] += share;
                    }
                }
            }
        }
    }
    for (i, v) in grad.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

/// Window `[floor(i * size / out), ceil((i + 1) * size / out))` of adaptive pooling.
fn adaptive(i: usize, size: usize, out: usize) -> (usize, usize) {
    (i * size / out, ((i + 1) * size).div_ceil(out))
}

/// `_adaptive_avg_pool2d`: the mean of each adaptive window.
pub(super) fn adaptive_avg_pool2d(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ity, x) = tensor(args, 0)?;
    let (planes, h, w) = planes(ity)?;
    let (oh, ow) = pooled(ity, o.ty)?;
    for p in 0..planes {
        for oy in 0..oh {
            let (y0, y1) = adaptive(oy, h, oh);
            for ox in 0..ow {
                let (x0, x1) = adaptive(ox, w, ow);
                let mut sum = 0.0;
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        sum += load(x, ity.dtype, (p * h + iy) * w + ix);
                    }
                }
                let count = ((y1 - y0) * (x1 - x0)) as f64;
                store(o.bytes, o.ty.dtype, (p * oh + oy) * ow + ox, sum / count);
            }
        }
    }
    Ok(())
}

/// `_adaptive_avg_pool2d_backward(grad_output, self)`.
pub(super) fn adaptive_avg_pool2d_backward(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (gty, g) = tensor(args, 0)?;
    let (ity, _) = tensor(args, 1)?;
    let (planes, h, w) = planes(ity)?;
    let (oh, ow) = pooled(ity, gty)?;
    let mut grad = vec![0.0; numel(&ity.shape)];
    for p in 0..planes {
        for oy in 0..oh {
            let (y0, y1) = adaptive(oy, h, oh);
            for ox in 0..ow {
                let (x0, x1) = adaptive(ox, w, ow);
                let count = ((y1 - y0) * (x1 - x0)) as f64;
                let share = load(g, gty.dtype, (p * oh + oy) * ow + ox) / count;
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        grad[(p * h + iy) * w + ix] += share;
                    }
                }
            }
        }
    }
    for (i, v) in grad.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

/// `max_pool2d_with_indices` of any 3-d or 4-d input: (max of each window, its index in
/// the `H x W` plane); NaN wins, and the first of equal maxima.
pub(super) fn max_pool2d(
    pool: &PoolParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (ity, x) = tensor(args, 0)?;
    let (planes, [h, w], [oh, ow]) = geometry(pool);
    let signed = |v: [u64; 2]| v.map(|x| x as i64);
    let (kernel, stride) = (signed(pool.kernel), signed(pool.stride));
    let (padding, dilation) = (signed(pool.padding), signed(pool.dilation));
    let mut values = vec![0.0; planes * oh * ow];
    let mut indices = vec![0.0; values.len()];
    for p in 0..planes {
        for oy in 0..oh {
            for ox in 0..ow {
                let (mut best, mut at) = (f64::NEG_INFINITY, None);
                for ky in 0..kernel[0] {
                    let iy = oy as i64 * stride[0] + ky * dilation[0] - padding[0];
                    for kx in 0..kernel[1] {
                        let ix = ox as i64 * stride[1] + kx * dilation[1] - padding[1];
                        if iy < 0 || ix < 0 || iy >= h as i64 || ix >= w as i64 {
                            continue;
                        }
                        let i = iy as usize * w + ix as usize;
                        let v = load(x, ity.dtype, p * h * w + i);
                        if at.is_none() || (!best.is_nan() && (v > best || v.is_nan())) {
                            (best, at) = (v, Some(i));
                        }
                    }
                }
                let o = (p * oh + oy) * ow + ox;
                values[o] = best;
                indices[o] = at.unwrap_or(0) as f64;
            }
        }
    }
    for (k, data) in [values, indices].into_iter().enumerate() {
        if let Some(Some(out)) = outs.get_mut(k) {
            for (i, v) in data.into_iter().enumerate() {
                store(out.bytes, out.ty.dtype, i, v);
            }
        }
    }
    Ok(())
}

/// `max_pool2d_with_indices_backward(grad_output, self, indices)` of any 3-d or 4-d
/// input: each gradient added at its (checked) index in its plane.
pub(super) fn max_pool2d_backward(
    pool: &PoolParams,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (gty, g) = tensor(args, 0)?;
    let (ity, _) = tensor(args, 1)?;
    let (xty, idx) = tensor(args, 2)?;
    let (planes, [h, w], [oh, ow]) = geometry(pool);
    if xty.shape != gty.shape {
        return Err(format!(
            "indices {xty} must have the shape of grad_output {gty}"
        ));
    }
    let mut grad = vec![0.0; numel(&ity.shape)];
    for p in 0..planes {
        for k in 0..oh * ow {
            let i = p * oh * ow + k;
            let at = index_at(idx, xty.dtype, i, (h * w) as u64, "pooling index")?;
            grad[p * h * w + at] += load(g, gty.dtype, i);
        }
    }
    for (i, v) in grad.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}
