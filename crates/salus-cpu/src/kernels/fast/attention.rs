//! Fused scaled-dot-product attention on f32 tensors, forward and backward, in f32 as
//! PyTorch's CPU kernel computes it: per head and query, the scores over the keys, their
//! softmax, and the weighted values; the backward recomputes the softmax from the
//! forward's log-sum-exp. Heads run in parallel, each writing its own part of the
//! outputs. The generic path (in f64) runs any other dtype or mask, and defines the
//! layouts and the dropout both paths follow (`super::super::attention`).

use rayon::prelude::*;
use salus_graph::AttentionParams;

use super::super::attention::{Dropout, Layout};
use super::{Arg, Out, Result, typed, typed_mut};

/// The mask as the kernels read it, with its strides over (batch, head, query, key).
#[derive(Clone, Copy)]
enum Mask<'a> {
    None,
    /// False drops the score.
    Bool(&'a [u8], [u64; 4]),
    /// Added to the score.
    Add(&'a [f32], [u64; 4]),
}

/// Input `k` as f32 of `len` elements (`None`: another dtype or size, for the generic path).
fn input<'a>(args: &'a [Arg<'a>], k: usize, len: usize) -> Option<&'a [f32]> {
    super::input::<f32>(args, k)
        .map(|(_, v)| v)
        .filter(|v| v.len() == len)
}

/// The mask at input `k`: absent, bool or f32 (`None`: another dtype, for the generic path).
fn mask<'a>(p: &AttentionParams, args: &'a [Arg<'a>], k: usize) -> Option<Mask<'a>> {
    let (Some(Arg::Tensor(ty, bytes)), Some(strides)) = (args.get(k), p.mask_strides) else {
        return Some(Mask::None);
    };
    typed::<u8>(ty, bytes)
        .map(|m| Mask::Bool(m, strides))
        .or_else(|| typed::<f32>(ty, bytes).map(|m| Mask::Add(m, strides)))
}

/// Output `k` as f32 of `len` elements, or a buffer of its own when the output is unused.
fn output<'a>(
    outs: &'a mut [Option<Out<'_>>],
    k: usize,
    len: usize,
    spare: &'a mut Vec<f32>,
) -> Option<&'a mut [f32]> {
    match outs.get_mut(k) {
        Some(Some(o)) => typed_mut::<f32>(o.ty, o.bytes).filter(|v| v.len() == len),
        _ => {
            spare.resize(len, 0.0);
            Some(&mut spare[..])
        }
    }
}

/// `a . b` in a fixed order (eight partial sums, then the rest): vectorizable, and the
/// same on every machine.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        sum += x * y;
    }
    sum
}

/// `y += a * x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// What the scores of a head need.
struct Scores<'a> {
    p: &'a AttentionParams,
    q: &'a [f32],
    k: &'a [f32],
    mask: Mask<'a>,
}

impl Scores<'_> {
    /// The scores of query `i` of head `head` over every key, into `row`: `scale * q_i .
    /// k_j`, the mask added or applied, causal rows cut after the diagonal; `-inf` where
    /// dropped.
    fn row(&self, head: usize, i: usize, row: &mut [f32]) {
        let p = self.p;
        let (l, s, e) = (p.q_len as usize, p.kv_len as usize, p.head_dim as usize);
        let heads = p.heads as usize;
        let (b, h) = ((head / heads) as u64, (head % heads) as u64);
        let qi = &self.q[(head * l + i) * e..(head * l + i + 1) * e];
        let scale = p.scale as f32;
        for (j, r) in row.iter_mut().enumerate() {
            if p.causal && j > i {
                *r = f32::NEG_INFINITY;
                continue;
            }
            let kj = &self.k[(head * s + j) * e..(head * s + j + 1) * e];
            let mut v = scale * dot(qi, kj);
            let at = |st: [u64; 4]| {
                (b * st[0] + h * st[1] + i as u64 * st[2] + j as u64 * st[3]) as usize
            };
            match self.mask {
                Mask::None => {}
                Mask::Bool(m, st) => {
                    if m[at(st)] == 0 {
                        v = f32::NEG_INFINITY;
                    }
                }
                Mask::Add(m, st) => v += m[at(st)],
            }
            *r = v;
        }
    }
}

/// Heads (`batch * heads`), queries, keys, and the query and value lengths.
fn dims(p: &AttentionParams) -> (usize, usize, usize, usize, usize) {
    let d = |v: u64| v as usize;
    (
        d(p.batch * p.heads),
        d(p.q_len),
        d(p.kv_len),
        d(p.head_dim),
        d(p.v_dim),
    )
}

/// `_scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask?)`: (output,
/// logsumexp). A query whose every score is dropped gets NaN outputs and a log-sum-exp of
/// `-inf`, as the softmax of nothing.
/// The dropout factor of the probability at flat index `at`, in f32.
fn factor(drop: Dropout, at: usize) -> f32 {
    if drop.is_none() {
        1.0
    } else {
        drop.factor(at) as f32
    }
}

pub(in super::super) fn forward(
    p: &AttentionParams,
    layout: Layout,
    drop: Dropout,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Option<Result<()>> {
    let (bh, l, s, e, ev) = dims(p);
    if [bh, l, s, e, ev].contains(&0) {
        return None; // Empty tensors: the generic path.
    }
    let scores = Scores {
        p,
        q: input(args, 0, bh * l * e)?,
        k: input(args, 1, bh * s * e)?,
        mask: mask(p, args, layout.mask)?,
    };
    let v = input(args, 2, bh * s * ev)?;
    let (mut spare_out, mut spare_lse) = (Vec::new(), Vec::new());
    let (first, rest) = outs.split_at_mut(1.min(outs.len()));
    let out = output(first, 0, bh * l * ev, &mut spare_out)?;
    // Each head's log-sum-exps, then (the efficient op) zeros up to the next head's.
    let stride = if p.lse_stride == 0 {
        l
    } else {
        p.lse_stride as usize
    };
    let lse = if p.lse_stride == 0 {
        spare_lse.resize(bh * l, 0.0);
        &mut spare_lse[..]
    } else {
        output(rest, 0, bh * stride, &mut spare_lse)?
    };
    out.par_chunks_mut(l * ev)
        .zip(lse.par_chunks_mut(stride))
        .enumerate()
        .for_each(|(head, (out, lse))| {
            lse[l..].fill(0.0);
            let mut row = vec![0.0f32; s];
            for i in 0..l {
                scores.row(head, i, &mut row);
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let o = &mut out[i * ev..(i + 1) * ev];
                o.fill(0.0);
                if m == f32::NEG_INFINITY {
                    o.fill(f32::NAN);
                    lse[i] = f32::NEG_INFINITY;
                    continue;
                }
                let mut sum = 0.0f32;
                for (j, r) in row.iter().enumerate() {
                    let w = (r - m).exp();
                    sum += w;
                    let w = w * factor(drop, (head * l + i) * s + j);
                    axpy(o, w, &v[(head * s + j) * ev..(head * s + j + 1) * ev]);
                }
                let inv = 1.0 / sum;
                for od in o.iter_mut() {
                    *od *= inv;
                }
                lse[i] = m + sum.ln();
            }
        });
    Some(Ok(()))
}

/// `_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
/// logsumexp, attn_mask?)`: (grad_query, grad_key, grad_value). With the softmax `P`
/// recomputed as `exp(score - logsumexp)`, `D_i = grad_out_i . out_i` and `dS = P * (grad_out
/// v^T - D)`: `grad_query = scale * dS k`, `grad_key = scale * dS^T q`, `grad_value = P^T
/// grad_out`.
pub(in super::super) fn backward(
    p: &AttentionParams,
    layout: Layout,
    drop: Dropout,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Option<Result<()>> {
    let (bh, l, s, e, ev) = dims(p);
    let stride = p.lse_stride as usize;
    if [bh, l, s, e, ev].contains(&0) {
        return None; // Empty tensors: the generic path.
    }
    let go = input(args, 0, bh * l * ev)?;
    let scores = Scores {
        p,
        q: input(args, 1, bh * l * e)?,
        k: input(args, 2, bh * s * e)?,
        mask: mask(p, args, layout.mask)?,
    };
    let v = input(args, 3, bh * s * ev)?;
    let o = input(args, layout.out, bh * l * ev)?;
    let lse = input(args, layout.lse, bh * stride)?;
    let mut spares = [Vec::new(), Vec::new(), Vec::new()];
    let [s0, s1, s2] = &mut spares;
    let (first, rest) = outs.split_at_mut(1.min(outs.len()));
    let (second, rest) = rest.split_at_mut(1.min(rest.len()));
    let dq = output(first, 0, bh * l * e, s0)?;
    let dk = output(second, 0, bh * s * e, s1)?;
    let dv = output(rest, 0, bh * s * ev, s2)?;
    let scale = p.scale as f32;
    let (q, k) = (scores.q, scores.k);
    dq.par_chunks_mut(l * e)
        .zip(dk.par_chunks_mut(s * e))
        .zip(dv.par_chunks_mut(s * ev))
        .enumerate()
        .for_each(|(head, ((dq, dk), dv))| {
            dq.fill(0.0);
            dk.fill(0.0);
            dv.fill(0.0);
            let mut row = vec![0.0f32; s];
            for i in 0..l {
                let at = head * l + i;
                let goi = &go[at * ev..(at + 1) * ev];
                let di = dot(goi, &o[at * ev..(at + 1) * ev]);
                let qi = &q[at * e..(at + 1) * e];
                scores.row(head, i, &mut row);
                for (j, &sc) in row.iter().enumerate() {
                    if sc == f32::NEG_INFINITY {
                        continue;
                    }
                    let pij = (sc - lse[head * stride + i]).exp();
                    let f = factor(drop, at * s + j);
                    let kv = head * s + j;
                    let dp = dot(goi, &v[kv * ev..(kv + 1) * ev]);
                    let ds = pij * (f * dp - di) * scale;
                    axpy(&mut dq[i * e..(i + 1) * e], ds, &k[kv * e..(kv + 1) * e]);
                    axpy(&mut dk[j * e..(j + 1) * e], ds, qi);
                    axpy(&mut dv[j * ev..(j + 1) * ev], pij * f, goi);
                }
            }
        });
    Some(Ok(()))
}
