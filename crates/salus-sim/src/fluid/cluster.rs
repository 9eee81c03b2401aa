//! A cluster of devices in virtual time, each a `salus-core` scheduler under PACK (one
//! salusd per device), running a tuning algorithm's trials where a [`Dispatcher`] puts
//! them.
//!
//! A trial on one device is one session; a trial on `w` devices is a session on each,
//! stepping together (an iteration ends when every device's part has), each part taking
//! `beta^(w - 1) / w` of the iteration's time alone. Iterations running on one device
//! share it as in the single-device simulator (processor sharing by compute share), and
//! each extra co-running iteration costs [`INTERFERENCE`] more. A resized trial stops at
//! its next iteration boundary, loses [`RESCALE_COST_S`] and goes on where it was placed.

use std::collections::BTreeMap;
use std::time::Duration;

use salus_core::{
    Action as CoreAction, Event as CoreEvent, Hints, MemoryConfig, PolicyKind, Scheduler,
    SessionId, SessionKind, SessionSpec,
};
use salus_fluid::{Action, Placement};

use super::algorithms::{Algorithm, Verdict};
use super::dispatch::{Dispatcher, Submitted};
use super::workload::{
    Config, DEVICE_BYTES, ITERATIONS_PER_EPOCH, RESCALE_COST_S, rate, scaling_factor,
};
use crate::sim::SimError;

#[derive(Debug, Clone, Copy)]
struct RunningIteration {
    session: SessionId,
    trial: u64,
    started_s: f64,
    work_left: f64,
    share: f64,
}

#[derive(Debug)]
struct Device {
    core: Scheduler,
    running: Vec<RunningIteration>,
    busy_s: f64,
}

/// One trial while it holds (or waits for) resources.
#[derive(Debug)]
struct Segment {
    config: Config,
    /// Epochs run in all when the current budget is reached.
    target_epoch: u32,
    iterations_left: u64,
    placement: Option<Placement>,
    /// Open sessions: (device, session).
    shards: Vec<(usize, SessionId)>,
    /// Parts of the current iteration still running.
    pending: usize,
    /// A resize decided while running, done at the next boundary.
    resize_to: Option<Placement>,
    /// Restarting on new devices until this time.
    resume_at: Option<f64>,
}

impl Segment {
    /// Devices it trains across (1 when it shares one).
    fn width(&self) -> usize {
        match &self.placement {
            Some(Placement::Exclusive(ds)) => ds.len(),
            _ => 1,
        }
    }
}

/// What one run of an algorithm on a system measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterReport {
    /// From the start (profiling included) to the last trial's end.
    pub makespan_s: f64,
    /// Devices' busy fraction (running compute shares summed, at most 1), averaged over
    /// devices and the makespan.
    pub utilization: f64,
    /// Trial resizes (DynamicFluid).
    pub rescales: u64,
    /// Trials placed on a share of a device.
    pub shared_placements: u64,
    /// The best accuracy a trial reported at the full budget.
    pub best_accuracy: Option<f64>,
}

fn at(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds.max(0.0))
}

/// The cluster and the run's state.
struct Cluster<'a> {
    devices: Vec<Device>,
    algorithm: &'a mut dyn Algorithm,
    dispatcher: Dispatcher,
    segments: BTreeMap<u64, Segment>,
    /// Epochs each trial has run, across pauses.
    epochs: BTreeMap<u64, u32>,
    next_session: u64,
    now: f64,
    rescales: u64,
    shared_placements: u64,
}

/// Runs `algorithm` to the end on `devices` devices placed by `dispatcher`, keeping at
/// most `concurrency` trials of an asynchronous algorithm out at once, starting at
/// `start_s` (time spent profiling before).
pub fn run(
    algorithm: &mut dyn Algorithm,
    dispatcher: Dispatcher,
    devices: usize,
    concurrency: usize,
    start_s: f64,
) -> Result<ClusterReport, SimError> {
    let mut cluster = Cluster {
        devices: (0..devices)
            .map(|_| {
                Ok(Device {
                    core: Scheduler::new(MemoryConfig::new(DEVICE_BYTES, 0), PolicyKind::Pack)?,
                    running: Vec::new(),
                    busy_s: 0.0,
                })
            })
            .collect::<Result<_, SimError>>()?,
        algorithm,
        dispatcher,
        segments: BTreeMap::new(),
        epochs: BTreeMap::new(),
        next_session: 0,
        now: start_s,
        rescales: 0,
        shared_placements: 0,
    };
    cluster.run(concurrency)?;
    let busy: f64 = cluster.devices.iter().map(|d| d.busy_s).sum();
    Ok(ClusterReport {
        makespan_s: cluster.now,
        utilization: if cluster.now > 0.0 {
            busy / (devices as f64 * cluster.now)
        } else {
            0.0
        },
        rescales: cluster.rescales,
        shared_placements: cluster.shared_placements,
        best_accuracy: cluster.algorithm.best(),
    })
}

impl Cluster<'_> {
    fn run(&mut self, concurrency: usize) -> Result<(), SimError> {
        loop {
            let room = concurrency.saturating_sub(self.segments.len());
            let runs = self.algorithm.next(room);
            if !runs.is_empty() {
                let mut group = Vec::new();
                for run in runs {
                    let config = self.algorithm.config(run.trial);
                    let done = self.epochs.get(&run.trial).copied().unwrap_or(0);
                    let iterations = u64::from(run.epochs) * ITERATIONS_PER_EPOCH;
                    self.segments.insert(
                        run.trial,
                        Segment {
                            config,
                            target_epoch: done + run.epochs,
                            iterations_left: iterations,
                            placement: None,
                            shards: Vec::new(),
                            pending: 0,
                            resize_to: None,
                            resume_at: None,
                        },
                    );
                    group.push(Submitted {
                        trial: run.trial,
                        remaining_s: iterations as f64 * config.iteration_s(),
                        bytes: config.persistent_bytes() + config.ephemeral_bytes(),
                    });
                }
                self.update_progress();
                self.dispatcher.submit(&group);
                self.apply()?;
            }
            if self.algorithm.finished() && self.segments.is_empty() {
                return Ok(());
            }
            self.advance()?;
        }
    }

    /// Tells the dispatcher every trial's remaining runtime alone on one device.
    fn update_progress(&mut self) {
        for (&trial, s) in &self.segments {
            self.dispatcher
                .progress(trial, s.iterations_left as f64 * s.config.iteration_s());
        }
    }

    fn apply(&mut self) -> Result<(), SimError> {
        for action in self.dispatcher.poll() {
            match action {
                Action::Place { trial, placement } => {
                    if matches!(placement, Placement::Shared(_)) {
                        self.shared_placements += 1;
                    }
                    if let Some(s) = self.segments.get_mut(&trial.0) {
                        s.placement = Some(placement);
                    }
                    self.open(trial.0)?;
                }
                Action::Resize { trial, placement } => {
                    self.rescales += 1;
                    let Some(s) = self.segments.get_mut(&trial.0) else {
                        continue;
                    };
                    if s.shards.is_empty() {
                        s.placement = Some(placement);
                    } else {
                        s.resize_to = Some(placement);
                    }
                }
            }
        }
        Ok(())
    }

    /// Opens the trial's sessions where it is placed and submits its next iteration.
    fn open(&mut self, trial: u64) -> Result<(), SimError> {
        let now = at(self.now);
        let Some(s) = self.segments.get_mut(&trial) else {
            return Ok(());
        };
        let Some(placement) = s.placement.clone() else {
            return Ok(());
        };
        for &device in placement.devices() {
            let id = SessionId(self.next_session);
            self.next_session += 1;
            let core = &mut self.devices[device].core;
            core.handle(
                now,
                CoreEvent::SessionOpened(SessionSpec {
                    id,
                    kind: SessionKind::Training,
                    class: salus_core::SessionClass::Online,
                    persistent_bytes: s.config.persistent_bytes(),
                    ephemeral_bytes: s.config.ephemeral_bytes(),
                    hints: Hints {
                        name: format!("trial{trial}"),
                        priority: 0,
                        total_iterations: Some(s.iterations_left),
                        expected_iteration: Some(at(s.config.iteration_s())),
                        slo: None,
                    },
                }),
            )?;
            s.shards.push((device, id));
        }
        self.submit_iteration(trial)
    }

    fn submit_iteration(&mut self, trial: u64) -> Result<(), SimError> {
        let now = at(self.now);
        let Some(s) = self.segments.get_mut(&trial) else {
            return Ok(());
        };
        s.pending = s.shards.len();
        let shards = s.shards.clone();
        for (device, id) in shards {
            self.devices[device]
                .core
                .handle(now, CoreEvent::IterationSubmitted(id))?;
            self.poll_device(device)?;
        }
        Ok(())
    }

    /// Starts the iterations the device's core decided to start.
    fn poll_device(&mut self, device: usize) -> Result<(), SimError> {
        let now = self.now;
        for action in self.devices[device].core.poll() {
            match action {
                CoreAction::StartIteration { session, .. } => {
                    let Some((&trial, s)) = self
                        .segments
                        .iter()
                        .find(|(_, s)| s.shards.iter().any(|(_, id)| *id == session))
                    else {
                        continue;
                    };
                    self.devices[device].running.push(RunningIteration {
                        session,
                        trial,
                        started_s: now,
                        work_left: s.config.iteration_s() * scaling_factor(s.width()),
                        share: s.config.compute_share(),
                    });
                }
                CoreAction::Reject { session, reason } => {
                    return Err(SimError::Stalled {
                        at_s: now,
                        unfinished: self.segments.len(),
                        detail: format!("{session} rejected: {reason}"),
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Moves time to the next iteration end or restart and handles it.
    fn advance(&mut self) -> Result<(), SimError> {
        let mut next = f64::INFINITY;
        for d in &self.devices {
            let demand: f64 = d.running.iter().map(|r| r.share).sum();
            let r = rate(d.running.len(), demand);
            for it in &d.running {
                next = next.min(self.now + it.work_left / r);
            }
        }
        for s in self.segments.values() {
            if let Some(t) = s.resume_at {
                next = next.min(t);
            }
        }
        if !next.is_finite() {
            return Err(SimError::Stalled {
                at_s: self.now,
                unfinished: self.segments.len(),
                detail: "no iteration runs and no trial is restarting".into(),
            });
        }
        let dt = (next - self.now).max(0.0);
        let tolerance = 1e-9 * next.max(1.0);
        let mut ended: Vec<(usize, RunningIteration)> = Vec::new();
        for (i, d) in self.devices.iter_mut().enumerate() {
            let demand: f64 = d.running.iter().map(|r| r.share).sum();
            let r = rate(d.running.len(), demand);
            d.busy_s += dt * demand.min(1.0);
            for it in &mut d.running {
                it.work_left -= dt * r;
            }
            let (done, still): (Vec<_>, Vec<_>) =
                d.running.iter().partition(|it| it.work_left <= tolerance);
            d.running = still;
            ended.extend(done.into_iter().map(|it| (i, it)));
        }
        self.now = next;
        for (device, it) in ended {
            self.devices[device].core.handle(
                at(self.now),
                CoreEvent::IterationFinished {
                    session: it.session,
                    duration: at(self.now - it.started_s),
                },
            )?;
            self.poll_device(device)?;
            let Some(s) = self.segments.get_mut(&it.trial) else {
                continue;
            };
            s.pending = s.pending.saturating_sub(1);
            if s.pending == 0 {
                self.iteration_done(it.trial)?;
            }
        }
        let resuming: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.resume_at.is_some_and(|t| t <= self.now + 1e-9))
            .map(|(t, _)| *t)
            .collect();
        for trial in resuming {
            if let Some(s) = self.segments.get_mut(&trial) {
                s.resume_at = None;
            }
            self.open(trial)?;
        }
        Ok(())
    }

    fn close_sessions(&mut self, trial: u64) -> Result<(), SimError> {
        let now = at(self.now);
        let Some(s) = self.segments.get_mut(&trial) else {
            return Ok(());
        };
        for (device, id) in std::mem::take(&mut s.shards) {
            self.devices[device]
                .core
                .handle(now, CoreEvent::SessionClosed(id))?;
            self.poll_device(device)?;
        }
        Ok(())
    }

    fn iteration_done(&mut self, trial: u64) -> Result<(), SimError> {
        let Some(s) = self.segments.get_mut(&trial) else {
            return Ok(());
        };
        s.iterations_left = s.iterations_left.saturating_sub(1);
        if s.iterations_left == 0 {
            let epoch = s.target_epoch;
            self.epochs.insert(trial, epoch);
            match self.algorithm.reached(trial, epoch) {
                Verdict::Continue(more) => {
                    if let Some(s) = self.segments.get_mut(&trial) {
                        s.target_epoch += more;
                        s.iterations_left = u64::from(more) * ITERATIONS_PER_EPOCH;
                    }
                    self.update_progress();
                }
                Verdict::Release => {
                    self.close_sessions(trial)?;
                    self.segments.remove(&trial);
                    self.update_progress();
                    self.dispatcher.finished(trial);
                    return self.apply();
                }
            }
        }
        let Some(s) = self.segments.get_mut(&trial) else {
            return Ok(());
        };
        if let Some(to) = s.resize_to.take() {
            s.placement = Some(to);
            s.resume_at = Some(self.now + RESCALE_COST_S);
            return self.close_sessions(trial);
        }
        self.submit_iteration(trial)
    }
}
