//! The engine: one task that owns the scheduling core and the device's bookkeeping.
//!
//! Every request that changes state (open, run, read, write, close, policy, drain) and
//! every finished iteration arrives as a [`Command`] on one channel; the engine applies it
//! to the sans-IO core as a timed event, polls the core, and carries out the actions.
//! Nothing else touches the core, so there are no locks around scheduling decisions.
//!
//! The engine speaks the daemon's own terms: it answers with domain values and
//! [`EngineError`]s, and knows nothing of protobuf or gRPC statuses (the service
//! converts). It can be driven without any socket: start it, send [`Command`]s.
//!
//! - `commands`: the command protocol and the answer to each request;
//! - `actions`: carrying out the core's actions and finished iterations;
//! - `reports`: session updates, the event stream, status, reports and metrics;
//! - `quota`: what sessions off the device may hold on the host, in all and per user;
//! - `error`: [`EngineError`].

mod actions;
mod commands;
mod error;
mod programs;
mod quota;
mod reports;
mod restart;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use salus_core::{Event, Hints, LaneId, MemoryConfig, PolicyKind, Scheduler, SessionId};
use salus_exec::{Device, Program};
use tokio::sync::{broadcast, mpsc, oneshot, watch};

use crate::auth::Principal;
use crate::state::Snapshot;

pub use commands::{Command, NewSession, Reply, Restored, Retry, RunResult, persistent_range};
pub use error::EngineError;
pub use quota::{HostBytes, HostImage, QuotaConfig, QuotaReport, Quotas, SessionSlot, UserUsage};
pub use reports::{
    EngineEvent, EventKind, Metrics, QueuedReport, SessionMetrics, SessionReport, SessionState,
    SessionUpdate, StatusReport, UpdateSink,
};

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
    /// Which of the session's programs runs.
    program: usize,
    feeds: Vec<Vec<u8>>,
    /// Persistent tensors to overwrite first: (offset in the persistent block, bytes).
    writes: Vec<(u64, Vec<u8>)>,
    reply: Reply<RunResult>,
    arrived: Instant,
}

enum Deferred {
    Read(Vec<u32>, Reply<Vec<(u32, Vec<u8>)>>),
    Write(Vec<(u32, Vec<u8>)>, Reply<u32>),
    Snapshot(Reply<Snapshot>),
}

struct Entry {
    owner: Principal,
    /// The secret that reattaches it after a restart.
    token: [u8; 16],
    /// Iterations done before this daemon started (restored from a snapshot).
    iterations_before: u64,
    /// Restored from a snapshot and not yet reattached by its client.
    orphan: bool,
    /// Its place among its owner's sessions, given back when the entry goes.
    _slot: SessionSlot,
    /// Its programs: the one it opened with (which defines the persistent block and E),
    /// then those added for other feed shapes, in the order they were added.
    programs: Vec<Arc<Program>>,
    hints: Hints,
    /// The persistent block on the host: before admission and while suspended.
    image: Option<HostImage>,
    place: Place,
    reason: String,
    running: bool,
    closing: bool,
    pending: VecDeque<Pending>,
    /// The running iteration's control (to abandon it).
    control: Option<Arc<salus_exec::RunControl>>,
    deferred: Vec<Deferred>,
    updates: UpdateSink,
    opened: Instant,
    recent: VecDeque<Duration>,
    histogram: [u64; HISTOGRAM_BOUNDS.len() + 1],
    iteration_seconds: f64,
}

impl Entry {
    /// The program the session opened with: its persistent tensors' layout and its E.
    fn program(&self) -> &Arc<Program> {
        &self.programs[0]
    }

    fn send(&self, update: SessionUpdate) {
        (self.updates)(Ok(update));
    }
}

/// A cloneable handle to the engine task.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::UnboundedSender<Command>,
    events: broadcast::Sender<EngineEvent>,
    shared: Arc<std::sync::Mutex<Shared>>,
    memory: MemoryConfig,
    protection: salus_core::ProtectionConfig,
    limits: salus_graph::Limits,
    /// The device, for planning programs (the engine task runs iterations on it).
    device: Arc<dyn Device>,
    next_session: Arc<AtomicU64>,
    stopping: Arc<watch::Sender<bool>>,
    quotas: Quotas,
    open_timeout: Duration,
    fatal: Arc<watch::Sender<Option<String>>>,
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
    /// How online sessions are protected from offline ones.
    pub protection: salus_core::ProtectionConfig,
    /// Bounds on graphs.
    pub limits: salus_graph::Limits,
    /// The daemon's own user, who may steer it.
    pub daemon_uid: u32,
    /// Bytes of host memory opening, waiting and suspended sessions may hold in all.
    pub host_memory: u64,
    /// The same, for one user's sessions.
    pub user_host_memory: u64,
    /// Sessions one user may have open or opening.
    pub max_sessions_per_user: u64,
    /// How long an `Open` stream may take from its start to `commit`.
    pub open_timeout: Duration,
}

/// A secret of 16 random bytes (a session's reattach token).
fn random_token() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for (i, half) in out.chunks_exact_mut(8).enumerate() {
        // std seeds every RandomState from the operating system's random source.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_usize(i);
        half.copy_from_slice(&hasher.finish().to_le_bytes());
    }
    out
}

/// The first session id of this engine: random, so that ids never repeat across restarts
/// (a client holding an id from before cannot reach a new session that happens to get it)
/// and below 2^53, so that they survive JSON readers that hold numbers as doubles.
fn first_session_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // std seeds every RandomState from the operating system's random source.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    if let Ok(since) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        hasher.write_u128(since.as_nanos());
    }
    // Leaves room for 2^51 sessions before 2^53.
    (hasher.finish() >> 13).max(1)
}

impl Engine {
    /// Starts the engine task on the current tokio runtime.
    pub fn start(config: EngineConfig) -> Result<Engine, String> {
        let core =
            Scheduler::with_protection(config.memory, config.policy, config.protection.clone())
                .map_err(|e| e.to_string())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (events, _) = broadcast::channel(4096);
        let shared = Arc::new(std::sync::Mutex::new(Shared::default()));
        let engine = Engine {
            tx: tx.clone(),
            events: events.clone(),
            shared: shared.clone(),
            memory: config.memory,
            protection: config.protection,
            limits: config.limits,
            device: config.device.clone(),
            next_session: Arc::new(AtomicU64::new(first_session_id())),
            stopping: Arc::new(watch::channel(false).0),
            quotas: Quotas::new(QuotaConfig {
                host_memory: config.host_memory,
                user_host_memory: config.user_host_memory,
                max_sessions_per_user: config.max_sessions_per_user,
                daemon_uid: config.daemon_uid,
            }),
            open_timeout: config.open_timeout,
            fatal: Arc::new(watch::channel(None).0),
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
            quotas: engine.quotas.clone(),
            open_timeout: config.open_timeout,
            lane_last_end: HashMap::new(),
            shutdown: None,
            stopping: false,
            keep: None,
            health: salus_core::HealthState::Init,
        };
        let running = tokio::spawn(state.run(rx));
        // A bug that panics the engine must not leave a daemon that answers UNAVAILABLE
        // forever: it stops, as for a failed device, and its supervisor restarts it.
        let fatal = engine.fatal.clone();
        tokio::spawn(async move {
            if let Err(error) = running.await
                && error.is_panic()
            {
                let panic = error.into_panic();
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(%what, "the engine panicked; shutting down");
                fatal.send_replace(Some(format!("the engine panicked (a bug): {what}")));
            }
        });
        Ok(engine)
    }

    /// Reads the device's load every `interval` on a thread of its own and hands it to
    /// protection (SM activity and clock: health metrics while online work runs), for
    /// as long as the engine runs. Nothing to do when protection is off or the device
    /// reports no load (logged).
    pub fn watch_load(&self, device: &dyn Device, interval: Duration) {
        if !self.protection.enabled {
            return;
        }
        let mut monitor = match device.load_monitor() {
            Ok(monitor) => monitor,
            Err(why) => {
                tracing::info!("protection reads no device load: {why}");
                return;
            }
        };
        let tx = self.tx.clone();
        let watching = std::thread::Builder::new()
            .name("salus-load".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(interval);
                    match monitor.read() {
                        Ok(load) => {
                            if tx.send(Command::DeviceLoad(load)).is_err() {
                                return;
                            }
                        }
                        Err(why) => {
                            tracing::warn!("reading the device's load failed ({why}); stopped");
                            return;
                        }
                    }
                }
            });
        match watching {
            Ok(_) => tracing::info!(?interval, "protection reads the device's load"),
            Err(error) => tracing::warn!(%error, "no thread to read the device's load"),
        }
    }

    /// Sends a command; fails only when the engine has stopped.
    pub fn send(&self, command: Command) -> Result<(), EngineError> {
        self.tx.send(command).map_err(|_| EngineError::ShuttingDown)
    }

    /// Sends a command built around a reply channel and waits for the answer.
    pub async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, EngineError> {
        let (reply, answer) = oneshot::channel();
        self.send(make(reply))?;
        answer.await.map_err(|_| EngineError::ShuttingDown)?
    }

    /// What sessions off the device hold on the host, in all and per user.
    pub fn quotas(&self) -> &Quotas {
        &self.quotas
    }

    /// How long an `Open` stream may take from its start to `commit`.
    pub fn open_timeout(&self) -> Duration {
        self.open_timeout
    }

    /// A fresh session id: unique for the engine's life and, with high probability,
    /// across restarts.
    pub fn new_session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// A new session's reattach token: 16 random bytes.
    pub fn new_token(&self) -> [u8; 16] {
        random_token()
    }

    /// Changes to true when the daemon starts shutting down.
    pub fn stopping(&self) -> watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    /// Subscribes to the event stream.
    pub fn subscribe(&self) -> broadcast::Receiver<EngineEvent> {
        self.events.subscribe()
    }

    /// Capacity and reserve.
    pub fn memory(&self) -> MemoryConfig {
        self.memory
    }

    /// How online sessions are protected from offline ones.
    pub fn protection(&self) -> &salus_core::ProtectionConfig {
        &self.protection
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
        self.shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .stats
            .clone()
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
    /// With `keep`, returns each session's snapshot, taken once nothing runs, just before
    /// the sessions close (for the state directory).
    pub async fn shutdown(&self, keep: bool) -> Kept {
        self.stopping.send_replace(true);
        let (done, wait) = oneshot::channel();
        let (keep, kept) = if keep {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        if self.send(Command::Shutdown { done, keep }).is_ok() {
            let _ = wait.await;
        }
        match kept {
            Some(kept) => kept.await.unwrap_or_default(),
            None => Kept::default(),
        }
    }
}

/// What a shutdown keeps for the state directory.
#[derive(Debug, Default)]
pub struct Kept {
    /// A snapshot of each session that could be taken.
    pub snapshots: Vec<Snapshot>,
    /// Every session open when they were taken, with a snapshot or not (one on a failed
    /// device has none: its last periodic one stands).
    pub open: Vec<u64>,
}

/// The engine task's state: the core and what the daemon knows beside it.
struct State {
    core: Scheduler,
    device: Arc<dyn Device>,
    daemon_uid: u32,
    sessions: HashMap<SessionId, Entry>,
    started: Instant,
    tx: mpsc::UnboundedSender<Command>,
    events: broadcast::Sender<EngineEvent>,
    shared: Arc<std::sync::Mutex<Shared>>,
    quotas: Quotas,
    open_timeout: Duration,
    /// When the last iteration on each lane ended, and whose it was.
    lane_last_end: HashMap<LaneId, (SessionId, Instant)>,
    shutdown: Option<oneshot::Sender<()>>,
    /// Shutting down (or shut down): sessions gone since were closed by it.
    stopping: bool,
    /// Where the sessions' snapshots go at shutdown, when they are kept.
    keep: Option<oneshot::Sender<Kept>>,
    /// Protection's health as last reported.
    health: salus_core::HealthState,
    fatal: Arc<watch::Sender<Option<String>>>,
}

impl State {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        // The device is up: protection leaves its Init state.
        if let Err(error) = self.core(Event::Tick) {
            tracing::error!(%error, "the core refused its first tick");
        }
        self.drive();
        loop {
            // Decisions that wait on time alone (offline iterations held by protection)
            // are made when the core says.
            let command = match self.core.next_wakeup() {
                Some(at) => {
                    let deadline = tokio::time::Instant::from_std(self.started + at);
                    tokio::select! {
                        command = rx.recv() => command,
                        () = tokio::time::sleep_until(deadline) => {
                            if let Err(error) = self.core(Event::Tick) {
                                tracing::error!(%error, "the core refused a tick");
                            }
                            self.drive();
                            continue;
                        }
                    }
                }
                None => rx.recv().await,
            };
            let Some(command) = command else {
                break;
            };
            self.handle(command);
            // Take what else is queued before polling: one poll per burst.
            while let Ok(command) = rx.try_recv() {
                self.handle(command);
            }
            self.drive();
            if self.shutdown.is_some() && self.sessions.values().all(|e| !e.running) {
                if let Some(keep) = self.keep.take() {
                    let _ = keep.send(Kept {
                        snapshots: self.snapshot_all(),
                        open: self.sessions.keys().map(|id| id.0).collect(),
                    });
                }
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

    /// The core's clock: time since the engine started.
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn event(
        &self,
        kind: EventKind,
        session: Option<SessionId>,
        lane: Option<LaneId>,
        detail: String,
        duration: Duration,
    ) {
        let _ = self.events.send(EngineEvent {
            time: self.now(),
            kind,
            session,
            lane,
            detail,
            duration,
        });
    }

    /// Feeds one event to the core, at the engine's time now.
    fn core(&mut self, event: Event) -> Result<(), EngineError> {
        let now = self.now();
        Ok(self.core.handle(now, event)?)
    }
}
