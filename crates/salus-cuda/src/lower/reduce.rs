//! Reductions over any set of dims, softmax and cumulative sums along one dim, and layer
//! and group norm.

use salus_graph::{Graph, Node, Op, OpParams};

use super::elementwise::{StridedView, coalesce};
use super::{
    Command, Launch, Lowered, Lowering, MAX_GRID, Operand, address, contiguous, numel, padded,
    signed,
};
use crate::abi::ElementwiseOp;
use crate::abi::{
    BLOCK, Kernel, LayerNormArgs, LayerNormBackwardArgs, MAX_RANK, ROW_WARP_MAX, ReduceArgs,
    ReduceOp, SoftmaxArgs,
};

/// How a row kernel (`rows.cu`) covers `rows` rows of `len` elements: a warp per row
/// (`BLOCK / 32` rows a block) when a row has at most [`ROW_WARP_MAX`] elements, else a
/// block per row. Returns the blocks to launch.
pub(super) fn row_blocks(rows: u64, len: u64) -> u64 {
    if len <= ROW_WARP_MAX {
        rows.div_ceil(u64::from(BLOCK / 32))
    } else {
        rows
    }
}

/// A reduction's input (contiguous, of `shape`) over `dims`, its kept and reduced dims
/// each coalesced: what the lowering and the device's scratch sizer both classify.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ReduceLayout {
    pub kshape: Vec<u64>,
    pub kst: Vec<i64>,
    pub rshape: Vec<u64>,
    pub rst: Vec<i64>,
    /// Elements per output.
    pub count: u64,
    /// Outputs.
    pub nout: u64,
}

impl ReduceLayout {
    pub(crate) fn new(shape: &[u64], dims: &[usize]) -> ReduceLayout {
        let own = contiguous(shape);
        let empty = || StridedView {
            ptr: 0,
            dt: 0,
            st: Vec::new(),
        };
        let (mut kept, mut reduced) = ([empty()], [empty()]);
        let (mut kshape, mut rshape) = (Vec::new(), Vec::new());
        for (d, (&size, &st)) in shape.iter().zip(&own).enumerate() {
            if dims.contains(&d) {
                rshape.push(size);
                reduced[0].st.push(st);
            } else {
                kshape.push(size);
                kept[0].st.push(st);
            }
        }
        let count = numel(&rshape);
        let nout = numel(&kshape);
        let kshape = coalesce(&kshape, &mut kept);
        let rshape = coalesce(&rshape, &mut reduced);
        let [kept] = kept;
        let [reduced] = reduced;
        ReduceLayout {
            kshape,
            kst: kept.st,
            rshape,
            rst: reduced.st,
            count,
            nout,
        }
    }

    /// The layout's pattern.
    pub(crate) fn pattern(&self) -> Pattern {
        let inner_contiguous = self.rst.last() == Some(&1);
        if self.count == 0 || self.nout == 0 || self.rshape.is_empty() {
            Pattern::Other
        } else if self.rshape.len() == 1 && inner_contiguous {
            if self.kshape.is_empty() {
                Pattern::Full
            } else {
                Pattern::Rows
            }
        } else if self.rshape.len() == 1 && self.kst == [1] {
            Pattern::Columns
        } else if inner_contiguous && !self.kshape.is_empty() {
            Pattern::Planes
        } else {
            Pattern::Other
        }
    }
}

/// How a reduction's elements lie, its dims coalesced (K kept, R reduced, outermost first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    /// K R: each output's elements one contiguous run.
    Rows,
    /// R K: outputs contiguous, each output's elements one stride apart (column sums).
    Columns,
    /// R K R (and other mixes) whose innermost reduced dim is contiguous: NCHW over
    /// (0, 2, 3).
    Planes,
    /// R: everything to one output, contiguous.
    Full,
    /// Anything else (and empty reductions): the general kernels.
    Other,
}

/// Blocks a split reduction aims for: several per SM of a 132-SM GPU. A constant (not
/// the device's SM count), so that the plan, and the order of the sums, depend only on
/// the shapes.
pub(crate) const SPLIT_TARGET_BLOCKS: u64 = 4 * 132;

/// Elements a block of a split reduction reads at least.
pub(crate) const SPLIT_MIN_WORK: u64 = 8192;

/// How a reduction is launched: `kernel` on `blocks` blocks (or a thread per output for
/// [`Kernel::ReduceByThread`]); with `splits` > 1 each output's reduced range is cut into
/// `splits` chunks of `chunk` elements (the last shorter), each block writes its chunk's
/// partial result into scratch, and [`Kernel::ReduceParts`] then combines each output's
/// partials in a fixed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReducePlan {
    pub kernel: Kernel,
    pub blocks: u64,
    pub splits: u64,
    pub chunk: u64,
}

impl ReducePlan {
    /// Scratch bytes for the partials (f64 each; a mean and a sum of squared deviations
    /// each for the variance): 0 unless split.
    pub(crate) fn scratch_bytes(&self, nout: u64, op: ReduceOp) -> u64 {
        if self.splits <= 1 {
            return 0;
        }
        let per = if op == ReduceOp::Var { 16 } else { 8 };
        nout * self.splits * per
    }

    /// Blocks of [`Kernel::ReduceParts`]: a warp per output.
    pub(crate) fn finish_blocks(nout: u64) -> u64 {
        nout.div_ceil(u64::from(BLOCK / 32))
    }
}

/// Into how many chunks to cut `count` reduced elements when `groups` blocks would
/// otherwise cover the outputs and each chunk element stands for `width` elements read;
/// returns (splits, chunk) with no empty chunk.
pub(crate) fn split(groups: u64, count: u64, width: u64) -> (u64, u64) {
    if groups == 0 || count == 0 || groups >= SPLIT_TARGET_BLOCKS {
        return (1, count);
    }
    let wanted = SPLIT_TARGET_BLOCKS.div_ceil(groups);
    let most = (count * width / SPLIT_MIN_WORK).max(1);
    let splits = wanted.min(most).min(count);
    let chunk = count.div_ceil(splits);
    (count.div_ceil(chunk), chunk)
}

/// The launch of a reduction of `layout`; `split_ok`: whether the node has scratch for
/// partials (else no split).
pub(crate) fn reduce_plan(layout: &ReduceLayout, split_ok: bool) -> ReducePlan {
    let (nout, count) = (layout.nout, layout.count);
    let single = |kernel, blocks| ReducePlan {
        kernel,
        blocks,
        splits: 1,
        chunk: count,
    };
    let general = || {
        if count <= THREAD_REDUCTION {
            single(Kernel::ReduceByThread, nout)
        } else {
            single(Kernel::ReduceByBlock, nout)
        }
    };
    match layout.pattern() {
        Pattern::Rows | Pattern::Full => {
            let (splits, chunk) = split(nout, count, 1);
            if split_ok && splits > 1 && count > ROW_WARP_MAX {
                ReducePlan {
                    kernel: Kernel::ReducePartRows,
                    blocks: nout * splits,
                    splits,
                    chunk,
                }
            } else {
                single(Kernel::ReduceRows, row_blocks(nout, count))
            }
        }
        Pattern::Columns => {
            let groups = nout.div_ceil(32);
            let (splits, chunk) = split(groups, count, 32);
            if split_ok && splits > 1 {
                ReducePlan {
                    kernel: Kernel::ReducePartColumns,
                    blocks: groups * splits,
                    splits,
                    chunk,
                }
            } else {
                single(Kernel::ReduceColumns, groups)
            }
        }
        Pattern::Planes if count > THREAD_REDUCTION => {
            let (splits, chunk) = if split_ok {
                split(nout, count, 1)
            } else {
                (1, count)
            };
            ReducePlan {
                kernel: Kernel::ReducePartRows,
                blocks: nout * splits,
                splits,
                chunk,
            }
        }
        Pattern::Planes | Pattern::Other => general(),
    }
}

/// Reductions of at most this many elements per output take a thread each; longer ones a
/// block each.
const THREAD_REDUCTION: u64 = 32;

/// The reduction a node computes: (op, dims) for the ops that lower to [`Lowering::reduce`]
/// as the node itself (not the bias gradient of a convolution's backward).
pub(crate) fn node_reduction(op: Op, params: &OpParams) -> Option<(ReduceOp, &[usize])> {
    match (op, params) {
        (Op::SumDimIntList, OpParams::Reduce(r)) => Some((ReduceOp::Sum, &r.dims)),
        (Op::Amax, OpParams::Reduce(r)) => Some((ReduceOp::Amax, &r.dims)),
        (Op::AnyDim, OpParams::Reduce(r)) => Some((ReduceOp::Any, &r.dims)),
        (Op::MeanDim | Op::Mean, OpParams::Reduce(r)) => Some((ReduceOp::Mean, &r.dims)),
        (Op::VarCorrection, OpParams::Var { reduction, .. }) => {
            Some((ReduceOp::Var, &reduction.dims))
        }
        _ => None,
    }
}

/// Scratch bytes the reduction node `node` of `graph` splits its work in (0 for other
/// nodes, and for reductions that do not split): the CUDA device's scratch sizer.
pub(crate) fn reduce_scratch_bytes(graph: &Graph, node: usize, params: &OpParams) -> u64 {
    let Some(n) = graph.nodes.get(node) else {
        return 0;
    };
    let Some((op, dims)) = node_reduction(n.op, params) else {
        return 0;
    };
    let Some(id) = n.inputs.first().copied().flatten() else {
        return 0;
    };
    let layout = ReduceLayout::new(&graph.tensors[id].ty.shape, dims);
    if layout.kshape.len() > MAX_RANK || layout.rshape.len() > MAX_RANK {
        return 0;
    }
    reduce_plan(&layout, true).scratch_bytes(layout.nout, op)
}

/// Row chunks of layer norm's weight and bias gradients: (chunks, rows per chunk), enough
/// blocks of 32 columns by a chunk to fill a large GPU (about 1024), chunks of at least
/// 32 rows. A function of the shape only, so the plan and the lowering agree.
fn layer_norm_chunks(rows: u64, inner: u64) -> (u64, u64) {
    let columns = inner.div_ceil(32).max(1);
    let chunks = 1024u64
        .div_ceil(columns)
        .min(rows.div_ceil(32))
        .clamp(1, MAX_GRID);
    (chunks, rows.div_ceil(chunks).max(1))
}

/// The scratch of a `native_layer_norm_backward` node that computes the weight or bias
/// gradient: its chunks' partial sums ([`layer_norm_chunks`]), a double per column for
/// each; 0 for any other node.
pub(crate) fn layer_norm_backward_scratch_bytes(
    graph: &Graph,
    node: usize,
    params: &OpParams,
) -> u64 {
    let Some(n) = graph.nodes.get(node) else {
        return 0;
    };
    let (
        Op::NativeLayerNormBackward,
        OpParams::LayerNorm {
            normalized_shape, ..
        },
    ) = (n.op, params)
    else {
        return 0;
    };
    let wanted = (1..3).any(|k| n.outputs.get(k).copied().flatten().is_some());
    let Some(Some(x)) = n.inputs.get(1) else {
        return 0;
    };
    let inner = numel(normalized_shape);
    let total = graph.tensors[*x].ty.numel().unwrap_or(0);
    let rows = total.checked_div(inner).unwrap_or(0);
    if !wanted || rows == 0 {
        return 0;
    }
    let (chunks, _) = layer_norm_chunks(rows, inner);
    2 * chunks * inner * 8
}

impl Lowering<'_> {
    /// The node's scratch for a split reduction: (address, bytes), (0, 0) unless the node
    /// itself is a reduction (a convolution's backward sums its bias gradient in its
    /// cuDNN workspace's stead: no split).
    fn reduction_scratch(&self) -> (u64, u64) {
        let node = &self.program.graph().nodes[self.index];
        if node_reduction(node.op, self.params()).is_none() {
            return (0, 0);
        }
        self.scratch()
    }

    /// Reduces `x` over `dims` into `out` (kept dims in order).
    pub(super) fn reduce(
        &mut self,
        op: ReduceOp,
        x: &Operand,
        dims: &[usize],
        out: &Operand,
        correction: f64,
    ) -> Lowered {
        let layout = ReduceLayout::new(x.shape(), dims);
        if layout.kshape.len() > MAX_RANK || layout.rshape.len() > MAX_RANK {
            return Err(format!(
                "the CUDA device reduces tensors of at most {MAX_RANK} dims"
            ));
        }
        let (scratch, scratch_len) = self.reduction_scratch();
        let wanted = reduce_plan(&layout, true);
        let need = wanted.scratch_bytes(layout.nout, op);
        // Planned without the device's scratch (or too little): no split.
        let plan = if need == 0 || (scratch != 0 && need <= scratch_len) {
            wanted
        } else {
            reduce_plan(&layout, false)
        };
        let (nout, count) = (layout.nout, layout.count);
        let args = ReduceArgs {
            nout: nout as i64,
            count: count as i64,
            op: op.code(),
            krank: layout.kshape.len() as i64,
            rrank: layout.rshape.len() as i64,
            correction,
            kshape: padded(&signed(&layout.kshape)),
            kst: padded(&layout.kst),
            rshape: padded(&signed(&layout.rshape)),
            rst: padded(&layout.rst),
            input: x.ptr,
            in_dt: x.dt(),
            out: out.ptr,
            out_dt: out.dt(),
            splits: plan.splits as i64,
            chunk: plan.chunk as i64,
            part: if plan.splits > 1 { scratch } else { 0 },
        };
        match plan.kernel {
            Kernel::ReduceByThread => self.launch(Kernel::ReduceByThread, nout, args),
            kernel => self.launch_blocks(kernel, plan.blocks, args),
        }
        if plan.splits > 1 {
            let blocks = ReducePlan::finish_blocks(nout);
            self.launch_blocks(Kernel::ReduceParts, blocks, args);
        }
        Ok(())
    }

    /// Softmax along `dim`: forward (`g` None: `o = softmax(a)`) or backward (`a` is the
    /// forward's output y, `g` the gradient, the result into `o`).
    pub(super) fn softmax(
        &mut self,
        dim: usize,
        a: &Operand,
        g: Option<&Operand>,
        o: &Operand,
        log: bool,
    ) -> Lowered {
        let len = a.shape().get(dim).copied().unwrap_or(1);
        let inner = numel(a.shape().get(dim + 1..).unwrap_or(&[]));
        let rows = a.numel() / (len * inner).max(1);
        if len == 0 || inner == 0 {
            return Ok(());
        }
        let mut args = SoftmaxArgs {
            rows: (rows * inner) as i64,
            len: len as i64,
            inner: inner as i64,
            log: i64::from(log),
            ..SoftmaxArgs::default()
        };
        // Along the last dim (inner 1) the rows are contiguous: the row kernels.
        let last = inner == 1;
        let kernel = match g {
            None => {
                (args.x, args.xdt) = (a.ptr, a.dt());
                (args.y, args.ydt) = (o.ptr, o.dt());
                if last {
                    Kernel::SoftmaxForwardRows
                } else {
                    Kernel::SoftmaxForward
                }
            }
            Some(g) => {
                (args.x, args.xdt) = (o.ptr, o.dt());
                (args.y, args.ydt) = (a.ptr, a.dt());
                (args.g, args.gdt) = (g.ptr, g.dt());
                if last {
                    Kernel::SoftmaxBackwardRows
                } else {
                    Kernel::SoftmaxBackward
                }
            }
        };
        let blocks = if last {
            row_blocks(rows, len)
        } else {
            rows * inner
        };
        self.launch_blocks(kernel, blocks, args);
        Ok(())
    }

    /// The elements of one normalised row, and eps.
    fn normalized(&self) -> Result<(u64, f64), String> {
        match self.params() {
            OpParams::LayerNorm {
                normalized_shape,
                eps,
                ..
            } => Ok((numel(normalized_shape), *eps)),
            other => Err(format!("layer norm without its parameters: {other:?}")),
        }
    }

    pub(super) fn layer_norm(&mut self, node: &Node) -> Lowered {
        let a = self.need(node, 0)?;
        let (inner, eps) = self.normalized()?;
        let rows = a.numel() / inner.max(1);
        let (w, b) = (self.input(node, 1), self.input(node, 2));
        let (y, mean, rstd) = (
            self.output(node, 0),
            self.output(node, 1),
            self.output(node, 2),
        );
        let mut args = LayerNormArgs {
            rows: rows as i64,
            inner: inner as i64,
            eps,
            x: a.ptr,
            xdt: a.dt(),
            ..LayerNormArgs::default()
        };
        (args.w, args.wdt) = address(w.as_ref());
        (args.b, args.bdt) = address(b.as_ref());
        (args.y, args.ydt) = address(y.as_ref());
        (args.mean, args.mdt) = address(mean.as_ref());
        (args.rstd, args.rdt) = address(rstd.as_ref());
        self.launch_blocks(Kernel::LayerNormForwardRows, row_blocks(rows, inner), args);
        Ok(())
    }

    /// `cumsum` (`cumprod` with `product`) along `dim`: a thread per line, in order.
    pub(super) fn cumulative(
        &mut self,
        dim: usize,
        product: bool,
        a: &Operand,
        o: &Operand,
    ) -> Lowered {
        if a.shape() != o.shape() {
            return Err(format!(
                "output {} must have the shape of input {}",
                o.ty, a.ty
            ));
        }
        let len = a.shape().get(dim).copied().unwrap_or(1);
        let inner = numel(a.shape().get(dim + 1..).unwrap_or(&[]));
        let lines = a.numel() / len.max(1);
        let args = SoftmaxArgs {
            rows: lines as i64,
            len: len as i64,
            inner: inner as i64,
            product: i64::from(product),
            x: a.ptr,
            xdt: a.dt(),
            y: o.ptr,
            ydt: o.dt(),
            ..SoftmaxArgs::default()
        };
        if a.numel() > 0 {
            self.launch(Kernel::Cumsum, lines, args);
        }
        Ok(())
    }

    /// `native_group_norm`: each (image, group)'s elements are one contiguous row, so
    /// layer norm's row kernel gives the normalised values and the statistics; the
    /// per-channel weight and bias follow as broadcast elementwise ops.
    pub(super) fn group_norm(&mut self, node: &Node) -> Lowered {
        let &OpParams::GroupNorm {
            batch,
            channels,
            inner,
            groups,
            eps,
        } = self.params()
        else {
            return Err("native_group_norm without its parameters".into());
        };
        let a = self.need(node, 0)?;
        let (rows, count) = (batch * groups, channels / groups.max(1) * inner);
        if a.numel() != rows * count {
            return Err(format!(
                "input {} must hold {batch} x {channels} x {inner} elements",
                a.ty
            ));
        }
        let (w, b) = (self.input(node, 1), self.input(node, 2));
        let (y, mean, rstd) = (
            self.output(node, 0),
            self.output(node, 1),
            self.output(node, 2),
        );
        let mut args = LayerNormArgs {
            rows: rows as i64,
            inner: count as i64,
            eps,
            x: a.ptr,
            xdt: a.dt(),
            ..LayerNormArgs::default()
        };
        (args.y, args.ydt) = address(y.as_ref());
        (args.mean, args.mdt) = address(mean.as_ref());
        (args.rstd, args.rdt) = address(rstd.as_ref());
        self.launch_blocks(Kernel::LayerNormForwardRows, row_blocks(rows, count), args);
        if let Some(y) = &y {
            // Weight and bias as [1, C, 1, ...], broadcast over images and positions.
            let mut per_channel = vec![1u64; y.ty.rank()];
            per_channel[1] = channels;
            if let Some(w) = &w {
                let w = w.viewed_as(w.ty.dtype, per_channel.clone());
                self.ew(ElementwiseOp::Mul, y, &[y, &w], [0.0; 3])?;
            }
            if let Some(b) = &b {
                let b = b.viewed_as(b.ty.dtype, per_channel);
                self.ew(ElementwiseOp::Add, y, &[y, &b], [1.0, 0.0, 0.0])?;
            }
        }
        Ok(())
    }

    pub(super) fn layer_norm_backward(&mut self, node: &Node) -> Lowered {
        let (g, a, mean, rstd) = (
            self.need(node, 0)?,
            self.need(node, 1)?,
            self.need(node, 2)?,
            self.need(node, 3)?,
        );
        let (inner, _) = self.normalized()?;
        let total = a.numel();
        let rows = total.checked_div(inner).unwrap_or(0);
        if g.numel() != total || mean.numel() != rows || rstd.numel() != rows {
            return Err(format!(
                "grad_out {}, mean {} and rstd {} do not fit input {} normalized over {inner} elements",
                g.ty, mean.ty, rstd.ty, a.ty
            ));
        }
        let w = match self.input(node, 4) {
            Some(w) if w.numel() == inner => Some(w),
            Some(w) => return Err(format!("weight {} must have {inner} elements", w.ty)),
            None => None,
        };
        let mut outs: Vec<Option<Operand>> = (0..3).map(|k| self.output(node, k)).collect();
        // With an epilogue (`epilogues`) the input gradient goes into its add's output, with
        // the add's other operand added in.
        let epilogue = self.epilogues.of(self.index);
        if let Some(e) = epilogue {
            outs[0] = Some(self.operand(e.out));
        }
        for (k, o) in outs.iter().enumerate() {
            if let Some(o) = o {
                let want = if k == 0 { total } else { inner };
                if o.numel() != want {
                    return Err(format!("output {k} {} must have {want} elements", o.ty));
                }
            }
        }
        let mut args = LayerNormBackwardArgs {
            rows: rows as i64,
            inner: inner as i64,
            g: g.ptr,
            gdt: g.dt(),
            x: a.ptr,
            xdt: a.dt(),
            mean: mean.ptr,
            mdt: mean.dt(),
            rstd: rstd.ptr,
            rdt: rstd.dt(),
            ..LayerNormBackwardArgs::default()
        };
        (args.w, args.wdt) = address(w.as_ref());
        (args.gi, args.gidt) = address(outs[0].as_ref());
        (args.gw, args.gwdt) = address(outs[1].as_ref());
        (args.gb, args.gbdt) = address(outs[2].as_ref());
        if let Some(e) = epilogue {
            (args.res, args.resdt) = address(Some(&self.operand(e.residual)));
        }
        if args.gi != 0 {
            let blocks = row_blocks(rows, inner);
            self.launch_blocks(Kernel::LayerNormBackwardInputRows, blocks, args);
        }
        if args.gw != 0 || args.gb != 0 {
            if rows == 0 {
                for o in outs.iter().skip(1).flatten() {
                    self.zero(o);
                }
            } else {
                let (chunks, per) = layer_norm_chunks(rows, inner);
                let (part, bytes) = self.scratch();
                if bytes < 2 * chunks * inner * 8 {
                    return Err(format!(
                        "the weight and bias gradients need {} bytes of scratch, the plan gives {bytes}",
                        2 * chunks * inner * 8
                    ));
                }
                (args.part, args.chunks, args.per) = (part, chunks as i64, per as i64);
                let columns = inner.div_ceil(32).clamp(1, MAX_GRID) as u32;
                let grid = (columns, chunks.clamp(1, MAX_GRID) as u32);
                let launch = Launch::new(Kernel::LayerNormBackwardParamsPart, grid, args);
                self.commands.push(Command::Launch(launch));
                self.launch(Kernel::LayerNormBackwardParamsFinish, inner, args);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use salus_exec::Program;
    use salus_graph::{
        Attr, DType, Limits, PortableScratch, Role, ScratchSizer, Tensor, TensorType,
    };

    use super::*;
    use crate::lower::{Command, fusion};

    fn layout(shape: &[u64], dims: &[usize]) -> ReduceLayout {
        ReduceLayout::new(shape, dims)
    }

    #[test]
    fn reductions_classify_by_their_coalesced_layout() {
        // [B*S, D] over rows: columns; over D: rows; everything: full.
        assert_eq!(layout(&[32, 128, 512], &[0, 1]).pattern(), Pattern::Columns);
        assert_eq!(layout(&[4096, 512], &[1]).pattern(), Pattern::Rows);
        assert_eq!(layout(&[32, 128, 512], &[0, 1, 2]).pattern(), Pattern::Full);
        // NCHW over (0, 2, 3): planes, H and W coalesced.
        let nchw = layout(&[32, 64, 56, 56], &[0, 2, 3]);
        assert_eq!(nchw.pattern(), Pattern::Planes);
        assert_eq!(
            (nchw.kshape.clone(), nchw.kst.clone()),
            (vec![64], vec![3136])
        );
        assert_eq!(
            (nchw.rshape.clone(), nchw.rst.clone()),
            (vec![32, 3136], vec![200_704, 1])
        );
        assert_eq!((nchw.count, nchw.nout), (32 * 3136, 64));
        // 1x1 spatial: NC over N, columns.
        assert_eq!(
            layout(&[32, 2048, 1, 1], &[0, 2, 3]).pattern(),
            Pattern::Columns
        );
        // K R K: the general kernels; size-1 and empty reductions too.
        assert_eq!(layout(&[4, 5, 6], &[1]).pattern(), Pattern::Other);
        assert_eq!(layout(&[4, 1], &[1]).pattern(), Pattern::Other);
        assert_eq!(layout(&[4, 0], &[1]).pattern(), Pattern::Other);
    }

    #[test]
    fn splits_fill_the_gpu_without_tiny_or_empty_chunks() {
        // Many outputs already fill it.
        assert_eq!(split(SPLIT_TARGET_BLOCKS, 1 << 20, 1), (1, 1 << 20));
        // Small work: no split.
        assert_eq!(split(1, 1000, 1), (1, 1000));
        for (groups, count, width) in [
            (1u64, 1u64 << 22, 1u64),
            (16, 4096, 32),
            (24, 16384, 32),
            (64, 100_352, 1),
            (256, 100_352, 1),
            (1, 10_000_019, 1),
            (3, 8193, 1),
        ] {
            let (splits, chunk) = split(groups, count, width);
            assert!(splits >= 1 && chunk >= 1, "{groups} {count}");
            // Every chunk non-empty, the chunks exactly covering the range.
            assert!((splits - 1) * chunk < count && splits * chunk >= count);
            assert!(
                chunk * width >= SPLIT_MIN_WORK.min(count * width) / 2,
                "{groups} {count}"
            );
            assert!(groups * splits <= 2 * SPLIT_TARGET_BLOCKS);
        }
        // Large work reaches at least 2 blocks per SM of a 132-SM GPU.
        assert!(split(1, 1 << 22, 1).0 >= 264);
        assert!(16 * split(16, 4096, 32).0 >= 256);
        assert!(24 * split(24, 16384, 32).0 >= 264);
        assert!(64 * split(64, 100_352, 1).0 >= 264);
    }

    #[test]
    fn each_pattern_takes_its_kernel() {
        let plan = |shape: &[u64], dims: &[usize], ok| reduce_plan(&layout(shape, dims), ok);
        // Bias gradient of a [4096, 512] activation: columns, split.
        let p = plan(&[4096, 512], &[0], true);
        assert_eq!(p.kernel, Kernel::ReducePartColumns);
        assert_eq!(p.blocks, 16 * p.splits);
        assert_eq!(
            plan(&[4096, 512], &[0], false).kernel,
            Kernel::ReduceColumns
        );
        // A scalar mean: one output split over many blocks.
        let p = plan(&[4096, 512], &[0, 1], true);
        assert_eq!((p.kernel, p.blocks), (Kernel::ReducePartRows, p.splits));
        assert_eq!(p.splits, 4096 * 512 / SPLIT_MIN_WORK);
        assert_eq!(
            plan(&[4096, 512], &[0, 1], false).kernel,
            Kernel::ReduceRows
        );
        // Many short rows: the row kernel.
        assert_eq!(plan(&[4096, 512], &[1], true).kernel, Kernel::ReduceRows);
        // Batch norm statistics: planes, split when the channels are few.
        let p = plan(&[32, 64, 56, 56], &[0, 2, 3], true);
        assert_eq!(p.kernel, Kernel::ReducePartRows);
        assert!(p.splits > 1 && p.blocks == 64 * p.splits);
        let p = plan(&[32, 64, 56, 56], &[0, 2, 3], false);
        assert_eq!(
            (p.kernel, p.splits, p.blocks),
            (Kernel::ReducePartRows, 1, 64)
        );
        let p = plan(&[32, 2048, 7, 7], &[0, 2, 3], true);
        assert_eq!((p.kernel, p.splits), (Kernel::ReducePartRows, 1));
        assert_eq!(p.scratch_bytes(2048, ReduceOp::Var), 0);
        // Short planes: a thread per output.
        assert_eq!(
            plan(&[2, 8, 2, 2], &[0, 2, 3], true).kernel,
            Kernel::ReduceByThread
        );
        assert_eq!(plan(&[4, 5, 6], &[1], true).kernel, Kernel::ReduceByThread);
        // Scratch: f64 partials, two for the variance.
        let p = plan(&[32, 64, 56, 56], &[0, 2, 3], true);
        assert_eq!(p.scratch_bytes(64, ReduceOp::Sum), 64 * p.splits * 8);
        assert_eq!(p.scratch_bytes(64, ReduceOp::Var), 64 * p.splits * 16);
    }

    /// The CUDA device's sizer, without a GPU (no cuDNN).
    struct Sizer;

    impl ScratchSizer for Sizer {
        fn scratch_bytes(&self, graph: &Graph, node: usize, params: &OpParams) -> u64 {
            match reduce_scratch_bytes(graph, node, params) {
                0 => PortableScratch.scratch_bytes(graph, node, params),
                n => n,
            }
        }
    }

    fn reduction(op: Op, shape: &[u64], dims: &[i64], out: &[u64]) -> Graph {
        let t = |name: &str, shape: &[u64], role| Tensor {
            name: name.into(),
            ty: TensorType::new(DType::F32, shape.to_vec()),
            role,
            data: vec![],
        };
        let mut attrs = BTreeMap::new();
        attrs.insert("dim".to_string(), Attr::Ints(dims.to_vec()));
        Graph {
            tensors: vec![t("x", shape, Role::Feed), t("y", out, Role::Intermediate)],
            nodes: vec![Node {
                name: format!("{op}"),
                op,
                inputs: vec![Some(0)],
                outputs: vec![Some(1)],
                attrs,
                source: String::new(),
            }],
            fetches: vec![1],
            updates: vec![],
            precision: Default::default(),
        }
    }

    fn lowered(program: &Program) -> Vec<(Kernel, u32, ReduceArgs)> {
        let none = super::super::folds::Folds::none();
        let super::super::tests::LoweredProgram(commands, _, _) =
            super::super::tests::lower_all(program, &fusion::FusionPlan::none(), &none);
        commands
            .iter()
            .filter_map(|c| match c {
                Command::Launch(l) => {
                    let args = l.args.as_any().downcast_ref::<ReduceArgs>()?;
                    Some((l.kernel, l.grid.0, *args))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn planned_scratch_holds_the_partials_and_without_it_nothing_splits() {
        for (op, shape, dims, out) in [
            (
                Op::SumDimIntList,
                vec![4096u64, 512],
                vec![0i64],
                vec![512u64],
            ),
            (
                Op::VarCorrection,
                vec![32, 64, 56, 56],
                vec![0, 2, 3],
                vec![64],
            ),
            (Op::SumDimIntList, vec![64, 8192], vec![0, 1], vec![]),
        ] {
            let graph = reduction(op, &shape, &dims, &out);
            let sized = Program::with_scratch(graph.clone(), &Limits::default(), &Sizer).unwrap();
            let (off, len) = sized.plan().scratch(0).expect("scratch for the partials");
            let launches = lowered(&sized);
            assert_eq!(launches.len(), 2, "{op}: {launches:?}");
            let (first, _, args) = launches[0];
            assert!(matches!(
                first,
                Kernel::ReducePartRows | Kernel::ReducePartColumns
            ));
            assert_eq!(launches[1].0, Kernel::ReduceParts);
            assert_eq!(args.part, (1 << 30) + off);
            let per = if op == Op::VarCorrection { 16 } else { 8 };
            assert!(args.splits > 1);
            assert!((args.nout * args.splits * per) as u64 <= len);
            assert!((args.splits - 1) * args.chunk < args.count);
            assert!(args.splits * args.chunk >= args.count);
            // The portable plan (CPU, sim) has no scratch for it: a single pass.
            let plain = Program::new(graph, &Limits::default()).unwrap();
            assert_eq!(plain.plan().scratch(0), None);
            assert!(plain.plan().ephemeral_bytes < sized.plan().ephemeral_bytes);
            let launches = lowered(&plain);
            assert_eq!(launches.len(), 1, "{op}: {launches:?}");
            assert_eq!((launches[0].2.splits, launches[0].2.part), (1, 0));
        }
    }
}
