//! Sessions as the core sees them: what a job asked for and what it has received.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Identifies a session. Chosen by the driver (the daemon or the simulator), unique for
/// the life of one [`crate::Scheduler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionId(pub u64);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session {}", self.0)
    }
}

/// What a session runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionKind {
    /// Training: forward, loss, backward and optimizer update each iteration.
    #[default]
    Training,
    /// Inference: a forward pass each iteration.
    Inference,
}

/// Whether a session's latency matters (see [`crate::protection`]).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum SessionClass {
    /// Latency matters (serving, or any job that did not say otherwise): never queued
    /// behind offline work, and protected from it.
    #[default]
    Online,
    /// Best effort (e.g. training that may use what online sessions leave): runs only in
    /// the capacity online sessions leave, and is suspended when they need its memory.
    Offline,
}

impl SessionClass {
    /// Its name in status output.
    pub fn name(self) -> &'static str {
        match self {
            SessionClass::Online => "online",
            SessionClass::Offline => "offline",
        }
    }
}

impl fmt::Display for SessionClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Hints a client gives about its job. Policies use them until measurements replace them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Hints {
    /// A name people recognise in status output.
    pub name: String,
    /// Higher is admitted earlier by PACK, SRTF and FAIR; FIFO ignores it.
    pub priority: i32,
    /// Iterations the job will run in all, when known.
    pub total_iterations: Option<u64>,
    /// Expected duration of one iteration, until one has been measured.
    pub expected_iteration: Option<Duration>,
    /// For an online session: the latency (submission to result) its iterations should
    /// stay under. Protection watches it.
    #[serde(default)]
    pub slo: Option<Duration>,
}

/// A request to open a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSpec {
    /// The driver's id for the session.
    pub id: SessionId,
    /// Training or inference.
    pub kind: SessionKind,
    /// Online or offline.
    #[serde(default)]
    pub class: SessionClass,
    /// P: bytes of persistent tensors, resident from admission to close.
    pub persistent_bytes: u64,
    /// E: peak bytes of ephemeral tensors during one iteration.
    pub ephemeral_bytes: u64,
    /// The client's hints.
    pub hints: Hints,
}

/// A session's accounting, as policies and status output read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionStats {
    /// When the session was opened.
    pub opened_at: Duration,
    /// When it was admitted to a lane, if it has been.
    pub admitted_at: Option<Duration>,
    /// Iterations submitted but not yet started.
    pub pending_iterations: u64,
    /// Iterations finished.
    pub completed_iterations: u64,
    /// Sum of measured iteration durations: the service the session has received.
    pub attained_service: Duration,
    /// When its last iteration started.
    pub last_started_at: Option<Duration>,
    /// Times another session was started on its lane while it had iterations waiting.
    pub preemptions: u64,
    /// Times its persistent memory was moved to the host to make room for another session.
    pub suspensions: u64,
}

impl SessionStats {
    pub(crate) fn new(now: Duration) -> Self {
        SessionStats {
            opened_at: now,
            admitted_at: None,
            pending_iterations: 0,
            completed_iterations: 0,
            attained_service: Duration::ZERO,
            last_started_at: None,
            preemptions: 0,
            suspensions: 0,
        }
    }

    /// Time spent waiting for admission: until admission, or until `now` while waiting.
    pub fn queue_wait(&self, now: Duration) -> Duration {
        self.admitted_at
            .unwrap_or(now)
            .saturating_sub(self.opened_at)
    }

    /// Mean measured iteration duration, if any iteration has finished.
    pub fn mean_iteration(&self) -> Option<Duration> {
        let n = u32::try_from(self.completed_iterations).ok()?;
        (n > 0).then(|| self.attained_service / n)
    }
}

/// A session as policies see it: the request and the accounting, read-only.
#[derive(Debug, Clone, Copy)]
pub struct SessionView<'a> {
    /// The request the session was opened with (sizes rounded to the alignment).
    pub spec: &'a SessionSpec,
    /// Its accounting.
    pub stats: &'a SessionStats,
    /// Service on the fair-share clock of its lane (see the FAIR policy).
    pub virtual_service: Duration,
}

impl SessionView<'_> {
    /// The session's id.
    pub fn id(&self) -> SessionId {
        self.spec.id
    }

    /// Remaining time: remaining iterations x measured mean iteration time (the hint until
    /// one is measured). `None` when either is unknown.
    pub fn remaining_time(&self) -> Option<Duration> {
        let total = self.spec.hints.total_iterations?;
        let per_iteration = self
            .stats
            .mean_iteration()
            .or(self.spec.hints.expected_iteration)?;
        let remaining = total.saturating_sub(self.stats.completed_iterations);
        Some(per_iteration.saturating_mul(u32::try_from(remaining).unwrap_or(u32::MAX)))
    }
}
