//! The cluster mode's workloads: online services with a diurnal request load, one per
//! GPU, and a generated trace of offline training jobs.
//!
//! - **Online services** (MuxFlow §7.1 uses three production services with 20-190 QPS):
//!   three kinds, each with a solo request time, the share of the GPU's SMs a request
//!   keeps busy while it runs (`busy_share`; inference rarely fills a GPU), the spread of
//!   request times, and memory. Service times are chosen so that the mean load of the
//!   cluster alone is about 26%, the online-only GPU utilisation MuxFlow reports for
//!   production (§7.5, Fig. 15).
//! - **Load**: per GPU, `105 + 85·sin(2πt/24h + φ)` requests per second times a
//!   log-normal AR(1) noise (σ 0.1, correlation 0.95 per minute), clipped to 20-190; the
//!   phase `φ` is drawn per GPU, so services peak at different times.
//! - **Offline jobs** (MuxFlow uses Microsoft's Philly trace, submission times and
//!   durations, and four CNNs): a Philly-like generated trace. Poisson submissions over
//!   the first 18 hours, log-normal solo durations (median 1 h, σ 1.2, clipped to
//!   5 min-24 h: most jobs short, a few very long, as Philly's), the workload drawn
//!   uniformly from the catalog's training jobs that fit the offline memory quota (40%
//!   of the GPU, §6; MuxFlow sets the batch size by the quota). Each job brings its
//!   solo compute share (the SM activity the profiler measures).

use crate::catalog::{self, REFERENCE_CAPACITY_BYTES};
use crate::rng::Rng;

/// Seconds per simulated step.
pub const STEP_S: f64 = 60.0;
/// Seconds between MuxFlow's global rescheduling (§7.2: 15 minutes).
pub const INTERVAL_S: f64 = 900.0;
/// The window online latency and utilisation are measured over: one day.
pub const WINDOW_S: f64 = 24.0 * 3600.0;
/// GPUs in the simulated cluster, one online service each.
pub const GPUS: usize = 16;
/// Offline jobs per GPU in the trace (MuxFlow's traces: 1.4 to 7.3 per GPU per day).
pub const JOBS_PER_GPU: usize = 8;
/// Offline jobs are submitted over this many seconds.
pub const SUBMIT_SPAN_S: f64 = 18.0 * 3600.0;
/// Memory of each GPU (the catalog's 16 GB reference device).
pub const GPU_BYTES: u64 = REFERENCE_CAPACITY_BYTES;
/// Fraction of a GPU's memory offline jobs may use (MuxFlow §6, salus' default).
pub const OFFLINE_MEMORY_SHARE: f64 = 0.4;
/// Lowest and highest request rate of a service, per second (MuxFlow §7.1).
pub const QPS_RANGE: (f64, f64) = (20.0, 190.0);

/// One kind of online service.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServiceKind {
    /// Name in the output.
    pub name: &'static str,
    /// Mean time one request takes alone, seconds.
    pub request_s: f64,
    /// Coefficient of variation of request times (gamma distributed).
    pub request_cv: f64,
    /// Share of the SMs a request keeps busy while it runs.
    pub busy_share: f64,
    /// Device memory the service holds, bytes.
    pub memory_bytes: u64,
}

/// The three kinds of service, assigned to GPUs in turn.
pub const SERVICES: [ServiceKind; 3] = [
    ServiceKind {
        name: "recommendation",
        request_s: 0.0020,
        request_cv: 0.3,
        busy_share: 0.35,
        memory_bytes: 5_000_000_000,
    },
    ServiceKind {
        name: "vision",
        request_s: 0.0025,
        request_cv: 0.2,
        busy_share: 0.55,
        memory_bytes: 6_000_000_000,
    },
    ServiceKind {
        name: "translation",
        request_s: 0.0030,
        request_cv: 0.5,
        busy_share: 0.75,
        memory_bytes: 8_000_000_000,
    },
];

/// One GPU's online service and its request rate per step.
#[derive(Debug, Clone, PartialEq)]
pub struct Online {
    /// The service.
    pub kind: ServiceKind,
    /// Requests per second in each step.
    pub qps: Vec<f64>,
}

impl Online {
    /// The request rate in `step` (the last one repeats past the end).
    pub fn qps_at(&self, step: usize) -> f64 {
        self.qps[step.min(self.qps.len() - 1)]
    }

    /// The mean request rate over `[from, to)` steps.
    pub fn mean_qps(&self, from: usize, to: usize) -> f64 {
        let to = to.max(from + 1);
        (from..to).map(|s| self.qps_at(s)).sum::<f64>() / (to - from) as f64
    }

    /// Busy fraction alone at `qps`.
    pub fn load(&self, qps: f64) -> f64 {
        qps * self.kind.request_s
    }
}

/// The online services of the cluster for `steps` steps.
pub fn online_services(seed: u64, gpus: usize, steps: usize) -> Vec<Online> {
    let mut rng = Rng::new(seed ^ 0x6f6e_6c69_6e65);
    let (lo, hi) = QPS_RANGE;
    let (mid, amp) = (105.0, 85.0);
    (0..gpus)
        .map(|g| {
            let phase = rng.uniform(0.0, std::f64::consts::TAU);
            let mut noise = 0.0f64;
            let qps = (0..steps)
                .map(|s| {
                    noise = 0.95 * noise + (1.0f64 - 0.95 * 0.95).sqrt() * rng.normal(0.0, 0.1);
                    let t = s as f64 * STEP_S;
                    let base = mid + amp * (std::f64::consts::TAU * t / WINDOW_S + phase).sin();
                    (base * noise.exp()).clamp(lo, hi)
                })
                .collect();
            Online {
                kind: SERVICES[g % SERVICES.len()],
                qps,
            }
        })
        .collect()
}

/// One offline training job of the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct OfflineJob {
    /// Index in the trace.
    pub id: usize,
    /// Catalog workload.
    pub workload: String,
    /// Submission time, seconds.
    pub submit_s: f64,
    /// Time it takes alone on an idle GPU, seconds.
    pub solo_s: f64,
    /// Share of the GPU's compute it keeps busy alone.
    pub compute_share: f64,
    /// Peak memory, bytes.
    pub memory_bytes: u64,
}

/// The offline trace: `jobs` Philly-like jobs.
pub fn offline_trace(seed: u64, jobs: usize) -> Vec<OfflineJob> {
    let mut rng = Rng::new(seed ^ 0x0ff1_1e00);
    let quota = (GPU_BYTES as f64 * OFFLINE_MEMORY_SHARE) as u64;
    let fitting: Vec<_> = catalog::catalog()
        .iter()
        .filter(|w| w.persistent_bytes + w.ephemeral_bytes <= quota)
        .collect();
    let mean_gap = SUBMIT_SPAN_S / jobs as f64;
    let mut t = 0.0;
    (0..jobs)
        .map(|id| {
            if id > 0 {
                t += rng.exponential(mean_gap);
            }
            let w = fitting[rng.index(fitting.len())];
            let solo_s = (3600.0 * rng.normal(0.0, 1.2).exp()).clamp(300.0, 24.0 * 3600.0);
            OfflineJob {
                id,
                workload: w.name(),
                submit_s: t,
                solo_s,
                compute_share: w.compute_share,
                memory_bytes: w.persistent_bytes + w.ephemeral_bytes,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_stay_in_range_and_average_about_a_quarter() {
        let steps = (WINDOW_S / STEP_S) as usize;
        let online = online_services(1, GPUS, steps);
        let mut load = 0.0;
        for o in &online {
            assert!(o.qps.iter().all(|&q| (20.0..=190.0).contains(&q)));
            load += (0..steps).map(|s| o.load(o.qps_at(s))).sum::<f64>() / steps as f64;
        }
        let mean = load / GPUS as f64;
        assert!((0.2..0.32).contains(&mean), "{mean}");
    }

    #[test]
    fn offline_jobs_fit_the_quota_and_are_heavy_tailed() {
        let jobs = offline_trace(1, 128);
        assert!(jobs.windows(2).all(|w| w[0].submit_s <= w[1].submit_s));
        assert!(
            jobs.iter()
                .all(|j| j.memory_bytes as f64 <= 0.4 * GPU_BYTES as f64)
        );
        let mut d: Vec<f64> = jobs.iter().map(|j| j.solo_s).collect();
        d.sort_by(f64::total_cmp);
        let mean = d.iter().sum::<f64>() / d.len() as f64;
        assert!(mean > 1.3 * d[d.len() / 2]);
    }
}
