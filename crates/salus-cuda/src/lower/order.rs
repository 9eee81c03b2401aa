//! Ordering: `argmax` and `argmin` over one dim (or all, as one line), and `sort.stable`
//! along one dim, each a block per line (`order.cu`).

use salus_graph::{DType, Node, OpParams, Reduction};

use super::{Lowered, Lowering, Operand, numel};
use crate::abi::{ArgReduceArgs, Kernel, SortArgs};

/// `[outer, len, inner]` of `shape` around the dims `lo..=hi`.
fn lines(shape: &[u64], lo: usize, hi: usize) -> (u64, u64, u64) {
    (
        numel(&shape[..lo]),
        numel(&shape[lo..=hi]),
        numel(&shape[hi + 1..]),
    )
}

impl Lowering<'_> {
    /// `argmax` (`largest`) or `argmin` into the i64 `o`.
    pub(super) fn arg_extreme(
        &mut self,
        largest: bool,
        a: &Operand,
        r: &Reduction,
        o: &Operand,
    ) -> Lowered {
        let (outer, len, inner) = match (r.dims.first(), r.dims.last()) {
            (Some(&lo), Some(&hi)) if hi - lo + 1 == r.dims.len() => lines(a.shape(), lo, hi),
            (None, _) => (1, 1, 1),
            _ => {
                return Err(format!(
                    "argmax and argmin reduce one dim or all, not {:?}",
                    r.dims
                ));
            }
        };
        if o.ty.dtype != DType::I64 || o.numel() != outer * inner {
            return Err(format!(
                "output {} must be i64 of {} elements",
                o.ty,
                outer * inner
            ));
        }
        if len == 0 {
            return Err(format!(
                "cannot take the arg of an extreme of the empty {}",
                a.ty
            ));
        }
        let args = ArgReduceArgs {
            outer: outer as i64,
            len: len as i64,
            inner: inner as i64,
            largest: i64::from(largest),
            x: a.ptr,
            xdt: a.dt(),
            out: o.ptr,
        };
        self.launch_blocks(Kernel::ArgExtreme, outer * inner, args);
        Ok(())
    }

    /// `sort.stable`: the values and indices that are used.
    pub(super) fn sort(&mut self, node: &Node) -> Lowered {
        let &OpParams::Sort { dim, descending } = self.params() else {
            return Err("sort without its parameters".into());
        };
        let x = self.need(node, 0)?;
        let (values, indices) = (self.output(node, 0), self.output(node, 1));
        if values.is_none() && indices.is_none() {
            return Err("both outputs are unused".into());
        }
        for out in values.iter().chain(&indices) {
            if out.shape() != x.shape() {
                return Err(format!("output {} must have the shape of {}", out.ty, x.ty));
            }
        }
        let (outer, len, inner) = if x.shape().is_empty() {
            (1, 1, 1)
        } else {
            lines(x.shape(), dim, dim)
        };
        let args = SortArgs {
            outer: outer as i64,
            len: len as i64,
            inner: inner as i64,
            descending: i64::from(descending),
            x: x.ptr,
            dt: x.dt(),
            values: values.as_ref().map_or(0, |v| v.ptr),
            indices: indices.as_ref().map_or(0, |i| i.ptr),
        };
        if len > 0 {
            self.launch_blocks(Kernel::SortLines, outer * inner, args);
        }
        Ok(())
    }
}
