//! Carrying out the core's actions: uploads at admission, host copies at suspension,
//! iterations handed to the blocking pool (one per lane at a time, so each lane is an
//! in-order queue and lanes run concurrently), and what finished iterations give back.

use std::time::{Duration, Instant};

use salus_core::{Action, Event, LaneId, SessionId};
use std::sync::Arc;

use salus_exec::{ExecError, Placement, RunControl};
use tokio::sync::oneshot;

use super::commands::{Command, Reply, Retry, RunResult};
use super::reports::{EventKind, SessionUpdate};
use super::{Deferred, EngineError, HISTOGRAM_BOUNDS, HostImage, Place, RECENT, State};

impl State {
    /// Polls the core until it has nothing more to say, carrying out each action.
    pub(super) fn drive(&mut self) {
        loop {
            let actions = self.core.poll();
            if actions.is_empty() {
                break;
            }
            for action in actions {
                self.apply(action);
            }
        }
        let health = self.core.health();
        if health != self.health {
            let why = metrics_text(&self.core.protection_status().metrics);
            tracing::info!(from = %self.health, to = %health, metrics = %why, "protection health changed");
            self.event(
                EventKind::Protection,
                None,
                None,
                format!("health {} -> {health} ({why})", self.health),
                Duration::ZERO,
            );
            self.health = health;
        }
    }

    fn apply(&mut self, action: Action) {
        match action {
            Action::Admit {
                session,
                lane,
                persistent,
                lane_size,
                resumed,
            } => {
                let Some(entry) = self.sessions.get_mut(&session) else {
                    return;
                };
                if let Some(image) = entry.image.take()
                    && let Err(e) = self.device.write(persistent.offset, &image.bytes)
                {
                    // The core's placement is inside the arena; a failure here is a bug.
                    tracing::error!(session = session.0, error = %e, "upload failed");
                    entry.image = Some(image);
                }
                entry.place = Place::Admitted {
                    persistent: persistent.offset,
                };
                entry.reason.clear();
                entry.send(SessionUpdate::Admitted {
                    lane,
                    lane_bytes: lane_size,
                    resumed,
                });
                tracing::info!(session = session.0, lane = lane.0, resumed, "admitted");
                self.event(
                    EventKind::Admitted,
                    Some(session),
                    Some(lane),
                    format!(
                        "persistent at {}, lane of {lane_size} B{}",
                        persistent.offset,
                        if resumed { ", resumed" } else { "" }
                    ),
                    Duration::ZERO,
                );
            }
            Action::Suspend {
                session,
                persistent,
            } => {
                let Some(entry) = self.sessions.get_mut(&session) else {
                    return;
                };
                match self.device.read(persistent.offset, persistent.size) {
                    Ok(bytes) => {
                        let held = self.quotas.force(entry.owner, bytes.len() as u64);
                        entry.image = Some(HostImage { bytes, held });
                    }
                    Err(e) => {
                        tracing::error!(session = session.0, error = %e, "suspend copy failed")
                    }
                }
                entry.place = Place::Suspended;
                entry.send(SessionUpdate::Suspended);
                self.event(
                    EventKind::Preempted,
                    Some(session),
                    None,
                    "suspended to host memory".into(),
                    Duration::ZERO,
                );
            }
            Action::Queue { session, reason } => {
                let Some(entry) = self.sessions.get_mut(&session) else {
                    return;
                };
                entry.reason = reason.to_string();
                entry.send(SessionUpdate::Queued {
                    reason: entry.reason.clone(),
                });
                self.event(
                    EventKind::Queued,
                    Some(session),
                    None,
                    reason.to_string(),
                    Duration::ZERO,
                );
            }
            Action::Reject { session, reason } => {
                if let Some(entry) = self.sessions.remove(&session) {
                    let never = || EngineError::NeverFits {
                        session: session.0,
                        reason: reason.clone(),
                    };
                    for pending in entry.pending {
                        let _ = pending.reply.send(Err(never()));
                    }
                    (entry.updates)(Err(never()));
                    self.event(
                        EventKind::Rejected,
                        Some(session),
                        None,
                        never().to_string(),
                        Duration::ZERO,
                    );
                }
            }
            Action::MoveLane { lane, from, to } => {
                self.event(
                    EventKind::LaneMoved,
                    None,
                    Some(lane),
                    match from {
                        Some(from) => {
                            format!("{}+{} -> {}+{}", from.offset, from.size, to.offset, to.size)
                        }
                        None => format!("placed at {}+{}", to.offset, to.size),
                    },
                    Duration::ZERO,
                );
            }
            Action::StartIteration {
                session,
                lane,
                lane_offset,
                switched_from,
                compute_share,
                background,
            } => {
                let control = if background {
                    RunControl::background(compute_share)
                } else {
                    RunControl::new(compute_share)
                };
                self.start(session, lane, lane_offset, switched_from, control)
            }
            Action::Abandon { session } => {
                if let Some(control) = self.sessions.get(&session).and_then(|e| e.control.as_ref())
                {
                    tracing::info!(session = session.0, "abandoning an offline iteration");
                    control.abandon();
                }
            }
            Action::SetComputeShare {
                session,
                compute_share,
            } => {
                if let Some(control) = self.sessions.get(&session).and_then(|e| e.control.as_ref())
                {
                    tracing::debug!(session = session.0, compute_share, "offline share");
                    control.set_share(compute_share);
                }
            }
            Action::Closed { session } => {
                // The lanes whose last iteration was the closed session's are forgotten
                // with it (a switch from a session that is gone is no switch), so the map
                // stays as small as the sessions open.
                self.lane_last_end.retain(|_, (last, _)| *last != session);
                if let Some(entry) = self.sessions.remove(&session) {
                    for pending in entry.pending {
                        let _ = pending.reply.send(Err(EngineError::Closed(session.0)));
                    }
                    for d in entry.deferred {
                        let closed = EngineError::Closed(session.0);
                        match d {
                            Deferred::Read(_, reply) => drop(reply.send(Err(closed))),
                            Deferred::Write(_, reply) => drop(reply.send(Err(closed))),
                            Deferred::Snapshot(reply) => drop(reply.send(Err(closed))),
                        }
                    }
                    tracing::info!(session = session.0, "closed");
                    self.event(
                        EventKind::Closed,
                        Some(session),
                        None,
                        String::new(),
                        Duration::ZERO,
                    );
                }
            }
        }
    }

    fn start(
        &mut self,
        id: SessionId,
        lane: LaneId,
        lane_offset: u64,
        switched_from: Option<SessionId>,
        control: RunControl,
    ) {
        let started = Instant::now();
        let Some(entry) = self.sessions.get_mut(&id) else {
            return;
        };
        let (Some(pending), Place::Admitted { persistent }) =
            (entry.pending.pop_front(), entry.place)
        else {
            // The core and the engine disagree: finish the iteration at once so the core
            // moves on.
            tracing::error!(session = id.0, "started with nothing to run");
            let (reply, _) = oneshot::channel();
            let _ = self.tx.send(Command::Finished {
                session: id,
                result: Err(ExecError::Device("nothing to run".into())),
                ended: Instant::now(),
                reply,
                wait: Duration::ZERO,
                retry: None,
            });
            return;
        };
        entry.running = true;
        let control = Arc::new(control);
        entry.control = Some(control.clone());
        if switched_from.is_some()
            && let Some(&(_, ended)) = self.lane_last_end.get(&lane)
        {
            let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            let switches = &mut shared.stats.switches;
            switches.push_back(started.saturating_duration_since(ended));
            if switches.len() > RECENT {
                switches.pop_front();
            }
        }
        let program = entry.programs[pending.program].clone();
        let device = self.device.clone();
        let tx = self.tx.clone();
        let wait = started.saturating_duration_since(pending.arrived);
        let at = Placement {
            persistent,
            lane: lane_offset,
        };
        self.event(
            EventKind::IterationStarted,
            Some(id),
            Some(lane),
            match switched_from {
                Some(from) => format!("after session {}", from.0),
                None => String::new(),
            },
            Duration::ZERO,
        );
        tokio::task::spawn_blocking(move || {
            let views: Vec<&[u8]> = pending.feeds.iter().map(Vec::as_slice).collect();
            // A kernel bug must fail this iteration, not leave its lane running forever.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                for (off, bytes) in &pending.writes {
                    device.write(at.persistent + off, bytes)?;
                }
                device.run_with(&program, at, &views, &control)
            }))
            .unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(ExecError::Device(format!("the device panicked: {what}")))
            });
            drop(views);
            let _ = tx.send(Command::Finished {
                session: id,
                retry: matches!(result, Err(ExecError::Abandoned)).then(|| Retry {
                    program: pending.program,
                    feeds: pending.feeds,
                    writes: pending.writes,
                    arrived: pending.arrived,
                }),
                result,
                ended: Instant::now(),
                reply: pending.reply,
                wait,
            });
        });
    }

    /// An iteration abandoned for an online session: the core frees its lane and it waits
    /// at the head of its session's queue to run again, its client none the wiser.
    fn abandoned(
        &mut self,
        id: SessionId,
        lane: Option<LaneId>,
        reply: Reply<RunResult>,
        retry: Retry,
    ) {
        if let Err(error) = self.core(Event::IterationAbandoned(id)) {
            tracing::error!(session = id.0, %error, "abandon refused by the scheduler");
        }
        self.event(
            EventKind::Preempted,
            Some(id),
            lane,
            "iteration abandoned for an online session; it runs again".into(),
            Duration::ZERO,
        );
        if let Some(entry) = self.sessions.get_mut(&id) {
            entry.running = false;
            entry.pending.push_front(super::Pending {
                program: retry.program,
                feeds: retry.feeds,
                writes: retry.writes,
                reply,
                arrived: retry.arrived,
            });
        }
    }

    pub(super) fn finished(
        &mut self,
        id: SessionId,
        result: Result<salus_exec::Outcome, ExecError>,
        ended: Instant,
        reply: Reply<RunResult>,
        wait: Duration,
        retry: Option<Retry>,
    ) {
        let lane = self.core.lane_of(id);
        if let Some(entry) = self.sessions.get_mut(&id) {
            entry.control = None;
        }
        if let Some(retry) = retry {
            self.abandoned(id, lane, reply, retry);
            return;
        }
        let duration = match &result {
            Ok(outcome) => outcome.duration,
            Err(_) => Duration::ZERO,
        };
        if let Some(lane) = lane {
            self.lane_last_end.insert(lane, (id, ended));
        }
        if let Err(error) = self.core(Event::IterationFinished {
            session: id,
            duration,
        }) {
            tracing::error!(session = id.0, %error, "finish refused by the scheduler");
        }
        match result {
            Ok(outcome) => {
                if let Some(entry) = self.sessions.get_mut(&id) {
                    entry.recent.push_back(outcome.duration);
                    if entry.recent.len() > RECENT {
                        entry.recent.pop_front();
                    }
                    let seconds = outcome.duration.as_secs_f64();
                    let bucket = HISTOGRAM_BOUNDS
                        .iter()
                        .position(|&b| seconds <= b)
                        .unwrap_or(HISTOGRAM_BOUNDS.len());
                    entry.histogram[bucket] += 1;
                    entry.iteration_seconds += seconds;
                }
                self.event(
                    EventKind::IterationFinished,
                    Some(id),
                    lane,
                    String::new(),
                    outcome.duration,
                );
                let _ = reply.send(Ok(RunResult {
                    fetches: outcome.fetches,
                    device: outcome.duration,
                    wait,
                }));
            }
            Err(e) => {
                tracing::warn!(session = id.0, error = %e, "iteration failed");
                if let Err(reason) = self.device.health()
                    && self.fatal.borrow().is_none()
                {
                    tracing::error!(%reason, "the device has failed; shutting down");
                    self.fatal.send_replace(Some(reason));
                }
                self.event(
                    EventKind::IterationFailed,
                    Some(id),
                    lane,
                    e.to_string(),
                    Duration::ZERO,
                );
                let _ = reply.send(Err(EngineError::Exec(e)));
            }
        }
        if let Some(entry) = self.sessions.get_mut(&id) {
            entry.running = false;
            let deferred = std::mem::take(&mut entry.deferred);
            for d in deferred {
                match d {
                    Deferred::Read(tensors, reply) => {
                        let _ = reply.send(self.read(id, &tensors));
                    }
                    Deferred::Write(tensors, reply) => {
                        let _ = reply.send(self.write(id, &tensors));
                    }
                    Deferred::Snapshot(reply) => {
                        let _ = reply.send(self.snapshot(id));
                    }
                }
            }
        }
    }
}

/// The health metrics that have a value, for the log and the event stream: what moved the
/// state machine.
fn metrics_text(m: &salus_core::protection::HealthMetrics) -> String {
    let parts: Vec<String> = [
        ("online slowdown p99", m.online_slowdown),
        ("SLO use p99", m.slo_use),
        ("SM activity", m.sm_activity),
        ("clock factor", m.clock_factor),
    ]
    .into_iter()
    .filter_map(|(name, v)| v.map(|v| format!("{name} {v:.2}")))
    .collect();
    if parts.is_empty() {
        "no metric yet".into()
    } else {
        parts.join(", ")
    }
}
