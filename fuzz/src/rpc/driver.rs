//! Runs a script against a fresh in-process salusd and checks what it leaves behind.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use salus_core::{MemoryConfig, PolicyKind};
use salus_proto::v1 as pb;
use salusd::auth::Access;
use salusd::engine::{Engine, EngineConfig};
use salusd::service::{AnswerMissingMessage, Service};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Status, Streaming};

use super::messages::{self, GraphInfo};
use super::{Memory, PolicyName, Script, SessionRef, Setup, Step, TokenRef, WriteFirst};

/// The bearer token of the daemon in token mode.
const TOKEN: &str = "salus-fuzz-token-0123456789abcdef";
/// The daemon's own uid (not the machine's: scripts must not depend on who runs them).
const DAEMON_UID: u32 = 4242;
/// How long a step waits for its answer before the script goes on (paused clock).
const STEP_WAIT: Duration = Duration::from_secs(1);
/// How long, once every client has gone, salusd may take to answer and clean up.
const SETTLE: Duration = Duration::from_secs(600);
/// Steps of one script.
const MAX_STEPS: usize = 24;
/// `--open-timeout` of the engine (paused clock).
const OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// `--reattach-timeout` after a restart (paused clock).
const REATTACH_TIMEOUT: Duration = Duration::from_secs(60);

const OPEN: &str = "/salus.v1.Sessions/Open";
const RUN: &str = "/salus.v1.Sessions/Run";
const RUN_STREAM: &str = "/salus.v1.Sessions/RunStream";
const READ: &str = "/salus.v1.Sessions/ReadTensors";
const WRITE: &str = "/salus.v1.Sessions/WriteTensors";
const CLOSE: &str = "/salus.v1.Sessions/Close";
const ADD_PROGRAM: &str = "/salus.v1.Sessions/AddProgram";
const ATTACH: &str = "/salus.v1.Sessions/AttachBuffer";
const STATUS: &str = "/salus.v1.Admin/Status";
const LIST: &str = "/salus.v1.Admin/ListSessions";
const POLICY: &str = "/salus.v1.Admin/SetPolicy";
const DRAIN: &str = "/salus.v1.Admin/Drain";
const WATCH: &str = "/salus.v1.Admin/Watch";
const METHODS: [&str; 13] = [
    OPEN,
    RUN,
    RUN_STREAM,
    READ,
    WRITE,
    CLOSE,
    ADD_PROGRAM,
    ATTACH,
    STATUS,
    LIST,
    POLICY,
    DRAIN,
    WATCH,
];
const POLICIES: [&str; 5] = ["share", "pack", "srtf", "fair", "fifo"];

/// Runs `script` on a fresh engine (its own runtime, paused clock); panics on a crash.
pub fn run(script: &Script) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut harness = Harness::start(&script.setup);
        let first = Step::Open(super::OpenSpec {
            graph: script.setup.first.clone(),
            kind: pb::SessionKind::Training as i32,
            name: super::NameSpec::Short,
            priority: 0,
            total_iterations: 0,
            expected_iteration_ms: 0.0,
            class: 0,
            slo_ms: 0.0,
            initial: super::Initial::Exact(7),
            extra: Vec::new(),
            commit: true,
            end_after_commit: false,
            patch: super::Patch::default(),
            auth: 2,
        });
        harness.step(&first, &script.setup).await;
        for step in script.steps.iter().take(MAX_STEPS) {
            if !harness.step(step, &script.setup).await {
                break;
            }
        }
        harness.settle().await;
    });
}

/// Sends messages as the bytes they are and hands answers back as bytes.
#[derive(Clone, Copy)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        use bytes::Buf;
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

/// With `SALUS_FUZZ_TRACE` set, each answer is logged on stderr (`answer TYPE`, `status
/// CODE`, `opened`): how deep a corpus gets, summed with `sort | uniq -c`.
fn trace(what: std::fmt::Arguments<'_>) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("SALUS_FUZZ_TRACE").is_some()) {
        eprintln!("{what}");
    }
}

/// A status salusd may answer; `INTERNAL` is a fault of salusd (docs/api.md).
fn check(status: &Status) {
    trace(format_args!("status {:?}", status.code()));
    assert!(
        !matches!(status.code(), Code::Internal | Code::Unknown),
        "salusd answered {:?}: {}",
        status.code(),
        status.message()
    );
    assert!(
        status.message().len() <= salusd::service::MAX_STATUS_MESSAGE,
        "a status message of {} bytes",
        status.message().len()
    );
}

/// Reads a stream of answers to its end (or `limit` of them), decoding each as `M`.
async fn drain<M: Message + Default>(mut answers: Streaming<Vec<u8>>, limit: usize) {
    for _ in 0..limit {
        match answers.message().await {
            Ok(Some(bytes)) => {
                let answer = M::decode(&bytes[..]).expect("salusd's answers decode");
                trace(format_args!("answer {}", std::any::type_name::<M>()));
                let _ = answer;
            }
            Ok(None) => return,
            Err(status) => return check(&status),
        }
    }
}

/// A session the script opened.
struct Known {
    id: u64,
    token: Vec<u8>,
    /// Its programs: the one it opened with, then those added.
    programs: Vec<GraphInfo>,
    lease: Option<mpsc::Sender<Vec<u8>>>,
    updates: Option<JoinHandle<()>>,
    /// Held by this script's client (false after a restart, until it reattaches).
    attached: bool,
}

/// An `Open` stream not (yet) answered with `opened`.
struct Opening {
    _lease: Option<mpsc::Sender<Vec<u8>>>,
    updates: JoinHandle<()>,
}

struct Harness {
    engine: Engine,
    sessions: AnswerMissingMessage<pb::sessions_server::SessionsServer<Service>>,
    admin: AnswerMissingMessage<pb::admin_server::AdminServer<Service>>,
    insecure: bool,
    known: Vec<Known>,
    gone: Vec<u64>,
    opening: Vec<Opening>,
    /// Requests still unanswered: every one must finish once the clients have gone.
    pending: Vec<JoinHandle<()>>,
}

impl Harness {
    fn start(setup: &Setup) -> Harness {
        let (engine, sessions, admin) = daemon(setup);
        Harness {
            engine,
            sessions,
            admin,
            insecure: setup.insecure,
            known: Vec::new(),
            gone: Vec::new(),
            opening: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// salusd restarts with its state directory: the engine shuts down keeping every
    /// session's snapshot, a new one brings them back, and the clients' streams to the old
    /// one end (their sessions wait for a reattach).
    async fn restart(&mut self, setup: &Setup) {
        let kept = tokio::time::timeout(SETTLE, self.engine.shutdown(true))
            .await
            .expect("shutdown finishes");
        let (engine, sessions, admin) = daemon(setup);
        let (_, refused) =
            salusd::keeper::restore_snapshots(&engine, kept.snapshots, REATTACH_TIMEOUT);
        assert!(
            refused.is_empty(),
            "snapshots that did not come back: {refused:?}"
        );
        (self.engine, self.sessions, self.admin) = (engine, sessions, admin);
        for known in &mut self.known {
            known.lease = None;
            known.attached = false;
            self.pending.extend(known.updates.take());
        }
        for opening in std::mem::take(&mut self.opening) {
            self.pending.push(opening.updates);
        }
    }

    /// A request as this script's client sends it: over "TCP" when insecure, with the
    /// token unless `auth` says to leave it out (0) or send a wrong one (1).
    fn request<T>(&self, message: T, auth: u8) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if self.insecure {
            request
                .extensions_mut()
                .insert(tonic::transport::server::TcpConnectInfo {
                    local_addr: None,
                    remote_addr: None,
                });
        }
        let token = match auth % 16 {
            0 => None,
            1 => Some("not-the-token-0123456789"),
            _ => Some(TOKEN),
        };
        if let Some(token) = token {
            let value = salus_proto::wire::bearer(token).parse().expect("ascii");
            request
                .metadata_mut()
                .insert(salus_proto::wire::AUTHORIZATION, value);
        }
        request
    }

    /// Calls `method` with `messages` as its request stream; the answers.
    fn call(
        &self,
        method: &'static str,
        messages: impl tokio_stream::Stream<Item = Vec<u8>> + Send + 'static,
        auth: u8,
    ) -> impl Future<Output = Result<Streaming<Vec<u8>>, Status>> + Send + 'static {
        let request = self.request(messages, auth);
        let sessions = self.sessions.clone();
        let admin = self.admin.clone();
        async move {
            let path = method.parse().expect("a method path");
            let answer = if method.starts_with("/salus.v1.Admin/") {
                let mut grpc = tonic::client::Grpc::new(admin);
                grpc.ready().await.expect("ready");
                grpc.streaming(request, path, RawCodec).await
            } else {
                let mut grpc = tonic::client::Grpc::new(sessions);
                grpc.ready().await.expect("ready");
                grpc.streaming(request, path, RawCodec).await
            };
            answer.map(tonic::Response::into_inner)
        }
    }

    /// Calls `method` with one message and reads every answer as `M`; waits a second, then
    /// lets the call go on in the background (or drops it, with `abandon`).
    async fn unary<M: Message + Default>(
        &mut self,
        method: &'static str,
        messages: Vec<Vec<u8>>,
        auth: u8,
        abandon: bool,
    ) {
        let call = self.call(method, tokio_stream::iter(messages), auth);
        self.wait(
            async move {
                match call.await {
                    Ok(answers) => drain::<M>(answers, usize::MAX).await,
                    Err(status) => check(&status),
                }
            },
            abandon,
        )
        .await;
    }

    async fn wait(&mut self, task: impl Future<Output = ()> + Send + 'static, abandon: bool) {
        let mut handle = tokio::spawn(task);
        match tokio::time::timeout(STEP_WAIT, &mut handle).await {
            Ok(done) => done.expect("a request task"),
            Err(_) if abandon => handle.abort(),
            Err(_) => self.pending.push(handle),
        }
    }

    fn session(&self, session: SessionRef) -> (u64, Option<usize>) {
        match session {
            SessionRef::Live(i) if !self.known.is_empty() => {
                let i = usize::from(i) % self.known.len();
                (self.known[i].id, Some(i))
            }
            SessionRef::Gone(i) if !self.gone.is_empty() => {
                (self.gone[usize::from(i) % self.gone.len()], None)
            }
            SessionRef::Live(_) | SessionRef::Gone(_) => (0, None),
            SessionRef::Any(id) => (id, self.known.iter().position(|k| k.id == id)),
        }
    }

    fn programs(&self, known: Option<usize>) -> &[GraphInfo] {
        known.map_or(&[], |i| &self.known[i].programs)
    }

    fn info(&self, known: Option<usize>) -> GraphInfo {
        self.programs(known).first().cloned().unwrap_or_default()
    }

    /// Carries out one step; false once the daemon has shut down.
    async fn step(&mut self, step: &Step, setup: &Setup) -> bool {
        match step {
            Step::Open(spec) => {
                let info = GraphInfo::of(&spec.graph);
                let messages = messages::open_stream(spec, &info);
                let (tx, rx) = mpsc::channel(messages.len().max(1));
                for message in messages {
                    tx.try_send(message).expect("room for every message");
                }
                let lease = (!spec.end_after_commit).then_some(tx);
                let call = self.call(OPEN, ReceiverStream::new(rx), spec.auth);
                self.open(call, lease, info).await;
            }
            Step::Reattach {
                session,
                token,
                patch,
            } => {
                let (id, known) = self.session(*session);
                let token = match (token, known) {
                    (TokenRef::Own, Some(i)) => self.known[i].token.clone(),
                    (TokenRef::Own, None) => Vec::new(),
                    (TokenRef::Any(bytes), _) => bytes.clone(),
                };
                let message = pb::OpenRequest {
                    item: Some(pb::open_request::Item::Reattach(pb::Reattach {
                        session: id,
                        token,
                    })),
                };
                let (tx, rx) = mpsc::channel(1);
                tx.try_send(messages::encode(&message, patch))
                    .expect("room");
                let call = self.call(OPEN, ReceiverStream::new(rx), 2);
                let info = self.info(known);
                self.open(call, Some(tx), info).await;
            }
            Step::Run(spec) => {
                let (id, known) = self.session(spec.session);
                let info = self.info(known);
                let message = messages::run_request(spec, id, self.programs(known), &info);
                self.unary::<pb::RunResponse>(RUN, vec![message], spec.auth, spec.abandon)
                    .await;
            }
            Step::RunStream {
                requests,
                garbage,
                read,
            } => {
                let mut messages: Vec<Vec<u8>> = requests
                    .iter()
                    .take(24)
                    .map(|spec| {
                        let (id, known) = self.session(spec.session);
                        let info = self.info(known);
                        messages::run_request(spec, id, self.programs(known), &info)
                    })
                    .collect();
                messages.extend(garbage.iter().cloned());
                let limit = if *read == u8::MAX {
                    usize::MAX
                } else {
                    usize::from(*read % 32)
                };
                let call = self.call(RUN_STREAM, tokio_stream::iter(messages), 2);
                self.wait(
                    async move {
                        match call.await {
                            Ok(answers) => drain::<pb::RunResponse>(answers, limit).await,
                            Err(status) => check(&status),
                        }
                    },
                    false,
                )
                .await;
            }
            Step::Read {
                session,
                tensors,
                patch,
                auth,
            } => {
                let (id, known) = self.session(*session);
                let info = self.info(known);
                let message = pb::ReadTensorsRequest {
                    session: id,
                    tensors: tensors
                        .iter()
                        .take(8)
                        .map(|&t| {
                            info.chunk(&super::ChunkSpec {
                                tensor: t,
                                offset: super::Offset::Zero,
                                length: super::Length::Any(0),
                                fill: 0,
                            })
                            .tensor
                        })
                        .collect(),
                };
                let message = messages::encode(&message, patch);
                self.unary::<pb::TensorChunk>(READ, vec![message], *auth, false)
                    .await;
            }
            Step::Write {
                session,
                first,
                chunks,
                patch,
                auth,
            } => {
                use pb::write_tensors_request::Item;
                let (id, known) = self.session(*session);
                let info = self.info(known);
                let chunk = |spec| pb::WriteTensorsRequest {
                    item: Some(Item::Chunk(info.chunk(spec))),
                };
                let mut messages = Vec::new();
                match first {
                    WriteFirst::Session => messages.push(messages::encode(
                        &pb::WriteTensorsRequest {
                            item: Some(Item::Session(id)),
                        },
                        patch,
                    )),
                    WriteFirst::Chunk => messages.push(
                        pb::WriteTensorsRequest {
                            item: Some(Item::Chunk(pb::TensorChunk::default())),
                        }
                        .encode_to_vec(),
                    ),
                    WriteFirst::Empty => messages.push(Vec::new()),
                    WriteFirst::None => {}
                }
                messages.extend(chunks.iter().take(8).map(|c| chunk(c).encode_to_vec()));
                self.unary::<pb::WriteTensorsResponse>(WRITE, messages, *auth, false)
                    .await;
            }
            Step::Close {
                session,
                patch,
                auth,
            } => {
                let (id, _) = self.session(*session);
                let message = messages::encode(&pb::CloseRequest { session: id }, patch);
                self.unary::<pb::CloseResponse>(CLOSE, vec![message], *auth, false)
                    .await;
            }
            Step::AddProgram {
                session,
                graph,
                patch,
            } => {
                let (id, known) = self.session(*session);
                let info = GraphInfo::of(graph);
                let message = pb::AddProgramRequest {
                    session: id,
                    graph: Some(info.proto.clone()),
                };
                let message = messages::encode(&message, patch);
                let call = self.call(ADD_PROGRAM, tokio_stream::iter(vec![message]), 2);
                let mut handle = tokio::spawn(async move {
                    match call.await {
                        Ok(mut answers) => match answers.message().await {
                            Ok(Some(bytes)) => Some(
                                pb::AddProgramResponse::decode(&bytes[..])
                                    .expect("salusd's answers decode")
                                    .program,
                            ),
                            Ok(None) => None,
                            Err(status) => {
                                check(&status);
                                None
                            }
                        },
                        Err(status) => {
                            check(&status);
                            None
                        }
                    }
                });
                match tokio::time::timeout(STEP_WAIT, &mut handle).await {
                    Ok(added) => {
                        if let (Some(number), Some(i)) = (added.expect("a task"), known) {
                            let programs = &mut self.known[i].programs;
                            assert_eq!(number as usize, programs.len(), "program numbers");
                            programs.push(info);
                        }
                    }
                    Err(_) => self.pending.push(tokio::spawn(async move {
                        let _ = handle.await;
                    })),
                }
            }
            Step::AttachBuffer { session, path } => {
                let (id, _) = self.session(*session);
                let message = pb::AttachBufferRequest {
                    session: id,
                    path: path.clone(),
                }
                .encode_to_vec();
                self.unary::<pb::AttachBufferResponse>(ATTACH, vec![message], 2, false)
                    .await;
            }
            Step::Status => {
                let status = self.status().await;
                check_memory_map(&status);
            }
            Step::Sessions => {
                let message = pb::ListSessionsRequest {}.encode_to_vec();
                self.unary::<pb::ListSessionsResponse>(LIST, vec![message], 2, false)
                    .await;
            }
            Step::SetPolicy(name) => {
                let policy = match name {
                    PolicyName::Read => String::new(),
                    PolicyName::Known(i) => POLICIES[usize::from(*i) % POLICIES.len()].into(),
                    PolicyName::Any(s) => s.clone(),
                };
                let message = pb::SetPolicyRequest { policy }.encode_to_vec();
                self.unary::<pb::SetPolicyResponse>(POLICY, vec![message], 2, false)
                    .await;
            }
            Step::Drain(drain) => {
                let message = pb::DrainRequest { drain: *drain }.encode_to_vec();
                self.unary::<pb::DrainResponse>(DRAIN, vec![message], 2, false)
                    .await;
            }
            Step::Watch { events } => {
                let call = self.call(WATCH, tokio_stream::iter(vec![Vec::new()]), 2);
                let limit = usize::from(events % 8);
                // A watch never ends by itself: read a few events, then let go.
                self.wait(
                    async move {
                        match call.await {
                            Ok(answers) => drain::<pb::Event>(answers, limit).await,
                            Err(status) => check(&status),
                        }
                    },
                    true,
                )
                .await;
            }
            Step::Leave {
                session,
                drop_updates,
            } => {
                if let (_, Some(i)) = self.session(*session) {
                    let known = self.known.remove(i);
                    self.gone.push(known.id);
                    drop(known.lease);
                    if let Some(updates) = known.updates {
                        if *drop_updates {
                            updates.abort();
                        } else {
                            self.pending.push(updates);
                        }
                    }
                }
            }
            Step::Raw { method, frames } => {
                let method = METHODS[usize::from(*method) % METHODS.len()];
                let frames: Vec<Vec<u8>> = frames.iter().take(4).cloned().collect();
                let call = self.call(method, tokio_stream::iter(frames), 2);
                // A watch never ends by itself.
                let abandon = method == WATCH;
                self.wait(
                    async move {
                        match call.await {
                            Ok(mut answers) => loop {
                                match answers.message().await {
                                    Ok(Some(_)) => {}
                                    Ok(None) => break,
                                    Err(status) => break check(&status),
                                }
                            },
                            Err(status) => check(&status),
                        }
                    },
                    abandon,
                )
                .await;
            }
            Step::Wait(seconds) => {
                tokio::time::sleep(Duration::from_secs(u64::from(seconds % 64))).await;
            }
            Step::Restart => self.restart(setup).await,
            Step::Shutdown { keep } => {
                let shutdown = self.engine.shutdown(*keep);
                tokio::time::timeout(SETTLE, shutdown)
                    .await
                    .expect("shutdown finishes");
                return false;
            }
        }
        true
    }

    /// Waits for `opened` on an `Open` stream (a second), then keeps reading its updates
    /// in the background, as a client holding its session does.
    async fn open(
        &mut self,
        call: impl Future<Output = Result<Streaming<Vec<u8>>, Status>> + Send + 'static,
        lease: Option<mpsc::Sender<Vec<u8>>>,
        info: GraphInfo,
    ) {
        let mut updates = match call.await {
            Ok(updates) => updates,
            Err(status) => return check(&status),
        };
        let first = tokio::time::timeout(STEP_WAIT, updates.message()).await;
        match first {
            Ok(Ok(Some(bytes))) => {
                let update = pb::SessionUpdate::decode(&bytes[..]).expect("updates decode");
                let Some(pb::session_update::Update::Opened(opened)) = update.update else {
                    panic!("an Open stream's first update is {update:?}, not `opened`");
                };
                trace(format_args!("opened"));
                let reader = Some(tokio::spawn(read_updates(updates)));
                match self.known.iter_mut().find(|k| k.id == opened.session) {
                    Some(known) => {
                        assert!(
                            !known.attached,
                            "session {} opened twice: two leases",
                            opened.session
                        );
                        trace(format_args!("reattached"));
                        known.attached = true;
                        known.lease = lease;
                        known.updates = reader;
                    }
                    None => self.known.push(Known {
                        id: opened.session,
                        token: opened.token,
                        programs: vec![info],
                        lease,
                        updates: reader,
                        attached: true,
                    }),
                }
            }
            Ok(Ok(None)) => panic!("an Open stream ended with OK before `opened`"),
            Ok(Err(status)) => check(&status),
            Err(_) => self.opening.push(Opening {
                _lease: lease,
                updates: tokio::spawn(read_updates(updates)),
            }),
        }
    }

    async fn status(&self) -> pb::StatusResponse {
        let call = self.call(STATUS, tokio_stream::iter(vec![Vec::new()]), 2);
        let mut answers = call.await.expect("status answers");
        let bytes = answers
            .message()
            .await
            .expect("status answers")
            .expect("a status");
        pb::StatusResponse::decode(&bytes[..]).expect("a status decodes")
    }

    async fn list_sessions(&self) -> Vec<pb::SessionInfo> {
        let call = self.call(LIST, tokio_stream::iter(vec![Vec::new()]), 2);
        let mut answers = call.await.expect("sessions answer");
        let bytes = answers
            .message()
            .await
            .expect("sessions answer")
            .expect("a list");
        pb::ListSessionsResponse::decode(&bytes[..])
            .expect("a list decodes")
            .sessions
    }

    /// Every client goes away; every request must then be answered, and nothing may stay
    /// behind: no session, nothing opening, no host bytes, no device memory.
    async fn settle(mut self) {
        for known in std::mem::take(&mut self.known) {
            drop(known.lease);
            if let Some(updates) = known.updates {
                self.pending.push(updates);
            }
        }
        for opening in std::mem::take(&mut self.opening) {
            self.pending.push(opening.updates);
        }
        for handle in std::mem::take(&mut self.pending) {
            tokio::time::timeout(SETTLE, handle)
                .await
                .expect("a request unanswered after every client had gone")
                .expect("a request task");
        }
        let stopped = tokio::time::timeout(Duration::ZERO, self.engine.device_failed()).await;
        if let Ok(reason) = stopped {
            panic!("the engine stopped: {reason}");
        }
        let deadline = tokio::time::Instant::now() + SETTLE;
        // Paused time costs nothing, but every look does: look less often as time goes.
        let mut wait = Duration::from_millis(10);
        loop {
            let sessions = self.list_sessions().await;
            let status = self.status().await;
            check_memory_map(&status);
            let memory = status.memory.clone().unwrap_or_default();
            let clean = sessions.is_empty()
                && status.opening_sessions == 0
                && status.opening_bytes == 0
                && status.host_bytes == 0
                && memory.persistent_bytes == 0
                && memory.lane_bytes == 0;
            if clean {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "left behind after every client had gone: {sessions:?} {status:?}"
            );
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(10));
        }
        tokio::time::timeout(SETTLE, self.engine.shutdown(false))
            .await
            .expect("shutdown finishes");
    }
}

/// An engine as `setup` says and salusd's services on it.
fn daemon(
    setup: &Setup,
) -> (
    Engine,
    AnswerMissingMessage<pb::sessions_server::SessionsServer<Service>>,
    AnswerMissingMessage<pb::admin_server::AdminServer<Service>>,
) {
    let capacity = match setup.memory {
        Memory::Small => 64 << 10,
        Memory::Medium => 1 << 20,
        Memory::Large => 16 << 20,
    };
    let device = Arc::new(salus_cpu::CpuDevice::new(capacity).expect("a cpu device"));
    let host_memory = setup
        .host_memory_kib
        .map_or(capacity, |kib| u64::from(kib) << 10);
    let policy: PolicyKind = POLICIES[usize::from(setup.policy) % POLICIES.len()]
        .parse()
        .expect("a policy");
    let engine = Engine::start(EngineConfig {
        device,
        memory: MemoryConfig::new(capacity, 0),
        policy,
        protection: salus_core::ProtectionConfig::default(),
        limits: salus_graph::Limits::default(),
        daemon_uid: DAEMON_UID,
        host_memory,
        user_host_memory: host_memory / 2,
        max_sessions_per_user: 1 + u64::from(setup.max_sessions % 8),
        open_timeout: OPEN_TIMEOUT,
    })
    .expect("the engine starts");
    let access = Access {
        daemon_uid: DAEMON_UID,
        token: (!setup.insecure).then(|| TOKEN.to_string()),
        insecure_tcp: setup.insecure,
    };
    let (sessions, admin) = salusd::services(&engine, &access, &salusd::serving::Servers::default());
    (engine, sessions, admin)
}

/// Reads a session's updates until its stream ends.
async fn read_updates(mut updates: Streaming<Vec<u8>>) {
    loop {
        match updates.message().await {
            Ok(Some(bytes)) => {
                pb::SessionUpdate::decode(&bytes[..]).expect("updates decode");
            }
            Ok(None) => return,
            Err(status) => return check(&status),
        }
    }
}

/// The memory map covers `[0, C)` exactly, in order (docs/api.md, Admin).
fn check_memory_map(status: &pb::StatusResponse) {
    let memory = status.memory.clone().unwrap_or_default();
    let mut at = 0;
    for region in &memory.regions {
        assert_eq!(
            region.offset, at,
            "the memory map has a gap or overlap: {memory:?}"
        );
        at += region.size;
    }
    assert_eq!(
        at, memory.capacity,
        "the memory map does not reach C: {memory:?}"
    );
}
