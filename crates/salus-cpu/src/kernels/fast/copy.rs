//! Shape copies: permute, expand and plain copies, as strided copies with a contiguous
//! (or single-strided) inner loop, for any dtype by element size.

use bytemuck::Pod;

use super::{Broadcast, MAX_RANK, for_chunks};
use crate::kernels::{Arg, Out, Result, tensor};

/// Copies `src` into `dst` (`dst` in row-major order of `shape`; element `i` of it from
/// `src` along `strides` per dim).
fn strided<T: Pod + Send + Sync>(
    shape: &[u64],
    strides: [usize; MAX_RANK],
    src: &[T],
    dst: &mut [T],
) -> Option<()> {
    if dst.is_empty() {
        return Some(());
    }
    let b = Broadcast::<1>::with_strides(shape, [strides])?;
    let inner = b.strides[0][b.rank - 1];
    // The largest offset read must lie in `src`.
    let last: usize = (0..b.rank).map(|d| (b.dims[d] - 1) * b.strides[0][d]).sum();
    if last >= src.len() {
        return None;
    }
    if b.rank >= 2 && inner > 1 && b.strides[0][b.rank - 2] == 1 {
        transposed(&b, src, dst);
        return Some(());
    }
    for_chunks(dst, 1, 1, |start, chunk| {
        b.segments(start, chunk.len(), |at, len, [off]| {
            let o = &mut chunk[at..at + len];
            match inner {
                1 => o.copy_from_slice(&src[off..off + len]),
                0 => o.fill(src[off]),
                s => o
                    .iter_mut()
                    .zip(src[off..].iter().step_by(s))
                    .for_each(|(o, &x)| *o = x),
            }
        });
    });
    Some(())
}

/// Rows and columns of a transposing copy done together, in tiles of this many.
const TILE: usize = 32;

/// The copy of [`strided`] where the output's last dim reads the input along a stride and
/// the one before it reads it contiguously: matrices transposed, in tiles, so that both
/// the reads (down a tile's rows) and the writes (along its columns) stay in cache.
fn transposed<T: Pod + Send + Sync>(b: &Broadcast<1>, src: &[T], dst: &mut [T]) {
    let r = b.rank;
    let (rows, cols) = (b.dims[r - 2], b.dims[r - 1]);
    let column = b.strides[0][r - 1];
    // Whole rows per chunk; a tile never crosses from one matrix into the next.
    for_chunks(dst, cols, 1, |start, chunk| {
        let first = start / cols;
        let count = chunk.len() / cols;
        let mut at = 0;
        while at < count {
            let row = first + at;
            let (matrix, r0) = (row / rows, row % rows);
            let height = TILE.min(rows - r0).min(count - at);
            // The matrix's first element in `src`, from its index over the outer dims.
            let mut base = 0;
            let mut rest = matrix;
            for d in (0..r - 2).rev() {
                base += rest % b.dims[d] * b.strides[0][d];
                rest /= b.dims[d];
            }
            let tile = &mut chunk[at * cols..(at + height) * cols];
            for c0 in (0..cols).step_by(TILE) {
                for c in c0..(c0 + TILE).min(cols) {
                    let from = &src[base + r0 + c * column..][..height];
                    for (i, &x) in from.iter().enumerate() {
                        tile[i * cols + c] = x;
                    }
                }
            }
            at += height;
        }
    });
}

/// A strided copy of any element size.
fn copy_bytes(
    shape: &[u64],
    strides: [usize; MAX_RANK],
    size: u64,
    src: &[u8],
    dst: &mut [u8],
) -> Option<()> {
    fn go<T: Pod + Send + Sync>(
        shape: &[u64],
        strides: [usize; MAX_RANK],
        src: &[u8],
        dst: &mut [u8],
    ) -> Option<()> {
        strided::<T>(
            shape,
            strides,
            bytemuck::try_cast_slice(src).ok()?,
            bytemuck::try_cast_slice_mut(dst).ok()?,
        )
    }
    match size {
        1 => go::<u8>(shape, strides, src, dst),
        2 => go::<u16>(shape, strides, src, dst),
        4 => go::<u32>(shape, strides, src, dst),
        8 => go::<u64>(shape, strides, src, dst),
        _ => None,
    }
}

fn contiguous(shape: &[u64]) -> Option<[usize; MAX_RANK]> {
    if shape.len() > MAX_RANK {
        return None;
    }
    let mut s = [0usize; MAX_RANK];
    let mut stride = 1;
    for d in (0..shape.len()).rev() {
        s[d] = stride;
        stride *= shape[d] as usize;
    }
    Some(s)
}

/// A copy to the same type.
pub(super) fn same(args: &[Arg<'_>], o: &mut Out<'_>) -> Option<Result<()>> {
    let (_, bytes) = tensor(args, 0).ok()?;
    let n = o.bytes.len();
    if bytes.len() != n {
        return None;
    }
    for_chunks(o.bytes, 1, 1, |start, chunk| {
        chunk.copy_from_slice(&bytes[start..start + chunk.len()]);
    });
    Some(Ok(()))
}

/// `permute`: output dimension `i` is input dimension `dims[i]`.
pub(super) fn permute(dims: &[usize], args: &[Arg<'_>], o: &mut Out<'_>) -> Option<Result<()>> {
    let (ty, bytes) = tensor(args, 0).ok()?;
    if ty.dtype != o.ty.dtype || dims.len() != ty.rank() || o.ty.rank() != ty.rank() {
        return None;
    }
    let own = contiguous(&ty.shape)?;
    let mut strides = [0usize; MAX_RANK];
    for (i, &d) in dims.iter().enumerate() {
        if d >= ty.rank() || ty.shape[d] != o.ty.shape[i] {
            return None;
        }
        strides[i] = own[d];
    }
    copy_bytes(&o.ty.shape, strides, ty.dtype.size(), bytes, o.bytes).map(Ok)
}

pub(super) fn expand(args: &[Arg<'_>], o: &mut Out<'_>) -> Option<Result<()>> {
    let (ty, bytes) = tensor(args, 0).ok()?;
    if ty.dtype != o.ty.dtype || ty.rank() > o.ty.rank() {
        return None;
    }
    let own = contiguous(&ty.shape)?;
    let lead = o.ty.rank() - ty.rank();
    let mut strides = [0usize; MAX_RANK];
    for d in 0..ty.rank() {
        if ty.shape[d] != 1 {
            if ty.shape[d] != o.ty.shape[lead + d] {
                return None;
            }
            strides[lead + d] = own[d];
        }
    }
    copy_bytes(&o.ty.shape, strides, ty.dtype.size(), bytes, o.bytes).map(Ok)
}
