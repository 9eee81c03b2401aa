//! The shared-speed predictor: the normalized throughput an offline job would get beside
//! an online service (MuxFlow §5, `P.CalcNormTput(u, v, sm)` of Algorithm 1).
//!
//! MuxFlow trains an MLP (four layers of 64) on about 2,000 profiled pairs per GPU type,
//! with each workload's separate-execution features as input (GPU utilisation, SM
//! activity, SM occupancy, solo time, the assigned SM percentage). This simulator has no
//! profiles to train on, so the predictor is an explicit model over the features the
//! simulator has: the service's busy share and its request rate measured over the last
//! interval (hence its SM activity at that load), and the offline job's solo compute
//! share. For MuxFlow it is the sharing model itself ([`super::gpu`]); for salus the
//! controller's duty is not known in advance, so it is predicted from the service's
//! latency slack: with `X` the stretch of a request beside the offline job
//! (`max(1, a/(1 - s))` under the core's compute share `s`, [`super::gpu::overlap`]) and
//! `slack = SLO / p99 alone at that rate - 1` (the p99 from the service's profile,
//! [`LatencyProfile`]), the predicted duty is `min(1, slack / (X - 1))` (1 when `X <= 1`).
//!
//! The truth differs from the prediction: the load moves within the interval, the
//! controller finds its own duty, and every (GPU, job) pair has a hidden factor
//! (log-normal, σ 0.1) the features do not explain, as a learned predictor's error.

use super::gpu::{Latencies, SalusGpu, Sharing, overlap, sample_requests, step_model};
use super::workload::{OfflineJob, Online, QPS_RANGE, ServiceKind};
use crate::rng::Rng;

/// Spread of the hidden per-pair factor (standard deviation of its logarithm).
pub const HIDDEN_SIGMA: f64 = 0.1;

/// A service's p99 latency alone against its request rate, measured by sampling.
#[derive(Debug, Clone)]
pub struct LatencyProfile {
    /// (requests per second, p99 seconds), rates ascending.
    points: Vec<(f64, f64)>,
}

impl LatencyProfile {
    /// Profiles `kind` at rates every 10 requests per second over [`QPS_RANGE`].
    pub fn measure(kind: &ServiceKind) -> Self {
        let (lo, hi) = QPS_RANGE;
        let mut points = Vec::new();
        let mut qps = lo;
        while qps <= hi + 1e-9 {
            let mut l = Latencies::default();
            let model = step_model(Sharing::OnlineOnly, kind, qps, None, SalusGpu::at(0.0));
            for round in 0..100 {
                let mut rng = Rng::new(0x5eed ^ round);
                sample_requests(
                    Sharing::OnlineOnly,
                    kind,
                    qps,
                    &model,
                    false,
                    &mut rng,
                    &mut l,
                );
            }
            points.push((qps, l.quantile(0.99)));
            qps += 10.0;
        }
        LatencyProfile { points }
    }

    /// The p99 at `qps`, interpolated linearly (clamped to the profiled range).
    pub fn p99(&self, qps: f64) -> f64 {
        let i = self.points.partition_point(|&(q, _)| q < qps);
        if i == 0 {
            return self.points[0].1;
        }
        if i >= self.points.len() {
            return self.points[self.points.len() - 1].1;
        }
        let (q0, p0) = self.points[i - 1];
        let (q1, p1) = self.points[i];
        p0 + (p1 - p0) * (qps - q0) / (q1 - q0)
    }
}

/// salus' predicted duty for an offline job of share `c` beside `kind`, with `slack`.
pub fn salus_duty(kind: &ServiceKind, c: f64, slack: f64, compute_share: f64) -> f64 {
    let salus = SalusGpu {
        duty: 0.0,
        compute_share,
    };
    let over = overlap(Sharing::Salus, kind.busy_share, c, kind.request_s, salus).0 - 1.0;
    if over <= 0.0 {
        1.0
    } else {
        (slack.max(0.0) / over).min(1.0)
    }
}

/// Predicted normalized throughput of `job` beside `online` at request rate `qps`;
/// `slack` is the service's latency slack at that rate (used by salus only).
pub fn predict(
    sharing: Sharing,
    online: &Online,
    qps: f64,
    job: &OfflineJob,
    slack: f64,
    compute_share: f64,
) -> f64 {
    let duty = salus_duty(&online.kind, job.compute_share, slack, compute_share);
    let salus = SalusGpu {
        duty,
        compute_share,
    };
    step_model(sharing, &online.kind, qps, Some(job.compute_share), salus).offline_speed
}

/// The hidden factor of the pair (`gpu`, `job`) for `seed`: the same in every system.
pub fn hidden_factor(seed: u64, gpu: usize, job: usize) -> f64 {
    let key = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((gpu as u64) << 32)
        .wrapping_add(job as u64);
    let mut rng = Rng::new(key);
    rng.next_u64();
    rng.normal(0.0, HIDDEN_SIGMA).exp()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::muxflow::workload::SERVICES;

    #[test]
    fn latency_grows_with_load() {
        for kind in &SERVICES {
            let p = LatencyProfile::measure(kind);
            assert!(p.p99(190.0) > p.p99(20.0) * 1.2, "{}", kind.name);
            assert!(p.p99(20.0) > kind.request_s);
        }
    }

    #[test]
    fn salus_duty_follows_the_stretch_of_a_request() {
        let s = crate::muxflow::gpu::salus_compute_share();
        assert!(s < 1.0);
        // The recommendation service (a = 0.35) fits in the rest of the device: full duty
        // beside a job that fits beside it; beside a heavier job each request loses part
        // of the offline kernel running when it starts, which the slack must cover.
        let r = SERVICES[0];
        assert_eq!(salus_duty(&r, 0.6, 0.0, s), 1.0);
        let kernel = crate::muxflow::gpu::PB_KERNEL_S / 2.0 / r.request_s;
        let over = kernel * (1.0 - 1.0 / (r.busy_share + 0.95));
        assert_eq!(salus_duty(&r, 0.95, 0.0, s), 0.0);
        assert!((salus_duty(&r, 0.95, over / 2.0, s) - 0.5).abs() < 1e-12);
        assert_eq!(salus_duty(&r, 0.95, 1.01 * over, s), 1.0);
        // The translation service (a = 0.75) is held to 1 - s beside any offline job.
        let k = SERVICES[2];
        let over = k.busy_share / (1.0 - s) - 1.0;
        assert!(over > 0.0);
        assert!((salus_duty(&k, 0.2, over / 2.0, s) - 0.5).abs() < 1e-12);
        assert_eq!(salus_duty(&k, 0.95, -1.0, s), 0.0);
        // With the whole device to share, processor sharing: the job's share counts.
        assert_eq!(salus_duty(&k, 0.2, 0.0, 1.0), 1.0);
        assert!((salus_duty(&k, 0.95, 0.35, 1.0) - 0.5).abs() < 1e-12);
    }
}
