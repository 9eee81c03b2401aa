//! Matrix products through the `gemm` crate, behind a safe, bounds-checked interface.
//! Threads come from rayon's global pool, sized to the machine: concurrent lanes share
//! the cores instead of each starting its own threads.

#![allow(unsafe_code)]

/// A matrix inside a slice: `rows x cols`, element (i, j) at `i * row_stride + j * col_stride`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Mat<'_> {
    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

thread_local! {
    /// Products on this thread run on it alone ([`serial`]).
    static SERIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every product it makes on this thread alone: for kernels that already
/// split their work over the pool (one task per attention head), where each product
/// splitting itself again only adds hand-offs.
pub(crate) fn serial<R>(f: impl FnOnce() -> R) -> R {
    let before = SERIAL.with(|s| s.replace(true));
    let result = f();
    SERIAL.with(|s| s.set(before));
    result
}

/// `out[m x n] (row-major) = (accumulate ? out : 0) + scale * a x b`.
pub(crate) fn sgemm(
    a: Mat<'_>,
    b: Mat<'_>,
    out: &mut [f32],
    accumulate: bool,
    scale: f32,
) -> Result<(), String> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || !a.fits() || !b.fits() || out.len() < m * n {
        return Err(format!(
            "matrix product of {m}x{k} and {}x{n} does not fit its buffers",
            b.rows
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            out[..m * n].fill(0.0);
        }
        return Ok(());
    }
    // The pool's size, not `available_parallelism` (a system call that allocates).
    let threads = rayon::current_num_threads();
    let parallelism = if m * n * k >= 64 * 64 * 64 && threads > 1 && !SERIAL.with(|s| s.get()) {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every index the product touches is in bounds: `fits` checks the largest
    // element of `a` and `b`, and `out` holds `m * n` contiguous row-major elements.
    // `out` is a unique borrow, so it aliases neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_plain_product_including_transposed_operands() {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.5).collect();
        let mut out = vec![1.0; m * n];
        // b given transposed: stored n x k.
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        sgemm(
            Mat {
                data: &a,
                rows: m,
                cols: k,
                row_stride: k,
                col_stride: 1,
            },
            Mat {
                data: &bt,
                rows: k,
                cols: n,
                row_stride: 1,
                col_stride: k,
            },
            &mut out,
            true,
            2.0,
        )
        .unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f32 =
                    1.0 + 2.0 * (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f32>();
                assert!((out[i * n + j] - want).abs() < 1e-4, "{i} {j}");
            }
        }
        let short = vec![0.0; 3];
        assert!(
            sgemm(
                Mat {
                    data: &short,
                    rows: 2,
                    cols: 2,
                    row_stride: 2,
                    col_stride: 1
                },
                Mat {
                    data: &b,
                    rows: 2,
                    cols: 2,
                    row_stride: 2,
                    col_stride: 1
                },
                &mut out,
                false,
                1.0
            )
            .is_err()
        );
    }
}
