//! Indexing (embedding, index_select, gather, scatter, advanced indexing with
//! `index.Tensor` and `index_put`, and the embedding gradient), whose kernels check every
//! index and report a bad one in the lane's error block, and the random draws of
//! `bernoulli.p`.

use salus_graph::{AdvancedIndex, DType, Node, OpParams};

use super::{Lowered, Lowering, Operand, address, broadcast, contiguous, numel, padded, signed};
use crate::abi::{
    AdvancedIndexArgs, AlongDimArgs, AlongDimMode, AssertArgs, BernoulliArgs, ElementwiseOp,
    EmbeddingBackwardArgs, IndexErrorKind, Kernel, MAX_RANK, TakeRowsArgs, UniformArgs,
};

impl Lowering<'_> {
    /// Rows of `x` viewed as `[outer, len, inner]` picked by `idx` along the middle dim
    /// into `o`; a bad index is reported as `kind`.
    #[allow(clippy::too_many_arguments)]
    fn take_rows(
        &mut self,
        x: &Operand,
        idx: &Operand,
        outer: u64,
        len: u64,
        inner: u64,
        o: &Operand,
        kind: IndexErrorKind,
    ) -> Lowered {
        if !idx.ty.dtype.is_int() {
            return Err(format!("{} must be an integer tensor", kind.what()));
        }
        if x.ty.dtype != o.ty.dtype {
            return Err(format!(
                "input {} and output {} differ in dtype",
                x.ty, o.ty
            ));
        }
        let rows = idx.numel();
        let args = TakeRowsArgs {
            outer: outer as i64,
            len: len as i64,
            inner: inner as i64,
            rows: rows as i64,
            code: kind.code(),
            dt: x.dt(),
            x: x.ptr,
            index: idx.ptr,
            idt: idx.dt(),
            out: o.ptr,
            err: self.err,
            node: self.index as i64,
        };
        self.launch(Kernel::TakeRows, outer * rows * inner, args);
        Ok(())
    }

    pub(super) fn embedding(&mut self, node: &Node, o: &Operand) -> Lowered {
        let (w, idx) = (self.need(node, 0)?, self.need(node, 1)?);
        if w.ty.rank() != 2 {
            return Err(format!("embedding weight {} must be 2-d", w.ty));
        }
        let (rows, width) = (w.shape()[0], w.shape()[1]);
        self.take_rows(&w, &idx, 1, rows, width, o, IndexErrorKind::Embedding)
    }

    pub(super) fn index_select(&mut self, node: &Node, dim: usize, o: &Operand) -> Lowered {
        let (a, idx) = (self.need(node, 0)?, self.need(node, 1)?);
        let kind = IndexErrorKind::IndexSelect;
        if a.ty.rank() == 0 {
            // A 0-dim self: every index must name element 0 (or -1).
            self.copy_flat(o, &a)?;
            for j in 0..idx.numel() {
                let one = Operand {
                    ty: salus_graph::TensorType::new(idx.ty.dtype, vec![1]),
                    ptr: idx.ptr + j * idx.elem_size(),
                };
                self.take_rows(&a, &one, 1, 1, 1, o, kind)?;
            }
            return Ok(());
        }
        let outer = numel(&a.shape()[..dim]);
        let inner = numel(&a.shape()[dim + 1..]);
        self.take_rows(&a, &idx, outer, a.shape()[dim], inner, o, kind)
    }

    /// A random op's output and the session's generator state (input 1, an i64 scalar).
    fn draw_operands(&self, node: &Node) -> Result<(Operand, Operand), String> {
        let o = self.output(node, 0).ok_or("output 0 is unused")?;
        let state = self.need(node, 1)?;
        if state.ty.dtype != DType::I64 || state.numel() != 1 {
            return Err(format!(
                "the generator must be an i64 scalar, got {}",
                state.ty
            ));
        }
        Ok((o, state))
    }

    /// `bernoulli.p` from the session's generator (input 1), as salus-cpu's
    /// `kernels::random` draws.
    pub(super) fn bernoulli(&mut self, node: &Node) -> Lowered {
        let &OpParams::Bernoulli { p } = self.params() else {
            return Err("bernoulli.p without its probability".into());
        };
        let (o, state) = self.draw_operands(node)?;
        let args = BernoulliArgs {
            n: o.numel() as i64,
            dt: o.dt(),
            out: o.ptr,
            state: state.ptr,
            key: salus_exec::random::name_key(&node.name),
            p,
        };
        self.launch(Kernel::Bernoulli, o.numel(), args);
        Ok(())
    }

    /// `_assert_async.msg`: one thread checks the condition on the device.
    pub(super) fn assert_true(&mut self, node: &Node) -> Lowered {
        let cond = self.need(node, 0)?;
        let args = AssertArgs {
            cond: cond.ptr,
            dt: cond.dt(),
            err: self.err,
            node: self.index as i64,
        };
        self.launch(Kernel::Assert, 1, args);
        Ok(())
    }

    /// `rand_like` from the session's generator (input 1), as salus-cpu's
    /// `kernels::random` draws.
    pub(super) fn rand_like(&mut self, node: &Node) -> Lowered {
        let (o, state) = self.draw_operands(node)?;
        let bits = i64::from(salus_exec::random::uniform_bits(o.ty.dtype));
        let args = UniformArgs {
            n: o.numel() as i64,
            dt: o.dt(),
            out: o.ptr,
            state: state.ptr,
            key: salus_exec::random::name_key(&node.name),
            bits,
        };
        self.launch(Kernel::Uniform, o.numel(), args);
        Ok(())
    }

    /// Writes `o` as its input `a` before a scatter or `index_put` changes some of it: a
    /// copy, or a fill when `a` is a fill's output left unwritten ([`Folds::constant`]).
    ///
    /// [`Folds::constant`]: super::folds::Folds::constant
    fn start_from(&mut self, node: &Node, o: &Operand, a: &Operand) -> Lowered {
        match node.inputs[0].and_then(|t| self.folds.constant(t)) {
            Some(value) => self.ew(ElementwiseOp::Fill, o, &[], [value, 0.0, 0.0]),
            None => self.copy_flat(o, a),
        }
    }

    /// `gather`, `scatter.value` (of `value`), `scatter.src`, `scatter_add` and
    /// `scatter_reduce.two` along `dim`, as `mode` says.
    pub(super) fn along(
        &mut self,
        node: &Node,
        dim: usize,
        mode: AlongDimMode,
        value: f64,
        o: &Operand,
    ) -> Lowered {
        let (a, idx) = (self.need(node, 0)?, self.need(node, 1)?);
        if !idx.ty.dtype.is_int() {
            return Err("index must be an integer tensor".into());
        }
        if idx.ty.rank() > MAX_RANK {
            return Err(format!(
                "the CUDA device indexes tensors of at most {MAX_RANK} dims"
            ));
        }
        if idx.numel() > 0
            && (0..idx.ty.rank())
                .any(|d| d != dim && idx.shape()[d] > a.shape().get(d).copied().unwrap_or(1))
        {
            return Err(format!(
                "index shape {:?} exceeds input shape {:?}",
                idx.shape(),
                a.shape()
            ));
        }
        let mut sst = contiguous(a.shape());
        sst.resize(idx.ty.rank(), 0);
        let dim_size = a.shape().get(dim).copied().unwrap_or(1);
        let src = match mode {
            AlongDimMode::Gather | AlongDimMode::ScatterValue => None,
            _ => {
                let src = self.need(node, 2)?;
                if idx.ty.rank() != src.ty.rank()
                    || idx.shape().iter().zip(src.shape()).any(|(i, s)| i > s)
                {
                    return Err(format!(
                        "index {} must not be larger than src {}",
                        idx.ty, src.ty
                    ));
                }
                Some(src)
            }
        };
        if mode != AlongDimMode::Gather {
            self.start_from(node, o, &a)?;
        }
        let srcst = src
            .as_ref()
            .map_or(vec![0; idx.ty.rank()], |s| contiguous(s.shape()));
        let mut args = AlongDimArgs {
            n: idx.numel() as i64,
            rank: idx.ty.rank() as i64,
            dim: dim as i64,
            dim_size: dim_size as i64,
            mode: mode.code(),
            value,
            ishape: padded(&signed(idx.shape())),
            sst: padded(&sst),
            srcst: padded(&srcst),
            input: a.ptr,
            sdt: a.dt(),
            index: idx.ptr,
            idt: idx.dt(),
            out: o.ptr,
            odt: o.dt(),
            err: self.err,
            node: self.index as i64,
            ..AlongDimArgs::default()
        };
        (args.src, args.srcdt) = address(src.as_ref());
        self.launch(Kernel::AlongDim, idx.numel(), args);
        Ok(())
    }

    pub(super) fn embedding_backward(
        &mut self,
        node: &Node,
        padding_idx: Option<u64>,
        scale_grad_by_freq: bool,
        o: &Operand,
    ) -> Lowered {
        let (g, idx) = (self.need(node, 0)?, self.need(node, 1)?);
        if !idx.ty.dtype.is_int() {
            return Err("embedding_dense_backward index must be an integer tensor".into());
        }
        let rows = o.shape().first().copied().unwrap_or(0);
        let width = g.shape().last().copied().unwrap_or(1);
        let count = idx.numel();
        if g.numel() != count * width || o.shape() != [rows, width] {
            return Err(format!(
                "grad_output {} must hold one row of the output {} per index of {}",
                g.ty, o.ty, idx.ty
            ));
        }
        self.zero(o);
        let args = EmbeddingBackwardArgs {
            count: count as i64,
            width: width as i64,
            rows: rows as i64,
            padding: padding_idx.map_or(-1, |p| p as i64),
            scale: i64::from(scale_grad_by_freq),
            g: g.ptr,
            gdt: g.dt(),
            index: idx.ptr,
            idt: idx.dt(),
            out: o.ptr,
            odt: o.dt(),
            err: self.err,
            node: self.index as i64,
        };
        self.launch(Kernel::EmbeddingBackward, count * width, args);
        Ok(())
    }

    /// The kernels' description of the selection `index` makes of `x`, the index tensors
    /// inputs `1 + k` of `node`; a bad index is reported as `kind`.
    fn selection(
        &self,
        node: &Node,
        index: &AdvancedIndex,
        x: &Operand,
        kind: IndexErrorKind,
    ) -> Result<AdvancedIndexArgs, String> {
        if x.ty.rank() > MAX_RANK || index.shape.len() > MAX_RANK {
            return Err(format!(
                "the CUDA device indexes tensors of at most {MAX_RANK} dims"
            ));
        }
        let mut args = AdvancedIndexArgs {
            n: numel(&index.shape) as i64,
            rank: index.shape.len() as i64,
            srank: x.ty.rank() as i64,
            code: kind.code(),
            shape: padded(&signed(&index.shape)),
            size: padded(&signed(x.shape())),
            xst: padded(&contiguous(x.shape())),
            x: x.ptr,
            dt: x.dt(),
            err: self.err,
            node: self.index as i64,
            ..AdvancedIndexArgs::default()
        };
        for (d, (whole, k)) in index.whole_dims().iter().zip(&index.dims).enumerate() {
            match (whole, k) {
                (Some(r), _) => args.whole[d] = *r as i64,
                (None, Some(k)) => {
                    let t = self.need(node, 1 + k)?;
                    if !t.ty.dtype.is_int() {
                        return Err(format!("{} must be an integer tensor", kind.what()));
                    }
                    (args.idx[d], args.idt[d]) = (t.ptr, t.dt());
                    let own = broadcast(t.shape(), &index.index_shape);
                    let at = d * MAX_RANK + index.index_at;
                    args.ist[at..at + own.len()].copy_from_slice(&own);
                }
                (None, None) => return Err(format!("dimension {d} is neither indexed nor whole")),
            }
        }
        Ok(args)
    }

    /// `index.Tensor`: the selected elements, copied.
    pub(super) fn index_gather(
        &mut self,
        node: &Node,
        index: &AdvancedIndex,
        o: &Operand,
    ) -> Lowered {
        let a = self.need(node, 0)?;
        if a.ty.dtype != o.ty.dtype || o.shape() != index.shape {
            return Err(format!(
                "output {} must be {:?} of {}",
                o.ty, index.shape, a.ty
            ));
        }
        let mut args = self.selection(node, index, &a, IndexErrorKind::Index)?;
        args.out = o.ptr;
        self.launch(Kernel::IndexGather, o.numel(), args);
        Ok(())
    }

    /// `index_put`: a copy of self, then the values (broadcast to the selection) written
    /// or added at the selected elements.
    pub(super) fn index_put(
        &mut self,
        node: &Node,
        count: usize,
        accumulate: bool,
        index: Option<&AdvancedIndex>,
        o: &Operand,
    ) -> Lowered {
        let Some(index) = index else {
            return Err("index_put with a bool (mask) index is not supported".into());
        };
        let a = self.need(node, 0)?;
        let values = self.need(node, count + 1)?;
        if values.ty.dtype != o.ty.dtype || a.ty != o.ty {
            return Err(format!(
                "values {} and output {} must be {}",
                values.ty, o.ty, a.ty
            ));
        }
        let mut args = self.selection(node, index, &a, IndexErrorKind::IndexPut)?;
        args.accumulate = i64::from(accumulate);
        args.vst = padded(&broadcast(values.shape(), &index.shape));
        (args.values, args.out) = (values.ptr, o.ptr);
        self.start_from(node, o, &a)?;
        self.launch(Kernel::IndexPut, numel(&index.shape), args);
        Ok(())
    }
}
