//! Reductions over any set of dims, softmax along one dim, and layer norm.

use salus_graph::{Node, OpParams};

use super::elementwise::{StridedView, coalesce};
use super::{Lowered, Lowering, Operand, address, contiguous, numel, padded, signed};
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

/// Which kernel reduces a tensor whose kept and reduced dims are coalesced to
/// (`kshape`, `kst`) and (`rshape`, `rst`), `count` elements per output.
pub(super) fn reduce_kernel(kst: &[i64], rshape: &[u64], rst: &[i64], count: u64) -> Kernel {
    if rshape.len() == 1 && rst == [1] {
        // Each output's elements are one contiguous run: a warp or block per output.
        Kernel::ReduceRows
    } else if rshape.len() == 1 && kst == [1] {
        // Adjacent outputs are adjacent elements: a lane per output, coalesced.
        Kernel::ReduceColumns
    } else if count <= THREAD_REDUCTION {
        Kernel::ReduceByThread
    } else {
        Kernel::ReduceByBlock
    }
}

/// Reductions of at most this many elements per output take a thread each; longer ones a
/// block each.
const THREAD_REDUCTION: u64 = 32;

impl Lowering<'_> {
    /// Reduces `x` over `dims` into `out` (kept dims in order).
    pub(super) fn reduce(
        &mut self,
        op: ReduceOp,
        x: &Operand,
        dims: &[usize],
        out: &Operand,
        correction: f64,
    ) -> Lowered {
        let own = contiguous(x.shape());
        let empty = || StridedView {
            ptr: 0,
            dt: 0,
            st: Vec::new(),
        };
        let (mut kept, mut reduced) = ([empty()], [empty()]);
        let (mut kshape, mut rshape) = (Vec::new(), Vec::new());
        for (d, (&size, &st)) in x.shape().iter().zip(&own).enumerate() {
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
        if kshape.len() > MAX_RANK || rshape.len() > MAX_RANK {
            return Err(format!(
                "the CUDA device reduces tensors of at most {MAX_RANK} dims"
            ));
        }
        let args = ReduceArgs {
            nout: nout as i64,
            count: count as i64,
            op: op.code(),
            krank: kshape.len() as i64,
            rrank: rshape.len() as i64,
            correction,
            kshape: padded(&signed(&kshape)),
            kst: padded(&kept[0].st),
            rshape: padded(&signed(&rshape)),
            rst: padded(&reduced[0].st),
            input: x.ptr,
            in_dt: x.dt(),
            out: out.ptr,
            out_dt: out.dt(),
        };
        match reduce_kernel(&kept[0].st, &rshape, &reduced[0].st, count) {
            Kernel::ReduceRows => {
                let blocks = row_blocks(nout, count);
                self.launch_blocks(Kernel::ReduceRows, blocks, args);
            }
            Kernel::ReduceColumns => {
                self.launch_blocks(Kernel::ReduceColumns, nout.div_ceil(32), args);
            }
            Kernel::ReduceByThread => self.launch(Kernel::ReduceByThread, nout, args),
            kernel => self.launch_blocks(kernel, nout, args),
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
        let outs: Vec<Option<Operand>> = (0..3).map(|k| self.output(node, k)).collect();
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
                let blocks = inner.div_ceil(32);
                self.launch_blocks(Kernel::LayerNormBackwardParamsColumns, blocks, args);
            }
        }
        Ok(())
    }
}
