//! Slicing and indexing kernels: `slice.Tensor`, `select.int`, `index_select`, `gather`,
//! `scatter.value`, `scatter_add`, `index_put`, `embedding` and `embedding_dense_backward`. Every index read from a tensor is checked
//! before it is used; a bad one fails the node with the index and the bound it broke.

use salus_graph::TensorType;

use super::{Arg, Out, Result, contiguous_strides, index_at, load, numel, store, tensor};

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

/// `scatter_add(self, index, src)`: a copy of `self` with `src[i]` added at the place
/// `index[i]` names along `dim`; `index` may be smaller than `src` in every dimension.
pub(super) fn scatter_add(dim: usize, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
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
        acc[dst] += load(src, sty.dtype, at);
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

/// `index_put(self, indices, values)`: a copy of `self` with `values` written (or added,
/// when `accumulate`) at the places the leading integer index tensors name.
pub(super) fn index_put(accumulate: bool, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let n = args.len() - 2;
    let (vty, vbytes) = tensor(args, n + 1)?;
    o.bytes.copy_from_slice(bytes);
    // Supported form: leading integer indices of one shape, the rest of the dims sliced.
    let mut index_shape: Option<&[u64]> = None;
    for k in 0..n {
        match &args[1 + k] {
            Arg::Tensor(ity, _) if ity.dtype.is_int() => match index_shape {
                None => index_shape = Some(&ity.shape),
                Some(s) if s == ity.shape.as_slice() => {}
                Some(_) => {
                    return Err(
                        "index_put with indices of different shapes is not supported yet".into(),
                    );
                }
            },
            _ => return Err("index_put supports leading integer indices only so far".into()),
        }
    }
    let count = index_shape.map_or(1, numel);
    let inner: usize = ty.shape[n..].iter().product::<u64>() as usize;
    let strides = contiguous_strides(&ty.shape);
    // Values are either one per indexed element, one row shared by all, or a scalar.
    let value_strides = match numel(&vty.shape) {
        n if n == count * inner => [inner, 1],
        n if n == inner => [0, 1],
        1 => [0, 0],
        _ => {
            return Err(format!(
                "values {vty} do not fit {count} indexed rows of {inner}"
            ));
        }
    };
    for i in 0..count {
        let mut base = 0;
        for (k, (&size, &stride)) in ty.shape.iter().zip(&strides).take(n).enumerate() {
            let (ity, ib) = tensor(args, 1 + k)?;
            base += index_at(ib, ity.dtype, i, size, "index_put index")? * stride;
        }
        for j in 0..inner {
            let v = load(
                vbytes,
                vty.dtype,
                i * value_strides[0] + j * value_strides[1],
            );
            let cur = if accumulate {
                load(o.bytes, o.ty.dtype, base + j)
            } else {
                0.0
            };
            store(o.bytes, o.ty.dtype, base + j, cur + v);
        }
    }
    Ok(())
}
