//! Training-mode batch norm, forward and backward (`batch_norm.cu`): per-channel partial
//! sums over runs of whole images in the node's scratch, a thread per channel to combine
//! them, then one pass over the elements.

use salus_graph::{Graph, Node, Op, OpParams};

use super::reduce::{SPLIT_MIN_WORK, SPLIT_TARGET_BLOCKS};
use super::{Lowered, Lowering, address};
use crate::abi::{BatchNormArgs, DeviceDType, Kernel};

/// How the per-channel sums are cut: `splits` runs of `chunk` images per channel (the
/// last shorter), so that about [`SPLIT_TARGET_BLOCKS`] blocks share the work and each
/// reads at least [`SPLIT_MIN_WORK`] elements. Depends on the shape alone, so the order of
/// the sums does too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchNormPlan {
    pub splits: u64,
    pub chunk: u64,
}

impl BatchNormPlan {
    pub(crate) fn new(batch: u64, channels: u64, inner: u64) -> BatchNormPlan {
        let wanted = SPLIT_TARGET_BLOCKS.div_ceil(channels.max(1));
        let most = (batch * inner / SPLIT_MIN_WORK).max(1);
        let splits = wanted.min(most).min(batch).max(1);
        let chunk = batch.div_ceil(splits).max(1);
        BatchNormPlan {
            splits: batch.div_ceil(chunk).max(1),
            chunk,
        }
    }

    /// Scratch bytes: two f64 partials per (channel, run), four f64 coefficients per
    /// channel.
    pub(crate) fn scratch_bytes(&self, channels: u64) -> u64 {
        channels * (self.splits * 2 + 4) * 8
    }
}

/// 1 when the element walks may move four f32 at a time: rows of a multiple of 4
/// elements, and every tensor they touch (address, dtype code; address 0: absent) f32 and
/// 16-byte aligned; else 0.
fn vec4(inner: i64, walked: &[(u64, i64)]) -> i64 {
    let f32 = DeviceDType::F32.code();
    let ok = inner % 4 == 0
        && walked
            .iter()
            .all(|&(ptr, dt)| ptr == 0 || (ptr % 16 == 0 && dt == f32));
    i64::from(ok)
}

/// Scratch bytes of a batch-norm node on this device (0 for other nodes).
pub(crate) fn batch_norm_scratch_bytes(graph: &Graph, node: usize, params: &OpParams) -> u64 {
    match (graph.nodes.get(node).map(|n| n.op), params) {
        (
            Some(Op::NativeBatchNorm | Op::NativeBatchNormBackward),
            &OpParams::BatchNorm {
                batch,
                channels,
                inner,
                ..
            },
        ) => BatchNormPlan::new(batch, channels, inner).scratch_bytes(channels),
        _ => 0,
    }
}

impl Lowering<'_> {
    /// The node's geometry, plan and scratch address, checked against its scratch.
    fn batch_norm_setup(&self) -> Result<(BatchNormArgs, u64), String> {
        let &OpParams::BatchNorm {
            batch,
            channels,
            inner,
            momentum,
            eps,
        } = self.params()
        else {
            return Err("batch norm without its parameters".into());
        };
        let plan = BatchNormPlan::new(batch, channels, inner);
        let need = plan.scratch_bytes(channels);
        let (part, len) = self.scratch();
        if len < need {
            return Err(format!(
                "batch norm needs {need} bytes of scratch and was planned with {len}: \
                 plan the program with this device's scratch sizes"
            ));
        }
        let args = BatchNormArgs {
            batch: batch as i64,
            channels: channels as i64,
            inner: inner as i64,
            splits: plan.splits as i64,
            chunk: plan.chunk as i64,
            momentum,
            eps,
            part,
            ..BatchNormArgs::default()
        };
        Ok((args, plan.splits * channels))
    }

    /// Launches one direction's three kernels (`[part, finish, apply]`): the partial sums
    /// on `part_blocks` blocks, a thread per channel, then (when the element output is
    /// used) the element pass, `BLOCK / inner` rows of (image, channel) a block when rows
    /// are short, else a block per row. The element walks (input, gradient, output) move
    /// four f32 at a time where [`vec4`] allows.
    fn launch_batch_norm(
        &mut self,
        mut args: BatchNormArgs,
        part_blocks: u64,
        kernels: [Kernel; 3],
    ) {
        let [part, finish, apply] = kernels;
        let walked = [(args.x, args.xdt), (args.g, args.gdt), (args.y, args.ydt)];
        args.vec4 = vec4(args.inner, &walked);
        self.launch_blocks(part, part_blocks, args);
        self.launch(finish, args.channels as u64, args);
        if args.y != 0 {
            let rows = (args.batch * args.channels) as u64;
            let per = (u64::from(crate::abi::BLOCK) / args.inner.max(1) as u64).max(1);
            self.launch_blocks(apply, rows.div_ceil(per), args);
        }
    }

    /// `_native_batch_norm_legit_functional(input, weight?, bias?, running_mean,
    /// running_var)` in training.
    pub(super) fn batch_norm(&mut self, node: &Node) -> Lowered {
        let (mut args, part_blocks) = self.batch_norm_setup()?;
        let x = self.need(node, 0)?;
        if x.numel() != (args.batch * args.channels * args.inner) as u64 {
            return Err(format!("input {} does not fit the node's geometry", x.ty));
        }
        (args.x, args.xdt) = (x.ptr, x.dt());
        (args.w, args.wdt) = address(self.input(node, 1).as_ref());
        (args.b, args.bdt) = address(self.input(node, 2).as_ref());
        (args.rm, args.rmdt) = address(Some(&self.need(node, 3)?));
        (args.rv, args.rvdt) = address(Some(&self.need(node, 4)?));
        (args.y, args.ydt) = address(self.output(node, 0).as_ref());
        (args.mean, args.mdt) = address(self.output(node, 1).as_ref());
        (args.rstd, args.rdt) = address(self.output(node, 2).as_ref());
        (args.rmo, args.rmodt) = address(self.output(node, 3).as_ref());
        (args.rvo, args.rvodt) = address(self.output(node, 4).as_ref());
        if x.numel() == 0 {
            return Ok(());
        }
        use Kernel::{BatchNormForwardApply, BatchNormForwardFinish, BatchNormForwardPart};
        let kernels = [
            BatchNormForwardPart,
            BatchNormForwardFinish,
            BatchNormForwardApply,
        ];
        self.launch_batch_norm(args, part_blocks, kernels);
        Ok(())
    }

    /// `native_batch_norm_backward(grad_out, input, weight?, running_mean?, running_var?,
    /// save_mean, save_invstd)` in training.
    pub(super) fn batch_norm_backward(&mut self, node: &Node) -> Lowered {
        let (mut args, part_blocks) = self.batch_norm_setup()?;
        let (g, x) = (self.need(node, 0)?, self.need(node, 1)?);
        let total = (args.batch * args.channels * args.inner) as u64;
        if x.numel() != total || g.numel() != total {
            return Err(format!(
                "grad_out {} and input {} do not fit the node's geometry",
                g.ty, x.ty
            ));
        }
        (args.g, args.gdt) = (g.ptr, g.dt());
        (args.x, args.xdt) = (x.ptr, x.dt());
        (args.w, args.wdt) = address(self.input(node, 2).as_ref());
        (args.mean, args.mdt) = address(Some(&self.need(node, 5)?));
        (args.rstd, args.rdt) = address(Some(&self.need(node, 6)?));
        (args.y, args.ydt) = address(self.output(node, 0).as_ref());
        (args.gw, args.gwdt) = address(self.output(node, 1).as_ref());
        (args.gb, args.gbdt) = address(self.output(node, 2).as_ref());
        if total == 0 {
            return Ok(());
        }
        use Kernel::{BatchNormBackwardApply, BatchNormBackwardFinish, BatchNormBackwardPart};
        let kernels = [
            BatchNormBackwardPart,
            BatchNormBackwardFinish,
            BatchNormBackwardApply,
        ];
        self.launch_batch_norm(args, part_blocks, kernels);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_images_fill_the_gpu_and_cover_every_image() {
        for (batch, channels, inner) in [
            (32u64, 64u64, 112 * 112),
            (32, 2048, 49),
            (2, 3, 5),
            (1, 1, 1),
            (128, 8, 1),
            (7, 16, 4096),
        ] {
            let p = BatchNormPlan::new(batch, channels, inner);
            assert!(p.splits >= 1 && p.chunk >= 1, "{p:?}");
            assert!(
                p.splits * p.chunk >= batch,
                "{p:?} misses images of {batch}"
            );
            assert!((p.splits - 1) * p.chunk < batch, "{p:?} has an empty run");
            if channels < SPLIT_TARGET_BLOCKS && batch * inner >= 2 * SPLIT_MIN_WORK && batch > 1 {
                assert!(
                    p.splits > 1,
                    "{p:?} leaves the GPU idle for {batch}x{channels}x{inner}"
                );
            }
            assert_eq!(p.scratch_bytes(channels), channels * (p.splits * 2 + 4) * 8);
        }
        // Few, large channels: one run per channel.
        assert_eq!(BatchNormPlan::new(32, 2048, 49).splits, 1);
    }

    #[test]
    fn four_at_a_time_only_over_aligned_f32_rows_of_fours() {
        let (f32, f16) = (DeviceDType::F32.code(), DeviceDType::F16.code());
        assert_eq!(vec4(8, &[(256, f32), (0, 0), (512, f32)]), 1);
        assert_eq!(vec4(6, &[(256, f32)]), 0);
        assert_eq!(vec4(8, &[(256, f32), (520, f32)]), 0);
        assert_eq!(vec4(8, &[(256, f16)]), 0);
    }
}
