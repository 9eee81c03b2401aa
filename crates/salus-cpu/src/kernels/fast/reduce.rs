//! Reductions (sum, mean, amax, var), softmax and layer norm (and its backward) over f32, walking the input
//! once in contiguous runs. Sums accumulate in f64 whichever dimensions they reduce.

use std::cell::RefCell;

use rayon::prelude::*;

use salus_graph::{Op, Reduction};

use super::exp::exp_shifted;
use super::{MAX_RANK, for_chunks, input, numel, typed_mut};
use crate::kernels::{Arg, Out, Result};

thread_local! {
    /// f64 accumulators of sums that add rows into their outputs; grown on first use,
    /// then reused by every iteration on this thread.
    static ACCUMULATORS: RefCell<Vec<f64>> = const { RefCell::new(Vec::new()) };
}

/// `f` with `len` zeroed f64 accumulators of this thread.
fn with_accumulators<R>(len: usize, f: impl FnOnce(&mut [f64]) -> R) -> R {
    ACCUMULATORS.with(|cell| {
        let mut buffer = cell.borrow_mut();
        if buffer.len() < len {
            buffer.resize(len, 0.0);
        }
        let acc = &mut buffer[..len];
        acc.fill(0.0);
        f(acc)
    })
}

/// The sum of a run, accumulated in f64 over eight lanes.
pub(super) fn sum(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    acc.iter().sum::<f64>() + tail
}

/// The largest element of a run (NaN if any is NaN).
fn max(x: &[f32]) -> f32 {
    x.iter().fold(f32::NEG_INFINITY, |a, &v| larger(a, v))
}

fn larger(a: f32, v: f32) -> f32 {
    if v.is_nan() || v > a { v } else { a }
}

/// An input seen as groups of neighbouring dims that are all reduced or all kept, size-1
/// dims dropped: `sizes[..count]`, the innermost last.
struct Groups {
    sizes: [usize; MAX_RANK],
    reduced: [bool; MAX_RANK],
    /// Output stride of each kept group (0 for reduced ones).
    out_strides: [usize; MAX_RANK],
    count: usize,
}

impl Groups {
    fn new(shape: &[u64], is_reduced: impl Fn(usize) -> bool) -> Option<Groups> {
        if shape.len() > MAX_RANK {
            return None;
        }
        let mut g = Groups {
            sizes: [1; MAX_RANK],
            reduced: [false; MAX_RANK],
            out_strides: [0; MAX_RANK],
            count: 0,
        };
        for (d, &size) in shape.iter().enumerate() {
            if size == 1 {
                continue;
            }
            let r = is_reduced(d);
            if g.count > 0 && g.reduced[g.count - 1] == r {
                g.sizes[g.count - 1] *= size as usize;
            } else {
                g.sizes[g.count] = size as usize;
                g.reduced[g.count] = r;
                g.count += 1;
            }
        }
        if g.count == 0 {
            g.count = 1;
            g.reduced[0] = true;
        }
        let mut stride = 1;
        for i in (0..g.count).rev() {
            if !g.reduced[i] {
                g.out_strides[i] = stride;
                stride *= g.sizes[i];
            }
        }
        Some(g)
    }

    fn inner(&self) -> usize {
        self.sizes[self.count - 1]
    }

    fn inner_reduced(&self) -> bool {
        self.reduced[self.count - 1]
    }

    /// Calls `f(input_offset, output_offset)` for each run of the innermost group, in
    /// input order.
    fn walk(&self, mut f: impl FnMut(usize, usize)) {
        let outer = self.count - 1;
        let runs: usize = self.sizes[..outer].iter().product();
        let inner = self.inner();
        let mut index = [0usize; MAX_RANK];
        let mut out = 0;
        for run in 0..runs {
            f(run * inner, out);
            for d in (0..outer).rev() {
                index[d] += 1;
                out += self.out_strides[d];
                if index[d] < self.sizes[d] {
                    break;
                }
                out -= self.out_strides[d] * self.sizes[d];
                index[d] = 0;
            }
        }
    }
}

/// `sum.dim_IntList`, `mean`, `mean.dim` and `amax` of `op`.
pub(super) fn reduce(
    op: Op,
    r: &Reduction,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Option<Result<()>> {
    let (ty, x) = input::<f32>(args, 0)?;
    let g = Groups::new(&ty.shape, |d| r.reduces(d))?;
    let dst = typed_mut::<f32>(o.ty, o.bytes)?;
    let count: usize = (0..g.count)
        .filter(|&i| g.reduced[i])
        .map(|i| g.sizes[i])
        .product();
    if numel(&ty.shape) == 0 || dst.is_empty() {
        return None;
    }
    let is_max = op == Op::Amax;
    let scale = if matches!(op, Op::MeanDim | Op::Mean) {
        1.0 / count.max(1) as f64
    } else {
        1.0
    };
    let inner = g.inner();
    if g.count <= 2 && g.inner_reduced() {
        // [kept, reduced]: one output per contiguous run.
        for_chunks(dst, 1, inner, |start, chunk| {
            for (i, v) in chunk.iter_mut().enumerate() {
                let run = &x[(start + i) * inner..(start + i + 1) * inner];
                *v = if is_max {
                    max(run)
                } else {
                    (sum(run) * scale) as f32
                };
            }
        });
        return Some(Ok(()));
    }
    if g.count == 2 && g.reduced[0] {
        // [reduced, kept]: rows added into the output, split by columns.
        let rows = g.sizes[0];
        for_chunks(dst, 1, rows, |start, chunk| {
            let width = chunk.len();
            let row = |r: usize| &x[r * inner + start..r * inner + start + width];
            if is_max {
                chunk.fill(f32::NEG_INFINITY);
                for r in 0..rows {
                    chunk
                        .iter_mut()
                        .zip(row(r))
                        .for_each(|(a, &v)| *a = larger(*a, v));
                }
                return;
            }
            with_accumulators(width, |acc| {
                for r in 0..rows {
                    acc.iter_mut()
                        .zip(row(r))
                        .for_each(|(a, &v)| *a += f64::from(v));
                }
                chunk
                    .iter_mut()
                    .zip(acc.iter())
                    .for_each(|(c, &a)| *c = (a * scale) as f32);
            });
        });
        return Some(Ok(()));
    }
    if is_max {
        dst.fill(f32::NEG_INFINITY);
        g.walk(|xi, oi| {
            let run = &x[xi..xi + inner];
            if g.inner_reduced() {
                dst[oi] = larger(dst[oi], max(run));
            } else {
                dst[oi..oi + inner]
                    .iter_mut()
                    .zip(run)
                    .for_each(|(a, &v)| *a = larger(*a, v));
            }
        });
        return Some(Ok(()));
    }
    with_accumulators(dst.len(), |acc| {
        g.walk(|xi, oi| {
            let run = &x[xi..xi + inner];
            if g.inner_reduced() {
                acc[oi] += sum(run);
            } else {
                acc[oi..oi + inner]
                    .iter_mut()
                    .zip(run)
                    .for_each(|(a, &v)| *a += f64::from(v));
            }
        });
        dst.iter_mut()
            .zip(acc.iter())
            .for_each(|(d, &a)| *d = (a * scale) as f32);
    });
    Some(Ok(()))
}

/// Outputs of a variance accumulated on the stack: larger ones take the generic path.
const VAR_OUTPUTS: usize = 1024;

/// `var.correction`: the sum of squared deviations over `count - correction`.
pub(super) fn variance(
    r: &Reduction,
    correction: f64,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Option<Result<()>> {
    let (ty, x) = input::<f32>(args, 0)?;
    let g = Groups::new(&ty.shape, |d| r.reduces(d))?;
    let dst = typed_mut::<f32>(o.ty, o.bytes)?;
    let n_out = dst.len();
    if n_out > VAR_OUTPUTS || numel(&ty.shape) == 0 {
        return None;
    }
    let count: usize = (0..g.count)
        .filter(|&i| g.reduced[i])
        .map(|i| g.sizes[i])
        .product();
    let inner = g.inner();
    let mut mean = [0f64; VAR_OUTPUTS];
    let mut sq = [0f64; VAR_OUTPUTS];
    if g.inner_reduced() {
        g.walk(|xi, oi| mean[oi] += sum(&x[xi..xi + inner]));
    } else {
        g.walk(|xi, oi| {
            for (m, &v) in mean[oi..oi + inner].iter_mut().zip(&x[xi..xi + inner]) {
                *m += f64::from(v);
            }
        });
    }
    for m in &mut mean[..n_out] {
        *m /= count as f64;
    }
    if g.inner_reduced() {
        g.walk(|xi, oi| {
            let m = mean[oi];
            sq[oi] += x[xi..xi + inner]
                .iter()
                .map(|&v| {
                    let d = f64::from(v) - m;
                    d * d
                })
                .sum::<f64>();
        });
    } else {
        g.walk(|xi, oi| {
            for ((s, &m), &v) in sq[oi..oi + inner]
                .iter_mut()
                .zip(&mean[oi..oi + inner])
                .zip(&x[xi..xi + inner])
            {
                let d = f64::from(v) - m;
                *s += d * d;
            }
        });
    }
    let divisor = (count as f64 - correction).max(0.0);
    for (v, s) in dst.iter_mut().zip(&sq) {
        *v = (s / divisor) as f32;
    }
    Some(Ok(()))
}

/// `_softmax` (`log` false) and `_log_softmax` along dimension `d`, when it is the last.
pub(super) fn softmax(
    d: usize,
    log: bool,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Option<Result<()>> {
    let (ty, x) = input::<f32>(args, 0)?;
    let len = ty.shape.get(d).copied().unwrap_or(1) as usize;
    let inner: usize = ty.shape.get(d + 1..)?.iter().product::<u64>() as usize;
    if inner != 1 || len == 0 {
        return None;
    }
    let dst = typed_mut::<f32>(o.ty, o.bytes)?;
    if dst.len() != x.len() {
        return None;
    }
    for_chunks(dst, len, 8, |start, chunk| {
        for (row, out) in x[start..start + chunk.len()]
            .chunks_exact(len)
            .zip(chunk.chunks_exact_mut(len))
        {
            let m = max(row);
            out.copy_from_slice(row);
            exp_shifted(out, m);
            let total: f64 = out.iter().map(|&e| f64::from(e)).sum();
            if log {
                let shift = m + total.ln() as f32;
                out.iter_mut().zip(row).for_each(|(o, &v)| *o = v - shift);
            } else {
                let r = (1.0 / total) as f32;
                out.iter_mut().for_each(|o| *o *= r);
            }
        }
    });
    Some(Ok(()))
}

/// `native_layer_norm` over the last dimensions `normalized`.
pub(super) fn layer_norm(
    normalized: &[u64],
    eps: f64,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Option<Result<()>> {
    let (_, x) = input::<f32>(args, 0)?;
    let inner = numel(normalized).max(1);
    if x.is_empty() || x.len() % inner != 0 {
        return None;
    }
    let param = |k: usize| match args.get(k) {
        Some(Arg::Absent) | None => Some(None),
        Some(_) => input::<f32>(args, k)
            .filter(|(_, v)| v.len() == inner)
            .map(|(_, v)| Some(v)),
    };
    let (weight, bias) = (param(1)?, param(2)?);
    let [y, mean, rstd] = match outs {
        [y, mean, rstd] => [y, mean, rstd].map(|o| {
            o.as_mut()
                .map(|o| typed_mut::<f32>(o.ty, &mut *o.bytes).ok_or(()))
                .transpose()
        }),
        _ => return None,
    };
    let (mut y, mut mean, mut rstd) = (y.ok()?, mean.ok()?, rstd.ok()?);
    for (a, row) in x.chunks_exact(inner).enumerate() {
        let m = sum(row) / inner as f64;
        let var = row
            .iter()
            .map(|&v| {
                let d = f64::from(v) - m;
                d * d
            })
            .sum::<f64>()
            / inner as f64;
        let r = 1.0 / (var + eps).sqrt();
        if let Some(y) = y.as_deref_mut() {
            let out = &mut y[a * inner..(a + 1) * inner];
            let (mf, rf) = (m as f32, r as f32);
            match (weight, bias) {
                (Some(w), Some(b)) => {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = (row[j] - mf) * rf * w[j] + b[j];
                    }
                }
                _ => {
                    for (j, o) in out.iter_mut().enumerate() {
                        let mut v = (row[j] - mf) * rf;
                        if let Some(w) = weight {
                            v *= w[j];
                        }
                        if let Some(b) = bias {
                            v += b[j];
                        }
                        *o = v;
                    }
                }
            }
        }
        if let Some(mean) = mean.as_deref_mut() {
            *mean.get_mut(a)? = m as f32;
        }
        if let Some(rstd) = rstd.as_deref_mut() {
            *rstd.get_mut(a)? = r as f32;
        }
    }
    Some(Ok(()))
}

/// Rows of layer norm's backward per task: each task also sums its rows' part of the
/// weight and bias gradients, and the parts are added in task order (the same result on
/// any number of threads).
const LAYER_NORM_ROWS: usize = 32;

/// `native_layer_norm_backward(grad_out, input, mean, rstd, weight?, bias?)` over the last
/// dimensions `normalized`: (grad_input, grad_weight, grad_bias), whichever are used.
/// With `x^ = (x - mean) rstd` and `g = grad_out * weight` per row, `grad_input = rstd
/// (g - mean(g) - x^ mean(g x^))`; `grad_weight` sums `grad_out x^` over the rows and
/// `grad_bias` sums `grad_out`; every sum in f64.
pub(super) fn layer_norm_backward(
    normalized: &[u64],
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Option<Result<()>> {
    let (_, grad) = input::<f32>(args, 0)?;
    let (_, x) = input::<f32>(args, 1)?;
    let (_, mean) = input::<f32>(args, 2)?;
    let (_, rstd) = input::<f32>(args, 3)?;
    let inner = numel(normalized).max(1);
    if x.is_empty() || x.len() % inner != 0 || grad.len() != x.len() {
        return None;
    }
    let outer = x.len() / inner;
    if mean.len() != outer || rstd.len() != outer {
        return None;
    }
    let weight = match args.get(4) {
        Some(Arg::Absent) | None => None,
        Some(_) => Some(input::<f32>(args, 4).filter(|(_, v)| v.len() == inner)?.1),
    };
    let [gi, gw, gb] = match outs {
        [gi, gw, gb] => [gi, gw, gb].map(|o| {
            o.as_mut()
                .map(|o| typed_mut::<f32>(o.ty, &mut *o.bytes).ok_or(()))
                .transpose()
        }),
        _ => return None,
    };
    let (gi, gw, gb) = (gi.ok()?, gw.ok()?, gb.ok()?);
    if gi.as_ref().is_some_and(|g| g.len() != x.len())
        || [&gw, &gb]
            .iter()
            .any(|o| o.as_ref().is_some_and(|g| g.len() != inner))
    {
        return None;
    }
    let columns = gw.is_some() || gb.is_some();
    // One task's rows `first..`: grad_input into `out` (when used), and its part of the
    // column sums.
    let task = |first: usize, out: Option<&mut [f32]>| -> (Vec<f64>, Vec<f64>) {
        let rows = LAYER_NORM_ROWS.min(outer - first);
        let (mut pw, mut pb) = if columns {
            (vec![0.0f64; inner], vec![0.0f64; inner])
        } else {
            (Vec::new(), Vec::new())
        };
        let mut out = out;
        for r in 0..rows {
            let a = first + r;
            let (xs, gs) = (
                &x[a * inner..(a + 1) * inner],
                &grad[a * inner..(a + 1) * inner],
            );
            let (m, rs) = (mean[a], rstd[a]);
            let (mut s1, mut s2) = (0.0f64, 0.0f64);
            for j in 0..inner {
                let xhat = (xs[j] - m) * rs;
                let g = gs[j] * weight.map_or(1.0, |w| w[j]);
                s1 += f64::from(g);
                s2 += f64::from(g) * f64::from(xhat);
                if columns {
                    pw[j] += f64::from(gs[j]) * f64::from(xhat);
                    pb[j] += f64::from(gs[j]);
                }
            }
            if let Some(out) = out.as_deref_mut() {
                let (mg, mgx) = ((s1 / inner as f64) as f32, (s2 / inner as f64) as f32);
                for (j, o) in out[r * inner..(r + 1) * inner].iter_mut().enumerate() {
                    let xhat = (xs[j] - m) * rs;
                    let g = gs[j] * weight.map_or(1.0, |w| w[j]);
                    *o = rs * (g - mg - xhat * mgx);
                }
            }
        }
        (pw, pb)
    };
    let parts: Vec<(Vec<f64>, Vec<f64>)> = match gi {
        Some(gi) => gi
            .par_chunks_mut(LAYER_NORM_ROWS * inner)
            .enumerate()
            .map(|(c, out)| task(c * LAYER_NORM_ROWS, Some(out)))
            .collect(),
        None => (0..outer.div_ceil(LAYER_NORM_ROWS))
            .into_par_iter()
            .map(|c| task(c * LAYER_NORM_ROWS, None))
            .collect(),
    };
    for (out, pick) in [(gw, 0), (gb, 1)] {
        if let Some(out) = out {
            let mut total = vec![0.0f64; inner];
            for part in &parts {
                let p = if pick == 0 { &part.0 } else { &part.1 };
                total.iter_mut().zip(p).for_each(|(t, v)| *t += v);
            }
            out.iter_mut().zip(&total).for_each(|(o, t)| *o = *t as f32);
        }
    }
    Some(Ok(()))
}
