//! Pointwise ops, strided copies and the view ops that copy (permute, expand, slice,
//! select, cat, split, flip, constant padding): one kernel, `ew`, over operands with their own strides, except
//! same-dtype copies whose coalesced dims allow a faster one ([`route_copy`]): contiguous
//! rows (`copy_rows`) or a batched 2-D transpose (`copy_transpose`).

use std::ops::Range;

use salus_graph::Node;

use super::folds::cat_slot;

use super::{
    BLOCK, Lowered, Lowering, MAX_GRID, Operand, broadcast, contiguous, numel, padded, signed,
};
use crate::abi::{
    CopyRowsArgs, DeviceDType, ElementwiseArgs, ElementwiseOp, IndexMode, Kernel, MAX_RANK,
    StridedTensor, TransposeArgs,
};

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

    /// The kernel's operand, with its fast index `(q, m)` ([`fast_index`]; (0, 0) where
    /// the mode is generic).
    pub(super) fn kernel_operand(&self, (q, m): (i64, i64)) -> StridedTensor {
        StridedTensor {
            ptr: self.ptr,
            dt: self.dt,
            q,
            m,
            st: padded(&self.st),
        }
    }
}

/// An operand's element of flat index `i` over the coalesced `shape` as `(i / q) % m` (`q`
/// 0: always element 0; `m` 0: no modulo), when its non-zero strides `st` are one run of
/// adjacent dims laid out row-major (innermost stride 1); `None` otherwise.
pub(super) fn fast_index(shape: &[u64], st: &[i64]) -> Option<(i64, i64)> {
    let walked: Vec<usize> = (0..shape.len()).filter(|&d| st[d] != 0).collect();
    let (Some(&first), Some(&last)) = (walked.first(), walked.last()) else {
        return Some((0, 0));
    };
    if last - first + 1 != walked.len() {
        return None;
    }
    let mut run = 1i64;
    for d in (first..=last).rev() {
        if st[d] != run {
            return None;
        }
        run *= shape[d] as i64;
    }
    let q = numel(&shape[last + 1..]) as i64;
    Some((q, if first == 0 { 0 } else { run }))
}

/// How the kernel indexes `ops` (those at `outputs` written, the rest read) over the
/// coalesced `shape`, and each operand's fast index: [`IndexMode::Flat`] when every input
/// is contiguous with the outputs or one element, [`IndexMode::Broadcast`] when every input
/// is one contiguous run broadcast along outer and/or inner dims, both only when the
/// outputs are dense; [`IndexMode::Generic`] (and (0, 0)s) otherwise.
pub(super) fn index_mode(
    shape: &[u64],
    ops: &[StridedView],
    outputs: Range<usize>,
) -> (IndexMode, Vec<(i64, i64)>) {
    let generic = (IndexMode::Generic, vec![(0, 0); ops.len()]);
    let dense = contiguous(shape);
    if ops[outputs.clone()].iter().any(|o| o.st != dense) {
        return generic;
    }
    let Some(fast) = ops
        .iter()
        .enumerate()
        .map(|(k, o)| {
            if outputs.contains(&k) {
                Some((1, 0))
            } else {
                fast_index(shape, &o.st)
            }
        })
        .collect::<Option<Vec<_>>>()
    else {
        return generic;
    };
    let flat = fast.iter().all(|&(q, m)| q <= 1 && m == 0);
    let mode = if flat {
        IndexMode::Flat
    } else {
        IndexMode::Broadcast
    };
    (mode, fast)
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

/// `a / b` rounded up, for positive sizes.
fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Bytes per element of a dtype code.
fn dtype_size(dt: i64) -> i64 {
    match dt {
        x if x == DeviceDType::F32.code() || x == DeviceDType::I32.code() => 4,
        x if x == DeviceDType::F16.code() || x == DeviceDType::Bf16.code() => 2,
        x if x == DeviceDType::I64.code() => 8,
        _ => 1,
    }
}

/// How a same-dtype copy runs.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum CopyRoute {
    /// Innermost dim contiguous in both: contiguous rows, vectorized.
    Rows(CopyRowsArgs),
    /// The destination's innermost dim is strided in the source, and another dim is
    /// contiguous there: a batched 2-D transpose.
    Transpose(TransposeArgs),
    /// Anything else: `ew`'s per-element index math.
    Generic,
}

/// The route of a copy of `shape` (already coalesced: no size-1 dims) from `src` into
/// `dst`, both `esize`-byte elements (strides in elements).
pub(super) fn route_copy(
    shape: &[u64],
    dst: &StridedView,
    src: &StridedView,
    esize: i64,
) -> CopyRoute {
    let rank = shape.len();
    if rank == 0 || rank > MAX_RANK {
        return CopyRoute::Generic;
    }
    let last = rank - 1;
    let outer = |skip: &[usize]| {
        let dims: Vec<usize> = (0..rank).filter(|d| !skip.contains(d)).collect();
        let sh: Vec<i64> = dims.iter().map(|&d| shape[d] as i64).collect();
        let ss: Vec<i64> = dims.iter().map(|&d| src.st[d] * esize).collect();
        let ds: Vec<i64> = dims.iter().map(|&d| dst.st[d] * esize).collect();
        (dims.len() as i64, padded(&sh), padded(&ss), padded(&ds))
    };
    if dst.st[last] == 1 && src.st[last] == 1 {
        let row_bytes = shape[last] as i64 * esize;
        let (orank, oshape, src_st, dst_st) = outer(&[last]);
        // The widest access that every row start and the row length allow.
        let vec = [16i64, 8, 4, 2, 1]
            .into_iter()
            .find(|&w| {
                row_bytes % w == 0
                    && src.ptr.is_multiple_of(w as u64)
                    && dst.ptr.is_multiple_of(w as u64)
                    && src_st[..orank as usize].iter().all(|s| s % w == 0)
                    && dst_st[..orank as usize].iter().all(|s| s % w == 0)
            })
            .unwrap_or(1);
        let vpr = row_bytes / vec;
        // Threads per row: about 4 vectors each, at most a block; a chunk is 4 vectors a
        // thread, so long rows split across blocks.
        let tpr = (ceil_div(vpr, 4) as u64)
            .next_power_of_two()
            .min(u64::from(BLOCK)) as i64;
        let chunk = 4 * tpr;
        return CopyRoute::Rows(CopyRowsArgs {
            dst: dst.ptr,
            src: src.ptr,
            rows: numel(&shape[..last]) as i64,
            vpr,
            vec,
            tpr,
            chunks: ceil_div(vpr, chunk),
            chunk,
            rank: orank,
            shape: oshape,
            src_st,
            dst_st,
        });
    }
    if dst.st[last] == 1
        && src.st[last] != 1
        && let Some(k) = (0..last).find(|&d| src.st[d] == 1)
    {
        let (brank, bshape, src_st, dst_st) = outer(&[k, last]);
        return CopyRoute::Transpose(TransposeArgs {
            dst: dst.ptr,
            src: src.ptr,
            esize,
            ni: shape[k] as i64,
            nj: shape[last] as i64,
            src_j: src.st[last],
            dst_i: dst.st[k],
            batches: (0..rank)
                .filter(|&d| d != k && d != last)
                .map(|d| shape[d] as i64)
                .product(),
            rank: brank,
            shape: bshape,
            src_st,
            dst_st,
        });
    }
    CopyRoute::Generic
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
        if op == ElementwiseOp::Copy && nin == 1 && ops[0].dt == ops[1].dt {
            match route_copy(&shape, &ops[0], &ops[1], dtype_size(ops[0].dt)) {
                CopyRoute::Rows(args) => {
                    let per_block = i64::from(BLOCK) / args.tpr;
                    let blocks = ceil_div(args.rows * args.chunks, per_block) as u64;
                    self.launch_blocks(Kernel::CopyRows, blocks.min(MAX_GRID), args);
                    return Ok(());
                }
                CopyRoute::Transpose(args) => {
                    let tiles = args.batches * ceil_div(args.ni, 32) * ceil_div(args.nj, 32);
                    self.launch_blocks(Kernel::CopyTranspose, (tiles as u64).min(MAX_GRID), args);
                    return Ok(());
                }
                CopyRoute::Generic => {}
            }
        }
        let (mut mode, fast) = index_mode(&shape, &ops, 0..1);
        let f32_code = DeviceDType::F32.code();
        let vec4 = mode == IndexMode::Flat
            && op != ElementwiseOp::Copy
            && n.is_multiple_of(4)
            && ops
                .iter()
                .zip(&fast)
                .all(|(o, &(q, _))| o.dt == f32_code && (q == 0 || o.ptr.is_multiple_of(16)));
        if vec4 {
            mode = IndexMode::FlatVec4;
        }
        let mut inputs = [StridedTensor::default(); 3];
        for ((slot, view), &f) in inputs.iter_mut().zip(&ops[1..]).zip(&fast[1..]) {
            *slot = view.kernel_operand(f);
        }
        let args = ElementwiseArgs {
            n: n as i64,
            rank: shape.len() as i64,
            op: op.code(),
            nin: nin as i64,
            mode: mode.code(),
            s0: s[0],
            s1: s[1],
            s2: s[2],
            shape: padded(&signed(&shape)),
            out: ops[0].kernel_operand(fast[0]),
            inputs,
        };
        let threads = if vec4 { n / 4 } else { n };
        self.launch(Kernel::Elementwise, threads, args);
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
    /// An input that is a folded transpose (`folds`) is read from its source.
    /// An input that is a split output's view read from the split's source is read there.
    pub(super) fn permute(&mut self, node: &Node, dims: &[usize], o: &Operand) -> Lowered {
        if let Some(view) = node.inputs[0].and_then(|t| self.folds.strided_source(t)) {
            let (a, offset) = (self.operand(view.root), view.offset);
            let st = dims.iter().map(|&d| view.strides[d]).collect();
            return self.copy_strided(o, &a, st, offset);
        }
        let folded = node.inputs[0].and_then(|t| self.folds.source(t));
        let (a, own) = match folded {
            Some((root, transposed)) => {
                let a = self.operand(root);
                let mut own = contiguous(a.shape());
                let r = own.len();
                if transposed && r >= 2 {
                    own.swap(r - 2, r - 1);
                }
                (a, own)
            }
            None => {
                let a = self.need(node, 0)?;
                let own = contiguous(a.shape());
                (a, own)
            }
        };
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

    /// `flip`: the input read backwards along `dims`, from the last element of each.
    pub(super) fn flip(&mut self, node: &Node, dims: &[usize], o: &Operand) -> Lowered {
        let a = self.need(node, 0)?;
        if a.numel() == 0 {
            return Ok(());
        }
        let mut st = contiguous(a.shape());
        let mut offset = 0u64;
        for &d in dims {
            offset += (a.shape()[d] - 1) * st[d] as u64;
            st[d] = -st[d];
        }
        self.copy_strided(o, &a, st, offset)
    }

    /// `constant_pad_nd`: `value` where the output is padding, then the part of the input
    /// that stays (negative amounts crop it) copied into its place.
    pub(super) fn constant_pad(
        &mut self,
        node: &Node,
        before: &[i64],
        value: f64,
        o: &Operand,
    ) -> Lowered {
        let a = self.need(node, 0)?;
        if before.len() != a.ty.rank() || o.ty.rank() != a.ty.rank() {
            return Err(format!("output {} does not pad input {}", o.ty, a.ty));
        }
        let (ist, ost) = (contiguous(a.shape()), contiguous(o.shape()));
        let (mut kept, mut src, mut dst) = (Vec::with_capacity(ist.len()), 0u64, 0u64);
        let mut whole = true;
        for (d, &b) in before.iter().enumerate() {
            // Input elements cropped at the start, and where the rest starts in the output.
            let (skip, at) = ((-b).max(0) as u64, b.max(0) as u64);
            let n = a.shape()[d]
                .saturating_sub(skip)
                .min(o.shape()[d].saturating_sub(at));
            whole &= at == 0 && n == o.shape()[d];
            kept.push(n);
            src += skip * ist[d] as u64;
            dst += at * ost[d] as u64;
        }
        if !whole {
            self.ew(ElementwiseOp::Fill, o, &[], [value, 0.0, 0.0])?;
        }
        if numel(&kept) == 0 {
            return Ok(());
        }
        let out = StridedView {
            ptr: o.ptr + dst * o.elem_size(),
            dt: o.dt(),
            st: ost,
        };
        let input = StridedView {
            ptr: a.ptr + src * a.elem_size(),
            dt: a.dt(),
            st: ist,
        };
        self.strided(ElementwiseOp::Copy, &kept, out, vec![input], [0.0; 3])
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
            if let Some(view) = node.inputs[k].and_then(|t| self.folds.strided_source(t)) {
                // A permute's view, copied from the permute's source over its shape.
                let root = self.operand(view.root);
                let source = StridedView {
                    ptr: root.ptr + view.offset * root.elem_size(),
                    dt: root.dt(),
                    st: view.strides.clone(),
                };
                let st = cat_slot(o.shape(), &shape, &view.shape)
                    .ok_or("a folded cat input's slot is not one strided view")?;
                let out = StridedView { st, ..out };
                self.strided(op, &view.shape, out, vec![source], [0.0; 3])?;
            } else {
                self.strided(op, &shape, out, vec![StridedView::dense(&a)], [0.0; 3])?;
            }
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
            let read_elsewhere = node
                .outputs
                .get(k)
                .copied()
                .flatten()
                .is_some_and(|t| self.folds.unwritten(t));
            if let Some(o) = self.output(node, k).filter(|_| !read_elsewhere) {
                self.copy_strided(&o, &a, st.clone(), at * st[*dim] as u64)?;
            }
            at += len;
        }
        Ok(())
    }
}
