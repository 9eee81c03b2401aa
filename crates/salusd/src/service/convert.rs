//! The engine's answers as the API speaks them: domain values to protobuf messages, and
//! each [`EngineError`] to the gRPC status code clients rely on.

use std::time::Duration;

use salus_core::{ProtectionStatus, RegionKind, SessionClass, SessionKind};
use salus_exec::ExecError;
use salus_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::{Code, Status};

use crate::auth::Principal;
use crate::engine::{
    EngineError, EngineEvent, EventKind, RunResult, SessionReport, SessionState, SessionUpdate,
    StatusReport, UpdateSink,
};

/// The longest status message salusd sends. Errors echo what clients sent (names, lists,
/// ops); cut to this, a message always fits the transport's metadata limit, so the client
/// gets the status the error deserves and not the transport's `RESOURCE_EXHAUSTED`.
pub const MAX_STATUS_MESSAGE: usize = 1024;

/// `message`, cut to at most [`MAX_STATUS_MESSAGE`] bytes with an ellipsis that says how
/// long it was.
pub fn bounded_message(message: &str) -> String {
    if message.len() <= MAX_STATUS_MESSAGE {
        return message.to_string();
    }
    let suffix = format!("... ({} bytes in all)", message.len());
    let mut end = MAX_STATUS_MESSAGE - suffix.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{suffix}", &message[..end])
}

/// `status` with its message cut by [`bounded_message`]: every status leaves the service
/// through this.
pub fn bounded(status: Status) -> Status {
    if status.message().len() <= MAX_STATUS_MESSAGE {
        return status;
    }
    Status::new(status.code(), bounded_message(status.message()))
}

/// Microseconds in a u64, saturating.
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The gRPC code each engine error travels as.
pub fn code(error: &EngineError) -> Code {
    match error {
        EngineError::ShuttingDown | EngineError::AwaitingReattach(_) => Code::Unavailable,
        EngineError::UnknownSession(_) => Code::NotFound,
        EngineError::Denied(_) | EngineError::WrongToken(_) => Code::PermissionDenied,
        EngineError::Attached(_) => Code::FailedPrecondition,
        EngineError::Closing(_) => Code::FailedPrecondition,
        EngineError::Feeds { .. }
        | EngineError::DuplicateTensor { .. }
        | EngineError::UnknownTensor { .. }
        | EngineError::NotPersistent { .. }
        | EngineError::TensorSize { .. }
        | EngineError::PartialWrite { .. }
        | EngineError::UnknownProgram { .. }
        | EngineError::FetchSizes { .. }
        | EngineError::ProgramMismatch { .. } => Code::InvalidArgument,
        EngineError::ProgramTooLarge { .. } => Code::ResourceExhausted,
        EngineError::ClosedBeforeStart { .. } | EngineError::Closed(_) => Code::Cancelled,
        EngineError::NeverFits { .. }
        | EngineError::HostMemory { .. }
        | EngineError::UserHostMemory { .. }
        | EngineError::UserSessions { .. } => Code::ResourceExhausted,
        EngineError::Exec(ExecError::Feed { .. } | ExecError::FeedCount { .. }) => {
            Code::InvalidArgument
        }
        EngineError::Exec(ExecError::Node { .. }) => Code::FailedPrecondition,
        // Abandoned iterations run again; a client sees this only if that is not possible.
        EngineError::Exec(ExecError::Abandoned) => Code::Aborted,
        EngineError::Exec(ExecError::Device(_))
        | EngineError::Scheduler(_)
        | EngineError::NoTensorCopy(_) => Code::Internal,
    }
}

impl From<EngineError> for Status {
    fn from(error: EngineError) -> Status {
        Status::new(code(&error), bounded_message(&error.to_string()))
    }
}

/// Ends an `Open` stream with `INTERNAL` when the engine drops the session's sink while
/// panicking: the client must not take that end for a close.
struct PanicReport(mpsc::UnboundedSender<Result<pb::SessionUpdate, Status>>);

impl Drop for PanicReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.0.send(Err(Status::internal(
                "salusd's engine failed (a bug; please report it); the session is lost",
            )));
        }
    }
}

/// The sink a session's updates go to: converted, then down its `Open` stream.
pub fn update_sink(
    updates: mpsc::UnboundedSender<Result<pb::SessionUpdate, Status>>,
) -> UpdateSink {
    let report = PanicReport(updates.clone());
    Box::new(move |update| {
        let _ = &report;
        let _ = updates.send(
            update
                .map(|u| pb::SessionUpdate {
                    update: Some(session_update(u)),
                })
                .map_err(Status::from),
        );
    })
}

fn session_update(update: SessionUpdate) -> pb::session_update::Update {
    use pb::session_update::Update;
    match update {
        SessionUpdate::Opened {
            session,
            persistent_bytes,
            ephemeral_bytes,
            token,
            iterations,
        } => Update::Opened(pb::Opened {
            session: session.0,
            persistent_bytes,
            ephemeral_bytes,
            token: token.to_vec(),
            iterations,
        }),
        SessionUpdate::Queued { reason } => Update::Queued(pb::Queued { reason }),
        SessionUpdate::Admitted {
            lane,
            lane_bytes,
            resumed,
        } => Update::Admitted(pb::Admitted {
            lane: lane.0,
            lane_bytes,
            resumed,
        }),
        SessionUpdate::Suspended => Update::Suspended(pb::Suspended {}),
    }
}

/// One iteration's answer, successful or not, as a `RunResponse`.
pub fn run_response(tag: u64, result: Result<RunResult, Status>) -> pb::RunResponse {
    match result {
        Ok(r) => pb::RunResponse {
            tag,
            fetches: r.fetches,
            device_us: micros(r.device),
            wait_us: micros(r.wait),
            failure: None,
        },
        Err(status) => pb::RunResponse {
            tag,
            failure: Some(pb::Failure {
                code: status.code() as i32,
                message: bounded_message(status.message()),
            }),
            ..Default::default()
        },
    }
}

/// An entry of the event stream.
pub fn event(event: EngineEvent) -> pb::Event {
    let kind = match event.kind {
        EventKind::Opened => pb::EventKind::Opened,
        EventKind::Queued => pb::EventKind::Queued,
        EventKind::Admitted => pb::EventKind::Admitted,
        EventKind::Rejected => pb::EventKind::Rejected,
        EventKind::IterationStarted => pb::EventKind::IterationStarted,
        EventKind::IterationFinished => pb::EventKind::IterationFinished,
        EventKind::IterationFailed => pb::EventKind::IterationFailed,
        EventKind::Preempted => pb::EventKind::Preempted,
        EventKind::LaneMoved => pb::EventKind::LaneMoved,
        EventKind::Closed => pb::EventKind::Closed,
        EventKind::PolicyChanged => pb::EventKind::PolicyChanged,
        EventKind::Draining => pb::EventKind::Draining,
        EventKind::Protection => pb::EventKind::Protection,
    };
    pb::Event {
        time_us: micros(event.time),
        kind: kind as i32,
        session: event.session.map(|s| s.0),
        lane: event.lane.map(|l| l.0),
        detail: event.detail,
        duration_us: micros(event.duration),
    }
}

/// One session's report as a `SessionInfo`.
/// A served model's numbers.
pub fn serving_info(s: &crate::serving::ServingStats) -> pb::ServingInfo {
    let ms = |d: Option<Duration>| d.map_or(0.0, millis);
    pb::ServingInfo {
        scheduler: s.scheduler.clone(),
        pending: s.pending,
        finished: s.finished,
        met_deadline: s.met_deadline,
        dropped: s.dropped,
        failed: s.failed,
        batches: s.batches.iter().map(|(&b, &n)| (b as u32, n)).collect(),
        p50_latency_ms: ms(s.latency_quantile(0.5)),
        p99_latency_ms: ms(s.latency_quantile(0.99)),
        scheduling_us_per_request: if s.requests == 0 {
            0.0
        } else {
            s.scheduling.as_secs_f64() * 1e6 / s.requests as f64
        },
    }
}

pub fn session_info(r: SessionReport) -> pb::SessionInfo {
    pb::SessionInfo {
        id: r.id.0,
        name: r.name,
        owner_uid: r.owner_uid,
        kind: match r.kind {
            SessionKind::Training => pb::SessionKind::Training,
            SessionKind::Inference => pb::SessionKind::Inference,
        } as i32,
        state: match r.state {
            SessionState::Queued => pb::SessionState::Queued,
            SessionState::Admitted => pb::SessionState::Admitted,
            SessionState::Suspended => pb::SessionState::Suspended,
            SessionState::Closing => pb::SessionState::Closing,
        } as i32,
        reason: r.reason,
        lane: r.lane.map(|l| l.0),
        persistent_bytes: r.persistent_bytes,
        ephemeral_bytes: r.ephemeral_bytes,
        priority: r.priority,
        total_iterations: r.total_iterations,
        iterations: r.iterations,
        pending: r.pending,
        mean_iteration_ms: millis(r.mean_iteration),
        p99_iteration_ms: millis(r.p99_iteration),
        queue_wait_ms: millis(r.queue_wait),
        attained_service_ms: millis(r.attained_service),
        preemptions: r.preemptions,
        suspensions: r.suspensions,
        age_ms: millis(r.age),
        class: match r.class {
            SessionClass::Online => pb::SessionClass::Online,
            SessionClass::Offline => pb::SessionClass::Offline,
        } as i32,
        slo_ms: r.slo.map_or(0.0, millis),
        serving: None,
    }
}

/// The status report as a `StatusResponse`.
pub fn status(r: StatusReport) -> pb::StatusResponse {
    let map = r.map;
    let quotas = r.quotas;
    pb::StatusResponse {
        device: Some(pb::Device {
            name: r.device,
            capacity: r.memory.capacity,
            reserve: r.memory.reserve,
        }),
        policy: r.policy.to_string(),
        draining: r.draining,
        memory: Some(pb::MemoryMap {
            capacity: map.capacity,
            reserve: map.reserve,
            persistent_bytes: map.persistent_bytes,
            lane_bytes: map.lane_bytes,
            available_bytes: map.available_bytes,
            regions: map
                .regions
                .iter()
                .map(|r| {
                    let mut region = pb::Region {
                        offset: r.extent.offset,
                        size: r.extent.size,
                        ..Default::default()
                    };
                    let kind = match &r.kind {
                        RegionKind::Persistent { session } => {
                            region.session = session.0;
                            pb::RegionKind::Persistent
                        }
                        RegionKind::Hole => pb::RegionKind::Hole,
                        RegionKind::Free => pb::RegionKind::Free,
                        RegionKind::Lane { lane, sessions } => {
                            region.lane = lane.0;
                            region.sessions = sessions.iter().map(|s| s.0).collect();
                            pb::RegionKind::Lane
                        }
                    };
                    region.kind = kind as i32;
                    region
                })
                .collect(),
        }),
        lanes: r
            .lanes
            .into_iter()
            .map(|l| pb::Lane {
                id: l.id.0,
                size: l.size,
                offset: l.placed.map_or(l.target.offset, |p| p.offset),
                placed: l.placed.is_some(),
                sessions: l.sessions.iter().map(|s| s.0).collect(),
                running: l.running.map(|s| s.0),
            })
            .collect(),
        queue: r
            .queue
            .into_iter()
            .map(|q| pb::QueuedSession {
                session: q.session.0,
                name: q.name,
                reason: q.reason,
            })
            .collect(),
        uptime_ms: r.uptime.as_millis() as u64,
        version: env!("CARGO_PKG_VERSION").to_string(),
        limits: Some(pb::Limits {
            host_memory: quotas.config.host_memory,
            user_host_memory: quotas.config.user_host_memory,
            max_sessions_per_user: quotas.config.max_sessions_per_user,
            open_timeout_ms: u64::try_from(r.open_timeout.as_millis()).unwrap_or(u64::MAX),
        }),
        host_bytes: quotas.host_bytes,
        opening_sessions: quotas.opening,
        opening_bytes: quotas.opening_bytes,
        users: quotas
            .users
            .iter()
            .map(|&(uid, u)| pb::UserUsage {
                uid,
                sessions: u.sessions,
                opening: u.opening,
                opening_bytes: u.opening_bytes,
                host_bytes: u.host_bytes,
                limited: quotas.config.limits(Principal { uid }),
            })
            .collect(),
        protection: Some(protection(&r.protection, r.uptime)),
    }
}

/// Protection's status; `now` is the engine's time (its uptime).
fn protection(p: &ProtectionStatus, now: Duration) -> pb::Protection {
    pb::Protection {
        enabled: p.enabled,
        health: p.health.to_string(),
        offline_duty: p.offline_duty,
        offline_compute_share: p.offline_compute_share,
        offline_compute_share_learned: p.offline_compute_share_learned,
        offline_bytes: p.offline_bytes,
        offline_limit: p.offline_limit,
        offline_evictions: p.offline_evictions,
        offline_abandoned: p.offline_abandoned,
        overlimit_entries: p.overlimit_entries as u64,
        online_slowdown_p99: p.metrics.online_slowdown.unwrap_or(0.0),
        slo_use_p99: p.metrics.slo_use.unwrap_or(0.0),
        sm_activity: p.metrics.sm_activity.unwrap_or(0.0),
        clock_factor: p.metrics.clock_factor.unwrap_or(0.0),
        offline_held_ms: p
            .offline_held_until
            .map_or(0.0, |t| millis(t.saturating_sub(now))),
    }
}

/// The kind named in the API, as the core knows it.
pub fn session_kind(kind: i32) -> Result<SessionKind, Status> {
    match pb::SessionKind::try_from(kind) {
        Ok(pb::SessionKind::Training) | Ok(pb::SessionKind::Unspecified) => {
            Ok(SessionKind::Training)
        }
        Ok(pb::SessionKind::Inference) => Ok(SessionKind::Inference),
        Err(_) => Err(Status::invalid_argument(format!(
            "unknown session kind {kind}"
        ))),
    }
}

/// An iteration's writes as (tensor, bytes): each chunk one whole tensor from offset 0
/// (the engine checks its size).
pub fn whole_tensors(writes: Vec<pb::TensorChunk>) -> Result<Vec<(u32, Vec<u8>)>, EngineError> {
    writes
        .into_iter()
        .map(|chunk| match chunk.offset {
            0 => Ok((chunk.tensor, chunk.data)),
            offset => Err(EngineError::PartialWrite {
                tensor: chunk.tensor,
                offset,
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sink_dropped_while_the_engine_panics_ends_the_stream_with_internal() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let sink = update_sink(tx);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _held = sink;
            panic!("an engine bug");
        }));
        assert!(panicked.is_err());
        let end = rx.try_recv().expect("a status").expect_err("an error");
        assert_eq!(end.code(), Code::Internal, "{}", end.message());
        // Dropped in the normal course (the session closed): the stream just ends.
        let (tx, mut rx) = mpsc::unbounded_channel();
        drop(update_sink(tx));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn long_messages_are_cut_at_a_character_with_their_length() {
        assert_eq!(bounded_message("short"), "short");
        let long = "é".repeat(5000);
        let cut = bounded_message(&long);
        assert!(cut.len() <= MAX_STATUS_MESSAGE, "{}", cut.len());
        assert!(cut.ends_with("... (10000 bytes in all)"), "{cut}");
        let status = bounded(Status::invalid_argument("x".repeat(100_000)));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().len() <= MAX_STATUS_MESSAGE);
    }
}
