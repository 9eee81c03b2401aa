//! Training-mode batch norm over f32 `[N, C, inner]`: each channel's statistics in f64
//! (channels in parallel), then the element pass over rows of `inner` (rows in parallel).
//! The per-element arithmetic is the generic kernel's (`super::super::norm`), in f64.

use rayon::prelude::*;
use salus_graph::TensorType;

use super::reduce::sum;
use super::{Arg, Out, PARALLEL_WORK, Result, for_chunks, input, typed_mut};

/// `(batch, channels, inner, momentum, eps)`, as `OpParams::BatchNorm` gives them.
pub(in super::super) type Geometry = (usize, usize, usize, f64, f64);

/// `f(c)` for every channel, on the pool when the whole op is large.
fn per_channel<T: Send>(
    channels: usize,
    work: usize,
    f: impl Fn(usize) -> T + Sync + Send,
) -> Vec<T> {
    if work >= PARALLEL_WORK && rayon::current_num_threads() > 1 {
        (0..channels).into_par_iter().map(f).collect()
    } else {
        (0..channels).map(f).collect()
    }
}

/// An optional per-channel f32 input: `Some(None)` when absent, `None` when it is not f32
/// of `channels` elements (the generic kernel then runs).
fn param<'a>(args: &'a [Arg<'a>], k: usize, channels: usize) -> Option<Option<&'a [f32]>> {
    match args.get(k) {
        Some(Arg::Absent) | None => Some(None),
        Some(_) => input::<f32>(args, k)
            .filter(|(_, v)| v.len() == channels)
            .map(|(_, v)| Some(v)),
    }
}

/// The used outputs as f32 slices (`None` for an unused one); `None` when one is not f32.
fn outputs<'a, const K: usize>(
    outs: &'a mut [Option<Out<'_>>],
) -> Option<[Option<&'a mut [f32]>; K]> {
    if outs.len() != K {
        return None;
    }
    let mut slices: [Option<&'a mut [f32]>; K] = std::array::from_fn(|_| None);
    for (slot, out) in slices.iter_mut().zip(outs.iter_mut()) {
        if let Some(out) = out {
            let ty: &TensorType = out.ty;
            *slot = Some(typed_mut::<f32>(ty, &mut *out.bytes)?);
        }
    }
    Some(slices)
}

/// Writes `values` into a used per-channel output.
fn store(out: Option<&mut [f32]>, values: impl Iterator<Item = f64>) {
    if let Some(out) = out {
        for (o, v) in out.iter_mut().zip(values) {
            *o = v as f32;
        }
    }
}

/// `_native_batch_norm_legit_functional` in training (see the generic kernel).
pub(in super::super) fn forward(
    (batch, channels, inner, momentum, eps): Geometry,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Option<Result<()>> {
    let (_, x) = input::<f32>(args, 0)?;
    if x.len() != batch * channels * inner || x.is_empty() {
        return None;
    }
    let (weight, bias) = (param(args, 1, channels)?, param(args, 2, channels)?);
    let (rm, rv) = (param(args, 3, channels)??, param(args, 4, channels)??);
    let [y, mean_out, rstd_out, rm_out, rv_out] = outputs::<5>(outs)?;
    let n = (batch * inner) as f64;
    let rows = |c: usize| (0..batch).map(move |i| &x[(i * channels + c) * inner..][..inner]);
    let stats = per_channel(channels, x.len(), |c| {
        let mean = rows(c).map(sum).sum::<f64>() / n;
        let var = rows(c)
            .map(|r| {
                r.iter()
                    .map(|&v| (f64::from(v) - mean).powi(2))
                    .sum::<f64>()
            })
            .sum::<f64>()
            / n;
        (mean, var, 1.0 / (var + eps).sqrt())
    });
    if let Some(y) = y {
        let scale = |c: usize| weight.map_or(1.0, |w| f64::from(w[c]));
        let shift = |c: usize| bias.map_or(0.0, |b| f64::from(b[c]));
        for_chunks(y, inner, 4, |start, chunk| {
            for (k, out) in chunk.chunks_exact_mut(inner).enumerate() {
                let row = start / inner + k;
                let c = row % channels;
                let (mean, _, rstd) = stats[c];
                let (a, b) = (scale(c), shift(c));
                for (o, &v) in out.iter_mut().zip(&x[row * inner..][..inner]) {
                    *o = ((f64::from(v) - mean) * rstd * a + b) as f32;
                }
            }
        });
    }
    store(mean_out, stats.iter().map(|s| s.0));
    store(rstd_out, stats.iter().map(|s| s.2));
    let m = momentum;
    store(
        rm_out,
        stats
            .iter()
            .zip(rm)
            .map(|(s, &r)| (1.0 - m) * f64::from(r) + m * s.0),
    );
    store(
        rv_out,
        stats
            .iter()
            .zip(rv)
            .map(|(s, &r)| (1.0 - m) * f64::from(r) + m * s.1 * n / (n - 1.0)),
    );
    Some(Ok(()))
}

/// `native_batch_norm_backward` in training (see the generic kernel).
pub(in super::super) fn backward(
    (batch, channels, inner, _, _): Geometry,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Option<Result<()>> {
    let (_, dy) = input::<f32>(args, 0)?;
    let (_, x) = input::<f32>(args, 1)?;
    if x.len() != batch * channels * inner || dy.len() != x.len() || x.is_empty() {
        return None;
    }
    let weight = param(args, 2, channels)?;
    let (mean, rstd) = (param(args, 5, channels)??, param(args, 6, channels)??);
    let [dx, dw, db] = outputs::<3>(outs)?;
    let n = (batch * inner) as f64;
    let at = |i: usize, c: usize| (i * channels + c) * inner;
    let sums = per_channel(channels, x.len(), |c| {
        let m = f64::from(mean[c]);
        (0..batch).fold((0.0, 0.0), |(sum_dy, dot), i| {
            let (g, v) = (&dy[at(i, c)..][..inner], &x[at(i, c)..][..inner]);
            let d = g
                .iter()
                .zip(v)
                .map(|(&g, &v)| f64::from(g) * (f64::from(v) - m))
                .sum::<f64>();
            (sum_dy + sum(g), dot + d)
        })
    });
    if let Some(dx) = dx {
        let scale = |c: usize| weight.map_or(1.0, |w| f64::from(w[c]));
        for_chunks(dx, inner, 4, |start, chunk| {
            for (k, out) in chunk.chunks_exact_mut(inner).enumerate() {
                let row = start / inner + k;
                let c = row % channels;
                let (m, r) = (f64::from(mean[c]), f64::from(rstd[c]));
                let (sum_dy, dot) = sums[c];
                let kk = r * r * dot / n;
                let (g, v) = (&dy[row * inner..][..inner], &x[row * inner..][..inner]);
                for ((o, &g), &v) in out.iter_mut().zip(g).zip(v) {
                    let centred = f64::from(v) - m;
                    *o = ((f64::from(g) - sum_dy / n - centred * kk) * r * scale(c)) as f32;
                }
            }
        });
    }
    store(dw, sums.iter().zip(rstd).map(|(s, &r)| s.1 * f64::from(r)));
    store(db, sums.iter().map(|s| s.0));
    Some(Ok(()))
}
