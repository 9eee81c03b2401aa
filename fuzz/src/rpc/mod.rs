//! Scripts of requests to an in-process salusd: every RPC of both services, with messages
//! that are mostly well formed (sessions that exist, feeds of the right size) and
//! sometimes not (other sizes, ids, tokens, bytes appended to the encoding, raw frames).
//!
//! A script runs against a fresh engine on the cpu device, through salusd's own gRPC
//! services (`salusd::services`: the generated servers, salus' codec, the service and
//! the engine), called in memory through tonic's client with a codec that sends bytes as
//! they are. Time is tokio's paused clock: waits cost nothing, and a request still
//! unanswered after every client has gone is a hang, not a slow machine.
//!
//! Crashes besides panics: a status `INTERNAL` (a fault of salusd, docs/api.md), a memory
//! map that does not cover the device exactly, and anything left behind once every client
//! has gone (sessions, opening sessions, host bytes, device memory).

mod driver;
mod messages;

use arbitrary::Arbitrary;

pub use driver::run;

/// A script: how salusd is set up, then the requests in order.
#[derive(Arbitrary, Debug)]
pub struct Script {
    /// The daemon's settings.
    pub setup: Setup,
    /// The requests, in order (the first 24).
    pub steps: Vec<Step>,
}

/// The daemon's settings.
#[derive(Arbitrary, Debug)]
pub struct Setup {
    /// Device capacity.
    pub memory: Memory,
    /// The policy at start.
    pub policy: u8,
    /// Clients over insecure TCP (uid `nobody`, held to the per-user limits, may not
    /// steer) instead of with the token (the daemon's user).
    pub insecure: bool,
    /// `--max-sessions-per-user`, 1 + this % 8.
    pub max_sessions: u8,
    /// `--host-memory` in KiB, when given.
    pub host_memory_kib: Option<u16>,
    /// A session opened properly before the steps (whole initial values, `commit`, its
    /// client staying), so that most scripts have one to work on.
    pub first: GraphChoice,
}

/// Device capacity.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Memory {
    /// 64 KiB.
    Small,
    /// 1 MiB.
    Medium,
    /// 16 MiB.
    Large,
}

/// One request (or a client's disappearance, or time passing).
#[derive(Arbitrary, Debug)]
pub enum Step {
    Open(OpenSpec),
    Reattach {
        session: SessionRef,
        token: TokenRef,
        patch: Patch,
    },
    Run(RunSpec),
    RunStream {
        requests: Vec<RunSpec>,
        garbage: Option<Vec<u8>>,
        /// Answers read before the client lets go of the stream (all when 255).
        read: u8,
    },
    Read {
        session: SessionRef,
        tensors: Vec<TensorRef>,
        patch: Patch,
        auth: u8,
    },
    Write {
        session: SessionRef,
        first: WriteFirst,
        chunks: Vec<ChunkSpec>,
        patch: Patch,
        auth: u8,
    },
    Close {
        session: SessionRef,
        patch: Patch,
        auth: u8,
    },
    AddProgram {
        session: SessionRef,
        graph: GraphChoice,
        patch: Patch,
    },
    AttachBuffer {
        session: SessionRef,
        path: String,
    },
    Status,
    Sessions,
    SetPolicy(PolicyName),
    Drain(bool),
    Watch {
        events: u8,
    },
    /// The client of a session goes away (its `Open` stream ends or is dropped).
    Leave {
        session: SessionRef,
        drop_updates: bool,
    },
    /// Raw frames to any method.
    Raw {
        method: u8,
        frames: Vec<Vec<u8>>,
    },
    /// Time passes (tokio's paused clock), in seconds.
    Wait(u8),
    /// salusd restarts with a state directory: its sessions come back and wait for their
    /// clients to reattach.
    Restart,
    /// salusd shuts down (SIGTERM), keeping snapshots or not; the script ends there.
    Shutdown {
        keep: bool,
    },
}

/// An `Open` stream.
#[derive(Arbitrary, Debug)]
pub struct OpenSpec {
    pub graph: GraphChoice,
    pub kind: i32,
    pub name: NameSpec,
    pub priority: i32,
    pub total_iterations: u64,
    pub expected_iteration_ms: f64,
    /// `hints.class`: mostly online (0) or offline (1), sometimes anything.
    pub class: i32,
    pub slo_ms: f64,
    pub initial: Initial,
    /// Messages after the initial values, before `commit`.
    pub extra: Vec<Extra>,
    pub commit: bool,
    /// The client ends its side right after `commit` (the lease ends at once).
    pub end_after_commit: bool,
    pub patch: Patch,
    pub auth: u8,
}

/// A session's name.
#[derive(Arbitrary, Debug)]
pub enum NameSpec {
    Short,
    Long(u16),
    Any(String),
}

/// Messages an `Open` stream should not carry after `open`.
#[derive(Arbitrary, Debug)]
pub enum Extra {
    Chunk(ChunkSpec),
    Open,
    Reattach,
    Empty,
    Raw(Vec<u8>),
}

/// The initial values of the persistent tensors.
#[derive(Arbitrary, Debug)]
pub enum Initial {
    /// Every PARAMETER and STATE tensor, whole, in chunks, from this seed.
    Exact(u8),
    /// These chunks only.
    Chunks(Vec<ChunkSpec>),
}

/// One of the sample graphs, or any bytes.
#[derive(Arbitrary, Debug, Clone)]
pub enum GraphChoice {
    /// relu of f32[4]: no persistent tensors.
    Relu,
    /// Linear regression trained by SGD (`salus_graph::samples::regression`):
    /// n = 1 + n % 8, d = 1 + d % 6, k = 1 + k % 3.
    Regression { n: u8, d: u8, k: u8 },
    /// An embedding lookup whose ids may be out of range.
    Embedding,
    /// The traced MLP training step of the seed corpus (`fuzz/seeds/graph/mlp.pb`).
    Mlp,
    /// A `salus.v1.Graph` decoded from these bytes (the empty graph when they do not
    /// decode).
    Bytes(Vec<u8>),
}

/// A session id.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum SessionRef {
    /// A session this script opened (0 when none).
    Live(u8),
    /// A session this script opened that has since gone.
    Gone(u8),
    Any(u64),
}

/// A reattach token.
#[derive(Arbitrary, Debug)]
pub enum TokenRef {
    /// The session's own.
    Own,
    Any(Vec<u8>),
}

/// A tensor id.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum TensorRef {
    /// The n-th PARAMETER or STATE tensor of the session's graph.
    Persistent(u8),
    Any(u32),
}

/// A chunk of a tensor.
#[derive(Arbitrary, Debug, Clone)]
pub struct ChunkSpec {
    pub tensor: TensorRef,
    pub offset: Offset,
    pub length: Length,
    pub fill: u8,
}

/// Where a chunk starts.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Offset {
    Zero,
    Half,
    Any(u64),
}

/// How long a chunk is.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Length {
    /// The rest of the tensor from the offset.
    Rest,
    Any(u16),
}

/// The first message of a `WriteTensors` stream.
#[derive(Arbitrary, Debug)]
pub enum WriteFirst {
    Session,
    Chunk,
    Empty,
    None,
}

/// One iteration's request.
#[derive(Arbitrary, Debug)]
pub struct RunSpec {
    pub session: SessionRef,
    pub feeds: Feeds,
    pub writes: Vec<ChunkSpec>,
    pub program: u8,
    pub tag: u64,
    /// Feed or fetch ranges (of a feed buffer, which in process never attaches).
    pub ranges: Option<(u64, u64)>,
    /// Let go of the request if it is not answered within a second.
    pub abandon: bool,
    pub patch: Patch,
    pub auth: u8,
}

/// An iteration's feeds.
#[derive(Arbitrary, Debug)]
pub enum Feeds {
    /// Each feed of the program, of its size, values from this seed (ids mostly in range).
    Exact(u8),
    Sized(Vec<u16>),
    Any(Vec<Vec<u8>>),
}

/// A policy name for `SetPolicy`.
#[derive(Arbitrary, Debug)]
pub enum PolicyName {
    Read,
    Known(u8),
    Any(String),
}

/// Bytes appended to a message's encoding: protobuf merges them into the message (a later
/// field overrides, a repeated field grows), or they make it undecodable.
#[derive(Arbitrary, Debug, Default)]
pub struct Patch(pub Vec<u8>);
