//! The simulator proper: replays jobs through `salus-core` in virtual time.
//!
//! # Contention model
//!
//! Each running iteration has a compute share `s` (the fraction of the GPU it keeps busy
//! when alone) and a solo duration. Iterations of concurrent lanes share the GPU as
//! processor sharing weighted by their shares: while the running shares sum to `S`, every
//! iteration progresses at rate `1 / max(1, S)` of its solo speed. Jobs that together do
//! not saturate the GPU (S <= 1) run at full speed side by side; beyond that the GPU's
//! throughput is the bottleneck and everyone slows down in proportion. On top of that,
//! every job switch on a lane (an iteration of another session than the one before it)
//! costs a fixed time, so time-sharing and preemption are not free either; and a session
//! suspended to host memory (SRTF making room) pays for copying its persistent tensors out
//! and back in with its next iteration.
//!
//! Clients are modelled as real training loops: a job submits its next iteration when the
//! previous one returns, and closes its session after its last iteration.

use std::time::Duration;

use salus_core::{
    Action, Event, Hints, MemoryConfig, PolicyKind, Scheduler, SessionId, SessionKind, SessionSpec,
};

use crate::catalog::REFERENCE_CAPACITY_BYTES;
use crate::trace::JobSpec;

/// How to run one simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Device memory in bytes.
    pub capacity: u64,
    /// Bytes the core keeps free.
    pub reserve: u64,
    /// The scheduling policy.
    pub policy: PolicyKind,
    /// Cost of switching a lane from one session to another, in seconds.
    pub switch_cost_s: f64,
    /// Record each job's progress in buckets of this many seconds (for share plots).
    pub sample_s: Option<f64>,
    /// Bytes per second between device and host memory, for suspending and restoring
    /// persistent tensors.
    pub host_bandwidth: f64,
}

impl SimConfig {
    /// Switch cost used unless told otherwise: the model stays resident, so a switch is the
    /// launch of the next session's first kernels, well under the iteration times here.
    pub const DEFAULT_SWITCH_COST_S: f64 = 0.001;

    /// Device-host copy bandwidth: PCIe 3.0 x16 as a P100 sees it, about 12 GB/s.
    pub const DEFAULT_HOST_BANDWIDTH: f64 = 12e9;

    /// The papers' setup: one 16 GB P100, no reserve, the default switch cost.
    pub fn reference(policy: PolicyKind) -> Self {
        SimConfig {
            capacity: REFERENCE_CAPACITY_BYTES,
            reserve: 0,
            policy,
            switch_cost_s: Self::DEFAULT_SWITCH_COST_S,
            sample_s: None,
            host_bandwidth: Self::DEFAULT_HOST_BANDWIDTH,
        }
    }
}

/// What happened to one job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOutcome {
    /// The job's id from the trace.
    pub id: String,
    /// When it arrived.
    pub arrival_s: f64,
    /// When it was admitted to a lane.
    pub admitted_s: Option<f64>,
    /// When its last iteration finished.
    pub finished_s: Option<f64>,
    /// Why it was rejected, if it was.
    pub rejected: Option<String>,
}

impl JobOutcome {
    /// Time from arrival to admission.
    pub fn queue_s(&self) -> Option<f64> {
        Some(self.admitted_s? - self.arrival_s)
    }

    /// Job completion time: arrival to last iteration.
    pub fn jct_s(&self) -> Option<f64> {
        Some(self.finished_s? - self.arrival_s)
    }
}

/// Aggregate statistics of a run, as the papers report them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Summary {
    /// From the first arrival to the last completion.
    pub makespan_s: f64,
    /// Mean time from arrival to admission.
    pub avg_queue_s: f64,
    /// Mean job completion time.
    pub avg_jct_s: f64,
    /// 95th percentile job completion time (nearest rank).
    pub p95_jct_s: f64,
    /// Jobs that completed.
    pub completed: usize,
    /// Jobs rejected because they can never fit.
    pub rejected: usize,
    /// Fraction of the makespan the device's compute was busy: the running iterations'
    /// compute shares summed (at most 1) and integrated over time, over the makespan.
    pub utilisation: f64,
}

/// Everything one simulation produced.
#[derive(Debug, Clone)]
pub struct SimReport {
    /// Per job, in trace order.
    pub jobs: Vec<JobOutcome>,
    /// Lane switches between sessions.
    pub switches: u64,
    /// Sessions suspended to host memory to make room (SRTF).
    pub suspensions: u64,
    /// With `sample_s`: per bucket, per job, seconds of solo-speed progress made.
    pub progress: Vec<Vec<f64>>,
    /// Seconds the device's compute was busy (the running shares summed, at most 1,
    /// integrated over time).
    pub busy_s: f64,
}

impl SimReport {
    /// The papers' statistics over completed jobs.
    pub fn summary(&self) -> Summary {
        let first = self
            .jobs
            .iter()
            .map(|j| j.arrival_s)
            .fold(f64::INFINITY, f64::min);
        let last = self
            .jobs
            .iter()
            .filter_map(|j| j.finished_s)
            .fold(f64::NEG_INFINITY, f64::max);
        let queues: Vec<f64> = self.jobs.iter().filter_map(JobOutcome::queue_s).collect();
        let mut jcts: Vec<f64> = self.jobs.iter().filter_map(JobOutcome::jct_s).collect();
        jcts.sort_by(f64::total_cmp);
        let mean = |v: &[f64]| {
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let p95 = if jcts.is_empty() {
            0.0
        } else {
            let rank = (0.95 * jcts.len() as f64).ceil() as usize;
            jcts[rank.clamp(1, jcts.len()) - 1]
        };
        Summary {
            makespan_s: if jcts.is_empty() { 0.0 } else { last - first },
            avg_queue_s: mean(&queues),
            avg_jct_s: mean(&jcts),
            p95_jct_s: p95,
            completed: jcts.len(),
            rejected: self.jobs.iter().filter(|j| j.rejected.is_some()).count(),
            utilisation: if jcts.is_empty() || last <= first {
                0.0
            } else {
                self.busy_s / (last - first)
            },
        }
    }
}

/// A simulation that could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// The core refused the configuration or an event.
    #[error("scheduler error: {0}")]
    Core(#[from] salus_core::CoreError),
    /// Nothing runs and nothing will arrive, yet jobs are unfinished.
    #[error("simulation stalled at {at_s:.3} s with {unfinished} unfinished jobs: {detail}")]
    Stalled {
        /// Virtual time of the stall.
        at_s: f64,
        /// Jobs neither finished nor rejected.
        unfinished: usize,
        /// What the core says the waiting jobs wait for.
        detail: String,
    },
}

#[derive(Debug, Clone, Copy)]
struct Running {
    job: usize,
    started_s: f64,
    /// Solo-speed seconds of work left, switch cost included.
    work_left: f64,
}

fn at(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds.max(0.0))
}

/// Replays `jobs` under `config` until every job has finished or been rejected.
pub fn simulate(jobs: &[JobSpec], config: &SimConfig) -> Result<SimReport, SimError> {
    let memory = MemoryConfig::new(config.capacity, config.reserve);
    let mut core = Scheduler::new(memory, config.policy)?;
    let mut outcomes: Vec<JobOutcome> = jobs
        .iter()
        .map(|j| JobOutcome {
            id: j.id.clone(),
            arrival_s: j.arrival_s,
            admitted_s: None,
            finished_s: None,
            rejected: None,
        })
        .collect();
    let mut arrivals: Vec<usize> = (0..jobs.len()).collect();
    arrivals.sort_by(|&a, &b| {
        jobs[a]
            .arrival_s
            .total_cmp(&jobs[b].arrival_s)
            .then(a.cmp(&b))
    });
    let mut next_arrival = 0;
    let mut done = vec![0u64; jobs.len()];
    let mut running: Vec<Running> = Vec::new();
    let mut progress: Vec<Vec<f64>> = Vec::new();
    let mut switches = 0;
    let mut suspensions = 0;
    let mut restore_s = vec![0.0f64; jobs.len()];
    let mut unresolved = jobs.len();
    let mut now = 0.0f64;
    let mut busy_s = 0.0f64;

    while unresolved > 0 {
        let demand: f64 = running.iter().map(|r| jobs[r.job].compute_share).sum();
        let rate = 1.0 / demand.max(1.0);
        let finish_at = running
            .iter()
            .map(|r| now + r.work_left / rate)
            .fold(f64::INFINITY, f64::min);
        let arrive_at = arrivals
            .get(next_arrival)
            .map_or(f64::INFINITY, |&j| jobs[j].arrival_s);
        let t = finish_at.min(arrive_at);
        if !t.is_finite() {
            let detail = core
                .waiting()
                .iter()
                .map(|(id, reason)| {
                    let why = reason
                        .as_ref()
                        .map_or("undecided".to_string(), |r| r.to_string());
                    format!("{}: {why}", jobs[id.0 as usize].id)
                })
                .collect::<Vec<_>>()
                .join("; ");
            return Err(SimError::Stalled {
                at_s: now,
                unfinished: unresolved,
                detail,
            });
        }
        let t = t.max(now);
        if let Some(width) = config.sample_s {
            record_progress(&mut progress, width, jobs.len(), &running, now, t, rate);
        }
        busy_s += (t - now) * demand.min(1.0);
        let finishing = t >= finish_at;
        for r in &mut running {
            r.work_left -= (t - now) * rate;
        }
        now = t;

        if finishing {
            // Every iteration due now (within rounding) finishes at `now`.
            let tolerance = 1e-9 * now.max(1.0);
            let (ended, still): (Vec<Running>, Vec<Running>) = running
                .iter()
                .partition(|r| r.work_left <= tolerance * rate.max(1e-12));
            running = still;
            let ended = if ended.is_empty() {
                // Rounding left the earliest one a hair above zero: finish it anyway.
                let i = (0..running.len())
                    .min_by(|&a, &b| running[a].work_left.total_cmp(&running[b].work_left))
                    .unwrap_or(0);
                vec![running.remove(i)]
            } else {
                ended
            };
            for r in ended {
                let id = SessionId(r.job as u64);
                core.handle(
                    at(now),
                    Event::IterationFinished {
                        session: id,
                        duration: at(now - r.started_s),
                    },
                )?;
                done[r.job] += 1;
                if done[r.job] >= jobs[r.job].iterations {
                    core.handle(at(now), Event::SessionClosed(id))?;
                } else {
                    core.handle(at(now), Event::IterationSubmitted(id))?;
                }
            }
        }
        while let Some(&j) = arrivals.get(next_arrival) {
            if jobs[j].arrival_s > now {
                break;
            }
            next_arrival += 1;
            let job = &jobs[j];
            let id = SessionId(j as u64);
            core.handle(
                at(now),
                Event::SessionOpened(SessionSpec {
                    id,
                    kind: SessionKind::Training,
                    class: salus_core::SessionClass::Online,
                    persistent_bytes: job.persistent_bytes,
                    ephemeral_bytes: job.ephemeral_bytes,
                    hints: Hints {
                        name: job.id.clone(),
                        priority: 0,
                        total_iterations: Some(job.iterations),
                        expected_iteration: Some(at(job.iteration_s)),
                        slo: None,
                    },
                }),
            )?;
            if core.session(id).is_some() {
                core.handle(at(now), Event::IterationSubmitted(id))?;
            }
        }
        for action in core.poll() {
            match action {
                Action::Admit {
                    session, resumed, ..
                } => {
                    let job = session.0 as usize;
                    outcomes[job].admitted_s.get_or_insert(now);
                    if resumed {
                        // Copying the persistent tensors out and back in, paid by the job's
                        // next iteration.
                        restore_s[job] +=
                            2.0 * jobs[job].persistent_bytes as f64 / config.host_bandwidth;
                    }
                }
                Action::Suspend { .. } => suspensions += 1,
                // These traces hold no offline sessions; an iteration asked to stop would
                // run to its end, which the core takes as its answer, and no share changes.
                Action::Abandon { .. } | Action::SetComputeShare { .. } => {}
                Action::Reject { session, reason } => {
                    outcomes[session.0 as usize].rejected = Some(reason.to_string());
                    unresolved -= 1;
                }
                Action::StartIteration {
                    session,
                    switched_from,
                    ..
                } => {
                    let job = session.0 as usize;
                    let mut work = jobs[job].iteration_s + std::mem::take(&mut restore_s[job]);
                    if switched_from.is_some() {
                        switches += 1;
                        work += config.switch_cost_s;
                    }
                    running.push(Running {
                        job,
                        started_s: now,
                        work_left: work,
                    });
                }
                Action::Closed { session } => {
                    outcomes[session.0 as usize].finished_s = Some(now);
                    unresolved -= 1;
                }
                Action::Queue { .. } | Action::MoveLane { .. } => {}
            }
        }
    }
    Ok(SimReport {
        jobs: outcomes,
        switches,
        suspensions,
        progress,
        busy_s,
    })
}

/// Adds each running job's progress over `[from, to)` to the buckets it spans.
fn record_progress(
    progress: &mut Vec<Vec<f64>>,
    width: f64,
    jobs: usize,
    running: &[Running],
    from: f64,
    to: f64,
    rate: f64,
) {
    let mut start = from;
    while start < to {
        let bucket = (start / width).floor() as usize;
        let end = to.min((bucket + 1) as f64 * width);
        if progress.len() <= bucket {
            progress.resize(bucket + 1, vec![0.0; jobs]);
        }
        for r in running {
            progress[bucket][r.job] += (end - start) * rate;
        }
        if end <= start {
            break;
        }
        start = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(
        id: &str,
        arrival_s: f64,
        iterations: u64,
        iteration_s: f64,
        share: f64,
        gb: u64,
    ) -> JobSpec {
        JobSpec {
            id: id.into(),
            arrival_s,
            iterations,
            iteration_s,
            persistent_bytes: gb * 1_000_000_000 / 4,
            ephemeral_bytes: gb * 1_000_000_000 * 3 / 4,
            compute_share: share,
            workload: None,
        }
    }

    fn config(policy: PolicyKind) -> SimConfig {
        SimConfig {
            switch_cost_s: 0.0,
            ..SimConfig::reference(policy)
        }
    }

    #[test]
    fn fifo_runs_jobs_back_to_back() {
        let jobs = vec![
            job("a", 0.0, 10, 1.0, 0.5, 2),
            job("b", 0.0, 5, 1.0, 0.5, 2),
        ];
        let report = simulate(&jobs, &config(PolicyKind::Fifo)).unwrap();
        let s = report.summary();
        assert_eq!(report.jobs[0].finished_s, Some(10.0));
        assert_eq!(report.jobs[1].admitted_s, Some(10.0));
        assert!((s.makespan_s - 15.0).abs() < 1e-9);
        assert!((s.avg_jct_s - 12.5).abs() < 1e-9);
        assert!((s.avg_queue_s - 5.0).abs() < 1e-9);
    }

    #[test]
    fn pack_overlaps_jobs_that_do_not_saturate_the_gpu() {
        let jobs = vec![
            job("a", 0.0, 10, 1.0, 0.5, 2),
            job("b", 0.0, 10, 1.0, 0.5, 2),
        ];
        let report = simulate(&jobs, &config(PolicyKind::Pack)).unwrap();
        assert!((report.summary().makespan_s - 10.0).abs() < 1e-6);
        // Saturating jobs gain nothing: two at share 1.0 take as long as back to back.
        let jobs = vec![
            job("a", 0.0, 10, 1.0, 1.0, 2),
            job("b", 0.0, 10, 1.0, 1.0, 2),
        ];
        let report = simulate(&jobs, &config(PolicyKind::Pack)).unwrap();
        assert!((report.summary().makespan_s - 20.0).abs() < 1e-6);
    }

    #[test]
    fn srtf_runs_the_short_job_first_and_switches_cost_time() {
        let jobs = vec![
            job("long", 0.0, 100, 1.0, 1.0, 2),
            job("short", 10.5, 5, 1.0, 1.0, 2),
        ];
        let report = simulate(&jobs, &SimConfig::reference(PolicyKind::Srtf)).unwrap();
        // The short job waits for the boundary at 11 s, runs 5 iterations (+1 switch).
        let short = &report.jobs[1];
        assert!(
            (short.finished_s.unwrap() - 16.001).abs() < 1e-6,
            "{short:?}"
        );
        assert_eq!(report.switches, 2);
        assert!((report.jobs[0].finished_s.unwrap() - 105.002).abs() < 1e-6);
    }

    #[test]
    fn jobs_too_big_for_the_device_are_rejected_not_stalled() {
        let jobs = vec![
            job("huge", 0.0, 1, 1.0, 1.0, 17),
            job("ok", 0.0, 1, 1.0, 1.0, 1),
        ];
        let report = simulate(&jobs, &config(PolicyKind::Pack)).unwrap();
        let reason = report.jobs[0].rejected.as_deref().unwrap();
        assert!(reason.contains("can never fit"), "{reason}");
        assert_eq!(report.summary().completed, 1);
    }

    #[test]
    fn progress_buckets_add_up_to_the_work_done() {
        let jobs = vec![
            job("a", 0.0, 10, 0.3, 1.0, 2),
            job("b", 0.0, 10, 0.3, 1.0, 2),
        ];
        let cfg = SimConfig {
            sample_s: Some(1.0),
            ..config(PolicyKind::Fair)
        };
        let report = simulate(&jobs, &cfg).unwrap();
        let total: f64 = report.progress.iter().flatten().sum();
        assert!((total - 6.0).abs() < 1e-6, "{total}");
    }
}
