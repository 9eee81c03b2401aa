//! One GPU of the cluster mode over one step: its online service under a request rate,
//! and at most one offline job beside it, shared as each system shares.
//!
//! Contention is the simulator's model (`crate::sim`): processor sharing by compute
//! share. While a request runs beside an active offline job whose SM demand is `m`, the
//! demands sum to `a + m` (`a`: the request's busy share) and both progress at
//! `1 / max(1, a + m)` of their solo speed. How each system shares:
//!
//! | system | offline SM demand `m` | offline active (duty `d`) | a request beside it |
//! |---|---|---|---|
//! | online-only | - | never | alone |
//! | time-sharing | its share `c` | always | the driver alternates time slices: twice its time |
//! | PB-time-sharing | `c` | while no request runs | waits for the running offline kernel (up to 1 ms) when it finds the service idle |
//! | MuxFlow | `min(c, 1 - U_on)`: dynamic SM allocation by the service's SM activity `U_on = ρ·a` at its load (MPS limit) | xCUDA: as long as `U_on + d·m <= 0.9` | processor sharing |
//! | salus | `min(c, s)`, `s` the core's offline compute share (0.5 by default) | its protection controller's duty (`cluster.rs`: steered by the p99 against the SLO) | held to `1 - s` of the device (the core's share for an online iteration beside offline ones): `max(1, a/(1 - s))` |
//!
//! The offline job's speed (normalized throughput, 1 = alone on an idle GPU) is then:
//! time-sharing `1 - ρ`; PB-time-sharing `1 - ρ'` (`ρ'` the service's busy fraction
//! with its stretched requests); MuxFlow `d · (m/c) · ((1 - ρ') + ρ'/max(1, a + m))`;
//! salus `d · (m/c)` (its shares never sum past the device). Each pair's true speed is that times a hidden factor (log-normal, σ 0.1)
//! the predictor does not see: what profiled features miss.
//!
//! Online latency: the step's requests are sampled through a single-server FIFO queue
//! (Lindley's recursion): Poisson arrivals at the step's rate, log-normal request times
//! with the service's mean and spread, each stretched as above (under MuxFlow and salus
//! a request finds the offline job active with probability `d`). 32 requests warm the
//! queue up from empty, then [`SAMPLED_REQUESTS`] are recorded, each weighing for
//! `rate · step / SAMPLED_REQUESTS` requests. A minute the queue cannot keep up with
//! (`ρ' >= 1`, time-sharing at peak load) is sampled for those few seconds only, so its
//! latency is a lower bound.

use super::workload::{STEP_S, ServiceKind};
use crate::rng::Rng;

/// Requests recorded per GPU and step.
pub const SAMPLED_REQUESTS: usize = 128;
/// Requests that warm each step's queue up before recording.
pub const WARMUP_REQUESTS: usize = 32;
/// Longest offline kernel a request may wait for under PB-time-sharing, seconds.
pub const PB_KERNEL_S: f64 = 0.001;
/// xCUDA's GPU-load threshold: SM activity it lets the offline job fill up to.
pub const XCUDA_LOAD_THRESHOLD: f64 = 0.9;

/// The share of the device salus' protection gives an offline iteration while online
/// sessions are active (`ProtectionConfig::offline_compute_share`, the core's default).
pub fn salus_compute_share() -> f64 {
    salus_core::protection::ProtectionConfig::default().offline_compute_share
}

/// What salus' protection decides for the offline job on one GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SalusGpu {
    /// The controller's duty.
    pub duty: f64,
    /// The compute share an offline iteration gets while a request runs (the whole
    /// device otherwise).
    pub compute_share: f64,
}

impl SalusGpu {
    /// `duty` at the core's default compute share.
    pub fn at(duty: f64) -> Self {
        SalusGpu {
            duty,
            compute_share: salus_compute_share(),
        }
    }
}

/// How a GPU is shared between its online service and an offline job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sharing {
    /// Offline jobs never run.
    OnlineOnly,
    /// The driver's time slices, no priorities (Gandiva).
    TimeSharing,
    /// Time slices, online first (AntMan, PAI).
    PriorityTimeSharing,
    /// Space sharing with MPS, dynamic SM allocation and xCUDA (MuxFlow §4).
    MuxFlow,
    /// Space sharing by iteration, offline held back by salus' protection controller.
    Salus,
}

/// How the offline job runs beside the service in a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    /// Fraction of the time the offline job is active.
    pub duty: f64,
    /// Its SM demand while active.
    pub sm: f64,
}

/// What a system decides for an offline job of compute share `c` beside `kind` at `qps`;
/// under salus the duty and share are its protection's, `salus`.
pub fn share(sharing: Sharing, kind: &ServiceKind, qps: f64, c: f64, salus: SalusGpu) -> Share {
    let rho = qps * kind.request_s;
    let a = kind.busy_share;
    match sharing {
        Sharing::OnlineOnly => Share { duty: 0.0, sm: 0.0 },
        Sharing::TimeSharing | Sharing::PriorityTimeSharing => Share { duty: 1.0, sm: c },
        Sharing::MuxFlow => {
            let u_on = (rho * a).min(1.0);
            let sm = c.min(1.0 - u_on).max(0.0);
            let duty = if sm <= 0.0 {
                0.0
            } else {
                ((XCUDA_LOAD_THRESHOLD - u_on) / sm).clamp(0.0, 1.0)
            };
            Share { duty, sm }
        }
        Sharing::Salus => Share {
            duty: salus.duty.clamp(0.0, 1.0),
            sm: c,
        },
    }
}

/// A request of busy share `a` and solo time `request_s` beside an active offline job of
/// SM demand `m`: how much longer it takes, and the offline job's speed meanwhile
/// (against its speed alone at `m`). Processor sharing: both slow by `max(1, a + m)`;
/// except that salus' protection with a compute share `s < 1` holds the offline job to
/// `min(m, s)` while a request runs, from the end of the offline kernel running when the
/// request starts (half of `PB_KERNEL_S` on average, processor sharing meanwhile), and
/// the request to the rest of the device, `1 - s`: the request takes
/// `max(1, a / (1 - s))` times longer after the kernel, and the offline job runs at
/// `min(m, s) / m` of its pace.
pub fn overlap(sharing: Sharing, a: f64, m: f64, request_s: f64, salus: SalusGpu) -> (f64, f64) {
    if sharing == Sharing::Salus && salus.compute_share < 1.0 {
        let s = salus.compute_share;
        let kernel = (PB_KERNEL_S / 2.0 / request_s).min(1.0);
        let lost = kernel * (1.0 - 1.0 / (a + m).max(1.0));
        let beside = if m > 0.0 { m.min(s) / m } else { 1.0 };
        ((1.0 + lost) * (a / (1.0 - s)).max(1.0), beside)
    } else {
        let total = (a + m).max(1.0);
        (total, 1.0 / total)
    }
}

/// One GPU's step, before sampling requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepModel {
    /// The service's busy fraction with offline beside it.
    pub online_busy: f64,
    /// How much longer a request takes beside the active offline job (space sharing).
    pub stretch: f64,
    /// The offline job's normalized throughput (without the hidden pair factor).
    pub offline_speed: f64,
    /// Fraction of the step some kernel runs (GPU utilisation).
    pub gpu_busy: f64,
    /// Mean SM activity.
    pub sm_activity: f64,
    /// The offline job's share decision.
    pub share: Share,
}

/// The step model of `kind` at `qps` with an offline job of share `offline` (if any);
/// `salus` is salus' protection's decision (ignored by the other systems).
pub fn step_model(
    sharing: Sharing,
    kind: &ServiceKind,
    qps: f64,
    offline: Option<f64>,
    salus: SalusGpu,
) -> StepModel {
    let rho = qps * kind.request_s;
    let a = kind.busy_share;
    let Some(c) = offline.filter(|_| sharing != Sharing::OnlineOnly) else {
        return StepModel {
            online_busy: rho,
            stretch: 1.0,
            offline_speed: 0.0,
            gpu_busy: rho.min(1.0),
            sm_activity: (rho * a).min(1.0),
            share: Share { duty: 0.0, sm: 0.0 },
        };
    };
    let s = share(sharing, kind, qps, c, salus);
    match sharing {
        Sharing::TimeSharing => StepModel {
            online_busy: 2.0 * rho,
            stretch: 2.0,
            offline_speed: (1.0 - rho).max(0.0),
            gpu_busy: 1.0,
            sm_activity: (rho * a + (1.0 - rho).max(0.0) * c).min(1.0),
            share: s,
        },
        Sharing::PriorityTimeSharing => {
            let busy = (qps * (kind.request_s + (1.0 - rho).max(0.0) * PB_KERNEL_S / 2.0)).min(1.0);
            StepModel {
                online_busy: busy,
                stretch: 1.0,
                offline_speed: 1.0 - busy,
                gpu_busy: 1.0,
                sm_activity: (busy * a + (1.0 - busy) * c).min(1.0),
                share: s,
            }
        }
        _ => {
            let (stretch, offline_beside) = overlap(sharing, a, s.sm, kind.request_s, salus);
            // salus holds the offline job to its share while a request runs.
            let beside_sm = if sharing == Sharing::Salus {
                s.sm * offline_beside
            } else {
                s.sm
            };
            let busy = (rho * (1.0 + s.duty * (stretch - 1.0))).min(1.0);
            let speed = if c > 0.0 {
                s.duty * (s.sm / c) * ((1.0 - busy) + busy * offline_beside)
            } else {
                0.0
            };
            StepModel {
                online_busy: busy,
                stretch,
                offline_speed: speed.clamp(0.0, 1.0),
                gpu_busy: 1.0 - (1.0 - busy) * (1.0 - s.duty),
                sm_activity: (busy * (a + s.duty * beside_sm).min(1.0)
                    + (1.0 - busy) * s.duty * s.sm)
                    .min(1.0),
                share: s,
            }
        }
    }
}

/// Request latencies, weighted, in logarithmic bins from 10 µs to 1,000 s.
#[derive(Debug, Clone)]
pub struct Latencies {
    bins: Vec<f64>,
    weight: f64,
    weighted_sum: f64,
}

const LOWEST_S: f64 = 1e-5;
const BINS: usize = 4000;
/// Bins per factor of 10.
const PER_DECADE: f64 = BINS as f64 / 8.0;

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            bins: vec![0.0; BINS],
            weight: 0.0,
            weighted_sum: 0.0,
        }
    }
}

impl Latencies {
    /// Records `latency_s` for `weight` requests.
    pub fn add(&mut self, latency_s: f64, weight: f64) {
        let bin = ((latency_s.max(LOWEST_S) / LOWEST_S).log10() * PER_DECADE) as usize;
        self.bins[bin.min(BINS - 1)] += weight;
        self.weight += weight;
        self.weighted_sum += weight * latency_s;
    }

    /// Mean latency, seconds.
    pub fn mean(&self) -> f64 {
        self.weighted_sum / self.weight.max(f64::MIN_POSITIVE)
    }

    /// The `q`-quantile, seconds (the geometric middle of its bin: within 0.3%).
    pub fn quantile(&self, q: f64) -> f64 {
        let target = q * self.weight;
        let mut acc = 0.0;
        for (i, w) in self.bins.iter().enumerate() {
            acc += w;
            if acc >= target && *w > 0.0 {
                return LOWEST_S * 10f64.powf((i as f64 + 0.5) / PER_DECADE);
            }
        }
        LOWEST_S * 10f64.powf(BINS as f64 / PER_DECADE)
    }
}

/// Samples the step's requests into `out` and returns their latencies. `rng` must be the
/// same for every system at this GPU and step (common random numbers: systems differ
/// only by how they share).
pub fn sample_requests(
    sharing: Sharing,
    kind: &ServiceKind,
    qps: f64,
    model: &StepModel,
    offline_placed: bool,
    rng: &mut Rng,
    out: &mut Latencies,
) -> Vec<f64> {
    let mut sampled = Vec::with_capacity(SAMPLED_REQUESTS);
    let sigma2 = (1.0 + kind.request_cv * kind.request_cv).ln();
    let mu = kind.request_s.ln() - sigma2 / 2.0;
    let sigma = sigma2.sqrt();
    let weight = qps * STEP_S / SAMPLED_REQUESTS as f64;
    let stretch = model.stretch;
    let mut wait = 0.0f64;
    for i in 0..WARMUP_REQUESTS + SAMPLED_REQUESTS {
        let size = (mu + sigma * rng.normal(0.0, 1.0)).exp();
        let gap = rng.exponential(1.0 / qps);
        let u = rng.unit();
        let service = match sharing {
            _ if !offline_placed => size,
            Sharing::OnlineOnly => size,
            Sharing::TimeSharing => 2.0 * size,
            Sharing::PriorityTimeSharing => {
                if wait <= 0.0 {
                    size + u * PB_KERNEL_S
                } else {
                    size
                }
            }
            Sharing::MuxFlow | Sharing::Salus => {
                if u < model.share.duty {
                    size * stretch
                } else {
                    size
                }
            }
        };
        if i >= WARMUP_REQUESTS {
            out.add(wait + service, weight);
            sampled.push(wait + service);
        }
        wait = (wait + service - gap).max(0.0);
    }
    sampled
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::muxflow::workload::SERVICES;

    #[test]
    fn quantiles_of_a_uniform_sample() {
        let mut l = Latencies::default();
        for i in 1..=1000 {
            l.add(i as f64 * 1e-3, 1.0);
        }
        assert!((l.quantile(0.99) / 0.99 - 1.0).abs() < 0.01);
        assert!((l.mean() - 0.5005).abs() < 1e-9);
    }

    #[test]
    fn protection_and_partitioning_bound_contention() {
        let kind = SERVICES[2];
        let m = step_model(Sharing::MuxFlow, &kind, 100.0, Some(0.9), SalusGpu::at(0.0));
        assert!(m.share.sm <= 1.0 - 100.0 * kind.request_s * kind.busy_share + 1e-12);
        // A small job beside a service that leaves room runs at full speed, all the time.
        let small = step_model(
            Sharing::Salus,
            &SERVICES[0],
            100.0,
            Some(0.2),
            SalusGpu::at(1.0),
        );
        assert_eq!(small.share.duty, 1.0);
        assert!((small.offline_speed - 1.0).abs() < 1e-12);
        // Held back half the time, it runs at half speed.
        let half = step_model(
            Sharing::Salus,
            &SERVICES[0],
            100.0,
            Some(0.2),
            SalusGpu::at(0.5),
        );
        assert!((half.offline_speed - 0.5).abs() < 1e-12);
        // Time-sharing gives the offline job what the service leaves.
        let ts = step_model(
            Sharing::TimeSharing,
            &kind,
            100.0,
            Some(0.9),
            SalusGpu::at(0.0),
        );
        assert!((ts.offline_speed - (1.0 - 100.0 * kind.request_s)).abs() < 1e-12);
    }

    #[test]
    fn time_sharing_doubles_request_times() {
        let kind = SERVICES[0];
        let mut alone = Latencies::default();
        let mut ts = Latencies::default();
        for step in 0..50 {
            let m0 = step_model(Sharing::OnlineOnly, &kind, 30.0, None, SalusGpu::at(0.0));
            let m1 = step_model(
                Sharing::TimeSharing,
                &kind,
                30.0,
                Some(0.5),
                SalusGpu::at(0.0),
            );
            sample_requests(
                Sharing::OnlineOnly,
                &kind,
                30.0,
                &m0,
                false,
                &mut Rng::new(step),
                &mut alone,
            );
            sample_requests(
                Sharing::TimeSharing,
                &kind,
                30.0,
                &m1,
                true,
                &mut Rng::new(step),
                &mut ts,
            );
        }
        let ratio = ts.mean() / alone.mean();
        assert!((2.0..2.3).contains(&ratio), "{ratio}");
    }
}
