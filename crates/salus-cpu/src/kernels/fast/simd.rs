//! Loops compiled for AVX2 and FMA, run when the CPU has them (checked at run time: the
//! build targets baseline x86-64). The one `unsafe` here is calling such a function.

#![allow(unsafe_code)]

use super::matmul::{Fused, small_with};
use crate::blas::Mat;

/// Whether [`small_fused`] may run.
pub(super) fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The small product with fused multiply-adds, 8-wide. Only call when [`has_fma`].
pub(super) fn small_fused(a: Mat<'_>, b: Mat<'_>, out: &mut [f32], accumulate: bool, alpha: f32) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn fused(a: Mat<'_>, b: Mat<'_>, out: &mut [f32], accumulate: bool, alpha: f32) {
            small_with::<Fused>(a, b, out, accumulate, alpha);
        }
        if has_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above), the only
            // requirement of a `target_feature` function; the body is safe Rust.
            unsafe { fused(a, b, out, accumulate, alpha) }
            return;
        }
    }
    small_with::<Fused>(a, b, out, accumulate, alpha);
}
