//! The exponential in a form that vectorizes, for the softmax of attention and of
//! `_softmax`/`_log_softmax` (whose arguments are at most 0).

/// `e^(x - m)` over a row in place, `-inf` scores giving 0: Cody and Waite's reduction
/// `x - m = n ln 2 + r` (|r| <= ln 2 / 2), Cephes' polynomial for `e^r` (within about 2e-7
/// relative), `2^n` through the exponent bits. Plain arithmetic and selects, so the loop
/// vectorizes where a call to the scalar `exp` cannot. Arguments below -87 (the smallest
/// normal's logarithm), `-inf` among them, give 0, and NaN gives NaN; a softmax's
/// arguments are at most 0 (the row's maximum subtracted), so nothing overflows.
pub(super) fn exp_shifted(row: &mut [f32], m: f32) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, the first exact in a few bits, so n ln 2 subtracts exactly.
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    for x in row.iter_mut() {
        let t = *x - m;
        let c = t.clamp(-87.0, 88.0);
        let k = c * LOG2E + ROUND;
        let n = k - ROUND;
        let r = c - n * LN2_HIGH - n * LN2_LOW;
        let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
            * r
            + 1.666_666_5e-1)
            * r
            + 0.5;
        let y = p * (r * r) + r + 1.0;
        // k's low mantissa bits hold n (as 2^22 + n): n + 127 into the exponent field.
        let scale =
            f32::from_bits(((k.to_bits() & 0x007f_ffff).wrapping_sub(0x0040_0000 - 127)) << 23);
        *x = if t < -87.0 { 0.0 } else { y * scale };
    }
}

#[cfg(test)]
mod tests {
    use super::exp_shifted;

    /// Within 3 f32 ulps of e^x (from f64) over the softmax's range, 0 below -87 and for
    /// -inf, and exactly 1 at 0.
    #[test]
    fn exp_shifted_is_within_three_ulps() {
        let mut xs: Vec<f32> = (0..=200_000)
            .map(|i| -87.0 + 87.0 * i as f32 / 200_000.0)
            .collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, 0.5, 3.0, 20.0, 88.0]);
        let mut row = xs.clone();
        exp_shifted(&mut row, 0.0);
        for (&x, &got) in xs.iter().zip(&row) {
            let want = (x as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                ((got as f64) - want).abs() <= 3.0 * ulp as f64,
                "e^{x}: {got} against {want}"
            );
        }
        let mut edges = [f32::NEG_INFINITY, -87.5, -1000.0, 0.0, f32::NAN];
        exp_shifted(&mut edges, 0.0);
        assert_eq!(edges[..4], [0.0, 0.0, 0.0, 1.0]);
        assert!(edges[4].is_nan());
        // Shifted: e^(x - m).
        let mut shifted = [5.0f32, 4.0];
        exp_shifted(&mut shifted, 5.0);
        assert_eq!(shifted[0], 1.0);
        assert!((shifted[1] as f64 - (-1.0f64).exp()).abs() < 1e-7);
    }
}
