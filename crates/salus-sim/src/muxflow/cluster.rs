//! The cluster mode: [`GPUS`] GPUs, an online service on each, offline jobs from the
//! trace placed beside them every step, shared as each system shares
//! ([`super::gpu`]).
//!
//! Placement:
//! - **matching** (MuxFlow §5, Algorithm 1): every [`INTERVAL_S`], Kuhn-Munkres over
//!   every GPU and every submitted, unfinished offline job, each edge the predicted
//!   normalized throughput of the job beside the GPU's service at the request rate of
//!   the last interval. A running job the matching puts elsewhere moves (and pays
//!   [`MIGRATION_S`] of checkpoint and restart), one it leaves out goes back to the
//!   queue; moving is charged in the weight (`1 - MIGRATION_S / INTERVAL_S`), so a job
//!   moves only for a gain. Between rounds, each step, GPUs that fell free are matched
//!   with the waiting jobs the same way (MuxFlow's interval is long; leaving a GPU idle
//!   until the next round wastes it).
//! - **first fit**: every step, waiting jobs in submission order go to free GPUs in
//!   index order and stay there until they finish (the baselines' placement; the paper
//!   names none for them).
//!
//! Under MuxFlow and salus a SysMonitor-like state machine guards each GPU: a GPU whose
//! service alone was busier than [`UNHEALTHY_LOAD`] in the last step takes no new
//! offline job; one whose service (with the offline job beside it) was busier than
//! [`OVERLIMIT_LOAD`] evicts its job, which waits again and pays the restart.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;

use super::Knobs;
use super::gpu::{Latencies, SalusGpu, Sharing, StepModel, sample_requests, step_model};
use super::km::max_weight_matching;
use super::predictor::{LatencyProfile, hidden_factor, predict, salus_duty};
use super::workload::{
    GPUS, INTERVAL_S, JOBS_PER_GPU, OfflineJob, Online, SERVICES, STEP_S, ServiceKind, WINDOW_S,
    offline_trace, online_services,
};
use crate::rng::Rng;
use salus_core::protection::OfflineShare;

/// Seconds of progress a job loses when it moves or restarts (checkpoint, transfer,
/// restart; MuxFlow §6).
pub const MIGRATION_S: f64 = 120.0;
/// SysMonitor: no new offline job beside a service busier than this alone.
pub const UNHEALTHY_LOAD: f64 = 0.5;
/// SysMonitor: evict the offline job when the service is busier than this.
pub const OVERLIMIT_LOAD: f64 = 0.9;
/// The simulation stops here even if offline jobs remain (they count as unfinished).
pub const MAX_S: f64 = 14.0 * 24.0 * 3600.0;
/// salus' latency target for a service: this many times its p99 alone over the day (its
/// dedicated deployment's figure, as an operator would set `Hints::slo`).
pub const SLO_FACTOR: f64 = super::DEFAULT_SLO_FACTOR;
/// salus' protection controller (cluster mode): steps of measured latencies it looks at.
pub const CONTROL_WINDOW: usize = 10;
/// salus' protection controller: integral gain on `1 - p99 / SLO` per step.
pub const CONTROL_GAIN: f64 = 0.5;
/// The most requests of a step salus' offline share learns from (a step's requests at
/// 20-190 per second number 1,200-11,400; the share needs hundreds at most).
pub const LEARN_SAMPLES: usize = 1024;

/// Where offline jobs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Offline jobs never run.
    None,
    /// Waiting jobs in order to free GPUs in order; no moves.
    FirstFit,
    /// Kuhn-Munkres on predicted normalized throughput (MuxFlow §5).
    Matching,
}

/// One compared system.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct System {
    /// Name in the output.
    pub name: &'static str,
    /// How each GPU is shared.
    pub sharing: Sharing,
    /// How offline jobs are placed.
    pub placement: Placement,
}

/// The cluster systems: MuxFlow's Fig. 11 (MuxFlow, online-only, time-sharing,
/// PB-time-sharing), salus' per-GPU protection with matching, and each space-sharing
/// system with first fit instead of matching (MuxFlow-M of Fig. 13).
pub const SYSTEMS: [System; 7] = [
    System {
        name: "online_only",
        sharing: Sharing::OnlineOnly,
        placement: Placement::None,
    },
    System {
        name: "time_sharing",
        sharing: Sharing::TimeSharing,
        placement: Placement::FirstFit,
    },
    System {
        name: "pb_time_sharing",
        sharing: Sharing::PriorityTimeSharing,
        placement: Placement::FirstFit,
    },
    System {
        name: "muxflow",
        sharing: Sharing::MuxFlow,
        placement: Placement::Matching,
    },
    System {
        name: "muxflow_first_fit",
        sharing: Sharing::MuxFlow,
        placement: Placement::FirstFit,
    },
    System {
        name: "salus_matching",
        sharing: Sharing::Salus,
        placement: Placement::Matching,
    },
    System {
        name: "salus_first_fit",
        sharing: Sharing::Salus,
        placement: Placement::FirstFit,
    },
];

/// One system's results.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterResult {
    /// Mean online latency over the day, ms.
    pub online_mean_ms: f64,
    /// 99th percentile online latency over the day, ms.
    pub online_p99_ms: f64,
    /// Mean latency over online-only's.
    pub online_mean_slowdown: f64,
    /// P99 latency over online-only's.
    pub online_p99_slowdown: f64,
    /// Offline work done over the time the jobs held GPUs, against the same jobs alone
    /// on idle GPUs for that time (MuxFlow's oversold GPU, Eq. 3).
    pub offline_throughput_fraction: f64,
    /// Offline work done over what the GPUs' idle compute allowed the same jobs in the
    /// same time: `min(1, (1 - U_on)/c)` of solo speed, `U_on` the service's SM
    /// activity alone.
    pub offline_idle_capacity_fraction: f64,
    /// Offline solo-hours done within the day.
    pub offline_work_day_h: f64,
    /// Offline jobs finished (of [`ClusterExperiment::offline_jobs`]).
    pub offline_finished: usize,
    /// Mean offline JCT (submission to finish) over finished jobs, hours.
    pub offline_avg_jct_h: f64,
    /// First submission to last finish, hours.
    pub offline_makespan_h: f64,
    /// Fraction of the day some kernel ran (GPU utilisation), averaged over GPUs.
    pub utilization: f64,
    /// `utilization` over online-only's.
    pub utilization_gain: f64,
    /// Mean SM activity over the day.
    pub sm_activity: f64,
    /// Jobs moved by a matching round.
    pub migrations: usize,
    /// Jobs evicted by the SysMonitor.
    pub evictions: usize,
}

/// The cluster experiment's results.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterExperiment {
    /// Seed of the traces.
    pub seed: u64,
    /// salus' SLO and compute share.
    pub knobs: Knobs,
    /// GPUs.
    pub gpus: usize,
    /// Offline jobs in the trace.
    pub offline_jobs: usize,
    /// Total solo hours of the offline trace.
    pub offline_solo_h: f64,
    /// Online load alone, the cluster's mean busy fraction over the day.
    pub online_load: f64,
    /// Per system name.
    pub systems: BTreeMap<String, ClusterResult>,
}

#[derive(Debug, Clone, Default)]
struct JobState {
    remaining_s: f64,
    gpu: Option<usize>,
    last_gpu: Option<usize>,
    started: bool,
    restart_s: f64,
    finished_s: Option<f64>,
}

struct Run<'a> {
    system: System,
    online: &'a [Online],
    profiles: &'a [LatencyProfile],
    slo: &'a [f64],
    /// Each GPU's offline share beside its service (salus' protection), fixed or learned.
    shares: Vec<OfflineShare>,
    target_load: f64,
    jobs: &'a [OfflineJob],
    state: Vec<JobState>,
    on_gpu: Vec<Option<usize>>,
    migrations: usize,
}

impl Run<'_> {
    fn place(&mut self, job: usize, gpu: usize) {
        let s = &mut self.state[job];
        if s.started && s.last_gpu != Some(gpu) {
            s.restart_s = MIGRATION_S;
        }
        s.started = true;
        s.gpu = Some(gpu);
        s.last_gpu = Some(gpu);
        self.on_gpu[gpu] = Some(job);
    }

    fn unplace(&mut self, job: usize) {
        if let Some(g) = self.state[job].gpu.take() {
            self.on_gpu[g] = None;
        }
    }

    /// The p99 salus' controller steers GPU `g`'s service to at `qps`: its SLO, or where
    /// the service alone is slower than that (its own peak), `target_load` times its p99
    /// alone. The core's controller steers the slowdown offline work causes and its health
    /// reads SLO use only beside offline work, so a service that misses its SLO by itself
    /// still lets offline work run at that slowdown.
    fn bound(&self, g: usize, qps: f64) -> f64 {
        let alone = self.profiles[g].p99(qps);
        self.slo[g].max(self.target_load * alone)
    }

    /// The latency slack of GPU `g`'s service at `qps`: [`Run::bound`] over its p99
    /// alone, less 1.
    fn slack(&self, g: usize, qps: f64) -> f64 {
        self.bound(g, qps) / self.profiles[g].p99(qps) - 1.0
    }

    /// Matches `gpus` with `jobs` on predicted speed at each GPU's rate `qps`.
    fn matching(
        &self,
        gpus: &[usize],
        jobs: &[usize],
        qps: &[f64],
        healthy: &[bool],
    ) -> Vec<Option<usize>> {
        let keep = 1.0 - MIGRATION_S / INTERVAL_S;
        let weights: Vec<Vec<f64>> = gpus
            .iter()
            .map(|&g| {
                jobs.iter()
                    .map(|&j| {
                        let s = &self.state[j];
                        let stays = s.gpu == Some(g);
                        if !healthy[g] && !stays {
                            return 0.0;
                        }
                        let w = predict(
                            self.system.sharing,
                            &self.online[g],
                            qps[g],
                            &self.jobs[j],
                            self.slack(g, qps[g]),
                            self.shares[g].share(),
                        );
                        if s.started && s.last_gpu != Some(g) {
                            w * keep
                        } else {
                            w
                        }
                    })
                    .collect()
            })
            .collect();
        max_weight_matching(&weights)
    }
}

/// Runs `system` on the traces; returns its results and each GPU's latencies over the
/// day. `slo` is each service's latency target and `target_load` the slowdown salus'
/// controller allows beside offline work (see [`Run::bound`]).
fn run_system(
    system: System,
    seed: u64,
    online: &[Online],
    profiles: &[LatencyProfile],
    slo: &[f64],
    knobs: Knobs,
    jobs: &[OfflineJob],
) -> (ClusterResult, Vec<Latencies>) {
    let gpus = online.len();
    let mut run = Run {
        system,
        online,
        profiles,
        slo,
        shares: vec![knobs.offline_share(); gpus],
        target_load: knobs.target_load,
        jobs,
        state: jobs
            .iter()
            .map(|j| JobState {
                remaining_s: j.solo_s,
                ..JobState::default()
            })
            .collect(),
        on_gpu: vec![None; gpus],
        migrations: 0,
    };
    let space = matches!(system.sharing, Sharing::MuxFlow | Sharing::Salus);
    let mut latencies = Latencies::default();
    let mut per_gpu = vec![Latencies::default(); gpus];
    let mut duty = vec![0.0f64; gpus];
    let mut window: Vec<VecDeque<Vec<f64>>> = vec![VecDeque::new(); gpus];
    let controlled = system.sharing == Sharing::Salus;
    let (mut busy, mut sm) = (0.0, 0.0);
    let (mut done_s, mut held_s, mut idle_allows_s, mut done_day_s) = (0.0, 0.0, 0.0, 0.0);
    let mut evictions = 0;
    let mut healthy = vec![true; gpus];
    let window_steps = (WINDOW_S / STEP_S) as usize;
    let interval_steps = (INTERVAL_S / STEP_S) as usize;
    let mut step = 0usize;
    loop {
        let t = step as f64 * STEP_S;
        let unfinished = run.state.iter().filter(|s| s.finished_s.is_none()).count();
        if (step >= window_steps && (unfinished == 0 || system.placement == Placement::None))
            || t >= MAX_S
        {
            break;
        }
        // Jobs submitted by now and not finished.
        let active: Vec<usize> = (0..jobs.len())
            .filter(|&j| jobs[j].submit_s <= t && run.state[j].finished_s.is_none())
            .collect();
        let measured: Vec<f64> = online
            .iter()
            .map(|o| o.mean_qps(step.saturating_sub(interval_steps), step))
            .collect();
        let placed_before = run.on_gpu.clone();
        match system.placement {
            Placement::None => {}
            Placement::FirstFit => {
                for &j in &active {
                    if run.state[j].gpu.is_some() {
                        continue;
                    }
                    let Some(g) = (0..gpus).find(|&g| run.on_gpu[g].is_none() && healthy[g]) else {
                        break;
                    };
                    run.place(j, g);
                }
            }
            Placement::Matching => {
                let all: Vec<usize> = (0..gpus).collect();
                let (rows, cols): (Vec<usize>, Vec<usize>) = if step.is_multiple_of(interval_steps)
                {
                    (all, active.clone())
                } else {
                    (
                        all.into_iter()
                            .filter(|&g| run.on_gpu[g].is_none())
                            .collect(),
                        active
                            .iter()
                            .copied()
                            .filter(|&j| run.state[j].gpu.is_none())
                            .collect(),
                    )
                };
                if !rows.is_empty() && !cols.is_empty() {
                    let m = run.matching(&rows, &cols, &measured, &healthy);
                    let wanted: Vec<(usize, Option<usize>)> = rows
                        .iter()
                        .zip(&m)
                        .map(|(&g, c)| (g, c.map(|c| cols[c])))
                        .collect();
                    for &(g, j) in &wanted {
                        if let Some(cur) = run.on_gpu[g]
                            && Some(cur) != j
                        {
                            run.unplace(cur);
                        }
                        if let Some(j) = j
                            && run.state[j].gpu.is_some_and(|h| h != g)
                        {
                            run.unplace(j);
                        }
                    }
                    for (g, j) in wanted {
                        if let Some(j) = j
                            && run.state[j].gpu.is_none()
                        {
                            if run.state[j].started && run.state[j].last_gpu != Some(g) {
                                run.migrations += 1;
                            }
                            run.place(j, g);
                        }
                    }
                }
            }
        }
        for g in 0..gpus {
            let o = &online[g];
            let qps = o.qps_at(step);
            let job = run.on_gpu[g];
            let compute_share = run.shares[g].share();
            if controlled && job.is_some() && job != placed_before[g] {
                // A new job starts at the predicted duty; the controller takes it from there.
                let c = job.map_or(0.0, |j| jobs[j].compute_share);
                duty[g] = salus_duty(&o.kind, c, run.slack(g, measured[g]), compute_share);
            }
            let c = job.map(|j| jobs[j].compute_share);
            let salus = SalusGpu {
                duty: duty[g],
                compute_share,
            };
            let model = step_model(system.sharing, &o.kind, qps, c, salus);
            if step < window_steps || (controlled && job.is_some()) {
                let mut rng = Rng::new(
                    seed.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ ((g as u64) << 40) ^ step as u64,
                );
                let mut scratch = Latencies::default();
                let out = if step < window_steps {
                    &mut latencies
                } else {
                    &mut scratch
                };
                let sampled = sample_requests(
                    system.sharing,
                    &o.kind,
                    qps,
                    &model,
                    job.is_some(),
                    &mut rng,
                    out,
                );
                if step < window_steps {
                    for &l in &sampled {
                        per_gpu[g].add(l, 1.0);
                    }
                    busy += model.gpu_busy;
                    sm += model.sm_activity;
                }
                if controlled {
                    if job.is_some() {
                        learn_share(&mut run.shares[g], &o.kind, qps, &model, &mut rng);
                    }
                    window[g].push_back(sampled);
                    if window[g].len() > CONTROL_WINDOW {
                        window[g].pop_front();
                    }
                    if job.is_some() {
                        let mut all: Vec<f64> = window[g].iter().flatten().copied().collect();
                        all.sort_by(f64::total_cmp);
                        let p99 = all[((all.len() as f64 * 0.99) as usize).min(all.len() - 1)];
                        let bound = run.bound(g, qps);
                        duty[g] = (duty[g] + CONTROL_GAIN * (1.0 - p99 / bound)).clamp(0.0, 1.0);
                    }
                }
            }
            healthy[g] = o.load(qps) <= UNHEALTHY_LOAD || !space;
            let Some(j) = job else { continue };
            let speed = (model.offline_speed * hidden_factor(seed, g, j)).min(1.0);
            let s = &mut run.state[j];
            let restart = s.restart_s.min(STEP_S);
            s.restart_s -= restart;
            let left = STEP_S - restart;
            let u_on = (o.load(qps) * o.kind.busy_share).min(1.0);
            let allows = ((1.0 - u_on) / jobs[j].compute_share).min(1.0);
            let (held, progress) = if speed * left >= s.remaining_s && speed > 0.0 {
                let need = s.remaining_s / speed;
                s.finished_s = Some(t + restart + need);
                (restart + need, s.remaining_s)
            } else {
                (STEP_S, speed * left)
            };
            s.remaining_s -= progress;
            done_s += progress;
            held_s += held;
            idle_allows_s += allows * (held - restart);
            if step < window_steps {
                done_day_s += progress;
            }
            if s.finished_s.is_some() {
                run.unplace(j);
            } else if space && model.online_busy > OVERLIMIT_LOAD {
                evictions += 1;
                run.unplace(j);
                run.state[j].last_gpu = None;
            }
        }
        step += 1;
    }
    let finished: Vec<(usize, f64)> = run
        .state
        .iter()
        .enumerate()
        .filter_map(|(j, s)| s.finished_s.map(|f| (j, f)))
        .collect();
    let jct: f64 = finished
        .iter()
        .map(|&(j, f)| f - jobs[j].submit_s)
        .sum::<f64>()
        / finished.len().max(1) as f64;
    let first = jobs
        .iter()
        .map(|j| j.submit_s)
        .fold(f64::INFINITY, f64::min);
    let last = finished.iter().map(|&(_, f)| f).fold(first, f64::max);
    let gpu_steps = (gpus * window_steps) as f64;
    let result = ClusterResult {
        online_mean_ms: 1e3 * latencies.mean(),
        online_p99_ms: 1e3 * latencies.quantile(0.99),
        online_mean_slowdown: 1.0,
        online_p99_slowdown: 1.0,
        offline_throughput_fraction: if held_s > 0.0 { done_s / held_s } else { 0.0 },
        offline_idle_capacity_fraction: if idle_allows_s > 0.0 {
            done_s / idle_allows_s
        } else {
            0.0
        },
        offline_work_day_h: done_day_s / 3600.0,
        offline_finished: finished.len(),
        offline_avg_jct_h: jct / 3600.0,
        offline_makespan_h: if finished.is_empty() {
            0.0
        } else {
            (last - first) / 3600.0
        },
        utilization: busy / gpu_steps,
        utilization_gain: 1.0,
        sm_activity: sm / gpu_steps,
        migrations: run.migrations,
        evictions,
    };
    (result, per_gpu)
}

/// Every system of [`SYSTEMS`] on the traces of `seed`, salus' knobs at their defaults.
pub fn cluster(seed: u64) -> ClusterExperiment {
    cluster_with(seed, Knobs::default())
}

/// [`cluster`] with salus' SLO and compute share as `knobs` say.
pub fn cluster_with(seed: u64, knobs: Knobs) -> ClusterExperiment {
    let slo_factor = knobs.slo_factor;
    let steps = (MAX_S / STEP_S) as usize + 1;
    // The online load repeats daily past the first day's trace.
    let day = (WINDOW_S / STEP_S) as usize;
    let mut online = online_services(seed, GPUS, day);
    for o in &mut online {
        let first: Vec<f64> = o.qps.clone();
        o.qps = (0..steps).map(|s| first[s % day]).collect();
    }
    let jobs = offline_trace(seed, GPUS * JOBS_PER_GPU);
    let by_kind: Vec<LatencyProfile> = SERVICES.iter().map(LatencyProfile::measure).collect();
    let profiles: Vec<LatencyProfile> = online
        .iter()
        .map(|o| {
            let k = SERVICES.iter().position(|k| k == &o.kind).unwrap_or(0);
            by_kind[k].clone()
        })
        .collect();
    let mut systems = BTreeMap::new();
    // Online-only first: each service's p99 alone sets its SLO.
    let mut slo = vec![f64::INFINITY; online.len()];
    for system in SYSTEMS {
        let (result, per_gpu) = run_system(system, seed, &online, &profiles, &slo, knobs, &jobs);
        if system.sharing == Sharing::OnlineOnly {
            slo = per_gpu
                .iter()
                .map(|l| slo_factor * l.quantile(0.99))
                .collect();
        }
        systems.insert(system.name.to_string(), result);
    }
    if let Some(base) = systems.get("online_only").cloned() {
        for r in systems.values_mut() {
            r.online_mean_slowdown = r.online_mean_ms / base.online_mean_ms;
            r.online_p99_slowdown = r.online_p99_ms / base.online_p99_ms;
            r.utilization_gain = r.utilization / base.utilization;
        }
    }
    let online_load = online
        .iter()
        .map(|o| (0..day).map(|s| o.load(o.qps_at(s))).sum::<f64>() / day as f64)
        .sum::<f64>()
        / online.len() as f64;
    ClusterExperiment {
        seed,
        knobs,
        gpus: GPUS,
        offline_jobs: jobs.len(),
        offline_solo_h: jobs.iter().map(|j| j.solo_s).sum::<f64>() / 3600.0,
        online_load,
        systems,
    }
}

/// Tells a GPU's offline share what the core measures of its service's requests in a
/// step at `qps` (up to [`LEARN_SAMPLES`] of them): each one's service time over the
/// service's mean alone, beside the offline job (with the step's stretch) or not. They
/// all ran at the share the step started with: once that changes, only the clean ones
/// still count.
fn learn_share(
    share: &mut OfflineShare,
    kind: &ServiceKind,
    qps: f64,
    model: &StepModel,
    rng: &mut Rng,
) {
    let sigma2 = (1.0 + kind.request_cv * kind.request_cv).ln();
    let (mu, sigma) = (-sigma2 / 2.0, sigma2.sqrt());
    let n = (qps * STEP_S).min(LEARN_SAMPLES as f64) as usize;
    let mut changed = false;
    for _ in 0..n {
        let size = (mu + sigma * rng.normal(0.0, 1.0)).exp();
        if rng.unit() >= model.share.duty {
            share.clean(size);
        } else if !changed {
            changed = share.beside(size * model.stretch);
        }
    }
}
