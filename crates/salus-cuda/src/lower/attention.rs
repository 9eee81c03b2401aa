//! Fused scaled-dot-product attention, forward and backward (`attention.cu`): the score
//! matrix is never formed; the backward keeps one f32 per query (`D = grad_out . out`) in
//! the node's scratch.

use salus_graph::{AttentionParams, Graph, Node, Op, OpParams};

use super::{Lowered, Lowering, Operand, address};
use crate::abi::{ATTENTION_MAX_DIM, AttentionArgs, BLOCK, Kernel};

/// Queries per block of the forward (`ATT_QROWS`: two per warp).
const FORWARD_QUERIES: u64 = BLOCK as u64 / 32 * 2;
/// Queries per block of the backward's query pass and keys per block of its key pass
/// (one per warp).
const BACKWARD_ROWS: u64 = BLOCK as u64 / 32;

/// Scratch bytes of a fused-attention node on this device: the backward's D, an f32 per
/// query (0 for other nodes).
pub(crate) fn attention_scratch_bytes(graph: &Graph, node: usize, params: &OpParams) -> u64 {
    match (graph.nodes.get(node).map(|n| n.op), params) {
        (Some(Op::ScaledDotProductAttentionBackward), OpParams::Attention(p)) => {
            p.batch * p.heads * p.q_len * 4
        }
        _ => 0,
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
        } = p.clone();
        if head_dim > ATTENTION_MAX_DIM || v_dim > ATTENTION_MAX_DIM {
            return Err(format!(
                "the CUDA device's fused attention takes query, key and value lengths up to \
                 {ATTENTION_MAX_DIM}, got {head_dim} and {v_dim}"
            ));
        }
        let mut args = AttentionArgs {
            batch: batch as i64,
            heads: heads as i64,
            lq: q_len as i64,
            lk: kv_len as i64,
            e: head_dim as i64,
            ev: v_dim as i64,
            causal: i64::from(causal),
            scale,
            ..AttentionArgs::default()
        };
        if let (Some(mask), Some(st)) = (self.input(node, mask_input), mask_strides) {
            (args.mask, args.mdt) = (mask.ptr, mask.dt());
            args.ms = st.map(|v| v as i64);
        }
        Ok(args)
    }

    /// `_scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask?)`.
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
        let heads = (args.batch * args.heads) as u64;
        let blocks = heads * (args.lq as u64).div_ceil(FORWARD_QUERIES);
        self.launch_blocks(Kernel::AttentionForward, blocks, args);
        Ok(())
    }

    /// `_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value,
    /// out, logsumexp, attn_mask?)`.
    pub(super) fn attention_backward(&mut self, node: &Node) -> Lowered {
        let mut args = self.attention_args(node, 6)?;
        let ins: Vec<Operand> = (0..6)
            .map(|k| self.need(node, k))
            .collect::<Result<_, _>>()?;
        let [go, q, k, v, o, lse] = &ins[..] else {
            unreachable!("six inputs");
        };
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
        let need = heads * lq * 4;
        let (delta, len) = self
            .program
            .plan()
            .scratch(self.index)
            .map_or((0, 0), |(off, len)| (self.lane + off, len));
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
