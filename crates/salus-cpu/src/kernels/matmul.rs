//! Matrix products in `f64` for every dtype, and through [`sgemm`] for f32 operands the
//! typed kernels did not take: `mm`, `addmm` and `bmm`. f16 and bf16 operands are widened
//! to f32 and multiplied by [`sgemm`] too, accumulating in f32 as PyTorch's CPU kernels
//! do (the result rounded once, by `store`).

use salus_graph::{DType, TensorType};

use super::{
    Arg, Out, Result, as_f32, as_f32_mut, broadcast_strides, for_each_index, load, store, tensor,
};
use crate::blas::{Mat, sgemm};

/// A row-major `rows x cols` matrix.
fn rows(data: &[f32], rows: usize, cols: usize) -> Mat<'_> {
    Mat {
        data,
        rows,
        cols,
        row_stride: cols,
        col_stride: 1,
    }
}

/// Operands and result of one 16-bit type: the product is computed in f32.
fn half_product(operands: [&TensorType; 2], out: &TensorType) -> bool {
    matches!(out.dtype, DType::F16 | DType::Bf16) && operands.iter().all(|t| t.dtype == out.dtype)
}

/// The elements of a 16-bit tensor, widened to f32 (exactly).
fn widened(ty: &TensorType, bytes: &[u8]) -> Vec<f32> {
    let n = ty.shape.iter().product::<u64>() as usize;
    (0..n).map(|i| load(bytes, ty.dtype, i) as f32).collect()
}

/// `mm` (`beta` `None`) and `addmm` (`beta * self + alpha * mat1 @ mat2`).
pub(super) fn matmul(
    beta: Option<f64>,
    alpha: f64,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (a, b, bias) = match beta {
        Some(beta) => (
            tensor(args, 1)?,
            tensor(args, 2)?,
            Some((beta, tensor(args, 0)?)),
        ),
        None => (tensor(args, 0)?, tensor(args, 1)?, None),
    };
    let (n, k, m) = (
        a.0.shape[0] as usize,
        a.0.shape[1] as usize,
        b.0.shape[1] as usize,
    );
    if let (Some(av), Some(bv), Some(dst)) = (
        as_f32(a.1, a.0.dtype),
        as_f32(b.1, b.0.dtype),
        as_f32_mut(o.bytes, o.ty.dtype),
    ) {
        let accumulate = match bias {
            Some((beta, (bty, bbytes))) => {
                let strides = broadcast_strides(&bty.shape, &o.ty.shape);
                for_each_index(&o.ty.shape, &[strides], |i, offs| {
                    dst[i] = (beta * load(bbytes, bty.dtype, offs[0])) as f32;
                });
                true
            }
            None => false,
        };
        return sgemm(
            Mat {
                data: av,
                rows: n,
                cols: k,
                row_stride: k,
                col_stride: 1,
            },
            Mat {
                data: bv,
                rows: k,
                cols: m,
                row_stride: m,
                col_stride: 1,
            },
            dst,
            accumulate,
            alpha as f32,
        );
    }
    if half_product([a.0, b.0], o.ty) {
        let mut product = vec![0.0f32; n * m];
        sgemm(
            rows(&widened(a.0, a.1), n, k),
            rows(&widened(b.0, b.1), k, m),
            &mut product,
            false,
            1.0,
        )?;
        let mut c: Vec<f64> = product.into_iter().map(f64::from).collect();
        match bias {
            Some((beta, (bty, bbytes))) => {
                let strides = broadcast_strides(&bty.shape, &o.ty.shape);
                for_each_index(&o.ty.shape, &[strides], |i, offs| {
                    c[i] = beta * load(bbytes, bty.dtype, offs[0]) + alpha * c[i];
                });
            }
            None => c.iter_mut().for_each(|v| *v *= alpha),
        }
        for (i, v) in c.into_iter().enumerate() {
            store(o.bytes, o.ty.dtype, i, v);
        }
        return Ok(());
    }
    let av: Vec<f64> = (0..n * k).map(|i| load(a.1, a.0.dtype, i)).collect();
    let bv: Vec<f64> = (0..k * m).map(|i| load(b.1, b.0.dtype, i)).collect();
    let mut c = vec![0.0f64; n * m];
    for i in 0..n {
        for p in 0..k {
            let x = av[i * k + p];
            if x == 0.0 {
                continue;
            }
            let row = &bv[p * m..(p + 1) * m];
            for (cj, bj) in c[i * m..(i + 1) * m].iter_mut().zip(row) {
                *cj += x * bj;
            }
        }
    }
    if let Some((beta, (bty, bbytes))) = bias {
        let strides = broadcast_strides(&bty.shape, &o.ty.shape);
        for_each_index(&o.ty.shape, &[strides], |i, offs| {
            c[i] = beta * load(bbytes, bty.dtype, offs[0]) + alpha * c[i];
        });
    }
    for (i, v) in c.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

/// `bmm`: one product per batch.
pub(super) fn bmm(args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (aty, a) = tensor(args, 0)?;
    let (bty, b) = tensor(args, 1)?;
    let (batches, n, k, m) = (
        aty.shape[0] as usize,
        aty.shape[1] as usize,
        aty.shape[2] as usize,
        bty.shape[2] as usize,
    );
    if let (Some(av), Some(bv), Some(dst)) = (
        as_f32(a, aty.dtype),
        as_f32(b, bty.dtype),
        as_f32_mut(o.bytes, o.ty.dtype),
    ) {
        for bi in 0..batches {
            sgemm(
                Mat {
                    data: &av[bi * n * k..(bi + 1) * n * k],
                    rows: n,
                    cols: k,
                    row_stride: k,
                    col_stride: 1,
                },
                Mat {
                    data: &bv[bi * k * m..(bi + 1) * k * m],
                    rows: k,
                    cols: m,
                    row_stride: m,
                    col_stride: 1,
                },
                &mut dst[bi * n * m..(bi + 1) * n * m],
                false,
                1.0,
            )?;
        }
        return Ok(());
    }
    if half_product([aty, bty], o.ty) {
        let (av, bv) = (widened(aty, a), widened(bty, b));
        let mut product = vec![0.0f32; n * m];
        for bi in 0..batches {
            sgemm(
                rows(&av[bi * n * k..(bi + 1) * n * k], n, k),
                rows(&bv[bi * k * m..(bi + 1) * k * m], k, m),
                &mut product,
                false,
                1.0,
            )?;
            for (j, &v) in product.iter().enumerate() {
                store(o.bytes, o.ty.dtype, bi * n * m + j, f64::from(v));
            }
        }
        return Ok(());
    }
    for bi in 0..batches {
        for i in 0..n {
            let mut row = vec![0.0; m];
            for p in 0..k {
                let x = load(a, aty.dtype, (bi * n + i) * k + p);
                for (j, r) in row.iter_mut().enumerate() {
                    *r += x * load(b, bty.dtype, (bi * k + p) * m + j);
                }
            }
            for (j, v) in row.into_iter().enumerate() {
                store(o.bytes, o.ty.dtype, (bi * n + i) * m + j, v);
            }
        }
    }
    Ok(())
}
