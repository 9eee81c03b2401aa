//! Fused scaled-dot-product attention, forward and backward, in f64: each query's scores
//! over the keys, their softmax, and the weighted values; the backward recomputes the
//! softmax from the forward's log-sum-exp. Two ops of each: the flash op, and the
//! efficient op, which drops probabilities (dropout) by the session's stream and pads
//! each head's log-sum-exps (`Layout`, `Dropout`).

use rayon::prelude::*;
use salus_graph::{AttentionParams, Node, Op};

use super::{Arg, Out, Result, fast, load, numel, random, store_results, tensor};

/// Where an attention node's inputs are, by op: the forward's mask, and the backward's
/// forward output, log-sum-exp and mask (the efficient op puts its bias before them).
#[derive(Clone, Copy)]
pub(super) struct Layout {
    pub(super) mask: usize,
    pub(super) out: usize,
    pub(super) lse: usize,
}

impl Layout {
    pub(super) const FLASH_FORWARD: Layout = Layout {
        mask: 3,
        out: usize::MAX,
        lse: usize::MAX,
    };
    pub(super) const FLASH_BACKWARD: Layout = Layout {
        mask: 6,
        out: 4,
        lse: 5,
    };
    const EFFICIENT_FORWARD: Layout = Layout::FLASH_FORWARD;
    const EFFICIENT_BACKWARD: Layout = Layout {
        mask: 4,
        out: 5,
        lse: 6,
    };
}

/// Dropout of the probabilities: the one of query `i` and key `j` in head `head` (flat
/// index `(head * q_len + i) * kv_len + j`) is kept when the session's stream under
/// `seed` draws below `1 - p` (24 bits, as `bernoulli.p`), and scaled by `1 / (1 - p)`.
#[derive(Clone, Copy)]
pub(super) struct Dropout {
    p: f64,
    seed: u64,
}

impl Dropout {
    pub(super) const NONE: Dropout = Dropout { p: 0.0, seed: 0 };

    pub(super) fn is_none(&self) -> bool {
        self.p == 0.0
    }

    /// The factor of the probability at flat index `at`: 0 or `1 / (1 - p)`.
    pub(super) fn factor(&self, at: usize) -> f64 {
        if self.p == 0.0 {
            1.0
        } else if random::uniform(self.seed, at as u64, 24) < 1.0 - self.p {
            1.0 / (1.0 - self.p)
        } else {
            0.0
        }
    }
}

/// The efficient ops, `_scaled_dot_product_efficient_attention(query, key, value,
/// attn_bias?, generator)` -> (output, logsumexp, philox_seed, philox_offset) and its
/// backward `(grad_out, query, key, value, attn_bias?, out, logsumexp, philox_seed,
/// philox_offset)` -> (grad_query, grad_key, grad_value, grad_bias): the forward's seed is
/// the node's stream under the generator state (the offset is 0), which the backward
/// reads back to draw the same keep-flags.
pub(super) fn efficient(
    node: &Node,
    p: &AttentionParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    if node.op == Op::EfficientAttention {
        let seed = random::node_stream(node, args, 4)?;
        for (k, v) in [(2, seed as i64), (3, 0)] {
            if let Some(Some(o)) = outs.get_mut(k) {
                if o.bytes.len() != 8 {
                    return Err(format!("output {k} {} must be an i64 scalar", o.ty));
                }
                o.bytes.copy_from_slice(&v.to_le_bytes());
            }
        }
        let drop = Dropout { p: p.dropout, seed };
        let layout = Layout::EFFICIENT_FORWARD;
        fast::attention_forward(p, layout, drop, args, outs)
            .unwrap_or_else(|| attention(p, layout, drop, args, outs))
    } else {
        let seed = random::i64_scalar(args, 7, "philox_seed")? as u64;
        let drop = Dropout { p: p.dropout, seed };
        let layout = Layout::EFFICIENT_BACKWARD;
        fast::attention_backward(p, layout, drop, args, outs)
            .unwrap_or_else(|| attention_backward(p, layout, drop, args, outs))
    }
}

/// A tensor argument's values as f64 (`None` when absent).
fn values(args: &[Arg<'_>], k: usize) -> Result<Option<Vec<f64>>> {
    match args.get(k) {
        Some(Arg::Tensor(ty, bytes)) => Ok(Some(
            (0..numel(&ty.shape))
                .map(|i| load(bytes, ty.dtype, i))
                .collect(),
        )),
        None | Some(Arg::Absent) => Ok(None),
        Some(_) => Err(format!("input {k} must be a tensor")),
    }
}

fn need(args: &[Arg<'_>], k: usize, what: &str, len: usize) -> Result<Vec<f64>> {
    let v = values(args, k)?.ok_or_else(|| format!("{what} must be a tensor"))?;
    if v.len() != len {
        let (ty, _) = tensor(args, k)?;
        return Err(format!("{what} {ty} must have {len} elements"));
    }
    Ok(v)
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

/// The query, key and value at inputs `first`, `first + 1` and `first + 2`, as f64.
fn query_key_value(
    p: &AttentionParams,
    args: &[Arg<'_>],
    first: usize,
) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let (bh, l, s, e, ev) = dims(p);
    Ok((
        need(args, first, "query", bh * l * e)?,
        need(args, first + 1, "key", bh * s * e)?,
        need(args, first + 2, "value", bh * s * ev)?,
    ))
}

/// The scores of one head: `scale * q_i . k_j`, the mask added (float) or applied (bool:
/// false drops the score), and causal rows cut after the diagonal; `-inf` where dropped.
struct Scores<'a> {
    p: &'a AttentionParams,
    q: &'a [f64],
    k: &'a [f64],
    /// The mask's values and whether it is bool.
    mask: Option<(&'a [f64], bool)>,
}

impl Scores<'_> {
    fn at(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        let p = self.p;
        let (l, s, e) = (p.q_len as usize, p.kv_len as usize, p.head_dim as usize);
        if p.causal && j > i {
            return f64::NEG_INFINITY;
        }
        let head = b * p.heads as usize + h;
        let (qi, kj) = ((head * l + i) * e, (head * s + j) * e);
        let mut v = self.p.scale * (0..e).map(|d| self.q[qi + d] * self.k[kj + d]).sum::<f64>();
        if let (Some((mask, bool)), Some(st)) = (self.mask, p.mask_strides) {
            let at = b as u64 * st[0] + h as u64 * st[1] + i as u64 * st[2] + j as u64 * st[3];
            let m = mask[at as usize];
            if bool {
                if m == 0.0 {
                    return f64::NEG_INFINITY;
                }
            } else {
                v += m;
            }
        }
        v
    }
}

fn mask_of<'a>(args: &'a [Arg<'a>], k: usize) -> Result<Option<(Vec<f64>, bool)>> {
    let bool =
        matches!(args.get(k), Some(Arg::Tensor(ty, _)) if ty.dtype == salus_graph::DType::Bool);
    Ok(values(args, k)?.map(|v| (v, bool)))
}

/// `_scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask?)`: (output,
/// logsumexp). A query whose every score is dropped gets NaN outputs and a log-sum-exp of
/// `-inf`, as the softmax of nothing. With dropout, each probability times its factor
/// weighs its value; the log-sum-exp is the undropped scores'.
pub(super) fn attention(
    p: &AttentionParams,
    layout: Layout,
    drop: Dropout,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (bh, l, s, _, ev) = dims(p);
    let (q, k, v) = query_key_value(p, args, 0)?;
    let mask = mask_of(args, layout.mask)?;
    let scores = Scores {
        p,
        q: &q,
        k: &k,
        mask: mask.as_ref().map(|(m, b)| (&m[..], *b)),
    };
    // Heads in parallel, each with its own outputs, joined in order after.
    let heads: Vec<(Vec<f64>, Vec<f64>)> = (0..bh)
        .into_par_iter()
        .map(|head| {
            let (b, h) = (head / p.heads as usize, head % p.heads as usize);
            let (mut out, mut lse) = (vec![0.0; l * ev], vec![0.0; p.lse_stride as usize]);
            let mut row = vec![0.0; s];
            for i in 0..l {
                for (j, r) in row.iter_mut().enumerate() {
                    *r = scores.at(b, h, i, j);
                }
                let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let o = &mut out[i * ev..(i + 1) * ev];
                if m == f64::NEG_INFINITY {
                    o.fill(f64::NAN);
                    if let Some(x) = lse.get_mut(i) {
                        *x = f64::NEG_INFINITY;
                    }
                    continue;
                }
                let mut sum = 0.0;
                for (j, r) in row.iter().enumerate() {
                    let w = (r - m).exp();
                    sum += w;
                    let w = w * drop.factor((head * l + i) * s + j);
                    let vj = &v[(head * s + j) * ev..(head * s + j + 1) * ev];
                    for (od, vd) in o.iter_mut().zip(vj) {
                        *od += w * vd;
                    }
                }
                for od in o.iter_mut() {
                    *od /= sum;
                }
                if let Some(x) = lse.get_mut(i) {
                    *x = m + sum.ln();
                }
            }
            (out, lse)
        })
        .collect();
    let (out, lse): (Vec<Vec<f64>>, Vec<Vec<f64>>) = heads.into_iter().unzip();
    store_results(vec![out.concat(), lse.concat()], outs)
}

/// `_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
/// logsumexp, attn_mask?)`: (grad_query, grad_key, grad_value). With the softmax `P`
/// recomputed as `exp(score - logsumexp)`, each probability's dropout factor `F`, `D_i =
/// grad_out_i . out_i` and `dS = P * (F * grad_out v^T - D)`: `grad_query = scale * dS k`,
/// `grad_key = scale * dS^T q`, `grad_value = (P * F)^T grad_out`.
pub(super) fn attention_backward(
    p: &AttentionParams,
    layout: Layout,
    drop: Dropout,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (bh, l, s, e, ev) = dims(p);
    let stride = p.lse_stride as usize;
    let go = need(args, 0, "grad_out", bh * l * ev)?;
    let (q, k, v) = query_key_value(p, args, 1)?;
    let o = need(args, layout.out, "out", bh * l * ev)?;
    let lse = need(args, layout.lse, "logsumexp", bh * stride)?;
    let mask = mask_of(args, layout.mask)?;
    let scores = Scores {
        p,
        q: &q,
        k: &k,
        mask: mask.as_ref().map(|(m, b)| (&m[..], *b)),
    };
    // Heads in parallel, each with its own gradients, joined in order after.
    let heads: Vec<[Vec<f64>; 3]> = (0..bh)
        .into_par_iter()
        .map(|head| {
            let (b, h) = (head / p.heads as usize, head % p.heads as usize);
            let (mut dq, mut dk, mut dv) = (vec![0.0; l * e], vec![0.0; s * e], vec![0.0; s * ev]);
            for i in 0..l {
                let row = head * l + i;
                let goi = &go[row * ev..(row + 1) * ev];
                let di: f64 = goi
                    .iter()
                    .zip(&o[row * ev..(row + 1) * ev])
                    .map(|(a, b)| a * b)
                    .sum();
                for j in 0..s {
                    let sc = scores.at(b, h, i, j);
                    if sc == f64::NEG_INFINITY {
                        continue;
                    }
                    let pij = (sc - lse[head * stride + i]).exp();
                    let factor = drop.factor(row * s + j);
                    let kv = head * s + j;
                    let vj = &v[kv * ev..(kv + 1) * ev];
                    let dp: f64 = goi.iter().zip(vj).map(|(a, b)| a * b).sum();
                    let ds = pij * (factor * dp - di) * p.scale;
                    let pij = pij * factor;
                    for d in 0..e {
                        dq[i * e + d] += ds * k[kv * e + d];
                        dk[j * e + d] += ds * q[row * e + d];
                    }
                    for d in 0..ev {
                        dv[j * ev + d] += pij * goi[d];
                    }
                }
            }
            [dq, dk, dv]
        })
        .collect();
    let [mut dq, mut dk, mut dv] = [Vec::new(), Vec::new(), Vec::new()];
    for [q_h, k_h, v_h] in heads {
        dq.extend(q_h);
        dk.extend(k_h);
        dv.extend(v_h);
    }
    store_results(vec![dq, dk, dv], outs)
}
