//! What the request schedulers know about execution times: the batch cost model
//! (Eq. 4.3), the online profiler (per-application empirical distributions over a window,
//! §4.3.2 "Per-Application Tracking" and "Long-Term Feedback Loop"), and the batch
//! latency distributions ORLOJ derives from them (§4.4.2, Eqs. 4.5-4.9).
//!
//! Times are milliseconds as `f64` here: the distributions are arithmetic, not instants.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::AppId;

/// How long a batch runs, from its size and the solo execution time of its slowest
/// request: `fixed + (per_batch + per_request·k)·slowest` for a batch of `k`.
///
/// This is Eq. 4.3 (`l_B = c0 + c1·k·l`, with `l` the slowest request's time as Eq. 4.4
/// pads every request to the longest) with one more constant, `per_batch`, so that a
/// batch of one can take exactly its request's own time and larger batches cost less per
/// request, as on a GPU. Eq. 4.3 itself is [`BatchCost::linear`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BatchCost {
    /// `c0`: time every batch takes whatever it holds.
    pub fixed: Duration,
    /// Multiple of the slowest request's time every batch takes.
    pub per_batch: f64,
    /// `c1`: further multiple of the slowest request's time per request in the batch.
    pub per_request: f64,
}

impl Default for BatchCost {
    /// A batch of `k` takes `1 + 0.2·(k - 1)` times its slowest request: 16 requests
    /// together cost 4 times one, roughly a convolutional network on a GPU.
    fn default() -> Self {
        BatchCost {
            fixed: Duration::ZERO,
            per_batch: 0.8,
            per_request: 0.2,
        }
    }
}

impl BatchCost {
    /// Eq. 4.3 as the dissertation writes it: `l_B = c0 + c1·k·l`.
    pub fn linear(c0: Duration, c1: f64) -> Self {
        BatchCost {
            fixed: c0,
            per_batch: 0.0,
            per_request: c1,
        }
    }

    /// The multiple of the slowest request's time a batch of `batch_size` takes.
    pub fn factor(&self, batch_size: usize) -> f64 {
        self.per_batch + self.per_request * batch_size as f64
    }

    /// A batch's time in milliseconds, from its slowest request's solo time.
    pub fn batch_ms(&self, batch_size: usize, slowest_ms: f64) -> f64 {
        ms(self.fixed) + self.factor(batch_size) * slowest_ms
    }

    /// A batch's time, from its slowest request's solo time.
    pub fn batch_time(&self, batch_size: usize, slowest: Duration) -> Duration {
        duration(self.batch_ms(batch_size, ms(slowest)))
    }
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Milliseconds as a duration (negative and non-finite values become zero).
pub fn duration(ms: f64) -> Duration {
    if ms.is_finite() && ms > 0.0 {
        Duration::from_secs_f64(ms / 1e3)
    } else {
        Duration::ZERO
    }
}

/// The online profiler: the last `window` solo execution times of each application and
/// the applications of the last `window` arrivals. Its [`Profile`] snapshot is rebuilt
/// every `refresh_every` changes (and when an application is seen for the first time),
/// so schedulers that derive tables from it recompute them only then, off the hot path.
#[derive(Debug, Clone)]
pub struct Profiler {
    window: usize,
    refresh_every: usize,
    samples: BTreeMap<AppId, VecDeque<f64>>,
    arrivals: VecDeque<AppId>,
    changes: usize,
    profile: Profile,
}

impl Profiler {
    /// A profiler keeping `window` samples per application.
    pub fn new(window: usize, refresh_every: usize) -> Self {
        Profiler {
            window: window.max(1),
            refresh_every: refresh_every.max(1),
            samples: BTreeMap::new(),
            arrivals: VecDeque::new(),
            changes: 0,
            profile: Profile::default(),
        }
    }

    /// The current snapshot.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// A measured solo execution time of one of `app`'s requests.
    pub fn record(&mut self, app: AppId, execution: Duration) {
        let samples = self.samples.entry(app).or_default();
        samples.push_back(ms(execution));
        if samples.len() > self.window {
            samples.pop_front();
        }
        let first = !self.profile.apps.contains_key(&app);
        self.changed(first);
    }

    /// A request of `app` arrived (the mix of applications the model serves).
    pub fn arrival(&mut self, app: AppId) {
        self.arrivals.push_back(app);
        if self.arrivals.len() > self.window {
            self.arrivals.pop_front();
        }
        self.changed(false);
    }

    fn changed(&mut self, now: bool) {
        self.changes += 1;
        if now || self.changes >= self.refresh_every {
            self.refresh();
        }
    }

    fn refresh(&mut self) {
        self.changes = 0;
        let mut counts: BTreeMap<AppId, f64> = BTreeMap::new();
        for app in &self.arrivals {
            if self.samples.contains_key(app) {
                *counts.entry(*app).or_default() += 1.0;
            }
        }
        let by_arrivals: f64 = counts.values().sum();
        let weight = |app: &AppId, n: usize| {
            if by_arrivals > 0.0 {
                counts.get(app).copied().unwrap_or(0.0)
            } else {
                n as f64
            }
        };
        let total: f64 = self.samples.iter().map(|(a, s)| weight(a, s.len())).sum();
        let apps = self
            .samples
            .iter()
            .map(|(app, samples)| {
                let mut sorted: Vec<f64> = samples.iter().map(|&x| x.max(0.0)).collect();
                sorted.sort_by(f64::total_cmp);
                let share = weight(app, samples.len()) / total;
                (*app, AppProfile { sorted, share })
            })
            .collect();
        self.profile = Profile::build(self.profile.version + 1, apps);
    }
}

/// One application's samples, sorted, and its share of recent arrivals.
#[derive(Debug, Clone, Default)]
struct AppProfile {
    sorted: Vec<f64>,
    share: f64,
}

/// A snapshot of the profiler. `version` changes at every refresh.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    version: u64,
    apps: BTreeMap<AppId, AppProfile>,
    /// Every distinct sample value of every application, ascending.
    values: Vec<f64>,
    /// Per application (in `apps` order), its CDF at each of `values`.
    cdfs: Vec<Vec<f64>>,
    /// The mix's CDF at each of `values`: applications weighted by their shares.
    mix: Vec<f64>,
}

/// One bin of a batch latency histogram: probability `mass` spread evenly over
/// `[lo_ms, hi_ms]` (a point mass when they are equal).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyBin {
    /// Lower edge, ms.
    pub lo_ms: f64,
    /// Upper edge, ms.
    pub hi_ms: f64,
    /// Probability of the bin.
    pub mass: f64,
}

/// The distribution of a batch's execution time (`L_B`), as ORLOJ's score needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchLatency {
    /// The histogram: bins of nonzero mass, ascending.
    pub bins: Vec<LatencyBin>,
    /// `E[L_B]`, ms (Eq. 4.5, exact for the empirical distributions).
    pub mean_ms: f64,
    /// The shortest time with nonzero probability, ms.
    pub min_ms: f64,
    /// The `quantile` asked for, ms.
    pub quantile_ms: f64,
}

impl Profile {
    fn build(version: u64, apps: BTreeMap<AppId, AppProfile>) -> Self {
        let mut values: Vec<f64> = apps.values().flat_map(|a| a.sorted.clone()).collect();
        values.sort_by(f64::total_cmp);
        values.dedup();
        let cdfs: Vec<Vec<f64>> = apps
            .values()
            .map(|a| {
                let n = a.sorted.len() as f64;
                let mut at = 0;
                values
                    .iter()
                    .map(|&v| {
                        while at < a.sorted.len() && a.sorted[at] <= v {
                            at += 1;
                        }
                        at as f64 / n
                    })
                    .collect()
            })
            .collect();
        let mix = (0..values.len())
            .map(|j| {
                apps.values()
                    .zip(&cdfs)
                    .map(|(a, cdf)| a.share * cdf[j])
                    .sum()
            })
            .collect();
        Profile {
            version,
            apps,
            values,
            cdfs,
            mix,
        }
    }

    /// Changes whenever the profile is rebuilt.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// True before any sample was recorded.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Applications with samples.
    pub fn apps(&self) -> impl Iterator<Item = AppId> + '_ {
        self.apps.keys().copied()
    }

    /// Mean solo execution time of the mix, ms (0 when empty).
    pub fn mean_ms(&self) -> f64 {
        self.apps
            .values()
            .map(|a| a.share * a.sorted.iter().sum::<f64>() / a.sorted.len().max(1) as f64)
            .sum()
    }

    /// The `q`-quantile of the mix's solo execution time, ms (0 when empty).
    pub fn quantile_ms(&self, q: f64) -> f64 {
        let j = self.mix.partition_point(|&f| f < q - 1e-12);
        self.values
            .get(j.min(self.values.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    }

    /// The distribution of a batch's execution time for each batch size, for a batch
    /// holding one request of `app` and `k - 1` requests drawn from the mix (§4.4.3: the
    /// other members are unknown when the score is computed, so every distribution the
    /// model serves is used, weighted by its share). `None` for `app` is a request of
    /// an application without samples: all `k` are drawn from the mix.
    ///
    /// The slowest of independent requests has CDF `F_app·F_mix^(k-1)` (Eq. 4.6, and for
    /// different distributions the product that Eq. 4.8's `k`-th order statistic reduces
    /// to); Eq. 4.9 maps it through the cost model. The histogram has `bins` equal bins
    /// over the support; the mean and quantile are exact for the empirical CDFs.
    pub fn batch_latency(
        &self,
        app: Option<AppId>,
        batch_sizes: &[usize],
        cost: &BatchCost,
        bins: usize,
        quantile: f64,
    ) -> Vec<BatchLatency> {
        let own = app
            .and_then(|a| self.apps.keys().position(|&k| k == a))
            .map(|i| &self.cdfs[i]);
        batch_sizes
            .iter()
            .map(|&k| {
                let cdf = |j: usize| {
                    let mix = self.mix[j].powi(k as i32 - 1);
                    own.map_or(mix * self.mix[j], |o| o[j] * mix)
                };
                self.latency(cdf, k, cost, bins.max(1), quantile)
            })
            .collect()
    }

    fn latency(
        &self,
        cdf: impl Fn(usize) -> f64,
        k: usize,
        cost: &BatchCost,
        bins: usize,
        quantile: f64,
    ) -> BatchLatency {
        let map = |v: f64| cost.batch_ms(k, v);
        let n = self.values.len();
        if n == 0 {
            let at = map(0.0);
            return BatchLatency {
                bins: vec![LatencyBin {
                    lo_ms: at,
                    hi_ms: at,
                    mass: 1.0,
                }],
                mean_ms: at,
                min_ms: at,
                quantile_ms: at,
            };
        }
        let start = (0..n).find(|&j| cdf(j) > 0.0).unwrap_or(n - 1);
        let quantile_at = (start..n).find(|&j| cdf(j) >= quantile - 1e-12);
        let (lo, hi) = (self.values[start], self.values[n - 1]);
        let mut mean = self.values[0];
        for j in 0..n - 1 {
            mean += (self.values[j + 1] - self.values[j]) * (1.0 - cdf(j));
        }
        // The CDF at any point: the step function of the samples.
        let cdf_at = |x: f64| {
            let j = self.values.partition_point(|&v| v <= x);
            if j == 0 { 0.0 } else { cdf(j - 1) }
        };
        let mut histogram = Vec::with_capacity(bins);
        if hi > lo {
            let width = (hi - lo) / bins as f64;
            let mut below = 0.0;
            for i in 0..bins {
                let edge = if i + 1 == bins {
                    hi
                } else {
                    lo + width * (i + 1) as f64
                };
                let upto = cdf_at(edge);
                if upto > below {
                    histogram.push(LatencyBin {
                        lo_ms: map(lo + width * i as f64),
                        hi_ms: map(edge),
                        mass: upto - below,
                    });
                }
                below = upto;
            }
        } else {
            histogram.push(LatencyBin {
                lo_ms: map(lo),
                hi_ms: map(lo),
                mass: 1.0,
            });
        }
        BatchLatency {
            bins: histogram,
            mean_ms: map(mean),
            min_ms: map(lo),
            quantile_ms: map(self.values[quantile_at.unwrap_or(n - 1)]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profiler(apps: &[(u32, &[f64])]) -> Profiler {
        let mut p = Profiler::new(1000, 1_000_000);
        for &(app, samples) in apps {
            for &s in samples {
                p.record(AppId(app), duration(s));
                p.arrival(AppId(app));
            }
        }
        p.refresh();
        p
    }

    #[test]
    fn cost_model_is_eq_4_3_with_a_per_batch_term() {
        let cost = BatchCost::default();
        assert!((cost.batch_ms(1, 10.0) - 10.0).abs() < 1e-12);
        assert!((cost.batch_ms(16, 10.0) - 40.0).abs() < 1e-12);
        let linear = BatchCost::linear(Duration::from_millis(2), 0.5);
        assert!((linear.batch_ms(4, 10.0) - 22.0).abs() < 1e-12);
    }

    #[test]
    fn the_slowest_of_k_follows_the_product_of_cdfs() {
        // Two equally likely values, 10 and 20 ms: the slowest of two is 20 with
        // probability 3/4, so E = 17.5.
        let p = profiler(&[(0, &[10.0, 20.0])]);
        let cost = BatchCost::linear(Duration::ZERO, 0.5);
        let [one, two] = &p.profile().batch_latency(None, &[1, 2], &cost, 4, 0.5)[..] else {
            panic!()
        };
        assert!((one.mean_ms - 7.5).abs() < 1e-9, "{one:?}");
        assert!((two.mean_ms - 17.5).abs() < 1e-9, "{two:?}");
        assert!((two.bins.iter().map(|b| b.mass).sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(two.bins.last().unwrap().mass, 0.75);
        assert_eq!(two.min_ms, 10.0);
        assert_eq!(two.quantile_ms, 20.0);
    }

    #[test]
    fn a_requests_own_application_shapes_its_batch() {
        // A short application (10 ms) and a long one (30 ms), half the arrivals each.
        let p = profiler(&[(0, &[10.0; 8]), (1, &[30.0; 8])]);
        let cost = BatchCost::linear(Duration::ZERO, 1.0);
        let short = &p
            .profile()
            .batch_latency(Some(AppId(0)), &[1, 2], &cost, 8, 0.5);
        let long = &p
            .profile()
            .batch_latency(Some(AppId(1)), &[1, 2], &cost, 8, 0.5);
        assert_eq!(short[0].mean_ms, 10.0);
        assert_eq!(long[0].mean_ms, 30.0);
        // A short request with one other from the mix: 2·(10 or 30), half each.
        assert!((short[1].mean_ms - 40.0).abs() < 1e-9, "{:?}", short[1]);
        assert_eq!(long[1].mean_ms, 60.0);
        assert!((p.profile().mean_ms() - 20.0).abs() < 1e-9);
    }

    #[test]
    fn constant_times_give_one_point_mass() {
        let p = profiler(&[(0, &[7.0; 20])]);
        let l = &p
            .profile()
            .batch_latency(None, &[4], &BatchCost::default(), 32, 0.99)[0];
        assert_eq!(l.bins.len(), 1);
        assert_eq!(l.bins[0].lo_ms, l.bins[0].hi_ms);
        assert!((l.bins[0].lo_ms - 11.2).abs() < 1e-9);
        assert!((l.mean_ms - 11.2).abs() < 1e-9);
    }

    #[test]
    fn profiler_keeps_a_window_and_refreshes_periodically() {
        let mut p = Profiler::new(4, 3);
        p.record(AppId(0), Duration::from_millis(100));
        let v = p.profile().version();
        assert!(v > 0, "a new application refreshes at once");
        for _ in 0..6 {
            p.record(AppId(0), Duration::from_millis(10));
        }
        assert_eq!(p.profile().version(), v + 2);
        assert!(
            (p.profile().mean_ms() - 10.0).abs() < 1e-9,
            "old samples left the window"
        );
        assert_eq!(p.profile().quantile_ms(0.99), 10.0);
    }

    #[test]
    fn an_empty_profile_gives_the_fixed_cost() {
        let p = Profiler::new(10, 10);
        let cost = BatchCost::linear(Duration::from_millis(3), 1.0);
        let l = &p.profile().batch_latency(None, &[8], &cost, 16, 0.5)[0];
        assert_eq!(l.mean_ms, 3.0);
        assert!(p.profile().is_empty());
    }
}
