//! Fused scaled-dot-product attention on f32 tensors, forward and backward: per head, the
//! scores of a block of queries over every key as one matrix product, their softmax (and
//! dropout) row by row, then the products with the values; the backward recomputes the
//! softmax from the forward's log-sum-exp and forms the gradients the same way, block by
//! block, never holding more than one block's scores. Heads run in parallel, each writing
//! its own part of the outputs. The generic path (in f64) runs any other dtype or mask,
//! and defines the layouts and the dropout both paths follow (`super::super::attention`).

use rayon::prelude::*;
use salus_graph::AttentionParams;

use super::super::attention::{Dropout, Layout};
use super::exp::exp_shifted;
use super::matmul::{gemm, rows, transposed};
use super::{Arg, Out, Result, typed, typed_mut};

/// Queries whose scores are formed at once: a block's scores are `QUERY_BLOCK x kv_len`
/// f32 (a quarter of a MiB per 1,024 keys).
const QUERY_BLOCK: usize = 64;

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

/// What the scores of a head need.
struct Scores<'a> {
    p: &'a AttentionParams,
    q: &'a [f32],
    k: &'a [f32],
    mask: Mask<'a>,
}

impl Scores<'_> {
    /// The scores of queries `i0..i0 + count` of head `head` over every key, row-major
    /// into `out`: `scale * q k^T` by one product, then the mask added or applied and
    /// causal rows cut after the diagonal; `-inf` where dropped.
    fn block(&self, head: usize, i0: usize, count: usize, out: &mut [f32]) -> Result<()> {
        let p = self.p;
        let (l, s, e) = (p.q_len as usize, p.kv_len as usize, p.head_dim as usize);
        let heads = p.heads as usize;
        let (b, h) = ((head / heads) as u64, (head % heads) as u64);
        let q = &self.q[(head * l + i0) * e..(head * l + i0 + count) * e];
        let k = &self.k[head * s * e..(head + 1) * s * e];
        let out = &mut out[..count * s];
        gemm(
            rows(q, count, e),
            transposed(k, e, s),
            out,
            false,
            p.scale as f32,
        )?;
        for (r, row) in out.chunks_exact_mut(s).enumerate() {
            let i = i0 + r;
            if p.causal && i + 1 < s {
                row[i + 1..].fill(f32::NEG_INFINITY);
            }
            let at = |st: [u64; 4], j: usize| {
                (b * st[0] + h * st[1] + i as u64 * st[2] + j as u64 * st[3]) as usize
            };
            match self.mask {
                Mask::None => {}
                Mask::Bool(m, st) => {
                    for (j, x) in row.iter_mut().enumerate() {
                        if m[at(st, j)] == 0 {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
                Mask::Add(m, st) => {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x += m[at(st, j)];
                    }
                }
            }
        }
        Ok(())
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
    let done = out
        .par_chunks_mut(l * ev)
        .zip(lse.par_chunks_mut(stride))
        .enumerate()
        .try_for_each(|(head, (out, lse))| -> Result<()> {
            crate::blas::serial(|| {
                lse[l..].fill(0.0);
                let v = &v[head * s * ev..(head + 1) * s * ev];
                let mut buf = vec![0.0f32; QUERY_BLOCK.min(l) * s];
                for i0 in (0..l).step_by(QUERY_BLOCK) {
                    let count = QUERY_BLOCK.min(l - i0);
                    let probs = &mut buf[..count * s];
                    scores.block(head, i0, count, probs)?;
                    // Each row's softmax (a row with every score dropped: zeros here, NaN
                    // outputs below), its log-sum-exp, then the dropout factors.
                    let mut empty = [false; QUERY_BLOCK];
                    for (r, row) in probs.chunks_exact_mut(s).enumerate() {
                        let i = i0 + r;
                        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        if m == f32::NEG_INFINITY {
                            row.fill(0.0);
                            (lse[i], empty[r]) = (f32::NEG_INFINITY, true);
                            continue;
                        }
                        exp_shifted(row, m);
                        let sum: f32 = row.iter().sum();
                        lse[i] = m + sum.ln();
                        let inv = 1.0 / sum;
                        if drop.is_none() {
                            row.iter_mut().for_each(|x| *x *= inv);
                        } else {
                            let first = (head * l + i) * s;
                            for (j, x) in row.iter_mut().enumerate() {
                                *x *= inv * factor(drop, first + j);
                            }
                        }
                    }
                    let o = &mut out[i0 * ev..(i0 + count) * ev];
                    gemm(rows(probs, count, s), rows(v, s, ev), o, false, 1.0)?;
                    for (row, _) in o.chunks_exact_mut(ev).zip(empty).filter(|(_, e)| *e) {
                        row.fill(f32::NAN);
                    }
                }
                Ok(())
            })
        });
    Some(done)
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
    let done = dq
        .par_chunks_mut(l * e)
        .zip(dk.par_chunks_mut(s * e))
        .zip(dv.par_chunks_mut(s * ev))
        .enumerate()
        .try_for_each(|(head, ((dq, dk), dv))| -> Result<()> {
            crate::blas::serial(|| {
                dk.fill(0.0);
                dv.fill(0.0);
                let (k, v) = (
                    &k[head * s * e..(head + 1) * s * e],
                    &v[head * s * ev..(head + 1) * s * ev],
                );
                let block = QUERY_BLOCK.min(l) * s;
                let (mut pb, mut gb) = (vec![0.0f32; block], vec![0.0f32; block]);
                for i0 in (0..l).step_by(QUERY_BLOCK) {
                    let count = QUERY_BLOCK.min(l - i0);
                    let (probs, grads) = (&mut pb[..count * s], &mut gb[..count * s]);
                    let (first, last) = (head * l + i0, head * l + i0 + count);
                    let qb = &q[first * e..last * e];
                    let (gob, ob) = (&go[first * ev..last * ev], &o[first * ev..last * ev]);
                    // P again from the log-sum-exp, and dP = grad_out v^T.
                    scores.block(head, i0, count, probs)?;
                    gemm(
                        rows(gob, count, ev),
                        transposed(v, ev, s),
                        grads,
                        false,
                        1.0,
                    )?;
                    for (r, (pr, gr)) in probs
                        .chunks_exact_mut(s)
                        .zip(grads.chunks_exact_mut(s))
                        .enumerate()
                    {
                        let m = lse[head * stride + i0 + r];
                        let di = dot(&gob[r * ev..(r + 1) * ev], &ob[r * ev..(r + 1) * ev]);
                        // P, then dS = P (F dP - D) scale; P F weighs grad_value.
                        if m == f32::NEG_INFINITY {
                            pr.fill(0.0);
                        } else {
                            exp_shifted(pr, m);
                        }
                        if drop.is_none() {
                            for (x, g) in pr.iter().zip(gr.iter_mut()) {
                                *g = x * (*g - di) * scale;
                            }
                        } else {
                            let first = (head * l + i0 + r) * s;
                            for (j, (x, g)) in pr.iter_mut().zip(gr.iter_mut()).enumerate() {
                                let f = factor(drop, first + j);
                                *g = *x * (f * *g - di) * scale;
                                *x *= f;
                            }
                        }
                    }
                    // grad_query = dS k, grad_key += dS^T q, grad_value += (P F)^T grad_out.
                    let dqb = &mut dq[i0 * e..(i0 + count) * e];
                    gemm(rows(grads, count, s), rows(k, s, e), dqb, false, 1.0)?;
                    gemm(
                        transposed(grads, s, count),
                        rows(qb, count, e),
                        dk,
                        true,
                        1.0,
                    )?;
                    gemm(
                        transposed(probs, s, count),
                        rows(gob, count, ev),
                        dv,
                        true,
                        1.0,
                    )?;
                }
                Ok(())
            })
        });
    Some(done)
}
