//! Slicing and indexing kernels: `slice.Tensor`, `select.int`, `index_select`,
//! `scatter_add`, `embedding_dense_backward`. Every index read from a tensor is checked
//! before it is used; a bad one fails the node with the index and the bound it broke.

use salus_graph::{Node, TensorType};

use super::{
    Arg, Out, Result, along_dim, attr_bool, attr_int, contiguous_strides, index_at, load, numel,
    store, tensor, wrap,
};

/// The tensor as `(outer, len, inner)` around dimension `d`: elements of the dims before
/// `d`, the size of `d`, elements of the dims after it.
fn around(shape: &[u64], d: usize) -> (usize, usize, usize) {
    let outer = shape[..d].iter().product::<u64>() as usize;
    let inner = shape[d + 1..].iter().product::<u64>() as usize;
    (outer, shape[d] as usize, inner)
}

/// Copies, for every outer position, the `inner`-element blocks `source_rows[j]` of the
/// input into row `j` of the output, byte for byte.
fn copy_rows(
    ty: &TensorType,
    bytes: &[u8],
    d: usize,
    source_rows: &[usize],
    o: &mut Out<'_>,
) -> Result<()> {
    if ty.dtype != o.ty.dtype {
        return Err(format!("input {ty} and output {} differ in dtype", o.ty));
    }
    let (outer, len, inner) = around(&ty.shape, d);
    let size = ty.dtype.size() as usize;
    let block = inner * size;
    let rows = source_rows.len();
    if o.bytes.len() != outer * rows * block {
        return Err(format!(
            "output {} does not hold {rows} rows of input {ty} along dimension {d}",
            o.ty
        ));
    }
    for a in 0..outer {
        for (j, &r) in source_rows.iter().enumerate() {
            let src = (a * len + r) * block;
            let dst = (a * rows + j) * block;
            o.bytes[dst..dst + block].copy_from_slice(&bytes[src..src + block]);
        }
    }
    Ok(())
}

/// `slice.Tensor`: elements `start, start + step, ... < end` along `dim`, with `start` and
/// `end` clamped to the dimension (negative counting from its end).
pub(super) fn slice(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    if ty.rank() == 0 {
        return Err("cannot slice a 0-dim tensor".into());
    }
    let d = wrap(attr_int(node, "dim", 0), ty.rank());
    let n = ty.shape[d] as i64;
    let step = attr_int(node, "step", 1);
    if step <= 0 {
        return Err(format!("step must be positive, got {step}"));
    }
    let clamp = |v: i64| {
        if v < 0 {
            v.saturating_add(n).max(0)
        } else {
            v.min(n)
        }
    };
    let start = clamp(attr_int(node, "start", 0));
    let end = clamp(attr_int(node, "end", n)).max(start);
    let rows: Vec<usize> = (start..end)
        .step_by(step as usize)
        .map(|r| r as usize)
        .collect();
    copy_rows(ty, bytes, d, &rows, o)
}

/// `select.int`: the `index`-th slice along `dim` (negative counting from the end), the
/// dimension removed.
pub(super) fn select(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    if ty.rank() == 0 {
        return Err("cannot select from a 0-dim tensor".into());
    }
    let d = wrap(attr_int(node, "dim", 0), ty.rank());
    let index = attr_int(node, "index", 0);
    let n = ty.shape[d] as i64;
    let row = if index < 0 { index + n } else { index };
    if !(0..n).contains(&row) {
        return Err(format!(
            "select index {index} is out of range for dimension {d} of size {n}"
        ));
    }
    copy_rows(ty, bytes, d, &[row as usize], o)
}

/// `index_select`: rows `index[0], index[1], ...` of `self` along `dim`.
pub(super) fn index_select(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let (ity, index) = tensor(args, 1)?;
    if ty.rank() == 0 {
        // A 0-dim self: the index may only name element 0 (or -1).
        for i in 0..numel(&ity.shape) {
            index_at(index, ity.dtype, i, 1, "index_select index")?;
        }
        o.bytes.copy_from_slice(bytes);
        return Ok(());
    }
    let d = wrap(attr_int(node, "dim", 0), ty.rank());
    let rows = (0..numel(&ity.shape))
        .map(|i| index_at(index, ity.dtype, i, ty.shape[d], "index_select index"))
        .collect::<Result<Vec<_>>>()?;
    copy_rows(ty, bytes, d, &rows, o)
}

/// `scatter_add(self, index, src)`: a copy of `self` with `src[i]` added at the place
/// `index[i]` names along `dim`; `index` may be smaller than `src` in every dimension.
pub(super) fn scatter_add(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let (ity, index) = tensor(args, 1)?;
    let (sty, src) = tensor(args, 2)?;
    let dim = wrap(attr_int(node, "dim", 0), ty.rank());
    if ity.rank() != sty.rank() || ity.shape.iter().zip(&sty.shape).any(|(i, s)| i > s) {
        return Err(format!("index {ity} must not be larger than src {sty}"));
    }
    let mut acc: Vec<f64> = (0..numel(&ty.shape))
        .map(|i| load(bytes, ty.dtype, i))
        .collect();
    let src_strides = contiguous_strides(&sty.shape);
    let index_strides = contiguous_strides(&ity.shape);
    along_dim(&ty.shape, ity, index, dim, |dst, i| {
        // The element of src at index element i's coordinates.
        let (mut rest, mut at) = (i, 0);
        for (is, ss) in index_strides.iter().zip(&src_strides) {
            at += rest / is * ss;
            rest %= is;
        }
        acc[dst] += load(src, sty.dtype, at);
    })?;
    for (i, v) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

/// `embedding_dense_backward(grad_output, indices)`: `[num_weights, D]`, row `r` the sum
/// of the gradient rows whose index is `r` (divided by how often `r` occurs when
/// `scale_grad_by_freq`); the `padding_idx` row (if >= 0) stays zero.
pub(super) fn embedding_backward(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (gty, grad) = tensor(args, 0)?;
    let (ity, indices) = tensor(args, 1)?;
    let rows = o.ty.shape.first().copied().unwrap_or(0);
    let width = gty.shape.last().copied().unwrap_or(1) as usize;
    let count = numel(&ity.shape);
    if numel(&gty.shape) != count * width || o.ty.shape != [rows, width as u64] {
        return Err(format!(
            "grad_output {gty} must hold one row of the output {} per index of {ity}",
            o.ty
        ));
    }
    let padding = attr_int(node, "padding_idx", -1);
    let at = (0..count)
        .map(|i| {
            index_at(
                indices,
                ity.dtype,
                i,
                rows,
                "embedding_dense_backward index",
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let mut freq = vec![0usize; rows as usize];
    for &r in &at {
        freq[r] += 1;
    }
    let scale = attr_bool(node, "scale_grad_by_freq");
    let mut acc = vec![0.0; rows as usize * width];
    for (i, &r) in at.iter().enumerate() {
        if padding >= 0 && r as i64 == padding {
            continue;
        }
        let factor = if scale { 1.0 / freq[r] as f64 } else { 1.0 };
        for j in 0..width {
            acc[r * width + j] += factor * load(grad, gty.dtype, i * width + j);
        }
    }
    for (i, v) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}
