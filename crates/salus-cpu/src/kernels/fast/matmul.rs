//! Matrix products over f32: small products in a plain loop (no packing, no allocation,
//! no thread hand-off: they take microseconds), larger ones through `gemm`.

use super::{for_chunks, input, typed_mut};
use crate::blas::{Mat, sgemm};
use crate::kernels::{Arg, Out, Result};

/// Products with at most this many multiply-adds run in [`small`].
const SMALL: usize = 1 << 18;

fn fits(a: &Mat<'_>) -> bool {
    a.rows == 0
        || a.cols == 0
        || (a.rows - 1) * a.row_stride + (a.cols - 1) * a.col_stride < a.data.len()
}

/// How a loop multiplies and adds: fused where the CPU can.
pub(super) trait MulAdd {
    fn mul_add(x: f32, y: f32, acc: f32) -> f32;
}

/// Separate multiply and add (any x86-64).
struct Plain;

impl MulAdd for Plain {
    #[inline(always)]
    fn mul_add(x: f32, y: f32, acc: f32) -> f32 {
        acc + x * y
    }
}

/// Fused multiply-add (compiled into loops built for FMA only).
pub(super) struct Fused;

impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(x: f32, y: f32, acc: f32) -> f32 {
        x.mul_add(y, acc)
    }
}

/// `out[n x m] (row-major) = (accumulate ? out : 0) + alpha * a x b` in plain loops: rows
/// of `b` contiguous (axpy form) or rows of `a` and columns of `b` contiguous (dot form).
fn small(a: Mat<'_>, b: Mat<'_>, out: &mut [f32], accumulate: bool, alpha: f32) {
    if super::simd::has_fma() {
        super::simd::small_fused(a, b, out, accumulate, alpha);
    } else {
        small_with::<Plain>(a, b, out, accumulate, alpha);
    }
}

#[inline(always)]
pub(super) fn small_with<F: MulAdd>(
    a: Mat<'_>,
    b: Mat<'_>,
    out: &mut [f32],
    accumulate: bool,
    alpha: f32,
) {
    let (k, m) = (a.cols, b.cols);
    if b.col_stride == 1 {
        for (i, row) in out.chunks_exact_mut(m).enumerate() {
            if !accumulate {
                row.fill(0.0);
            }
            for p in 0..k {
                let x = alpha * a.data[i * a.row_stride + p * a.col_stride];
                let br = &b.data[p * b.row_stride..p * b.row_stride + m];
                row.iter_mut()
                    .zip(br)
                    .for_each(|(r, &y)| *r = F::mul_add(x, y, *r));
            }
        }
    } else if b.row_stride == 1 && a.col_stride == 1 {
        for (i, row) in out.chunks_exact_mut(m).enumerate() {
            let ar = &a.data[i * a.row_stride..i * a.row_stride + k];
            for (j, r) in row.iter_mut().enumerate() {
                let bc = &b.data[j * b.col_stride..j * b.col_stride + k];
                let d = alpha * dot::<F>(ar, bc);
                *r = if accumulate { *r + d } else { d };
            }
        }
    } else {
        for (i, row) in out.chunks_exact_mut(m).enumerate() {
            for (j, r) in row.iter_mut().enumerate() {
                let d: f32 = (0..k)
                    .map(|p| {
                        a.data[i * a.row_stride + p * a.col_stride]
                            * b.data[p * b.row_stride + j * b.col_stride]
                    })
                    .sum();
                *r = if accumulate {
                    *r + alpha * d
                } else {
                    alpha * d
                };
            }
        }
    }
}

/// A dot product over sixteen lanes.
#[inline(always)]
fn dot<F: MulAdd>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] = F::mul_add(x[l], y[l], acc[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out[n x m] (row-major) = (accumulate ? out : 0) + alpha * a x b`: small products in
/// plain loops, larger ones through `gemm`.
pub(super) fn gemm(
    a: Mat<'_>,
    b: Mat<'_>,
    out: &mut [f32],
    accumulate: bool,
    alpha: f32,
) -> Result<()> {
    let (n, k, m) = (a.rows, a.cols, b.cols);
    if b.rows != k || !fits(&a) || !fits(&b) || out.len() < n * m {
        return Err(format!(
            "matrix product of {n}x{k} and {}x{m} does not fit its buffers",
            b.rows
        ));
    }
    if n * k * m > SMALL {
        return sgemm(a, b, out, accumulate, alpha);
    }
    if n == 0 || m == 0 {
        return Ok(());
    }
    small(a, b, &mut out[..n * m], accumulate, alpha);
    Ok(())
}

/// A row-major `rows x cols` matrix.
pub(super) fn rows(data: &[f32], rows: usize, cols: usize) -> Mat<'_> {
    Mat {
        data,
        rows,
        cols,
        row_stride: cols,
        col_stride: 1,
    }
}

/// The transpose of a row-major `cols x rows` matrix.
pub(super) fn transposed(data: &[f32], rows: usize, cols: usize) -> Mat<'_> {
    Mat {
        data,
        rows,
        cols,
        row_stride: 1,
        col_stride: rows,
    }
}

/// A product of contiguous row-major matrices.
fn product(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    (n, k, m): (usize, usize, usize),
    accumulate: bool,
    alpha: f32,
) -> Result<()> {
    gemm(rows(a, n, k), rows(b, k, m), out, accumulate, alpha)
}

/// `mm` (`beta` `None`) and `addmm` (`beta * self + alpha * mat1 @ mat2`, `self`
/// broadcast from a matrix, a row or one value).
pub(super) fn matmul(
    beta: Option<f64>,
    alpha: f64,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Option<Result<()>> {
    let (first, bias) = if beta.is_some() {
        (1, Some(input::<f32>(args, 0)?))
    } else {
        (0, None)
    };
    let (aty, a) = input::<f32>(args, first)?;
    let (bty, b) = input::<f32>(args, first + 1)?;
    if aty.rank() != 2 || bty.rank() != 2 || aty.shape[1] != bty.shape[0] {
        return None;
    }
    let (n, k, m) = (
        aty.shape[0] as usize,
        aty.shape[1] as usize,
        bty.shape[1] as usize,
    );
    let (beta, alpha) = (beta.unwrap_or(1.0) as f32, alpha as f32);
    let dst = typed_mut::<f32>(o.ty, o.bytes)?;
    if dst.len() != n * m {
        return None;
    }
    let accumulate = match bias {
        Some((_, c)) if c.len() == n * m => {
            dst.iter_mut().zip(c).for_each(|(d, &c)| *d = beta * c);
            true
        }
        Some((_, c)) if c.len() == m && m > 0 => {
            for row in dst.chunks_exact_mut(m) {
                row.iter_mut().zip(c).for_each(|(d, &c)| *d = beta * c);
            }
            true
        }
        Some((_, [c])) => {
            dst.fill(beta * c);
            true
        }
        Some(_) => return None,
        None => false,
    };
    Some(product(a, b, dst, (n, k, m), accumulate, alpha))
}

pub(super) fn bmm(args: &[Arg<'_>], o: &mut Out<'_>) -> Option<Result<()>> {
    let (aty, a) = input::<f32>(args, 0)?;
    let (bty, b) = input::<f32>(args, 1)?;
    if aty.rank() != 3 || bty.rank() != 3 || aty.shape[2] != bty.shape[1] {
        return None;
    }
    let (batches, n, k, m) = (
        aty.shape[0] as usize,
        aty.shape[1] as usize,
        aty.shape[2] as usize,
        bty.shape[2] as usize,
    );
    let dst = typed_mut::<f32>(o.ty, o.bytes)?;
    if dst.len() != batches * n * m || n * m == 0 {
        return None;
    }
    let per = n * m;
    let mut error = std::sync::Mutex::new(None);
    for_chunks(dst, per, k.max(1), |start, chunk| {
        for (j, out) in chunk.chunks_exact_mut(per).enumerate() {
            let bi = start / per + j;
            let r = product(
                &a[bi * n * k..(bi + 1) * n * k],
                &b[bi * k * m..(bi + 1) * k * m],
                out,
                (n, k, m),
                false,
                1.0,
            );
            if let (Err(e), Ok(mut slot)) = (r, error.lock()) {
                slot.get_or_insert(e);
            }
        }
    });
    let error = error.get_mut().ok().and_then(|e| e.take());
    Some(error.map_or(Ok(()), Err))
}
