//! Pointwise ops, strided copies and the view ops that copy (permute, expand, slice,
//! select, cat, split): all one kernel, `ew`, over operands with their own strides.

use salus_graph::Node;

use super::{Lowered, Lowering, Operand, broadcast, contiguous, numel, padded, signed};
use crate::abi::{ElementwiseArgs, ElementwiseOp, Kernel, MAX_RANK, StridedTensor};

/// An operand of the elementwise kernel: address (of element 0), dtype code, strides in
/// elements.
#[derive(Debug, Clone)]
pub(super) struct StridedView {
    pub ptr: u64,
    pub dt: i64,
    pub st: Vec<i64>,
}

impl StridedView {
    /// A dense tensor read or written in row-major order.
    fn dense(t: &Operand) -> StridedView {
        StridedView {
            ptr: t.ptr,
            dt: t.dt(),
            st: contiguous(t.shape()),
        }
    }

    fn kernel_operand(&self) -> StridedTensor {
        StridedTensor {
            ptr: self.ptr,
            dt: self.dt,
            st: padded(&self.st),
        }
    }
}

/// Drops size-1 dims and merges dims that every operand walks contiguously.
pub(super) fn coalesce(shape: &[u64], ops: &mut [StridedView]) -> Vec<u64> {
    let keep: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
    let mut out_shape: Vec<u64> = Vec::new();
    let mut out_st: Vec<Vec<i64>> = vec![Vec::new(); ops.len()];
    for &d in &keep {
        let mergeable = !out_shape.is_empty()
            && ops
                .iter()
                .enumerate()
                .all(|(k, o)| out_st[k].last().copied() == Some(o.st[d] * shape[d] as i64));
        if mergeable {
            let last = out_shape.len() - 1;
            out_shape[last] *= shape[d];
            for (k, o) in ops.iter().enumerate() {
                let l = out_st[k].len() - 1;
                out_st[k][l] = o.st[d];
            }
        } else {
            out_shape.push(shape[d]);
            for (k, o) in ops.iter().enumerate() {
                out_st[k].push(o.st[d]);
            }
        }
    }
    for (o, st) in ops.iter_mut().zip(out_st) {
        o.st = st;
    }
    out_shape
}

impl Lowering<'_> {
    /// `out[idx] = op(ins[idx]...)` over `shape`, each operand with its own strides.
    pub(super) fn strided(
        &mut self,
        op: ElementwiseOp,
        shape: &[u64],
        out: StridedView,
        ins: Vec<StridedView>,
        s: [f64; 3],
    ) -> Lowered {
        let n = numel(shape);
        if n == 0 {
            return Ok(());
        }
        let nin = ins.len();
        let mut ops = vec![out];
        ops.extend(ins);
        let shape = coalesce(shape, &mut ops);
        if shape.len() > MAX_RANK {
            return Err(format!(
                "the CUDA device runs elementwise ops of at most {MAX_RANK} dims, got {}",
                shape.len()
            ));
        }
        let contig = shape.len() <= 1 && ops.iter().all(|o| o.st.iter().all(|&x| x == 1));
        let mut inputs = [StridedTensor::default(); 3];
        for (slot, view) in inputs.iter_mut().zip(&ops[1..]) {
            *slot = view.kernel_operand();
        }
        let args = ElementwiseArgs {
            n: n as i64,
            rank: shape.len() as i64,
            op: op.code(),
            nin: nin as i64,
            contig: i64::from(contig),
            s0: s[0],
            s1: s[1],
            s2: s[2],
            shape: padded(&signed(&shape)),
            out: ops[0].kernel_operand(),
            inputs,
        };
        self.launch(Kernel::Elementwise, n, args);
        Ok(())
    }

    /// An elementwise op with broadcasting over `ins` into `out`.
    pub(super) fn ew(
        &mut self,
        op: ElementwiseOp,
        out: &Operand,
        ins: &[&Operand],
        s: [f64; 3],
    ) -> Lowered {
        let shape = out.shape().to_vec();
        let ins = ins
            .iter()
            .map(|t| StridedView {
                ptr: t.ptr,
                dt: t.dt(),
                st: broadcast(t.shape(), &shape),
            })
            .collect();
        self.strided(op, &shape, StridedView::dense(out), ins, s)
    }

    pub(super) fn unary(
        &mut self,
        op: ElementwiseOp,
        node: &Node,
        o: &Operand,
        s: [f64; 3],
    ) -> Lowered {
        let a = self.need(node, 0)?;
        self.ew(op, o, &[&a], s)
    }

    pub(super) fn binary(&mut self, op: ElementwiseOp, node: &Node, o: &Operand) -> Lowered {
        let (a, b) = (self.need(node, 0)?, self.need(node, 1)?);
        self.ew(op, o, &[&a, &b], [0.0; 3])
    }

    /// Copies `x` (numel of `out`) into `out` as a flat sequence, converting the dtype.
    pub(super) fn copy_flat(&mut self, out: &Operand, x: &Operand) -> Lowered {
        if out.ptr == x.ptr && out.ty.dtype == x.ty.dtype {
            return Ok(());
        }
        let flat = |t: &Operand| StridedView {
            ptr: t.ptr,
            dt: t.dt(),
            st: vec![1],
        };
        let shape = vec![out.numel()];
        self.strided(
            ElementwiseOp::Copy,
            &shape,
            flat(out),
            vec![flat(x)],
            [0.0; 3],
        )
    }

    /// `o[idx] = a[offset + sum idx[d] * st[d]]` over o's shape.
    pub(super) fn copy_strided(
        &mut self,
        o: &Operand,
        a: &Operand,
        st: Vec<i64>,
        offset: u64,
    ) -> Lowered {
        let shape = o.shape().to_vec();
        let source = StridedView {
            ptr: a.ptr + offset * a.elem_size(),
            dt: a.dt(),
            st,
        };
        let op = ElementwiseOp::Copy;
        self.strided(op, &shape, StridedView::dense(o), vec![source], [0.0; 3])
    }

    /// `permute`: output dim i walks input dim `dims[i]`.
    pub(super) fn permute(&mut self, node: &Node, dims: &[usize], o: &Operand) -> Lowered {
        let a = self.need(node, 0)?;
        let own = contiguous(a.shape());
        let st = dims.iter().map(|&d| own[d]).collect();
        self.copy_strided(o, &a, st, 0)
    }

    pub(super) fn expand(&mut self, node: &Node, o: &Operand) -> Lowered {
        let a = self.need(node, 0)?;
        let st = broadcast(a.shape(), o.shape());
        self.copy_strided(o, &a, st, 0)
    }

    /// `slice.Tensor` with its bounds already clamped.
    pub(super) fn slice(
        &mut self,
        node: &Node,
        dim: usize,
        start: u64,
        step: u64,
        o: &Operand,
    ) -> Lowered {
        let a = self.need(node, 0)?;
        let mut st = contiguous(a.shape());
        let offset = start * st[dim] as u64;
        st[dim] *= step as i64;
        self.copy_strided(o, &a, st, offset)
    }

    /// `select.int` with its index already in range.
    pub(super) fn select(&mut self, node: &Node, dim: usize, index: u64, o: &Operand) -> Lowered {
        let a = self.need(node, 0)?;
        let mut st = contiguous(a.shape());
        let offset = index * st[dim] as u64;
        st.remove(dim);
        self.copy_strided(o, &a, st, offset)
    }

    pub(super) fn cat(&mut self, node: &Node, dim: usize, o: &Operand) -> Lowered {
        let ost = contiguous(o.shape());
        let mut at = 0u64;
        for k in 0..node.inputs.len() {
            let a = self.input(node, k).ok_or("cat inputs must be tensors")?;
            let shape = a.shape().to_vec();
            let offset = at * ost.get(dim).copied().unwrap_or(1) as u64;
            let out = StridedView {
                ptr: o.ptr + offset * o.elem_size(),
                dt: o.dt(),
                st: ost.clone(),
            };
            let op = ElementwiseOp::Copy;
            self.strided(op, &shape, out, vec![StridedView::dense(&a)], [0.0; 3])?;
            at += shape.get(dim).copied().unwrap_or(1);
        }
        Ok(())
    }

    pub(super) fn split(&mut self, node: &Node) -> Lowered {
        let salus_graph::OpParams::Split { dim, sizes } = self.params() else {
            return Err("split_with_sizes without its split parameters".into());
        };
        let a = self.need(node, 0)?;
        let st = contiguous(a.shape());
        let mut at = 0u64;
        for (k, &len) in sizes.iter().enumerate() {
            if let Some(o) = self.output(node, k) {
                self.copy_strided(&o, &a, st.clone(), at * st[*dim] as u64)?;
            }
            at += len;
        }
        Ok(())
    }
}
