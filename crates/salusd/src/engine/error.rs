//! What the engine answers when it cannot do what was asked.
//!
//! Domain errors only: each names the session, tensor or policy involved, and the gRPC
//! service alone decides which status code each becomes.

use salus_core::{CoreError, RejectReason};
use salus_exec::ExecError;
use salus_graph::Role;

use crate::auth::Denied;

/// A request the engine refused, or an iteration that failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Holding this session's tensors on the host would pass the owner's share,
    /// `--user-host-memory`.
    #[error(
        "uid {uid}'s sessions off the device (opening, waiting or suspended) hold {used} bytes \
         of host memory; {bytes} more would pass the per-user limit of {limit} (salusd \
         --user-host-memory)"
    )]
    UserHostMemory {
        /// Whose.
        uid: u32,
        /// Bytes the user holds now.
        used: u64,
        /// Bytes asked for.
        bytes: u64,
        /// The per-user limit.
        limit: u64,
    },
    /// The owner already has as many sessions as one user may, `--max-sessions-per-user`.
    #[error(
        "uid {uid} has {sessions} sessions open or opening, the per-user limit of {limit} \
         (salusd --max-sessions-per-user)"
    )]
    UserSessions {
        /// Whose.
        uid: u32,
        /// Sessions the user has now.
        sessions: u64,
        /// The per-user limit.
        limit: u64,
    },
    /// A request names one tensor twice.
    #[error("{request} names tensor {tensor} twice")]
    DuplicateTensor {
        /// Which request.
        request: &'static str,
        /// The tensor.
        tensor: u32,
    },
    /// The engine has stopped: the daemon is shutting down.
    #[error("salusd is shutting down")]
    ShuttingDown,
    /// No open session has this id.
    #[error("session {0} does not exist")]
    UnknownSession(u64),
    /// A session restored after a restart, asked to work before its client took it back.
    #[error(
        "session {0} was restored after a restart of salusd and waits for its client: take it \
         back with its token (an Open stream whose first message is `reattach`), then go on"
    )]
    AwaitingReattach(u64),
    /// The asker may not do this.
    #[error(transparent)]
    Denied(#[from] Denied),
    /// The session is closing and takes no more requests.
    #[error("session {0} is closing")]
    Closing(u64),
    /// The feeds of an iteration do not match the session's graph.
    #[error("session {session}: run request: {error}")]
    Feeds {
        /// Whose iteration.
        session: u64,
        /// What does not match.
        error: ExecError,
    },
    /// The session was closed while this iteration waited to start.
    #[error("session {session} was closed ({why}) before this iteration started")]
    ClosedBeforeStart {
        /// Which session.
        session: u64,
        /// Why it was closed.
        why: &'static str,
    },
    /// The session closed before this request could be served.
    #[error("session {0} is closed")]
    Closed(u64),
    /// The session can never be admitted on this device.
    #[error("session {session} can never run here: {reason}")]
    NeverFits {
        /// Which session.
        session: u64,
        /// Why, with the sizes involved.
        reason: RejectReason,
    },
    /// The device failed an iteration, a read or a write.
    #[error("{0}")]
    Exec(ExecError),
    /// The scheduling core refused an event: the engine and the core disagree (a bug).
    #[error("scheduler: {0}")]
    Scheduler(#[from] CoreError),
    /// A tensor id outside the session's graph.
    #[error("tensor {tensor} does not exist (the graph has {count})")]
    UnknownTensor {
        /// The id asked for.
        tensor: u32,
        /// How many tensors the graph has.
        count: usize,
    },
    /// A tensor that lives only during an iteration, asked for between iterations.
    #[error("tensor {tensor} '{name}' is not persistent ({role:?})")]
    NotPersistent {
        /// Its id.
        tensor: u32,
        /// Its name.
        name: String,
        /// Its role in the graph.
        role: Role,
    },
    /// A tensor value of the wrong size.
    #[error("tensor {tensor} '{name}' ({ty}) needs {expected} bytes, got {got}")]
    TensorSize {
        /// Its id.
        tensor: u32,
        /// Its name.
        name: String,
        /// Its dtype and shape.
        ty: String,
        /// Bytes it holds.
        expected: u64,
        /// Bytes given.
        got: usize,
    },
    /// A write of part of a tensor where only whole tensors may be written.
    #[error(
        "tensor {tensor}: a write before an iteration covers the whole tensor from offset 0, not from offset {offset}"
    )]
    PartialWrite {
        /// Its id.
        tensor: u32,
        /// The offset given.
        offset: u64,
    },
    /// A reattach with a token that is not the session's.
    #[error("the token does not reattach session {0}")]
    WrongToken(u64),
    /// A reattach to a session whose client never went away.
    #[error("session {0} has its client: only a session restored after a restart is reattached")]
    Attached(u64),
    /// A program number the session does not have.
    #[error("session {session} has {count} program(s); there is no program {program}")]
    UnknownProgram {
        /// Whose.
        session: u64,
        /// The number asked for.
        program: u32,
        /// How many it has.
        count: usize,
    },
    /// A program that cannot join the session.
    #[error("the program cannot join session {session}: {why}")]
    ProgramMismatch {
        /// Whose.
        session: u64,
        /// What differs.
        why: String,
    },
    /// A program that needs more scratch than the session was planned with.
    #[error(
        "the program needs {need} bytes of scratch (E) but session {session} was planned \
         with {have}, by the program it opened with: open the session with its largest \
         batch"
    )]
    ProgramTooLarge {
        /// Whose.
        session: u64,
        /// The program's E.
        need: u64,
        /// The session's E.
        have: u64,
    },
    /// Fetch places of other sizes than the program's fetches.
    #[error(
        "session {session}: the fetches have {expected:?} bytes, the request's places for them {given:?}"
    )]
    FetchSizes {
        /// Whose.
        session: u64,
        /// The program's fetch sizes.
        expected: Vec<u64>,
        /// The sizes given.
        given: Vec<u64>,
    },
    /// The session's persistent tensors are neither on the device nor on the host (a bug).
    #[error("session {0} has no copy of its tensors")]
    NoTensorCopy(u64),
    /// Holding this session's tensors on the host would pass `--host-memory`.
    #[error(
        "sessions off the device (opening, waiting or suspended) hold {used} bytes of host \
         memory; {bytes} more would pass the limit of {limit} (salusd --host-memory)"
    )]
    HostMemory {
        /// Bytes held now.
        used: u64,
        /// Bytes asked for.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}
