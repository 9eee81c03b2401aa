//! A small seeded random number generator (SplitMix64) and the distributions the
//! experiments draw from. Seeded runs are reproducible on every platform.

/// SplitMix64: fast, statistically sound for simulation, and fully determined by its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform index in `[0, n)`; `n` must be positive.
    pub fn index(&mut self, n: usize) -> usize {
        (self.unit() * n as f64) as usize % n
    }

    /// Exponential with the given mean.
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }

    /// Normal with the given mean and standard deviation (Box-Muller).
    pub fn normal(&mut self, mean: f64, std: f64) -> f64 {
        let u1 = 1.0 - self.unit();
        let u2 = self.unit();
        mean + std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Shuffles `items` uniformly (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.index(i + 1));
        }
    }
}

/// The `u`-quantile (`0 <= u < 1`) of the bounded Pareto distribution on `[lo, hi]` with
/// shape `alpha`: the heavy tail of production job durations (many short jobs, a few very
/// long ones).
pub fn bounded_pareto_quantile(u: f64, alpha: f64, lo: f64, hi: f64) -> f64 {
    let ratio = (lo / hi).powf(alpha);
    lo / (1.0 - u * (1.0 - ratio)).powf(1.0 / alpha)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn pareto_quantiles_span_the_range() {
        assert!((bounded_pareto_quantile(0.0, 1.1, 10.0, 1000.0) - 10.0).abs() < 1e-9);
        assert!((bounded_pareto_quantile(1.0, 1.1, 10.0, 1000.0) - 1000.0).abs() < 1e-6);
        let median = bounded_pareto_quantile(0.5, 1.1, 10.0, 1000.0);
        assert!(median > 10.0 && median < 30.0, "{median}");
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v: Vec<u32> = (0..50).collect();
        Rng::new(3).shuffle(&mut v);
        assert_ne!(v, (0..50).collect::<Vec<_>>());
        v.sort();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn distributions_stay_in_range_and_have_the_right_mean() {
        let mut rng = Rng::new(1);
        let n = 200_000;
        let mut sum_exp = 0.0;
        let mut sum_unit = 0.0;
        let (mut sum_normal, mut sum_sq) = (0.0, 0.0);
        for _ in 0..n {
            let x = rng.normal(2.0, 3.0);
            sum_normal += x;
            sum_sq += (x - 2.0) * (x - 2.0);
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
            sum_unit += u;
            sum_exp += rng.exponential(3.0);
            assert!(rng.index(5) < 5);
        }
        assert!((sum_unit / n as f64 - 0.5).abs() < 0.01);
        assert!((sum_exp / n as f64 - 3.0).abs() < 0.05);
        assert!((sum_normal / n as f64 - 2.0).abs() < 0.05);
        assert!(((sum_sq / n as f64).sqrt() - 3.0).abs() < 0.05);
    }
}
