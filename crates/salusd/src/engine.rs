//! The engine: one task that owns the scheduling core and the device's bookkeeping.
//!
//! Every request that changes state (open, run, read, write, close, policy, drain) and
//! every finished iteration arrives as a [`Command`] on one channel; the engine applies it
//! to the sans-IO core, polls the core, and carries out the actions: uploads at admission,
//! host copies at suspension, iterations handed to the blocking pool (one per lane at a
//! time, so each lane is an in-order queue and lanes run concurrently). Nothing else
//! touches the core, so there are no locks around scheduling decisions.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use salus_core::{
    Action, Event, Hints, LaneId, MemoryConfig, PolicyKind, RegionKind, Scheduler, SessionId,
    SessionKind, SessionSpec, SessionView,
};
use salus_exec::{Device, ExecError, Location, Placement, Program};
use salus_graph::Role;
use salus_proto::v1 as pb;
use tokio::sync::{broadcast, mpsc, oneshot};
use tonic::Status;

use crate::auth::Principal;

/// Updates sent down a session's `Open` stream.
pub type UpdateSender = mpsc::UnboundedSender<Result<pb::SessionUpdate, Status>>;

/// Host memory held by sessions that are not on the device (their initial values before
/// admission, their tensors while suspended), counted against `--host-memory` so that
/// waiting sessions cannot exhaust the host.
#[derive(Debug, Clone)]
pub struct HostBudget {
    used: Arc<std::sync::atomic::AtomicU64>,
    limit: u64,
}

/// Bytes counted against a [`HostBudget`] until dropped.
#[derive(Debug)]
pub struct HostBytes {
    used: Arc<std::sync::atomic::AtomicU64>,
    bytes: u64,
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        self.used
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

impl HostBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> HostBudget {
        HostBudget {
            used: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            limit,
        }
    }

    /// Counts `bytes` if they fit, else says how much is held and allowed.
    pub fn reserve(&self, bytes: u64) -> Result<HostBytes, Status> {
        use std::sync::atomic::Ordering::Relaxed;
        self.used
            .fetch_update(Relaxed, Relaxed, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .map_err(|used| {
                Status::resource_exhausted(format!(
                    "waiting sessions hold {used} bytes of host memory; {bytes} more would pass \
                     the limit of {} (salusd --host-memory)",
                    self.limit
                ))
            })?;
        Ok(HostBytes {
            used: self.used.clone(),
            bytes,
        })
    }

    /// Counts `bytes` whatever the limit (a suspension the policy decided).
    pub fn force(&self, bytes: u64) -> HostBytes {
        self.used
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        HostBytes {
            used: self.used.clone(),
            bytes,
        }
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A session's persistent block on the host, counted against the host budget.
#[derive(Debug)]
pub struct HostImage {
    /// The P bytes.
    pub bytes: Vec<u8>,
    /// Its share of the budget.
    pub held: HostBytes,
}

/// A session as the service hands it to the engine: validated, planned, its initial
/// persistent block assembled on the host.
pub struct NewSession {
    /// Its id, from [`Engine::new_session_id`].
    pub id: u64,
    /// Who opened it.
    pub owner: Principal,
    /// Its graph and plan.
    pub program: Program,
    /// The persistent block's initial bytes (P of them).
    pub image: HostImage,
    /// Training or inference.
    pub kind: SessionKind,
    /// The client's hints.
    pub hints: Hints,
    /// Where its updates go.
    pub updates: UpdateSender,
}

/// What one iteration gave the client.
#[derive(Debug)]
pub struct RunResult {
    /// The fetches, in graph order.
    pub fetches: Vec<Vec<u8>>,
    /// Time on the device.
    pub device: Duration,
    /// Time from arrival to start.
    pub wait: Duration,
}

type Reply<T> = oneshot::Sender<Result<T, Status>>;

/// A request to the engine.
pub enum Command {
    /// Open a session; answered on its update stream.
    Open(Box<NewSession>),
    /// Run one iteration.
    Run {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// One buffer per feed.
        feeds: Vec<Vec<u8>>,
        /// Where the result goes.
        reply: Reply<RunResult>,
    },
    /// Read persistent tensors between iterations.
    Read {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// Tensor ids; empty for every PARAMETER and STATE tensor.
        tensors: Vec<u32>,
        /// (id, bytes) per tensor.
        reply: Reply<Vec<(u32, Vec<u8>)>>,
    },
    /// Overwrite persistent tensors between iterations.
    Write {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// (id, bytes) per tensor, each complete.
        tensors: Vec<(u32, Vec<u8>)>,
        /// How many were written.
        reply: Reply<u32>,
    },
    /// Close a session: by request (`reply` set) or because its lease ended.
    Close {
        /// Who asks.
        principal: Principal,
        /// Which session.
        session: u64,
        /// Present for a Close request; absent when the lease ended.
        reply: Option<Reply<()>>,
    },
    /// An iteration finished on the device.
    Finished {
        /// Whose.
        session: SessionId,
        /// What it gave.
        result: Result<salus_exec::Outcome, ExecError>,
        /// When it ended.
        ended: Instant,
        /// The client waiting for it.
        reply: Reply<RunResult>,
        /// Time from arrival to start.
        wait: Duration,
    },
    /// Status for the admin service.
    Status(Reply<pb::StatusResponse>),
    /// Sessions for the admin service.
    Sessions(Reply<Vec<pb::SessionInfo>>),
    /// Numbers for the metrics endpoint.
    Metrics(Reply<Metrics>),
    /// Read or set the policy.
    Policy {
        /// Who asks.
        principal: Principal,
        /// The new policy, or none to read it.
        policy: Option<PolicyKind>,
        /// The policy in force.
        reply: Reply<PolicyKind>,
    },
    /// Start or stop draining.
    Drain {
        /// Who asks.
        principal: Principal,
        /// True to drain.
        drain: bool,
        /// Whether it drains now.
        reply: Reply<bool>,
    },
    /// Shut down: drain, let running iterations finish, close every session. Answered
    /// once nothing runs.
    Shutdown(oneshot::Sender<()>),
}

/// Numbers the engine keeps about itself, for benchmarks and metrics.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    /// Recent switch latencies: end of one session's iteration to the start of another's
    /// on the same lane.
    pub switches: VecDeque<Duration>,
}

/// Fixed upper bounds of the iteration-time histogram, in seconds.
pub const HISTOGRAM_BOUNDS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// How many recent samples percentiles are computed over.
const RECENT: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Queued,
    Admitted { persistent: u64 },
    Suspended,
}

struct Pending {
    feeds: Vec<Vec<u8>>,
    reply: Reply<RunResult>,
    arrived: Instant,
}

enum Deferred {
    Read(Vec<u32>, Reply<Vec<(u32, Vec<u8>)>>),
    Write(Vec<(u32, Vec<u8>)>, Reply<u32>),
}

struct Entry {
    owner: Principal,
    program: Arc<Program>,
    hints: Hints,
    /// The persistent block on the host: before admission and while suspended.
    image: Option<HostImage>,
    place: Place,
    reason: String,
    running: bool,
    closing: bool,
    pending: VecDeque<Pending>,
    deferred: Vec<Deferred>,
    updates: UpdateSender,
    opened: Instant,
    recent: VecDeque<Duration>,
    histogram: [u64; HISTOGRAM_BOUNDS.len() + 1],
    iteration_seconds: f64,
}

impl Entry {
    fn send(&self, update: pb::session_update::Update) {
        let _ = self.updates.send(Ok(pb::SessionUpdate {
            update: Some(update),
        }));
    }
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
    /// Counts per bucket of [`HISTOGRAM_BOUNDS`] (not cumulative), the last one +Inf.
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
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Per-session numbers.
    pub sessions: Vec<SessionMetrics>,
    /// Sum of lane sizes.
    pub lane_bytes: u64,
    /// Sum of P over admitted sessions.
    pub persistent_bytes: u64,
    /// Host memory held by waiting and suspended sessions.
    pub host_bytes: u64,
}

/// A cloneable handle to the engine task.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::UnboundedSender<Command>,
    events: broadcast::Sender<pb::Event>,
    shared: Arc<std::sync::Mutex<Shared>>,
    memory: MemoryConfig,
    limits: salus_graph::Limits,
    /// The device, for planning programs (the engine task runs iterations on it).
    device: Arc<dyn Device>,
    next_session: Arc<std::sync::atomic::AtomicU64>,
    stopping: Arc<tokio::sync::watch::Sender<bool>>,
    host: HostBudget,
    fatal: Arc<tokio::sync::watch::Sender<Option<String>>>,
}

/// What the engine publishes for readers that must not wait on it (benchmarks).
#[derive(Debug, Default)]
struct Shared {
    stats: EngineStats,
}

/// How the engine is set up.
pub struct EngineConfig {
    /// The device it runs iterations on.
    pub device: Arc<dyn Device>,
    /// Capacity and reserve.
    pub memory: MemoryConfig,
    /// The policy at start.
    pub policy: PolicyKind,
    /// Bounds on graphs.
    pub limits: salus_graph::Limits,
    /// The daemon's own user, who may steer it.
    pub daemon_uid: u32,
    /// Bytes of host memory waiting and suspended sessions may hold.
    pub host_memory: u64,
}

impl Engine {
    /// Starts the engine task on the current tokio runtime.
    pub fn start(config: EngineConfig) -> Result<Engine, String> {
        let core = Scheduler::new(config.memory, config.policy).map_err(|e| e.to_string())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (events, _) = broadcast::channel(4096);
        let shared = Arc::new(std::sync::Mutex::new(Shared::default()));
        let engine = Engine {
            tx: tx.clone(),
            events: events.clone(),
            shared: shared.clone(),
            memory: config.memory,
            limits: config.limits,
            device: config.device.clone(),
            next_session: Arc::new(std::sync::atomic::AtomicU64::new(1)),
            stopping: Arc::new(tokio::sync::watch::channel(false).0),
            host: HostBudget::new(config.host_memory),
            fatal: Arc::new(tokio::sync::watch::channel(None).0),
        };
        let state = State {
            fatal: engine.fatal.clone(),
            core,
            device: config.device,
            daemon_uid: config.daemon_uid,
            sessions: HashMap::new(),
            started: Instant::now(),
            tx,
            events,
            shared,
            host: engine.host.clone(),
            lane_last_end: HashMap::new(),
            shutdown: None,
        };
        tokio::spawn(state.run(rx));
        Ok(engine)
    }

    /// Sends a command; fails only when the engine has stopped.
    pub fn send(&self, command: Command) -> Result<(), Status> {
        self.tx
            .send(command)
            .map_err(|_| Status::unavailable("salusd is shutting down"))
    }

    /// Sends a command built around a reply channel and waits for the answer.
    pub async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, Status> {
        let (reply, answer) = oneshot::channel();
        self.send(make(reply))?;
        answer
            .await
            .map_err(|_| Status::unavailable("salusd is shutting down"))?
    }

    /// Host memory of waiting and suspended sessions.
    pub fn host_budget(&self) -> &HostBudget {
        &self.host
    }

    /// A fresh session id.
    pub fn new_session_id(&self) -> u64 {
        self.next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Changes to true when the daemon starts shutting down.
    pub fn stopping(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    /// Subscribes to the event stream.
    pub fn subscribe(&self) -> broadcast::Receiver<pb::Event> {
        self.events.subscribe()
    }

    /// Capacity and reserve.
    pub fn memory(&self) -> MemoryConfig {
        self.memory
    }

    /// Bounds on graphs.
    pub fn limits(&self) -> &salus_graph::Limits {
        &self.limits
    }

    /// Validates and plans a session's graph for the device: E includes the working memory
    /// the device's kernels need (a GPU's cuDNN workspaces).
    pub fn plan(&self, graph: salus_graph::Graph) -> Result<Program, salus_graph::GraphError> {
        Program::for_device(graph, &self.limits, &*self.device)
    }

    /// A snapshot of the engine's own numbers.
    pub fn stats(&self) -> EngineStats {
        self.lock().stats.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Resolves with the reason once the device has failed for good (a poisoned GPU
    /// context): the daemon then shuts down rather than serve wrong results.
    pub async fn device_failed(&self) -> String {
        let mut rx = self.fatal.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => std::future::pending().await,
        }
    }

    /// Shuts down: no admission, running iterations finish, every session is closed.
    pub async fn shutdown(&self) {
        self.stopping.send_replace(true);
        let (done, wait) = oneshot::channel();
        if self.send(Command::Shutdown(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

struct State {
    core: Scheduler,
    device: Arc<dyn Device>,
    daemon_uid: u32,
    sessions: HashMap<SessionId, Entry>,
    started: Instant,
    tx: mpsc::UnboundedSender<Command>,
    events: broadcast::Sender<pb::Event>,
    shared: Arc<std::sync::Mutex<Shared>>,
    host: HostBudget,
    /// When the last iteration on each lane ended, and whose it was.
    lane_last_end: HashMap<LaneId, (SessionId, Instant)>,
    shutdown: Option<oneshot::Sender<()>>,
    fatal: Arc<tokio::sync::watch::Sender<Option<String>>>,
}

fn core_status(e: salus_core::CoreError) -> Status {
    Status::internal(format!("scheduler: {e}"))
}

fn exec_status(e: &ExecError) -> Status {
    match e {
        ExecError::Feed { .. } => Status::invalid_argument(e.to_string()),
        ExecError::Node { .. } => Status::failed_precondition(e.to_string()),
        ExecError::Device(_) => Status::internal(e.to_string()),
    }
}

/// Microseconds in a u64, saturating.
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl State {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        while let Some(command) = rx.recv().await {
            self.handle(command);
            // Take what else is queued before polling: one poll per burst.
            while let Ok(command) = rx.try_recv() {
                self.handle(command);
            }
            self.drive();
            if self.shutdown.is_some() && self.sessions.values().all(|e| !e.running) {
                let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
                for id in ids {
                    self.close(id, "salusd is shutting down");
                }
                self.drive();
                if self.sessions.is_empty()
                    && let Some(done) = self.shutdown.take()
                {
                    let _ = done.send(());
                }
            }
        }
    }

    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn event(
        &self,
        kind: pb::EventKind,
        session: Option<SessionId>,
        lane: Option<LaneId>,
        detail: String,
        duration: Duration,
    ) {
        let _ = self.events.send(pb::Event {
            time_us: micros(self.now()),
            kind: kind as i32,
            session: session.map(|s| s.0),
            lane: lane.map(|l| l.0),
            detail,
            duration_us: micros(duration),
        });
    }

    fn core(&mut self, event: Event) -> Result<(), Status> {
        let now = self.now();
        self.core.handle(now, event).map_err(core_status)
    }

    /// Finds a session the principal may use.
    fn owned(&mut self, principal: Principal, session: u64) -> Result<&mut Entry, Status> {
        let entry = self
            .sessions
            .get_mut(&SessionId(session))
            .ok_or_else(|| Status::not_found(format!("session {session} does not exist")))?;
        if !principal.may_use(entry.owner) {
            return Err(Status::permission_denied(format!(
                "session {session} belongs to uid {}; {principal} may not use it",
                entry.owner.uid
            )));
        }
        if entry.closing {
            return Err(Status::failed_precondition(format!(
                "session {session} is closing"
            )));
        }
        Ok(entry)
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Open(new) => self.open(*new),
            Command::Run {
                principal,
                session,
                feeds,
                reply,
            } => self.submit(principal, session, feeds, reply),
            Command::Read {
                principal,
                session,
                tensors,
                reply,
            } => match self.owned(principal, session) {
                Err(status) => {
                    let _ = reply.send(Err(status));
                }
                Ok(entry) if entry.running => entry.deferred.push(Deferred::Read(tensors, reply)),
                Ok(_) => {
                    let result = self.read(SessionId(session), &tensors);
                    let _ = reply.send(result);
                }
            },
            Command::Write {
                principal,
                session,
                tensors,
                reply,
            } => match self.owned(principal, session) {
                Err(status) => {
                    let _ = reply.send(Err(status));
                }
                Ok(entry) if entry.running => entry.deferred.push(Deferred::Write(tensors, reply)),
                Ok(_) => {
                    let result = self.write(SessionId(session), &tensors);
                    let _ = reply.send(result);
                }
            },
            Command::Close {
                principal,
                session,
                reply,
            } => {
                let result = match reply {
                    // A lease that ended: the session may already be gone.
                    None => {
                        if self.sessions.contains_key(&SessionId(session)) {
                            self.close(SessionId(session), "the client went away");
                        }
                        return;
                    }
                    Some(reply) => (self.owned(principal, session).map(|_| ()), reply),
                };
                if result.0.is_ok() {
                    self.close(SessionId(session), "closed by the client");
                }
                let _ = result.1.send(result.0);
            }
            Command::Finished {
                session,
                result,
                ended,
                reply,
                wait,
            } => self.finished(session, result, ended, reply, wait),
            Command::Status(reply) => {
                let _ = reply.send(Ok(self.status()));
            }
            Command::Sessions(reply) => {
                let _ = reply.send(Ok(self.session_infos()));
            }
            Command::Metrics(reply) => {
                let _ = reply.send(Ok(self.metrics()));
            }
            Command::Policy {
                principal,
                policy,
                reply,
            } => {
                let result = match policy {
                    None => Ok(self.core.policy()),
                    Some(_) if !principal.may_steer(self.daemon_uid) => {
                        Err(Status::permission_denied(format!(
                            "changing the policy needs root or the daemon's user (uid {}); \
                             {principal} may not",
                            self.daemon_uid
                        )))
                    }
                    Some(policy) => {
                        if policy != self.core.policy() {
                            self.core.set_policy(policy);
                            tracing::info!(%policy, "policy changed");
                            self.event(
                                pb::EventKind::PolicyChanged,
                                None,
                                None,
                                policy.to_string(),
                                Duration::ZERO,
                            );
                        }
                        Ok(policy)
                    }
                };
                let _ = reply.send(result);
            }
            Command::Drain {
                principal,
                drain,
                reply,
            } => {
                let result = if principal.may_steer(self.daemon_uid) {
                    self.set_draining(drain);
                    Ok(drain)
                } else {
                    Err(Status::permission_denied(format!(
                        "draining needs root or the daemon's user (uid {}); {principal} may not",
                        self.daemon_uid
                    )))
                };
                let _ = reply.send(result);
            }
            Command::Shutdown(done) => {
                self.set_draining(true);
                self.shutdown = Some(done);
            }
        }
    }

    fn set_draining(&mut self, drain: bool) {
        if drain != self.core.draining() {
            self.core.set_draining(drain);
            tracing::info!(drain, "draining changed");
            self.event(
                pb::EventKind::Draining,
                None,
                None,
                if drain { "draining" } else { "admitting" }.into(),
                Duration::ZERO,
            );
        }
    }

    fn open(&mut self, new: NewSession) {
        let id = SessionId(new.id);
        let plan = new.program.plan();
        let (p, e, planned_e) = (
            plan.persistent_bytes,
            plan.ephemeral_bytes.max(1),
            plan.ephemeral_bytes,
        );
        let spec = SessionSpec {
            id,
            kind: new.kind,
            persistent_bytes: p,
            ephemeral_bytes: e,
            hints: new.hints.clone(),
        };
        if let Err(status) = self.core(Event::SessionOpened(spec)) {
            let _ = new.updates.send(Err(status));
            return;
        }
        let entry = Entry {
            owner: new.owner,
            program: Arc::new(new.program),
            hints: new.hints,
            image: Some(new.image),
            place: Place::Queued,
            reason: "waiting for the scheduler".into(),
            running: false,
            closing: false,
            pending: VecDeque::new(),
            deferred: Vec::new(),
            updates: new.updates,
            opened: Instant::now(),
            recent: VecDeque::new(),
            histogram: [0; HISTOGRAM_BOUNDS.len() + 1],
            iteration_seconds: 0.0,
        };
        entry.send(pb::session_update::Update::Opened(pb::Opened {
            session: id.0,
            persistent_bytes: p,
            ephemeral_bytes: planned_e,
        }));
        tracing::info!(session = id.0, name = %entry.hints.name, owner = entry.owner.uid, p, e, "opened");
        self.event(
            pb::EventKind::Opened,
            Some(id),
            None,
            format!("{} (P {p} B, E {e} B)", entry.hints.name),
            Duration::ZERO,
        );
        self.sessions.insert(id, entry);
    }

    fn submit(
        &mut self,
        principal: Principal,
        session: u64,
        feeds: Vec<Vec<u8>>,
        reply: Reply<RunResult>,
    ) {
        let entry = match self.owned(principal, session) {
            Ok(entry) => entry,
            Err(status) => {
                let _ = reply.send(Err(status));
                return;
            }
        };
        let views: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
        if let Err(e) = entry.program.check_feeds(&views) {
            let _ = reply.send(Err(Status::invalid_argument(format!(
                "session {session}: {e}"
            ))));
            return;
        }
        entry.pending.push_back(Pending {
            feeds,
            reply,
            arrived: Instant::now(),
        });
        if let Err(status) = self.core(Event::IterationSubmitted(SessionId(session)))
            && let Some(entry) = self.sessions.get_mut(&SessionId(session))
            && let Some(pending) = entry.pending.pop_back()
        {
            let _ = pending.reply.send(Err(status));
        }
    }

    fn close(&mut self, id: SessionId, why: &str) {
        let Some(entry) = self.sessions.get_mut(&id) else {
            return;
        };
        if entry.closing {
            return;
        }
        entry.closing = true;
        for pending in entry.pending.drain(..) {
            let _ = pending.reply.send(Err(Status::cancelled(format!(
                "session {} was closed ({why}) before this iteration started",
                id.0
            ))));
        }
        tracing::info!(session = id.0, why, "closing");
        if let Err(status) = self.core(Event::SessionClosed(id)) {
            tracing::error!(session = id.0, %status, "close refused by the scheduler");
        }
    }

    fn finished(
        &mut self,
        id: SessionId,
        result: Result<salus_exec::Outcome, ExecError>,
        ended: Instant,
        reply: Reply<RunResult>,
        wait: Duration,
    ) {
        let lane = self.core.lane_of(id);
        let duration = match &result {
            Ok(outcome) => outcome.duration,
            Err(_) => Duration::ZERO,
        };
        if let Some(lane) = lane {
            self.lane_last_end.insert(lane, (id, ended));
        }
        if let Err(status) = self.core(Event::IterationFinished {
            session: id,
            duration,
        }) {
            tracing::error!(session = id.0, %status, "finish refused by the scheduler");
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
                    pb::EventKind::IterationFinished,
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
                    pb::EventKind::IterationFailed,
                    Some(id),
                    lane,
                    e.to_string(),
                    Duration::ZERO,
                );
                let _ = reply.send(Err(exec_status(&e)));
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
                }
            }
        }
    }

    /// Byte range of a persistent tensor within the session's block, checking the id.
    fn persistent_range(program: &Program, tensor: u32) -> Result<(u64, u64), Status> {
        let t = program
            .graph()
            .tensors
            .get(tensor as usize)
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "tensor {tensor} does not exist (the graph has {})",
                    program.graph().tensors.len()
                ))
            })?;
        match program.location(tensor as usize) {
            Some(Location::Persistent(off)) => Ok((off, program.bytes(tensor as usize))),
            _ => Err(Status::invalid_argument(format!(
                "tensor {tensor} '{}' is not persistent ({:?})",
                t.name, t.role
            ))),
        }
    }

    fn read(&self, id: SessionId, tensors: &[u32]) -> Result<Vec<(u32, Vec<u8>)>, Status> {
        let entry = self
            .sessions
            .get(&id)
            .ok_or_else(|| Status::not_found(format!("session {} does not exist", id.0)))?;
        let program = &entry.program;
        let ids: Vec<u32> = if tensors.is_empty() {
            program
                .graph()
                .tensors
                .iter()
                .enumerate()
                .filter(|(_, t)| matches!(t.role, Role::Parameter | Role::State))
                .map(|(i, _)| i as u32)
                .collect()
        } else {
            tensors.to_vec()
        };
        let mut out = Vec::with_capacity(ids.len());
        for tensor in ids {
            let (off, len) = Self::persistent_range(program, tensor)?;
            let bytes = match (&entry.image, entry.place) {
                (Some(image), _) => image.bytes[off as usize..(off + len) as usize].to_vec(),
                (None, Place::Admitted { persistent }) => self
                    .device
                    .read(persistent + off, len)
                    .map_err(|e| exec_status(&e))?,
                (None, _) => {
                    return Err(Status::internal(format!(
                        "session {} has no copy of its tensors",
                        id.0
                    )));
                }
            };
            out.push((tensor, bytes));
        }
        Ok(out)
    }

    fn write(&mut self, id: SessionId, tensors: &[(u32, Vec<u8>)]) -> Result<u32, Status> {
        let entry = self
            .sessions
            .get_mut(&id)
            .ok_or_else(|| Status::not_found(format!("session {} does not exist", id.0)))?;
        let program = entry.program.clone();
        // Check everything before changing anything: all or nothing.
        let mut ranges = Vec::with_capacity(tensors.len());
        for (tensor, bytes) in tensors {
            let (off, len) = Self::persistent_range(&program, *tensor)?;
            if bytes.len() as u64 != len {
                let t = &program.graph().tensors[*tensor as usize];
                return Err(Status::invalid_argument(format!(
                    "tensor {tensor} '{}' ({}) needs {len} bytes, got {}",
                    t.name,
                    t.ty,
                    bytes.len()
                )));
            }
            ranges.push(off);
        }
        for ((_, bytes), off) in tensors.iter().zip(ranges) {
            match (&mut entry.image, entry.place) {
                (Some(image), _) => {
                    image.bytes[off as usize..off as usize + bytes.len()].copy_from_slice(bytes);
                }
                (None, Place::Admitted { persistent }) => self
                    .device
                    .write(persistent + off, bytes)
                    .map_err(|e| exec_status(&e))?,
                (None, _) => {
                    return Err(Status::internal(format!(
                        "session {} has no copy of its tensors",
                        id.0
                    )));
                }
            }
        }
        Ok(tensors.len() as u32)
    }

    /// Polls the core until it has nothing more to say, carrying out each action.
    fn drive(&mut self) {
        loop {
            let actions = self.core.poll();
            if actions.is_empty() {
                return;
            }
            for action in actions {
                self.apply(action);
            }
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
                entry.send(pb::session_update::Update::Admitted(pb::Admitted {
                    lane: lane.0,
                    lane_bytes: lane_size,
                    resumed,
                }));
                tracing::info!(session = session.0, lane = lane.0, resumed, "admitted");
                self.event(
                    pb::EventKind::Admitted,
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
                        let held = self.host.force(bytes.len() as u64);
                        entry.image = Some(HostImage { bytes, held });
                    }
                    Err(e) => {
                        tracing::error!(session = session.0, error = %e, "suspend copy failed")
                    }
                }
                entry.place = Place::Suspended;
                entry.send(pb::session_update::Update::Suspended(pb::Suspended {}));
                self.event(
                    pb::EventKind::Preempted,
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
                entry.send(pb::session_update::Update::Queued(pb::Queued {
                    reason: entry.reason.clone(),
                }));
                self.event(
                    pb::EventKind::Queued,
                    Some(session),
                    None,
                    reason.to_string(),
                    Duration::ZERO,
                );
            }
            Action::Reject { session, reason } => {
                if let Some(entry) = self.sessions.remove(&session) {
                    let message = format!("session {} can never run here: {reason}", session.0);
                    for pending in entry.pending {
                        let _ = pending
                            .reply
                            .send(Err(Status::resource_exhausted(message.clone())));
                    }
                    let _ = entry
                        .updates
                        .send(Err(Status::resource_exhausted(message.clone())));
                    self.event(
                        pb::EventKind::Rejected,
                        Some(session),
                        None,
                        message,
                        Duration::ZERO,
                    );
                }
            }
            Action::MoveLane { lane, from, to } => {
                self.event(
                    pb::EventKind::LaneMoved,
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
            } => self.start(session, lane, lane_offset, switched_from),
            Action::Closed { session } => {
                if let Some(entry) = self.sessions.remove(&session) {
                    for pending in entry.pending {
                        let _ = pending.reply.send(Err(Status::cancelled(format!(
                            "session {} is closed",
                            session.0
                        ))));
                    }
                    for d in entry.deferred {
                        let status = Status::cancelled(format!("session {} is closed", session.0));
                        match d {
                            Deferred::Read(_, reply) => drop(reply.send(Err(status))),
                            Deferred::Write(_, reply) => drop(reply.send(Err(status))),
                        }
                    }
                    tracing::info!(session = session.0, "closed");
                    self.event(
                        pb::EventKind::Closed,
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
            });
            return;
        };
        entry.running = true;
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
        let program = entry.program.clone();
        let device = self.device.clone();
        let tx = self.tx.clone();
        let wait = started.saturating_duration_since(pending.arrived);
        let at = Placement {
            persistent,
            lane: lane_offset,
        };
        self.event(
            pb::EventKind::IterationStarted,
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
                device.run(&program, at, &views)
            }))
            .unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Err(ExecError::Device(format!("the device panicked: {what}")))
            });
            let _ = tx.send(Command::Finished {
                session: id,
                result,
                ended: Instant::now(),
                reply: pending.reply,
                wait,
            });
        });
    }

    fn view_info(&self, view: SessionView<'_>, now: Duration) -> pb::SessionInfo {
        let id = view.id();
        let entry = self.sessions.get(&id);
        let state = match entry {
            Some(e) if e.closing => pb::SessionState::Closing,
            Some(Entry {
                place: Place::Admitted { .. },
                ..
            }) => pb::SessionState::Admitted,
            Some(Entry {
                place: Place::Suspended,
                ..
            }) => pb::SessionState::Suspended,
            _ => pb::SessionState::Queued,
        };
        let (mean, p99) = entry.map_or((0.0, 0.0), |e| {
            if e.recent.is_empty() {
                return (0.0, 0.0);
            }
            let mut sorted: Vec<Duration> = e.recent.iter().copied().collect();
            sorted.sort_unstable();
            let mean = sorted.iter().sum::<Duration>() / sorted.len() as u32;
            let index = ((sorted.len() as f64 * 0.99).ceil() as usize).clamp(1, sorted.len()) - 1;
            (millis(mean), millis(sorted[index]))
        });
        pb::SessionInfo {
            id: id.0,
            name: view.spec.hints.name.clone(),
            owner_uid: entry.map_or(0, |e| e.owner.uid),
            kind: match view.spec.kind {
                SessionKind::Training => pb::SessionKind::Training,
                SessionKind::Inference => pb::SessionKind::Inference,
            } as i32,
            state: state as i32,
            reason: entry.map(|e| e.reason.clone()).unwrap_or_default(),
            lane: self.core.lane_of(id).map(|l| l.0),
            persistent_bytes: view.spec.persistent_bytes,
            ephemeral_bytes: view.spec.ephemeral_bytes,
            priority: view.spec.hints.priority,
            total_iterations: view.spec.hints.total_iterations.unwrap_or(0),
            iterations: view.stats.completed_iterations,
            pending: view.stats.pending_iterations,
            mean_iteration_ms: mean,
            p99_iteration_ms: p99,
            queue_wait_ms: millis(view.stats.queue_wait(now)),
            attained_service_ms: millis(view.stats.attained_service),
            preemptions: view.stats.preemptions,
            suspensions: view.stats.suspensions,
            age_ms: entry.map_or(0.0, |e| millis(e.opened.elapsed())),
        }
    }

    fn session_infos(&self) -> Vec<pb::SessionInfo> {
        let now = self.now();
        let mut infos: Vec<pb::SessionInfo> = self
            .core
            .sessions()
            .map(|view| self.view_info(view, now))
            .collect();
        infos.sort_by_key(|i| i.id);
        infos
    }

    fn status(&self) -> pb::StatusResponse {
        let map = self.core.memory_map();
        let config = self.core.memory_config();
        let name = |id: SessionId| {
            self.sessions
                .get(&id)
                .map(|e| e.hints.name.clone())
                .unwrap_or_default()
        };
        pb::StatusResponse {
            device: Some(pb::Device {
                name: self.device.name(),
                capacity: config.capacity,
                reserve: config.reserve,
            }),
            policy: self.core.policy().to_string(),
            draining: self.core.draining(),
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
            lanes: self
                .core
                .lanes()
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
            queue: self
                .core
                .waiting()
                .into_iter()
                .map(|(id, reason)| pb::QueuedSession {
                    session: id.0,
                    name: name(id),
                    reason: reason.map_or_else(
                        || "waiting for the scheduler".to_string(),
                        |r| r.to_string(),
                    ),
                })
                .collect(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// What the metrics endpoint exports, now.
    fn metrics(&self) -> Metrics {
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
            host_bytes: self.host.used(),
        }
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
