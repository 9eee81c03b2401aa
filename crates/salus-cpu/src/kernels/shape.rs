//! Shape ops in the generic path, for any dtype: views (`view`, `unsqueeze`,
//! `squeeze.dims`: the bytes as they are), `permute`, `expand`, `flip`, `cat` and
//! `split_with_sizes`.

use super::{
    Arg, Out, Result, broadcast_strides, contiguous_strides, for_each_index, load, store, tensor,
};

/// A view: the output's bytes are the input's.
pub(super) fn view(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (_, bytes) = tensor(args, 0)?;
    o.bytes.copy_from_slice(&bytes[..o.bytes.len()]);
    Ok(())
}

/// `permute`: output dimension `i` is input dimension `dims[i]`.
pub(super) fn permute(dims: &[usize], args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let own = contiguous_strides(&ty.shape);
    let strides: Vec<usize> = dims.iter().map(|&d| own[d]).collect();
    copy_strided(ty.dtype.size() as usize, bytes, strides, o);
    Ok(())
}

/// `expand`: size-1 and new leading dimensions repeated.
pub(super) fn expand(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let strides = broadcast_strides(&ty.shape, &o.ty.shape);
    copy_strided(ty.dtype.size() as usize, bytes, strides, o);
    Ok(())
}

/// `flip`: the elements in reverse order along each of `dims` (sorted).
pub(super) fn flip(dims: &[usize], args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    if ty != o.ty {
        return Err(format!("output {} must be input {ty}", o.ty));
    }
    let size = ty.dtype.size() as usize;
    let strides = contiguous_strides(&ty.shape);
    for i in 0..o.bytes.len() / size.max(1) {
        let mut src = i;
        for &d in dims {
            let n = ty.shape[d] as usize;
            let c = i / strides[d] % n;
            src = src + (n - 1 - c) * strides[d] - c * strides[d];
        }
        o.bytes[i * size..(i + 1) * size].copy_from_slice(&bytes[src * size..(src + 1) * size]);
    }
    Ok(())
}

/// Copies elements of `size` bytes into the output in its order, reading the input along
/// `strides` (in elements, one per output dimension).
fn copy_strided(size: usize, bytes: &[u8], strides: Vec<usize>, o: &mut Out<'_>) {
    for_each_index(&o.ty.shape, &[strides], |i, offs| {
        o.bytes[i * size..(i + 1) * size]
            .copy_from_slice(&bytes[offs[0] * size..(offs[0] + 1) * size]);
    });
}

/// `cat` along dimension `d`: each input's blocks after the previous inputs'.
pub(super) fn cat(d: usize, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let outer: usize = o.ty.shape[..d].iter().product::<u64>() as usize;
    let inner: usize = o.ty.shape[d + 1..].iter().product::<u64>() as usize;
    let out_len = o.ty.shape[d] as usize;
    let mut at = 0;
    for arg in args {
        let (ty, bytes) = match arg {
            Arg::Tensor(ty, bytes) => (*ty, *bytes),
            _ => return Err("cat inputs must be tensors".into()),
        };
        let len = ty.shape[d] as usize;
        if ty.dtype == o.ty.dtype {
            // Blocks of the same dtype: copied whole.
            let size = ty.dtype.size() as usize;
            let block = len * inner * size;
            for a in 0..outer {
                let to = (a * out_len + at) * inner * size;
                o.bytes[to..to + block].copy_from_slice(&bytes[a * block..(a + 1) * block]);
            }
            at += len;
            continue;
        }
        for a in 0..outer {
            for j in 0..len * inner {
                let v = load(bytes, ty.dtype, a * len * inner + j);
                store(o.bytes, o.ty.dtype, a * out_len * inner + at * inner + j, v);
            }
        }
        at += len;
    }
    Ok(())
}

/// `split_with_sizes` along dimension `d`: output `j` takes the next `sizes[j]` rows.
pub(super) fn split(
    d: usize,
    sizes: &[u64],
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let outer: usize = ty.shape[..d].iter().product::<u64>() as usize;
    let inner: usize = ty.shape[d + 1..].iter().product::<u64>() as usize;
    let total = ty.shape[d] as usize;
    let size = ty.dtype.size() as usize;
    let mut at = 0;
    for (out, &len) in outs.iter_mut().zip(sizes) {
        let len = len as usize;
        if let Some(out) = out {
            for a in 0..outer {
                let src = (a * total + at) * inner * size;
                let dst = a * len * inner * size;
                out.bytes[dst..dst + len * inner * size]
                    .copy_from_slice(&bytes[src..src + len * inner * size]);
            }
        }
        at += len;
    }
    Ok(())
}
