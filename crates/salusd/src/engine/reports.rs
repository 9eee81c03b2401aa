//! What the engine tells the outside, in its own terms: a session's updates, the event
//! stream, status, per-session reports and metrics. The gRPC service turns these into
//! protobuf messages; the metrics endpoint renders [`Metrics`].

use std::time::Duration;

use salus_core::{
    LaneId, LaneInfo, MemoryConfig, MemoryMap, PolicyKind, ProtectionStatus, SessionClass,
    SessionId, SessionKind, SessionView,
};

use super::{Entry, Place, QuotaReport, State};

/// What a session's owner hears about it, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionUpdate {
    /// The engine took the session: first, once.
    Opened {
        /// Its id.
        session: SessionId,
        /// P, as planned.
        persistent_bytes: u64,
        /// E, as planned.
        ephemeral_bytes: u64,
        /// The secret that reattaches it after a restart.
        token: [u8; 16],
        /// Iterations it has done (more than 0 only when it comes back from a snapshot).
        iterations: u64,
    },
    /// It waits for admission, for this reason.
    Queued {
        /// Why, in words.
        reason: String,
    },
    /// It has a lane.
    Admitted {
        /// Which.
        lane: LaneId,
        /// The lane's size.
        lane_bytes: u64,
        /// True when it came back from host memory.
        resumed: bool,
    },
    /// The policy moved its tensors to host memory; it waits to resume.
    Suspended,
}

/// Where a session's updates go; dropped when the session is gone, which ends its
/// stream. The service supplies it and converts what it receives.
pub type UpdateSink = Box<dyn Fn(Result<SessionUpdate, super::EngineError>) + Send>;

/// What happened, for watchers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A session was opened.
    Opened,
    /// A session waits for admission.
    Queued,
    /// A session got a lane.
    Admitted,
    /// A session can never run here.
    Rejected,
    /// An iteration started.
    IterationStarted,
    /// An iteration finished.
    IterationFinished,
    /// An iteration failed.
    IterationFailed,
    /// A session was suspended to host memory by the policy.
    Preempted,
    /// A lane was placed or moved.
    LaneMoved,
    /// A session closed.
    Closed,
    /// The policy changed.
    PolicyChanged,
    /// Draining started or ended.
    Draining,
    /// Protection's health changed, or offline sessions were enabled or disabled.
    Protection,
}

/// One entry of the event stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineEvent {
    /// Since the engine started.
    pub time: Duration,
    /// What happened.
    pub kind: EventKind,
    /// To which session, if one.
    pub session: Option<SessionId>,
    /// On which lane, if one.
    pub lane: Option<LaneId>,
    /// Details in words.
    pub detail: String,
    /// How long it took (finished iterations).
    pub duration: Duration,
}

/// A session's state as an operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// Waiting for admission.
    Queued,
    /// In a lane.
    Admitted,
    /// Moved to host memory by the policy; waiting to resume.
    Suspended,
    /// Closed while an iteration runs; gone once it ends.
    Closing,
}

/// One session, with its numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionReport {
    /// Its id.
    pub id: SessionId,
    /// Its name hint.
    pub name: String,
    /// Its owner's uid.
    pub owner_uid: u32,
    /// Training or inference.
    pub kind: SessionKind,
    /// Online or offline.
    pub class: SessionClass,
    /// An online session's latency target.
    pub slo: Option<Duration>,
    /// Where it is.
    pub state: SessionState,
    /// Why it waits (empty once admitted).
    pub reason: String,
    /// Its lane, once admitted.
    pub lane: Option<LaneId>,
    /// P.
    pub persistent_bytes: u64,
    /// E.
    pub ephemeral_bytes: u64,
    /// The client's priority hint.
    pub priority: i32,
    /// The client's total-iterations hint (0 when not given).
    pub total_iterations: u64,
    /// Iterations finished.
    pub iterations: u64,
    /// Iterations submitted and not started.
    pub pending: u64,
    /// Mean of recent iteration times.
    pub mean_iteration: Duration,
    /// 99th percentile of recent iteration times.
    pub p99_iteration: Duration,
    /// Time waited for admission.
    pub queue_wait: Duration,
    /// Device time received.
    pub attained_service: Duration,
    /// Times another session's iteration ran while it was ready.
    pub preemptions: u64,
    /// Times it was suspended to host memory.
    pub suspensions: u64,
    /// Since it was opened.
    pub age: Duration,
}

/// A waiting session in the status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedReport {
    /// Which.
    pub session: SessionId,
    /// Its name hint.
    pub name: String,
    /// Why it waits.
    pub reason: String,
}

/// The daemon at a glance.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusReport {
    /// The device's name.
    pub device: String,
    /// Capacity and reserve.
    pub memory: MemoryConfig,
    /// The policy in force.
    pub policy: PolicyKind,
    /// True while draining.
    pub draining: bool,
    /// The physical memory map.
    pub map: MemoryMap,
    /// Lanes, top of memory first.
    pub lanes: Vec<LaneInfo>,
    /// Waiting sessions in arrival order.
    pub queue: Vec<QueuedReport>,
    /// Since the engine started.
    pub uptime: Duration,
    /// What sessions off the device hold on the host, in all and per user, and the limits.
    pub quotas: QuotaReport,
    /// How long an `Open` stream may take from its start to `commit`.
    pub open_timeout: Duration,
    /// How online sessions are protected from offline ones.
    pub protection: ProtectionStatus,
}

/// Per-session numbers the metrics endpoint exports.
#[derive(Debug, Clone)]
pub struct SessionMetrics {
    /// Id.
    pub id: u64,
    /// Name hint.
    pub name: String,
    /// Iterations finished.
    pub iterations: u64,
    /// Counts per bucket of [`super::HISTOGRAM_BOUNDS`] (not cumulative), the last one +Inf.
    pub histogram: Vec<u64>,
    /// Sum of iteration times, seconds.
    pub iteration_seconds: f64,
    /// Time waited for admission, seconds.
    pub queue_wait_seconds: f64,
    /// P.
    pub persistent_bytes: u64,
    /// E.
    pub ephemeral_bytes: u64,
}

/// What the metrics endpoint exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Per-session numbers.
    pub sessions: Vec<SessionMetrics>,
    /// Sum of lane sizes.
    pub lane_bytes: u64,
    /// Sum of P over admitted sessions.
    pub persistent_bytes: u64,
    /// Host memory held by opening, waiting and suspended sessions, in all and per user,
    /// and the limits.
    pub quotas: QuotaReport,
    /// How online sessions are protected from offline ones.
    pub protection: ProtectionStatus,
}

/// The reason a session waits before the core has said anything about it.
pub(super) const NOT_YET_DECIDED: &str = "waiting for the scheduler";

impl State {
    fn session_report(&self, view: SessionView<'_>, now: Duration) -> SessionReport {
        let id = view.id();
        let entry = self.sessions.get(&id);
        let state = match entry {
            Some(e) if e.closing => SessionState::Closing,
            Some(Entry {
                place: Place::Admitted { .. },
                ..
            }) => SessionState::Admitted,
            Some(Entry {
                place: Place::Suspended,
                ..
            }) => SessionState::Suspended,
            _ => SessionState::Queued,
        };
        let (mean, p99) = entry.map_or((Duration::ZERO, Duration::ZERO), |e| {
            if e.recent.is_empty() {
                return (Duration::ZERO, Duration::ZERO);
            }
            let mut sorted: Vec<Duration> = e.recent.iter().copied().collect();
            sorted.sort_unstable();
            let mean = sorted.iter().sum::<Duration>() / sorted.len() as u32;
            let index = ((sorted.len() as f64 * 0.99).ceil() as usize).clamp(1, sorted.len()) - 1;
            (mean, sorted[index])
        });
        SessionReport {
            id,
            name: view.spec.hints.name.clone(),
            owner_uid: entry.map_or(0, |e| e.owner.uid),
            kind: view.spec.kind,
            class: view.spec.class,
            slo: view.spec.hints.slo,
            state,
            reason: entry.map(|e| e.reason.clone()).unwrap_or_default(),
            lane: self.core.lane_of(id),
            persistent_bytes: view.spec.persistent_bytes,
            ephemeral_bytes: view.spec.ephemeral_bytes,
            priority: view.spec.hints.priority,
            total_iterations: view.spec.hints.total_iterations.unwrap_or(0),
            iterations: view.stats.completed_iterations,
            pending: view.stats.pending_iterations,
            mean_iteration: mean,
            p99_iteration: p99,
            queue_wait: view.stats.queue_wait(now),
            attained_service: view.stats.attained_service,
            preemptions: view.stats.preemptions,
            suspensions: view.stats.suspensions,
            age: entry.map_or(Duration::ZERO, |e| e.opened.elapsed()),
        }
    }

    /// Every open session, by id.
    pub(super) fn session_reports(&self) -> Vec<SessionReport> {
        let now = self.now();
        let mut reports: Vec<SessionReport> = self
            .core
            .sessions()
            .map(|view| self.session_report(view, now))
            .collect();
        reports.sort_by_key(|r| r.id);
        reports
    }

    /// The daemon at a glance, now.
    pub(super) fn status(&self) -> StatusReport {
        let name = |id: SessionId| {
            self.sessions
                .get(&id)
                .map(|e| e.hints.name.clone())
                .unwrap_or_default()
        };
        StatusReport {
            device: self.device.name(),
            memory: self.core.memory_config(),
            policy: self.core.policy(),
            draining: self.core.draining(),
            map: self.core.memory_map(),
            lanes: self.core.lanes(),
            queue: self
                .core
                .waiting()
                .into_iter()
                .map(|(id, reason)| QueuedReport {
                    session: id,
                    name: name(id),
                    reason: reason.map_or_else(|| NOT_YET_DECIDED.to_string(), |r| r.to_string()),
                })
                .collect(),
            uptime: self.started.elapsed(),
            quotas: self.quotas.report(),
            open_timeout: self.open_timeout,
            protection: self.core.protection_status(),
        }
    }

    /// What the metrics endpoint exports, now.
    pub(super) fn metrics(&self) -> Metrics {
        let now = self.now();
        let sessions = self
            .core
            .sessions()
            .map(|view| {
                let entry = self.sessions.get(&view.id());
                SessionMetrics {
                    id: view.id().0,
                    name: view.spec.hints.name.clone(),
                    iterations: view.stats.completed_iterations,
                    histogram: entry.map_or_else(Vec::new, |e| e.histogram.to_vec()),
                    iteration_seconds: entry.map_or(0.0, |e| e.iteration_seconds),
                    queue_wait_seconds: view.stats.queue_wait(now).as_secs_f64(),
                    persistent_bytes: view.spec.persistent_bytes,
                    ephemeral_bytes: view.spec.ephemeral_bytes,
                }
            })
            .collect();
        let map = self.core.memory_map();
        Metrics {
            sessions,
            lane_bytes: map.lane_bytes,
            persistent_bytes: map.persistent_bytes,
            quotas: self.quotas.report(),
            protection: self.core.protection_status(),
        }
    }
}
