//! Special functions in f64: the gamma family, `lgamma` (libm's), `digamma` and
//! `polygamma` (through the Hurwitz zeta function), with PyTorch's values at the poles;
//! and `erfinv`.

use std::f64::consts::PI;

/// The Bernoulli numbers B2, B4, ..., B24 of the Euler–Maclaurin and asymptotic series.
const BERNOULLI: [f64; 12] = [
    1.0 / 6.0,
    -1.0 / 30.0,
    1.0 / 42.0,
    -1.0 / 30.0,
    5.0 / 66.0,
    -691.0 / 2730.0,
    7.0 / 6.0,
    -3617.0 / 510.0,
    43867.0 / 798.0,
    -174611.0 / 330.0,
    854513.0 / 138.0,
    -236364091.0 / 2730.0,
];

/// ln |Γ(x)|: infinite at 0 and the negative integers.
pub(super) fn lgamma(x: f64) -> f64 {
    libm::lgamma(x)
}

/// ψ(x), the derivative of ln Γ: ∓∞ at ±0, NaN at the negative integers and at -∞.
/// Below 0 by reflection (ψ(1 - x) - π / tan(πx), the tangent of x's fractional part for
/// accuracy); above, ψ(x) = ψ(x + 1) - 1/x up to 10, then the asymptotic series
/// ln x - 1/(2x) - Σ B2k / (2k x^2k).
pub(super) fn digamma(x: f64) -> f64 {
    if x == 0.0 {
        return f64::INFINITY.copysign(-x);
    }
    if x < 0.0 {
        if x == x.trunc() {
            return f64::NAN;
        }
        return digamma(1.0 - x) - PI / (PI * (x - x.trunc())).tan();
    }
    let (mut x, mut shift) = (x, 0.0);
    while x < 10.0 {
        shift -= 1.0 / x;
        x += 1.0;
    }
    let z = 1.0 / (x * x);
    let (mut series, mut power) = (0.0, 1.0);
    for (k, b) in BERNOULLI.iter().take(7).enumerate() {
        power *= z;
        series += b / (2.0 * (k + 1) as f64) * power;
    }
    shift + x.ln() - 0.5 / x - series
}

/// ψ⁽ⁿ⁾(x), the n-th derivative of ψ (n 0: ψ itself): (-1)^(n+1) n! ζ(n + 1, x).
pub(super) fn polygamma(n: u64, x: f64) -> f64 {
    if n == 0 {
        return digamma(x);
    }
    let factorial: f64 = (1..=n).map(|k| k as f64).product();
    let sign = if n % 2 == 1 { 1.0 } else { -1.0 };
    sign * factorial * hurwitz_zeta((n + 1) as f64, x)
}

/// ζ(s, q) = Σ_k (q + k)^-s for s > 1: infinite where q is 0 or a negative integer. The
/// terms are summed directly until their base passes 9 (and at least 9 of them), then
/// the rest by Euler–Maclaurin: a^(1-s)/(s-1) - a^-s/2 + Σ_j B2j/(2j)! s(s+1)...(s+2j-2)
/// a^(-s-2j+1), a the last base summed.
pub(super) fn hurwitz_zeta(s: f64, q: f64) -> f64 {
    if q.is_nan() || s.is_nan() {
        return f64::NAN;
    }
    if q <= 0.0 && q == q.floor() {
        return f64::INFINITY;
    }
    let (mut sum, mut a, mut terms) = (q.powf(-s), q, 0);
    let mut last = sum;
    while terms < 9 || a <= 9.0 {
        terms += 1;
        a += 1.0;
        last = a.powf(-s);
        sum += last;
        if (last / sum).abs() < f64::EPSILON / 2.0 {
            return sum;
        }
    }
    sum += last * a / (s - 1.0) - 0.5 * last;
    // term j: B2j / (2j)! * s (s+1) ... (s+2j-2) * a^(-s-2j+1)
    let (mut rising, mut power, mut factorial) = (1.0, last, 1.0);
    for (j, b) in BERNOULLI.iter().enumerate() {
        let k = 2.0 * j as f64;
        rising *= s + k;
        power /= a;
        factorial *= (k + 1.0) * (k + 2.0);
        let term = b / factorial * rising * power;
        sum += term;
        if (term / sum).abs() < f64::EPSILON / 2.0 {
            break;
        }
        rising *= s + k + 1.0;
        power /= a;
    }
    sum
}

/// erf⁻¹(x) on [-1, 1] (±∞ at ±1, NaN outside): Winitzki's approximation, then Newton
/// steps on erf(y) - |x| (on (1 - |x|) - erfc(y) past 1/2, where 1 - |x| is exact and
/// erfc keeps the tail's digits) until they no longer move it.
pub(super) fn erfinv(x: f64) -> f64 {
    let t = x.abs();
    if t.is_nan() || t > 1.0 {
        return f64::NAN;
    }
    if t == 1.0 {
        return f64::INFINITY.copysign(x);
    }
    let a = 0.147;
    let log = (1.0 - t * t).ln();
    let first = 2.0 / (PI * a) + log / 2.0;
    let mut y = ((first * first - log / a).sqrt() - first).sqrt();
    for _ in 0..6 {
        let residual = if t <= 0.5 {
            libm::erf(y) - t
        } else {
            (1.0 - t) - libm::erfc(y)
        };
        let step = residual / (2.0 / PI.sqrt() * (-y * y).exp());
        y -= step;
        if step.abs() <= f64::EPSILON * y.abs() {
            break;
        }
    }
    y.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, rel: f64) {
        assert!(
            (got - want).abs() <= rel * want.abs(),
            "{got} against {want} (relative {})",
            ((got - want) / want).abs()
        );
    }

    #[test]
    fn special_functions_meet_known_values() {
        // ψ(1) = -γ, ψ(1/2) = -γ - 2 ln 2, ψ(10), ψ(-1/2) = ψ(1/2) + 2.
        let euler = 0.577_215_664_901_532_9;
        close(digamma(1.0), -euler, 1e-15);
        close(digamma(0.5), -euler - 2.0 * 2f64.ln(), 1e-15);
        close(digamma(10.0), 2.251_752_589_066_721, 1e-15);
        close(digamma(-0.5), -euler - 2.0 * 2f64.ln() + 2.0, 1e-14);
        assert_eq!(digamma(0.0), f64::NEG_INFINITY);
        assert_eq!(digamma(-0.0), f64::INFINITY);
        assert!(digamma(-3.0).is_nan() && digamma(f64::NEG_INFINITY).is_nan());
        // ψ'(1) = π²/6, ψ'(1/2) = π²/2, ψ''(1) = -2 ζ(3), ψ'''(1) = π⁴/15, ψ'(-1/2) by
        // reflection: π²/sin²(-π/2) - ψ'(3/2) = π² - (π²/2 - 4).
        close(polygamma(1, 1.0), PI * PI / 6.0, 1e-15);
        close(polygamma(1, 0.5), PI * PI / 2.0, 1e-15);
        close(polygamma(2, 1.0), -2.0 * 1.202_056_903_159_594_3, 1e-15);
        close(polygamma(3, 1.0), PI.powi(4) / 15.0, 1e-15);
        close(polygamma(1, -0.5), PI * PI / 2.0 + 4.0, 1e-14);
        close(polygamma(1, 1e6), 1.000_000_500_000_166_7e-6, 1e-15);
        assert_eq!(polygamma(1, 0.0), f64::INFINITY);
        assert_eq!(polygamma(1, -2.0), f64::INFINITY);
        // erf undoes erf⁻¹, in the middle and (through erfc) in the tails; odd.
        for x in [1e-8, 0.3, 0.5, 0.9, 0.999_999, 1.0 - 1e-12] {
            let y = erfinv(x);
            if x <= 0.5 {
                close(libm::erf(y), x, 1e-15);
            } else {
                close(libm::erfc(y), 1.0 - x, 1e-13);
            }
            assert_eq!(erfinv(-x), -y);
        }
        assert_eq!(erfinv(0.0), 0.0);
        assert_eq!(erfinv(1.0), f64::INFINITY);
        assert!(erfinv(1.5).is_nan() && erfinv(f64::NAN).is_nan());
        // ln Γ: ln Γ(1/2) = ln √π, infinite at the poles.
        close(lgamma(0.5), PI.sqrt().ln(), 1e-15);
        assert_eq!(lgamma(-2.0), f64::INFINITY);
    }
}
