//! Slicing and indexing kernels: `slice.Tensor`, `select.int`, `index_select`, `gather`,
//! `scatter.value`, `scatter_add`, `index.Tensor`, `index_put`, `embedding` and
//! `embedding_dense_backward`. Every index read from a tensor is checked before it is
//! used; a bad one fails the node with the index and the bound it broke.

use salus_graph::{AdvancedIndex, TensorType};

use super::{
    Arg, Out, Result, as_f32, as_f32_mut, broadcast_strides, contiguous_strides, index_at, load,
    numel, store, tensor,
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

/// `slice.Tensor`: the `len` elements `start, start + step, ...` along `d` (validation
/// clamped the bounds to the dimension).
pub(super) fn slice(
    d: usize,
    start: u64,
    step: u64,
    len: u64,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let rows: Vec<usize> = (0..len).map(|i| (start + i * step) as usize).collect();
    copy_rows(ty, bytes, d, &rows, o)
}

/// `select.int`: the `index`-th slice along `d` (validation normalised and checked the
/// index), the dimension removed.
pub(super) fn select(d: usize, index: u64, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    copy_rows(ty, bytes, d, &[index as usize], o)
}

/// `index_select`: rows `index[0], index[1], ...` of `self` along `dim`.
pub(super) fn index_select(d: usize, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
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
    let rows = (0..numel(&ity.shape))
        .map(|i| index_at(index, ity.dtype, i, ty.shape[d], "index_select index"))
        .collect::<Result<Vec<_>>>()?;
    copy_rows(ty, bytes, d, &rows, o)
}

/// `scatter_add(self, index, src)`, `scatter.src` and `scatter_reduce.two`: a copy of
/// `self` where each `src[i]` meets the place `index[i]` names along `dim` and the place
/// becomes `combine(place, src[i])`; `index` may be smaller than `src` in every
/// dimension. Where `scatter.src` names a place twice, the last write (in index order)
/// stays.
pub(super) fn scatter(
    dim: usize,
    combine: fn(f64, f64) -> f64,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let (ity, index) = tensor(args, 1)?;
    let (sty, src) = tensor(args, 2)?;
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
        let v = load(src, sty.dtype, at);
        acc[dst] = combine(acc[dst], v);
    })?;
    for (i, v) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

/// `embedding_dense_backward(grad_output, indices)`: `[num_weights, D]`, row `r` the sum
/// of the gradient rows whose index is `r` (divided by how often `r` occurs when
/// `scale_grad_by_freq`); the `padding_idx` row (if any) stays zero.
pub(super) fn embedding_backward(
    padding_idx: Option<u64>,
    scale_grad_by_freq: bool,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
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
    let mut acc = vec![0.0; rows as usize * width];
    for (i, &r) in at.iter().enumerate() {
        if padding_idx == Some(r as u64) {
            continue;
        }
        let factor = if scale_grad_by_freq {
            1.0 / freq[r] as f64
        } else {
            1.0
        };
        for j in 0..width {
            acc[r * width + j] += factor * load(grad, gty.dtype, i * width + j);
        }
    }
    for (i, v) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

/// Calls `f(self_offset, index_position)` for every element of `index` along `dim`.
fn along_dim(
    self_shape: &[u64],
    index_ty: &TensorType,
    index: &[u8],
    dim: usize,
    mut f: impl FnMut(usize, usize),
) -> Result<()> {
    let strides = contiguous_strides(self_shape);
    let index_strides = contiguous_strides(&index_ty.shape);
    let mut error = None;
    for i in 0..numel(&index_ty.shape) {
        let mut offset = 0;
        let mut rest = i;
        for d in 0..index_ty.rank() {
            let coord = rest / index_strides[d];
            rest %= index_strides[d];
            let coord = if d == dim {
                match index_at(index, index_ty.dtype, i, self_shape[d], "index") {
                    Ok(c) => c,
                    Err(e) => {
                        error.get_or_insert(e);
                        0
                    }
                }
            } else if coord as u64 >= self_shape[d] {
                error.get_or_insert(format!(
                    "index shape {:?} exceeds input shape {self_shape:?}",
                    index_ty.shape
                ));
                0
            } else {
                coord
            };
            offset += coord * strides[d];
        }
        if error.is_some() {
            break;
        }
        f(offset, i);
    }
    error.map_or(Ok(()), Err)
}

/// `gather`: `out[i] = self[index[i]]` along `dim`, the other coordinates those of `i`.
pub(super) fn gather(dim: usize, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let (ity, index) = tensor(args, 1)?;
    along_dim(&ty.shape, ity, index, dim, |src, i| {
        store(o.bytes, o.ty.dtype, i, load(bytes, ty.dtype, src));
    })
}

/// `scatter.value`: a copy of `self` with `value` at the places `index` names along `dim`.
pub(super) fn scatter_value(
    dim: usize,
    value: f64,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let (ity, index) = tensor(args, 1)?;
    o.bytes.copy_from_slice(bytes);
    let out_bytes = &mut *o.bytes;
    let dtype = o.ty.dtype;
    along_dim(&ty.shape, ity, index, dim, |dst, _| {
        store(out_bytes, dtype, dst, value)
    })
}

/// `embedding(weight, indices)`: row `indices[i]` of `weight` for each index.
pub(super) fn embedding(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (wty, wbytes) = tensor(args, 0)?;
    let (ity, ibytes) = tensor(args, 1)?;
    let (rows, width) = (wty.shape[0], wty.shape[1] as usize);
    let size = wty.dtype.size() as usize;
    for i in 0..numel(&ity.shape) {
        let row = index_at(ibytes, ity.dtype, i, rows, "embedding index")?;
        o.bytes[i * width * size..(i + 1) * width * size]
            .copy_from_slice(&wbytes[row * width * size..(row + 1) * width * size]);
    }
    Ok(())
}

/// Calls `f(position, coordinates, offset)` for every element of the selection `index`
/// makes of a tensor of `self_shape` (`position` in the selection, `offset` the element
/// of self it selects); the index tensors are `args[1 + k]`. A bad index fails with
/// `what`.
fn for_each_selected(
    index: &AdvancedIndex,
    self_shape: &[u64],
    args: &[Arg<'_>],
    what: &str,
    mut f: impl FnMut(usize, &[usize], usize),
) -> Result<()> {
    let strides = contiguous_strides(self_shape);
    let selection = &index.shape;
    let whole = index.whole_dims();
    let mut indexed = Vec::new();
    for (d, k) in index.dims.iter().enumerate() {
        let Some(k) = *k else { continue };
        let (ity, bytes) = tensor(args, 1 + k)?;
        // The index tensor's strides over the selection's dims.
        let mut st = vec![0; selection.len()];
        let own = broadcast_strides(&ity.shape, &index.index_shape);
        st[index.index_at..index.index_at + own.len()].copy_from_slice(&own);
        indexed.push((d, ity.dtype, bytes, st));
    }
    let mut coord = vec![0usize; selection.len()];
    for p in 0..numel(selection) {
        let mut rest = p;
        for r in (0..selection.len()).rev() {
            let n = selection[r] as usize;
            coord[r] = rest % n;
            rest /= n;
        }
        let mut offset = 0;
        for (d, r) in whole.iter().enumerate() {
            if let Some(r) = r {
                offset += coord[*r] * strides[d];
            }
        }
        for (d, dtype, bytes, st) in &indexed {
            let j = coord.iter().zip(st).map(|(c, s)| c * s).sum();
            offset += index_at(bytes, *dtype, j, self_shape[*d], what)? * strides[*d];
        }
        f(p, &coord, offset);
    }
    Ok(())
}

/// Whole rows of `self`: one index tensor, on dimension 0, selecting rows into a selection
/// of the index tensor's shape followed by the rows' (an embedding's lookup and its
/// gradient's `index_put`). The row each index selects, in the selection's order, each
/// index checked; `None` for any other indexing.
fn leading_rows(
    index: &AdvancedIndex,
    self_shape: &[u64],
    args: &[Arg<'_>],
    what: &str,
) -> Result<Option<Vec<usize>>> {
    let lone = index.dims.first() == Some(&Some(0))
        && index.dims[1..].iter().all(Option::is_none)
        && index.index_at == 0;
    if !lone || self_shape.is_empty() {
        return Ok(None);
    }
    let (ity, bytes) = tensor(args, 1)?;
    let rows_shape = &self_shape[1..];
    if ity.shape != index.index_shape
        || index.shape.len() != ity.shape.len() + rows_shape.len()
        || index.shape[ity.shape.len()..] != *rows_shape
    {
        return Ok(None);
    }
    (0..numel(&ity.shape))
        .map(|j| index_at(bytes, ity.dtype, j, self_shape[0], what))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// `index.Tensor(self, indices)`: the elements of `self` the index tensors select, in the
/// selection's shape.
pub(super) fn index(index: &AdvancedIndex, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    if ty.dtype != o.ty.dtype || o.ty.shape != index.shape {
        return Err(format!("output {} must be {:?} of {ty}", o.ty, index.shape));
    }
    let size = ty.dtype.size() as usize;
    let out = &mut *o.bytes;
    if let Some(rows) = leading_rows(index, &ty.shape, args, "index")? {
        let row = numel(&ty.shape[1..]) * size;
        for (p, r) in rows.into_iter().enumerate() {
            out[p * row..(p + 1) * row].copy_from_slice(&bytes[r * row..(r + 1) * row]);
        }
        return Ok(());
    }
    for_each_selected(index, &ty.shape, args, "index", |p, _, at| {
        out[p * size..(p + 1) * size].copy_from_slice(&bytes[at * size..(at + 1) * size]);
    })
}

/// `index_put(self, indices, values)`: a copy of `self` with `values` (broadcast to the
/// selection) written at the selected places, or added to them when `accumulate`
/// (repeated places add up). Bool mask indices are refused.
pub(super) fn index_put(
    accumulate: bool,
    index: Option<&AdvancedIndex>,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let Some(index) = index else {
        return Err("index_put with a bool (mask) index is not supported".into());
    };
    let (ty, bytes) = tensor(args, 0)?;
    let n = args.len() - 2;
    let (vty, vbytes) = tensor(args, n + 1)?;
    if vty.dtype != o.ty.dtype || ty != o.ty {
        return Err(format!("values {vty} and output {} must be {ty}", o.ty));
    }
    o.bytes.copy_from_slice(bytes);
    let selection = &index.shape;
    let value_strides = broadcast_strides(&vty.shape, selection);
    let size = ty.dtype.size() as usize;
    let dtype = o.ty.dtype;
    let out = &mut *o.bytes;
    if vty.shape == *selection
        && let Some(rows) = leading_rows(index, &ty.shape, args, "index_put index")?
    {
        // Row by row, in the selection's order (repeated rows add up in that order).
        let n = numel(&ty.shape[1..]);
        for (p, r) in rows.into_iter().enumerate() {
            let to = &mut out[r * n * size..(r + 1) * n * size];
            let from = &vbytes[p * n * size..(p + 1) * n * size];
            if !accumulate {
                to.copy_from_slice(from);
            } else if let (Some(o), Some(v)) = (as_f32_mut(to, dtype), as_f32(from, dtype)) {
                for (o, v) in o.iter_mut().zip(v) {
                    *o += v;
                }
            } else {
                for k in 0..n {
                    store(to, dtype, k, load(to, dtype, k) + load(from, dtype, k));
                }
            }
        }
        return Ok(());
    }
    for_each_selected(index, &ty.shape, args, "index_put index", |_, coord, at| {
        let v: usize = coord.iter().zip(&value_strides).map(|(c, s)| c * s).sum();
        if accumulate {
            store(
                out,
                dtype,
                at,
                load(out, dtype, at) + load(vbytes, dtype, v),
            );
        } else {
            out[at * size..(at + 1) * size].copy_from_slice(&vbytes[v * size..(v + 1) * size]);
        }
    })
}
