//! Scaled-dot-product attention, forward and backward (`attention.cu`), two ways:
//!
//! - **through cuBLAS** (f32, the scores of the node within [`SCORES_MAX_BYTES`]): the
//!   scores `scale * q k^T` as one strided-batched product into the node's scratch, the
//!   softmax (with mask and causality) in place by a row kernel, then `P v`; the backward
//!   recomputes the probabilities from the log-sum-exp and runs its four products the
//!   same way, with `dS = P (dP - D) scale` by a row kernel between them;
//! - **fused** (16-bit inputs, or longer sequences): kernels that never form the score
//!   matrix (an online softmax forward; a query pass and a key/value pass backward). The
//!   forward and backward run in register tiles (`attn_fwd_tiled`, `attn_bwd_dq_tiled`,
//!   `attn_bwd_dkv_tiled`) where the head dims are at most [`ATTENTION_TILED_MAX_DIM`],
//!   and f32 attention too when the device asks for it
//!   ([`crate::CudaDevice::set_tiled_attention`]).
//!
//! Either way the backward keeps one f32 per query (`D = grad_out . out`) in scratch.
//!
//! The efficient ops (`_scaled_dot_product_efficient_attention` and its backward) run the
//! same kernels with dropout: every kernel draws each probability's keep-flag again from
//! the forward's seed (never a stored mask), and the log-sum-exps of a head sit
//! `lse_stride` apart, the padding past the queries zero.

use salus_graph::{AttentionParams, DType, Graph, Node, Op, OpParams};

use super::matmul::Matrix;
use super::reduce::row_blocks;
use super::{Lowered, Lowering, Operand, address};
use crate::abi::{
    ATTENTION_MAX_DIM, ATTENTION_TILED_MAX_DIM, AttentionArgs, AttentionSeedArgs, BLOCK, Kernel,
};
use crate::driver::GemmType::F32;

/// The most bytes of f32 scores (`batch * heads * q_len * kv_len * 4`) the cuBLAS path
/// plans for one node (the backward plans twice that): beyond, the fused kernels run.
pub(crate) const SCORES_MAX_BYTES: u64 = 2 << 30;

/// Bytes of the backward's D (an f32 per query), rounded up so that the score buffers
/// after it stay aligned.
fn delta_bytes(p: &AttentionParams) -> u64 {
    (p.batch * p.heads * p.q_len * 4).next_multiple_of(256)
}

fn scores_bytes(p: &AttentionParams) -> u64 {
    p.batch * p.heads * p.q_len * p.kv_len * 4
}

/// Whether a node of these inputs' dtype runs through cuBLAS.
fn through_cublas(p: &AttentionParams, dtype: DType) -> bool {
    dtype == DType::F32 && scores_bytes(p) <= SCORES_MAX_BYTES
}

/// Queries per block of the forward (`ATT_QROWS`: two per warp).
const FORWARD_QUERIES: u64 = BLOCK as u64 / 32 * 2;
/// Queries per block of the register-tiled forward (`ATT_TQ`).
const TILED_QUERIES: u64 = 64;
/// Queries, or keys, per block of the register-tiled backward (`ATT_TB`).
const TILED_BACKWARD_ROWS: u64 = 32;

/// Whether f32 attention starts with the register-tiled forward (`SALUS_CUDA_ATTENTION=tiled`)
/// rather than cuBLAS.
pub(crate) fn tiled_by_default() -> bool {
    std::env::var("SALUS_CUDA_ATTENTION").as_deref() == Ok("tiled")
}

fn tiles_fit(p: &AttentionParams) -> bool {
    p.head_dim <= ATTENTION_TILED_MAX_DIM && p.v_dim <= ATTENTION_TILED_MAX_DIM
}
/// Queries per block of the backward's query pass and keys per block of its key pass
/// (one per warp).
const BACKWARD_ROWS: u64 = BLOCK as u64 / 32;

/// Whether `op` is an attention forward (`Some(true)`: the query is input 0) or backward
/// (`Some(false)`: input 1), flash or efficient.
fn attention_forward(op: Op) -> Option<bool> {
    match op {
        Op::ScaledDotProductAttention | Op::EfficientAttention => Some(true),
        Op::ScaledDotProductAttentionBackward | Op::EfficientAttentionBackward => Some(false),
        _ => None,
    }
}

/// Scratch bytes of an attention node on this device (0 for other nodes): through cuBLAS
/// the scores (the backward: D, the probabilities and their gradients); fused, the
/// backward's D. The efficient ops plan as the flash ones.
pub(crate) fn attention_scratch_bytes(graph: &Graph, node: usize, params: &OpParams) -> u64 {
    let (Some(n), OpParams::Attention(p)) = (graph.nodes.get(node), params) else {
        return 0;
    };
    let Some(forward) = attention_forward(n.op) else {
        return 0;
    };
    let q = if forward { 0 } else { 1 };
    let Some(dtype) = n
        .inputs
        .get(q)
        .copied()
        .flatten()
        .map(|id| graph.tensors[id].ty.dtype)
    else {
        return 0;
    };
    let cublas = through_cublas(p, dtype);
    match (forward, cublas) {
        // Planned for cuBLAS whichever forward runs: the choice is the device's, at
        // lowering, and the plan must hold either.
        (true, true) => scores_bytes(p),
        (true, false) => 0,
        (false, true) => delta_bytes(p) + 2 * scores_bytes(p),
        (false, false) => delta_bytes(p),
    }
}

impl Lowering<'_> {
    fn attention_args(&self, node: &Node, mask_input: usize) -> Result<AttentionArgs, String> {
        let OpParams::Attention(p) = self.params() else {
            return Err("attention without its parameters".into());
        };
        let AttentionParams {
            batch,
            heads,
            q_len,
            kv_len,
            head_dim,
            v_dim,
            causal,
            scale,
            mask_strides,
            dropout,
            lse_stride,
        } = p.clone();
        let mut args = AttentionArgs {
            batch: batch as i64,
            heads: heads as i64,
            lq: q_len as i64,
            lk: kv_len as i64,
            e: head_dim as i64,
            ev: v_dim as i64,
            causal: i64::from(causal),
            scale,
            dropout,
            lses: lse_stride as i64,
            ..AttentionArgs::default()
        };
        if let (Some(mask), Some(st)) = (self.input(node, mask_input), mask_strides) {
            (args.mask, args.mdt) = (mask.ptr, mask.dt());
            args.ms = st.map(|v| v as i64);
        }
        Ok(args)
    }

    /// An i64 scalar input: the generator state or the forward's seed.
    fn attention_seed_input(&self, node: &Node, k: usize) -> Result<Operand, String> {
        let t = self.need(node, k)?;
        if t.ty.dtype != DType::I64 || t.numel() != 1 {
            return Err(format!("input {k} must be an i64 scalar, got {}", t.ty));
        }
        Ok(t)
    }

    /// The efficient forward's draws and padding: the seed kernel writes the seed
    /// (`mix64(state ^ key)`, from the generator state in input 4 and the node's key) and
    /// the offset 0 into outputs 2 and 3, the attention kernels draw from the state and
    /// the key themselves; the log-sum-exp is zeroed first where its rows are padded, left
    /// alone where it has none.
    fn efficient_forward_draws(&mut self, node: &Node, args: &mut AttentionArgs) -> Lowered {
        let state = self.attention_seed_input(node, 4)?;
        let key = salus_exec::random::name_key(&node.name);
        let (seed, offset) = (self.output(node, 2), self.output(node, 3));
        if seed.is_some() || offset.is_some() {
            let seeds = AttentionSeedArgs {
                state: state.ptr,
                key,
                seed: address(seed.as_ref()).0,
                offset: address(offset.as_ref()).0,
            };
            self.launch(Kernel::AttentionSeed, 1, seeds);
        }
        if args.dropout > 0.0 {
            (args.seed, args.key, args.keyed) = (state.ptr, key, 1);
        }
        if args.lses == 0 {
            (args.lse, args.lsedt) = (0, 0);
        } else if args.lses > args.lq
            && let Some(lse) = self.output(node, 1)
        {
            self.zero(&lse);
        }
        Ok(())
    }

    /// `_scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask?)` and
    /// `_scaled_dot_product_efficient_attention(query, key, value, attn_bias?, generator)`.
    pub(super) fn attention(&mut self, node: &Node) -> Lowered {
        let mut args = self.attention_args(node, 3)?;
        let (q, k, v) = (
            self.need(node, 0)?,
            self.need(node, 1)?,
            self.need(node, 2)?,
        );
        (args.q, args.qdt, args.k, args.kdt, args.v, args.vdt) =
            (q.ptr, q.dt(), k.ptr, k.dt(), v.ptr, v.dt());
        (args.o, args.odt) = address(self.output(node, 0).as_ref());
        (args.lse, args.lsedt) = address(self.output(node, 1).as_ref());
        if node.op == Op::EfficientAttention {
            self.efficient_forward_draws(node, &mut args)?;
        }
        let heads = (args.batch * args.heads) as u64;
        let p = self.attention_params()?;
        let (scratch, len) = self.scratch();
        // (No keys: the fused kernels give every query NaN, as the CPU does.)
        let tiled = tiles_fit(&p) && (self.tiled_attention || !through_cublas(&p, q.ty.dtype));
        if !tiled
            && through_cublas(&p, q.ty.dtype)
            && len >= scores_bytes(&p)
            && args.o != 0
            && p.kv_len > 0
        {
            args.s = scratch;
            let (l, s, e, ev) = (p.q_len, p.kv_len, p.head_dim, p.v_dim);
            // S = scale * q k^T, softmax (times the dropout factors) in place, out = P v.
            let scores = Matrix::batched(args.s, s, l);
            self.gemm_row_major(
                F32,
                (l, e, s),
                Matrix::batched(q.ptr, e, l),
                Matrix::batched(k.ptr, e, s).t(),
                scores,
                p.scale,
                0.0,
                heads,
            );
            self.launch_blocks(Kernel::AttentionSoftmaxRows, row_blocks(heads * l, s), args);
            self.gemm_row_major(
                F32,
                (l, s, ev),
                scores,
                Matrix::batched(v.ptr, ev, s),
                Matrix::batched(args.o, ev, l),
                1.0,
                0.0,
                heads,
            );
            return Ok(());
        }
        if tiled {
            let blocks = heads * (args.lq as u64).div_ceil(TILED_QUERIES);
            self.launch_blocks(Kernel::AttentionForwardTiled, blocks, args);
            return Ok(());
        }
        Self::fused_attention_fits(&p)?;
        let blocks = heads * (args.lq as u64).div_ceil(FORWARD_QUERIES);
        self.launch_blocks(Kernel::AttentionForward, blocks, args);
        Ok(())
    }

    /// The fused kernels' tiles hold query, key and value rows of at most
    /// [`ATTENTION_MAX_DIM`] elements.
    fn fused_attention_fits(p: &AttentionParams) -> Lowered {
        if p.head_dim > ATTENTION_MAX_DIM || p.v_dim > ATTENTION_MAX_DIM {
            return Err(format!(
                "the CUDA device's fused attention takes query, key and value lengths up to \
                 {ATTENTION_MAX_DIM}, got {} and {} (f32 attention whose scores fit {} bytes \
                 runs through cuBLAS without this bound)",
                p.head_dim, p.v_dim, SCORES_MAX_BYTES
            ));
        }
        Ok(())
    }

    fn attention_params(&self) -> Result<AttentionParams, String> {
        match self.params() {
            OpParams::Attention(p) => Ok(p.clone()),
            _ => Err("attention without its parameters".into()),
        }
    }

    /// `_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value,
    /// out, logsumexp, attn_mask?)` and `_scaled_dot_product_efficient_attention_backward(
    /// grad_out, query, key, value, attn_bias?, out, logsumexp, philox_seed, philox_offset)`
    /// (its grad_bias, output 3, never asked for).
    pub(super) fn attention_backward(&mut self, node: &Node) -> Lowered {
        let efficient = node.op == Op::EfficientAttentionBackward;
        let (mask, inputs) = if efficient {
            (4, [0, 1, 2, 3, 5, 6])
        } else {
            (6, [0, 1, 2, 3, 4, 5])
        };
        let mut args = self.attention_args(node, mask)?;
        let ins: Vec<Operand> = inputs
            .iter()
            .map(|&k| self.need(node, k))
            .collect::<Result<_, _>>()?;
        let [go, q, k, v, o, lse] = &ins[..] else {
            unreachable!("six inputs");
        };
        if efficient && args.dropout > 0.0 {
            // The keep-flags again, from the forward's seed as it is.
            args.seed = self.attention_seed_input(node, 7)?.ptr;
        }
        (args.go, args.godt) = (go.ptr, go.dt());
        (args.q, args.qdt, args.k, args.kdt, args.v, args.vdt) =
            (q.ptr, q.dt(), k.ptr, k.dt(), v.ptr, v.dt());
        (args.o, args.odt, args.lse, args.lsedt) = (o.ptr, o.dt(), lse.ptr, lse.dt());
        let outs: Vec<Option<Operand>> = (0..3).map(|k| self.output(node, k)).collect();
        (args.dq, args.dqdt) = address(outs[0].as_ref());
        (args.dk, args.dkdt) = address(outs[1].as_ref());
        (args.dv, args.dvdt) = address(outs[2].as_ref());
        let heads = (args.batch * args.heads) as u64;
        let (lq, lk) = (args.lq as u64, args.lk as u64);
        if lq == 0 || lk == 0 {
            // No query sees a key: every gradient is zero.
            for o in outs.iter().flatten() {
                self.zero(o);
            }
            return Ok(());
        }
        let p = self.attention_params()?;
        let need = delta_bytes(&p);
        let (delta, len) = self.scratch();
        let tiled = tiles_fit(&p) && (self.tiled_attention || !through_cublas(&p, q.ty.dtype));
        if !tiled && through_cublas(&p, q.ty.dtype) && len >= need + 2 * scores_bytes(&p) {
            args.delta = delta;
            args.s = delta + need;
            args.dp = args.s + scores_bytes(&p);
            let (l, s, e, ev) = (p.q_len, p.kv_len, p.head_dim, p.v_dim);
            let (probs, dscores) = (
                Matrix::batched(args.s, s, l),
                Matrix::batched(args.dp, s, l),
            );
            let rows = heads * l;
            // D, then P again from the scores and the log-sum-exp.
            self.launch_blocks(Kernel::AttentionDeltaRows, row_blocks(rows, ev), args);
            self.gemm_row_major(
                F32,
                (l, e, s),
                Matrix::batched(q.ptr, e, l),
                Matrix::batched(k.ptr, e, s).t(),
                probs,
                p.scale,
                0.0,
                heads,
            );
            self.launch_blocks(Kernel::AttentionProbsRows, row_blocks(rows, s), args);
            // dP = grad_out v^T, then dS = P (factor dP - D) scale in place (and P times
            // its dropout factor in place).
            self.gemm_row_major(
                F32,
                (l, ev, s),
                Matrix::batched(go.ptr, ev, l),
                Matrix::batched(v.ptr, ev, s).t(),
                dscores,
                1.0,
                0.0,
                heads,
            );
            self.launch_blocks(Kernel::AttentionScoreGradRows, row_blocks(rows, s), args);
            if args.dv != 0 {
                // grad_value = P^T grad_out (P times the dropout factors).
                self.gemm_row_major(
                    F32,
                    (s, l, ev),
                    probs.t(),
                    Matrix::batched(go.ptr, ev, l),
                    Matrix::batched(args.dv, ev, s),
                    1.0,
                    0.0,
                    heads,
                );
            }
            if args.dq != 0 {
                // grad_query = dS k.
                self.gemm_row_major(
                    F32,
                    (l, s, e),
                    dscores,
                    Matrix::batched(k.ptr, e, s),
                    Matrix::batched(args.dq, e, l),
                    1.0,
                    0.0,
                    heads,
                );
            }
            if args.dk != 0 {
                // grad_key = dS^T q.
                self.gemm_row_major(
                    F32,
                    (s, l, e),
                    dscores.t(),
                    Matrix::batched(q.ptr, e, l),
                    Matrix::batched(args.dk, e, s),
                    1.0,
                    0.0,
                    heads,
                );
            }
            return Ok(());
        }
        if tiled {
            if len < need {
                return Err(format!(
                    "attention's backward needs {need} bytes of scratch and was planned with \
                     {len}: plan the program with this device's scratch sizes"
                ));
            }
            args.delta = delta;
            self.launch_blocks(
                Kernel::AttentionDeltaRows,
                row_blocks(heads * lq, p.v_dim),
                args,
            );
            if args.dq != 0 {
                let blocks = heads * lq.div_ceil(TILED_BACKWARD_ROWS);
                self.launch_blocks(Kernel::AttentionBackwardQueryTiled, blocks, args);
            }
            if args.dk != 0 || args.dv != 0 {
                let blocks = heads * lk.div_ceil(TILED_BACKWARD_ROWS);
                self.launch_blocks(Kernel::AttentionBackwardKeyValueTiled, blocks, args);
            }
            return Ok(());
        }
        Self::fused_attention_fits(&p)?;
        if len < need {
            return Err(format!(
                "fused attention's backward needs {need} bytes of scratch and was planned \
                 with {len}: plan the program with this device's scratch sizes"
            ));
        }
        args.delta = delta;
        // D is written by the query pass, which runs even when grad_query is unused.
        let blocks = heads * lq.div_ceil(BACKWARD_ROWS);
        self.launch_blocks(Kernel::AttentionBackwardQuery, blocks, args);
        if args.dk != 0 || args.dv != 0 {
            let blocks = heads * lk.div_ceil(BACKWARD_ROWS);
            self.launch_blocks(Kernel::AttentionBackwardKeyValue, blocks, args);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(batch: u64, heads: u64, q_len: u64, kv_len: u64) -> AttentionParams {
        AttentionParams {
            batch,
            heads,
            q_len,
            kv_len,
            head_dim: 64,
            v_dim: 64,
            causal: false,
            scale: 0.125,
            mask_strides: None,
            dropout: 0.0,
            lse_stride: q_len,
        }
    }

    #[test]
    fn f32_scores_within_the_cap_go_through_cublas() {
        let gpt = params(32, 12, 512, 512);
        assert_eq!(scores_bytes(&gpt), 32 * 12 * 512 * 512 * 4);
        assert!(through_cublas(&gpt, DType::F32));
        assert!(!through_cublas(&gpt, DType::Bf16), "16-bit runs fused");
        let long = params(8, 16, 8192, 8192);
        assert!(scores_bytes(&long) > SCORES_MAX_BYTES);
        assert!(
            !through_cublas(&long, DType::F32),
            "long sequences run fused"
        );
        // D keeps the score buffers after it aligned.
        assert_eq!(delta_bytes(&params(1, 1, 3, 5)), 256);
        assert_eq!(delta_bytes(&gpt) % 256, 0);
    }
}
