//! The single-GPU experiment: an online serving session and offline training sessions on
//! one device, driven through the real `salus_core::Scheduler` in virtual time, as the
//! daemon would drive it.
//!
//! - **Online**: one inference session (the "vision" service of [`SERVICES`]: 6 GB
//!   resident). Requests arrive open loop, a Poisson process whose rate follows one
//!   diurnal cycle compressed into the run (20 to 190 per second, [`SPAN_S`]); each
//!   request is one iteration submitted at its arrival (log-normal solo time, the
//!   service's mean and spread, compute share its busy share); its latency is arrival to
//!   finish.
//! - **Offline**: training jobs from the catalog's workloads that fit the offline memory
//!   share, one after another: the next opens when the previous closes (one offline job
//!   per GPU, as the cluster mode places them). Each is a closed training loop with
//!   [`OFFLINE_JOB_S`] of solo work.
//! - **Device**: the simulator's contention model: running iterations share the GPU as
//!   processor sharing by compute share (`crate::sim`), a lane switch costs 1 ms, a
//!   suspended session pays for copying its persistent tensors out and in at 12 GB/s.
//!   The driver sends `Event::Tick` at `Scheduler::next_wakeup` (held offline iterations
//!   start then). It sends no `Event::DeviceSampled`: the simulator models no SM clock.
//!
//! Systems: salus with protection (`ProtectionConfig::default()`, SHARE, the online
//! session with an SLO), the same with health read from the SLO only
//! ([`slo_only_protection`]), salus without (`ProtectionConfig::disabled()`, SHARE: classes
//! change nothing), time-sharing (FAIR without protection: one lane, iterations taking
//! turns whatever their class) and online-only.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use salus_core::protection::ProtectionConfig;
use salus_core::{
    Action, Event, Hints, MemoryConfig, PolicyKind, Scheduler, SessionClass, SessionId,
    SessionKind, SessionSpec,
};
use serde::Serialize;

use super::Knobs;
use super::gpu::{Latencies, PB_KERNEL_S};
use super::workload::{GPU_BYTES, OFFLINE_MEMORY_SHARE, QPS_RANGE, SERVICES, ServiceKind};
use crate::catalog::{self, Workload};
use crate::rng::Rng;
use crate::sim::{SimConfig, SimError};

/// Virtual seconds per run: one diurnal cycle of the request rate.
pub const SPAN_S: f64 = 600.0;
/// Solo seconds of work of each offline job.
pub const OFFLINE_JOB_S: f64 = 120.0;
/// The online session's SLO: this many times its p99 latency alone over the run.
pub const SLO_FACTOR: f64 = super::DEFAULT_SLO_FACTOR;
/// Resident bytes of the online session beyond the service's model (its request
/// buffers), as ephemeral memory.
pub const ONLINE_EPHEMERAL_BYTES: u64 = 200_000_000;

/// The single-GPU systems, by name.
pub const SYSTEMS: [&str; 5] = [
    "online_only",
    "salus_protection",
    "salus_protection_slo",
    "salus_unprotected",
    "time_sharing",
];

/// The protection of `salus_protection_slo`: the defaults, with the health machine
/// reading the online SLO use but not the online slowdown. The slowdown metric compares
/// each online iteration with the session's typical clean one, so requests of varying
/// size read as slowdown: with the service's spread (CV 0.2) its p99 is about 1.5 with
/// no offline work at all, past the default unhealthy threshold (1.3).
pub fn slo_only_protection() -> ProtectionConfig {
    let mut config = ProtectionConfig::default();
    let never = f64::INFINITY;
    config.thresholds.online_slowdown.healthy = never;
    config.thresholds.online_slowdown.unhealthy = never;
    config.thresholds.online_slowdown.overlimit = never;
    config
}

/// One system's results.
#[derive(Debug, Clone, Serialize)]
pub struct SingleResult {
    /// Online requests served.
    pub requests: usize,
    /// Mean online latency, ms.
    pub online_mean_ms: f64,
    /// 99th percentile online latency, ms.
    pub online_p99_ms: f64,
    /// Mean latency over online-only's.
    pub online_mean_slowdown: f64,
    /// P99 latency over online-only's.
    pub online_p99_slowdown: f64,
    /// Offline solo-seconds done over the run's length: the work against the same jobs
    /// alone on an idle device for the run (Eq. 3's oversold GPU).
    pub offline_throughput_fraction: f64,
    /// Offline solo-seconds done over what the compute the service leaves idle allows
    /// them: `min(1, (1 - U_on)/c)` of solo speed, `U_on` the service's SM activity
    /// alone, integrated over the run.
    pub offline_idle_capacity_fraction: f64,
    /// Offline jobs finished.
    pub offline_finished: usize,
    /// Mean JCT of finished offline jobs over their solo time.
    pub offline_jct_slowdown: f64,
    /// Fraction of the run some iteration ran.
    pub utilization: f64,
    /// `utilization` over online-only's.
    pub utilization_gain: f64,
    /// Mean SM activity (running compute shares, capped at 1).
    pub sm_activity: f64,
    /// Offline sessions suspended (protection's evictions and memory).
    pub offline_suspensions: u64,
    /// Offline iterations abandoned (stopped for an online session past the deadline).
    pub offline_abandoned: u64,
    /// Fraction of the run in each health state (where protection is enabled, online-only
    /// included).
    pub health: BTreeMap<String, f64>,
    /// The protection's `online_slowdown` health metric (p99 over its window of online
    /// iterations' duration against clean ones), sampled every second: the median sample
    /// (0 without protection).
    pub online_slowdown_metric: f64,
    /// Fraction of the run an offline iteration was running.
    pub offline_running_fraction: f64,
    /// Fraction of the run an offline session was admitted (not waiting, not evicted),
    /// sampled every second.
    pub offline_admitted_fraction: f64,
    /// The controller's offline duty, sampled every second while an offline session was
    /// admitted (salus with protection; 0 elsewhere).
    pub mean_duty: f64,
}

/// The single-GPU experiment's results.
#[derive(Debug, Clone, Serialize)]
pub struct SingleExperiment {
    /// Seed of the requests and the offline jobs.
    pub seed: u64,
    /// The online service.
    pub service: &'static str,
    /// The online session's SLO, ms.
    pub slo_ms: f64,
    /// The offline jobs, in order.
    pub offline_jobs: Vec<String>,
    /// Per system.
    pub systems: BTreeMap<String, SingleResult>,
}

#[derive(Debug, Clone, Copy)]
struct Running {
    session: SessionId,
    started: f64,
    /// Seconds of copies and switches left, at full rate (no compute share slows them).
    fixed_left: f64,
    /// Solo seconds of compute left.
    work_left: f64,
    /// The compute share it keeps busy alone.
    wants: f64,
    /// Compute share it demands.
    share: f64,
    /// Its speed against running alone with the whole device (below 1 when held to a
    /// compute share smaller than what it keeps busy alone; 0 while held).
    speed: f64,
    /// A share the core gave it while it runs, and when its running kernel ends: the
    /// device applies the share from there on.
    reshare: Option<(f64, f64)>,
    /// Solo seconds of offline work it has added to the run's total (taken back if it is
    /// abandoned).
    counted: f64,
}

/// One online request.
#[derive(Debug, Clone, Copy)]
struct Request {
    arrival: f64,
    solo: f64,
}

fn at(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

/// The requests of a run: rate `105 + 85 sin(2π t / SPAN_S)` (thinned Poisson).
fn requests(seed: u64, kind: &ServiceKind) -> Vec<Request> {
    let mut rng = Rng::new(seed ^ 0x7265_7175);
    let (lo, hi) = QPS_RANGE;
    let (mid, amp) = ((lo + hi) / 2.0, (hi - lo) / 2.0);
    let sigma2 = (1.0 + kind.request_cv * kind.request_cv).ln();
    let mu = kind.request_s.ln() - sigma2 / 2.0;
    let mut out = Vec::new();
    let mut t = 0.0;
    loop {
        t += rng.exponential(1.0 / hi);
        if t >= SPAN_S {
            break;
        }
        let rate = mid + amp * (std::f64::consts::TAU * t / SPAN_S).sin();
        let keep = rng.unit() < rate / hi;
        let solo = (mu + sigma2.sqrt() * rng.normal(0.0, 1.0)).exp();
        if keep {
            out.push(Request { arrival: t, solo });
        }
    }
    out
}

/// Offline jobs for a run: enough to outlast it.
fn offline_jobs(seed: u64) -> Vec<&'static Workload> {
    let mut rng = Rng::new(seed ^ 0x0074_7261_696e);
    let quota = (GPU_BYTES as f64 * OFFLINE_MEMORY_SHARE) as u64;
    let fitting: Vec<&'static Workload> = catalog::catalog()
        .iter()
        .filter(|w| w.persistent_bytes + w.ephemeral_bytes <= quota)
        .collect();
    let n = (SPAN_S / OFFLINE_JOB_S).ceil() as usize + 1;
    (0..n).map(|_| fitting[rng.index(fitting.len())]).collect()
}

struct Offline {
    workload: &'static Workload,
    opened: f64,
    iterations_left: u64,
}

impl Running {
    /// Held to `share` of the device.
    fn set_share(&mut self, share: f64) {
        self.share = self.wants.min(share.clamp(0.0, 1.0));
        self.speed = if self.wants > 0.0 {
            self.share / self.wants
        } else {
            1.0
        };
    }

    /// Seconds to its end at processor-sharing `rate` (infinite while held).
    fn time_left(&self, rate: f64) -> f64 {
        let compute = if self.work_left <= 0.0 {
            0.0
        } else if self.speed > 0.0 {
            self.work_left / self.speed
        } else {
            f64::INFINITY
        };
        (self.fixed_left + compute) / rate
    }

    /// Runs `dt` seconds at `rate`; returns the solo seconds of compute done.
    fn advance(&mut self, dt: f64, rate: f64) -> f64 {
        let units = dt * rate;
        let fixed = units.min(self.fixed_left);
        self.fixed_left -= fixed;
        let done = ((units - fixed) * self.speed).min(self.work_left.max(0.0));
        self.work_left -= (units - fixed) * self.speed;
        done
    }
}

/// Runs one system; returns its results and the request latencies.
fn run(
    seed: u64,
    system: &str,
    kind: &ServiceKind,
    reqs: &[Request],
    jobs: &[&'static Workload],
    slo_s: Option<f64>,
    knobs: Knobs,
) -> Result<(SingleResult, Latencies), SimError> {
    let (policy, mut protection) = match system {
        "salus_unprotected" => (PolicyKind::Share, ProtectionConfig::disabled()),
        "time_sharing" => (PolicyKind::Fair, ProtectionConfig::disabled()),
        "salus_protection_slo" => (PolicyKind::Share, slo_only_protection()),
        _ => (PolicyKind::Share, ProtectionConfig::default()),
    };
    let tuned = knobs.protection();
    protection.offline_compute_share = tuned.offline_compute_share;
    protection.dynamic_compute_share = tuned.dynamic_compute_share;
    protection.target_load = knobs.target_load;
    let with_offline = system != "online_only";
    let config = SimConfig::reference(policy);
    let mut core = Scheduler::with_protection(MemoryConfig::new(GPU_BYTES, 0), policy, protection)?;
    let online = SessionId(0);
    core.handle(
        Duration::ZERO,
        Event::SessionOpened(SessionSpec {
            id: online,
            kind: SessionKind::Inference,
            class: SessionClass::Online,
            persistent_bytes: kind.memory_bytes,
            ephemeral_bytes: ONLINE_EPHEMERAL_BYTES,
            hints: Hints {
                name: kind.name.to_string(),
                priority: 0,
                total_iterations: None,
                expected_iteration: Some(at(kind.request_s)),
                slo: slo_s.map(at),
            },
        }),
    )?;
    let mut pending: VecDeque<Request> = VecDeque::new();
    let mut in_flight: Option<Request> = None;
    let mut latencies = Latencies::default();
    let mut running: Vec<Running> = Vec::new();
    let mut next_req = 0usize;
    let mut next_job = 0usize;
    let mut offline: Option<(SessionId, Offline)> = None;
    let mut restore = 0.0f64;
    let (mut done_work, mut finished, mut jct_ratio) = (0.0f64, 0usize, 0.0f64);
    let (mut busy, mut sm) = (0.0f64, 0.0f64);
    let mut idle_allows = 0.0f64;
    let mut suspensions = 0u64;
    let mut health: BTreeMap<String, f64> = BTreeMap::new();
    let (mut duty_sum, mut duty_n) = (0.0f64, 0u64);
    let mut admitted = false;
    let mut admitted_s = 0.0f64;
    let mut offline_running_s = 0.0f64;
    let mut slowdown_metric: Vec<f64> = Vec::new();
    let mut abandoned = 0u64;
    let mut next_sample = 0.0f64;
    let mut now = 0.0f64;
    // Where the running offline kernel ends when the core changes an iteration's share.
    let mut kernel_rng = Rng::new(seed ^ 0x6b65_726e);
    let a = kind.busy_share;
    let rate_at = |t: f64| {
        let (lo, hi) = QPS_RANGE;
        (lo + hi) / 2.0 + (hi - lo) / 2.0 * (std::f64::consts::TAU * t / SPAN_S).sin()
    };
    loop {
        // Open the next offline job when none is open.
        if with_offline && offline.is_none() && now < SPAN_S && next_job < jobs.len() {
            let w = jobs[next_job];
            next_job += 1;
            let id = SessionId(next_job as u64);
            let iterations = ((OFFLINE_JOB_S / w.iteration_s).round() as u64).max(1);
            core.handle(
                at(now),
                Event::SessionOpened(SessionSpec {
                    id,
                    kind: SessionKind::Training,
                    class: SessionClass::Offline,
                    persistent_bytes: w.persistent_bytes,
                    ephemeral_bytes: w.ephemeral_bytes,
                    hints: Hints {
                        name: w.name(),
                        priority: 0,
                        total_iterations: Some(iterations),
                        expected_iteration: Some(at(w.iteration_s)),
                        slo: None,
                    },
                }),
            )?;
            core.handle(at(now), Event::IterationSubmitted(id))?;
            offline = Some((
                id,
                Offline {
                    workload: w,
                    opened: now,
                    iterations_left: iterations,
                },
            ));
        }
        let mut abandon_events = false;
        for action in core.poll() {
            match action {
                Action::StartIteration {
                    session,
                    switched_from,
                    compute_share,
                    ..
                } => {
                    // Compute (slowed by a compute share) and copies and switches (not).
                    let mut fixed = 0.0;
                    let work = if session == online {
                        let r = pending.pop_front().ok_or_else(|| SimError::Stalled {
                            at_s: now,
                            unfinished: 0,
                            detail: "online iteration without a request".into(),
                        })?;
                        in_flight = Some(r);
                        r.solo
                    } else {
                        let w = offline
                            .as_ref()
                            .map_or(0.0, |(_, o)| o.workload.iteration_s);
                        fixed += std::mem::take(&mut restore);
                        w
                    };
                    if switched_from.is_some() {
                        fixed += config.switch_cost_s;
                    }
                    let wants = if session == online {
                        a
                    } else {
                        offline
                            .as_ref()
                            .map_or(1.0, |(_, o)| o.workload.compute_share)
                    };
                    // Held to a share of the device below what it keeps busy alone, the
                    // iteration demands that share and runs slower in proportion.
                    let mut r = Running {
                        session,
                        started: now,
                        fixed_left: fixed,
                        work_left: work,
                        wants,
                        share: wants,
                        speed: 1.0,
                        reshare: None,
                        counted: 0.0,
                    };
                    r.set_share(compute_share);
                    running.push(r);
                }
                Action::SetComputeShare {
                    session,
                    compute_share,
                } => {
                    // From the end of the kernel it runs now (uniform up to
                    // `PB_KERNEL_S`, as a request waits for one under PB-time-sharing).
                    if let Some(r) = running.iter_mut().find(|r| r.session == session) {
                        let at = match r.reshare {
                            Some((_, at)) => at,
                            None => now + kernel_rng.unit() * PB_KERNEL_S,
                        };
                        r.reshare = Some((compute_share, at));
                    }
                }
                Action::Admit {
                    session, resumed, ..
                } => {
                    if session != online {
                        admitted = true;
                    }
                    if resumed && session != online {
                        let p = offline
                            .as_ref()
                            .map_or(0, |(_, o)| o.workload.persistent_bytes);
                        restore += 2.0 * p as f64 / config.host_bandwidth;
                    }
                }
                Action::Suspend { session, .. } => {
                    if session != online {
                        suspensions += 1;
                        admitted = false;
                    }
                }
                Action::Closed { session } => {
                    if offline.as_ref().is_some_and(|(id, _)| *id == session) {
                        offline = None;
                        admitted = false;
                    }
                }
                Action::Abandon { session } => {
                    // Stopped before its end, keeping nothing: it runs again later.
                    if let Some(i) = running.iter().position(|r| r.session == session) {
                        let r = running.remove(i);
                        done_work -= r.counted;
                        abandoned += 1;
                        core.handle(at(now), Event::IterationAbandoned(session))?;
                        abandon_events = true;
                    }
                }
                Action::Reject { reason, .. } => {
                    return Err(SimError::Stalled {
                        at_s: now,
                        unfinished: 1,
                        detail: reason.to_string(),
                    });
                }
                Action::Queue { .. } | Action::MoveLane { .. } => {}
            }
        }
        if abandon_events
            || (offline.is_none() && with_offline && now < SPAN_S && next_job < jobs.len())
        {
            // The core has more to say (a lane freed by an abandoned iteration), or the
            // next offline job opens now.
            continue;
        }
        // The next event.
        let demand: f64 = running.iter().map(|r| r.share).sum();
        let rate = 1.0 / demand.max(1.0);
        let finish_at = running
            .iter()
            .map(|r| now + r.time_left(rate))
            .fold(f64::INFINITY, f64::min);
        let reshare_at = running
            .iter()
            .filter_map(|r| r.reshare.map(|(_, at)| at.max(now)))
            .fold(f64::INFINITY, f64::min);
        let arrive_at = reqs.get(next_req).map_or(f64::INFINITY, |r| r.arrival);
        let wake_at = core
            .next_wakeup()
            .map_or(f64::INFINITY, |d| d.as_secs_f64().max(now));
        let t = finish_at
            .min(reshare_at)
            .min(arrive_at)
            .min(wake_at)
            .min(next_sample.max(now));
        let end = SPAN_S;
        if now >= end && next_req >= reqs.len() && in_flight.is_none() && pending.is_empty() {
            break;
        }
        if !t.is_finite() {
            break;
        }
        // Run [now, t), and account for the part within the run.
        let (from, to) = (now.min(end), t.min(end));
        let within = if t > now {
            (to - from).max(0.0) / (t - now)
        } else {
            0.0
        };
        let mut any_offline = false;
        for r in &mut running {
            let done = r.advance(t - now, rate);
            if r.session != online {
                done_work += within * done;
                r.counted += within * done;
                any_offline = true;
            }
        }
        if to > from {
            let width = to - from;
            if demand > 0.0 {
                busy += width;
            }
            sm += width * demand.min(1.0);
            if any_offline {
                offline_running_s += width;
            }
            if let Some((_, o)) = &offline {
                let u_on = (rate_at(from) * kind.request_s * a).min(1.0);
                idle_allows += width * ((1.0 - u_on) / o.workload.compute_share).min(1.0);
            }
        }
        now = t;
        if now >= next_sample {
            if next_sample < end && admitted {
                admitted_s += 1.0;
            }
            if next_sample < end && core.protection_config().enabled {
                let status = core.protection_status();
                if let Some(x) = status.metrics.online_slowdown {
                    slowdown_metric.push(x);
                }
                *health.entry(status.health.name().to_string()).or_default() += 1.0;
                if admitted {
                    duty_sum += status.offline_duty;
                    duty_n += 1;
                }
            }
            next_sample += 1.0;
        }
        // Shares the device applies now.
        if now >= reshare_at {
            for r in &mut running {
                if let Some((share, at)) = r.reshare
                    && at <= now
                {
                    r.reshare = None;
                    r.set_share(share);
                }
            }
            continue;
        }
        // Finishes.
        if now >= finish_at {
            let tolerance = 1e-9 * now.max(1.0);
            let (ended, still): (Vec<Running>, Vec<Running>) = running
                .iter()
                .partition(|r| r.fixed_left <= tolerance && r.work_left <= tolerance);
            running = still;
            let ended = if ended.is_empty() {
                let i = (0..running.len())
                    .min_by(|&x, &y| {
                        running[x]
                            .time_left(1.0)
                            .total_cmp(&running[y].time_left(1.0))
                    })
                    .unwrap_or(0);
                vec![running.remove(i)]
            } else {
                ended
            };
            for r in ended {
                core.handle(
                    at(now),
                    Event::IterationFinished {
                        session: r.session,
                        duration: at(now - r.started),
                    },
                )?;
                if r.session == online {
                    if let Some(req) = in_flight.take()
                        && req.arrival < end
                    {
                        latencies.add(now - req.arrival, 1.0);
                    }
                } else if let Some((id, o)) = &mut offline {
                    o.iterations_left = o.iterations_left.saturating_sub(1);
                    if o.iterations_left == 0 {
                        if now <= end {
                            finished += 1;
                            jct_ratio += (now - o.opened) / OFFLINE_JOB_S;
                        }
                        core.handle(at(now), Event::SessionClosed(*id))?;
                    } else if now < end {
                        core.handle(at(now), Event::IterationSubmitted(*id))?;
                    } else {
                        core.handle(at(now), Event::SessionClosed(*id))?;
                    }
                }
            }
            continue;
        }
        if now >= arrive_at {
            let r = reqs[next_req];
            next_req += 1;
            pending.push_back(r);
            core.handle(at(now), Event::IterationSubmitted(online))?;
            continue;
        }
        core.handle(at(now), Event::Tick)?;
    }
    let result = SingleResult {
        requests: reqs.len(),
        online_mean_ms: 1e3 * latencies.mean(),
        online_p99_ms: 1e3 * latencies.quantile(0.99),
        online_mean_slowdown: 1.0,
        online_p99_slowdown: 1.0,
        offline_throughput_fraction: if with_offline {
            done_work / SPAN_S
        } else {
            0.0
        },
        offline_idle_capacity_fraction: if idle_allows > 0.0 {
            done_work / idle_allows
        } else {
            0.0
        },
        offline_finished: finished,
        offline_jct_slowdown: if finished > 0 {
            jct_ratio / finished as f64
        } else {
            0.0
        },
        utilization: busy / SPAN_S,
        utilization_gain: 1.0,
        sm_activity: sm / SPAN_S,
        offline_suspensions: suspensions,
        offline_abandoned: abandoned,
        health: {
            let total: f64 = health.values().sum();
            health
                .into_iter()
                .map(|(k, v)| (k, v / total.max(1.0)))
                .collect()
        },
        offline_running_fraction: offline_running_s / SPAN_S,
        online_slowdown_metric: {
            slowdown_metric.sort_by(f64::total_cmp);
            slowdown_metric
                .get(slowdown_metric.len() / 2)
                .copied()
                .unwrap_or(0.0)
        },
        offline_admitted_fraction: admitted_s / SPAN_S,
        mean_duty: if duty_n > 0 {
            duty_sum / duty_n as f64
        } else {
            0.0
        },
    };
    Ok((result, latencies))
}

/// The single-GPU experiment for `seed`, salus' knobs at their defaults.
pub fn single(seed: u64) -> Result<SingleExperiment, SimError> {
    single_with(seed, Knobs::default())
}

/// [`single`] with salus' protection as `knobs` say.
pub fn single_with(seed: u64, knobs: Knobs) -> Result<SingleExperiment, SimError> {
    let slo_factor = knobs.slo_factor;
    let kind = SERVICES[1];
    let reqs = requests(seed, &kind);
    let jobs = offline_jobs(seed);
    let (alone, alone_lat) = run(seed, "online_only", &kind, &reqs, &jobs, None, knobs)?;
    let slo = slo_factor * alone_lat.quantile(0.99);
    let mut systems = BTreeMap::new();
    systems.insert("online_only".to_string(), alone.clone());
    for system in SYSTEMS.iter().filter(|s| **s != "online_only") {
        let (mut r, _) = run(seed, system, &kind, &reqs, &jobs, Some(slo), knobs)?;
        r.online_mean_slowdown = r.online_mean_ms / alone.online_mean_ms;
        r.online_p99_slowdown = r.online_p99_ms / alone.online_p99_ms;
        r.utilization_gain = r.utilization / alone.utilization;
        systems.insert(system.to_string(), r);
    }
    Ok(SingleExperiment {
        seed,
        service: kind.name,
        slo_ms: 1e3 * slo,
        offline_jobs: jobs.iter().map(|w| w.name()).collect(),
        systems,
    })
}
