//! Ops that order elements: `argmax` and `argmin` over one dimension (or all of them, as
//! one flattened line), and `sort.stable` along one dimension.
//!
//! Elements are compared by value in their own dtype (i64 as i64, so large integers keep
//! their order); NaN counts as larger than every number, as PyTorch's `sort` and `max`
//! treat it: `argmax` and `argmin` both pick the first NaN of a line that has one, an
//! ascending sort puts NaNs last and a descending one first. Equal elements keep their
//! input order (the first of several maxima wins), so results never depend on the thread
//! count.

use std::cmp::Ordering;

use salus_graph::{DType, Reduction};

use super::{Arg, Out, Result, load, numel, store, tensor, word};

/// A line's geometry: `outer` lines of `len` elements `inner` apart.
struct Lines {
    outer: usize,
    len: usize,
    inner: usize,
}

impl Lines {
    /// The lines along the dims `lo..=hi` of `shape`, walked as one (row-major).
    fn along(shape: &[u64], lo: usize, hi: usize) -> Lines {
        Lines {
            outer: numel(&shape[..lo]),
            len: numel(&shape[lo..=hi]),
            inner: numel(&shape[hi + 1..]),
        }
    }

    /// Element `j` of line `(a, b)`.
    fn at(&self, a: usize, b: usize, j: usize) -> usize {
        (a * self.len + j) * self.inner + b
    }
}

/// Ascending order of elements `i` and `j` of a tensor: NaN after every number, equal
/// values (and -0 and +0) `Equal`.
fn compare(bytes: &[u8], dtype: DType, i: usize, j: usize) -> Ordering {
    if dtype == DType::I64 {
        let at = |k: usize| i64::from_le_bytes(word(bytes, k));
        return at(i).cmp(&at(j));
    }
    let (a, b) = (load(bytes, dtype, i), load(bytes, dtype, j));
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (false, false) => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

/// `argmax` (`largest`) or `argmin` over the dims of `r`: one dim, or every dim (the
/// index is then into the flattened input).
pub(super) fn arg_extreme(
    largest: bool,
    r: &Reduction,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let lines = match (r.dims.first(), r.dims.last()) {
        (Some(&lo), Some(&hi)) if hi - lo + 1 == r.dims.len() => Lines::along(&ty.shape, lo, hi),
        (None, _) => Lines::along(&[1], 0, 0),
        _ => {
            return Err(format!(
                "argmax and argmin reduce one dim or all, not {:?}",
                r.dims
            ));
        }
    };
    if lines.len == 0 {
        return Err(format!(
            "cannot take the arg of an extreme of the empty {ty}"
        ));
    }
    let wanted = if largest {
        Ordering::Greater
    } else {
        Ordering::Less
    };
    // A NaN wins over every number, and the first NaN over later ones.
    let nan = |k| ty.dtype.is_float() && load(bytes, ty.dtype, k).is_nan();
    for a in 0..lines.outer {
        for b in 0..lines.inner {
            let mut best = 0;
            if !nan(lines.at(a, b, 0)) {
                for j in 1..lines.len {
                    let at = lines.at(a, b, j);
                    if nan(at) {
                        best = j;
                        break;
                    }
                    if compare(bytes, ty.dtype, at, lines.at(a, b, best)) == wanted {
                        best = j;
                    }
                }
            }
            store(o.bytes, DType::I64, a * lines.inner + b, best as f64);
        }
    }
    Ok(())
}

/// `sort.stable` along `dim`: the values (copied bit for bit) and their input positions.
pub(super) fn sort(
    dim: usize,
    descending: bool,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let lines = if ty.rank() == 0 {
        Lines::along(&[1], 0, 0)
    } else {
        Lines::along(&ty.shape, dim, dim)
    };
    for out in outs.iter().flatten() {
        if out.ty.shape != ty.shape {
            return Err(format!(
                "output {} must have the shape of input {ty}",
                out.ty
            ));
        }
    }
    if let Some(Some(values)) = outs.first()
        && values.ty.dtype != ty.dtype
    {
        return Err(format!(
            "values {} must have the dtype of input {ty}",
            values.ty
        ));
    }
    let size = ty.dtype.size() as usize;
    let mut order: Vec<usize> = Vec::with_capacity(lines.len);
    for a in 0..lines.outer {
        for b in 0..lines.inner {
            order.clear();
            order.extend(0..lines.len);
            // `sort_by` is stable: equal elements keep their input order either way.
            order.sort_by(|&j, &k| {
                let ord = compare(bytes, ty.dtype, lines.at(a, b, j), lines.at(a, b, k));
                if descending { ord.reverse() } else { ord }
            });
            for (rank, &j) in order.iter().enumerate() {
                let (from, to) = (lines.at(a, b, j), lines.at(a, b, rank));
                if let Some(Some(values)) = outs.get_mut(0) {
                    values.bytes[to * size..(to + 1) * size]
                        .copy_from_slice(&bytes[from * size..(from + 1) * size]);
                }
                if let Some(Some(indices)) = outs.get_mut(1) {
                    store(indices.bytes, DType::I64, to, j as f64);
                }
            }
        }
    }
    Ok(())
}
