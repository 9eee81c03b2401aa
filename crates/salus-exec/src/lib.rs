//! The execution layer of salus: what every device backend shares.
//!
//! Owns the contract between the core and a device: the [`Device`] trait, a [`Program`]
//! (a validated graph and its memory plan, built once per session, with each node's
//! operand [`layout`] worked out once), [`Placement`] and [`Location`] (where a session's
//! persistent block and lane are, and where a tensor lies in them), [`ExecError`] and
//! [`Outcome`], the host [`Arena`] (one allocation handed out as exclusive, disjoint
//! [`Region`]s), and the key random ops derive their streams from ([`random`]). A program
//! runs one iteration at a time on a device, with its persistent tensors at the offset
//! `salus-core` gave the session and its intermediates in the lane `salus-core` started the
//! iteration in. A device owns one arena of its capacity; it never allocates per tensor or
//! per iteration, and it knows nothing about sessions, lanes or policies beyond the offsets
//! it is given.
//!
//! Also the `sim` device (modeled time, accounted memory): a device with no kernels. The
//! backends that compute are crates of their own: `salus-cpu` (the embedded default) and
//! `salus-cuda` (one GPU).
//!
//! Must not touch: kernels, op semantics or any backend's libraries (no CUDA, no BLAS, no
//! thread pool); sessions, scheduling and policies (`salus-core`); the wire (`salusd`).
//! The arena is the one module here allowed `unsafe`, to hand concurrent lanes disjoint
//! mutable views of one allocation.

mod arena;
pub mod layout;
pub mod random;
pub mod sim;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use salus_graph::{
    CheckedGraph, Graph, GraphError, Limits, MemoryPlan, OpParams, PortableScratch, Role,
    ScratchSizer, TensorId, check_with,
};

pub use arena::{Arena, Region};
pub use sim::{CostModel, SimDevice};

/// Why an iteration or a transfer failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    /// The device refused: memory out of range, overlapping use, allocation failure.
    #[error("device: {0}")]
    Device(String),
    /// An iteration given the wrong number of feeds.
    #[error("the graph takes {expected} feeds, {given} given")]
    FeedCount {
        /// Feeds the graph takes.
        expected: usize,
        /// Feeds given.
        given: usize,
    },
    /// A feed does not match the graph.
    #[error("feed {index} '{name}': {message}")]
    Feed {
        /// Position among the feeds.
        index: usize,
        /// The feed tensor's name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A node failed while running (e.g. an index out of range).
    #[error("node {index} '{name}' ({op}): {message}")]
    Node {
        /// Position in the node list.
        index: usize,
        /// Its name.
        name: String,
        /// Its op.
        op: String,
        /// What went wrong.
        message: String,
    },
    /// The iteration was abandoned before its end, at the driver's request
    /// ([`RunControl::abandon`]): nothing of it was kept, the persistent block is unchanged.
    #[error("the iteration was abandoned before its end")]
    Abandoned,
}

/// How one iteration runs, and the driver's hold on it while it runs: the share of the
/// device it may use, which the driver may change while it runs (the device follows from
/// its next kernel on), whether it runs in the background, and abandonment.
#[derive(Debug)]
pub struct RunControl {
    /// The share, as the bits of an `f64` in [0, 1].
    share: AtomicU64,
    /// Runs below every other iteration, on what they leave
    /// ([`Device::has_background_priority`]).
    background: bool,
    abandon: AtomicBool,
    /// What the device does when the iteration is abandoned, while it needs something done
    /// ([`RunControl::on_abandon`]).
    on_abandon: AbandonHook,
    /// Wakes an iteration held at share 0.
    changed: (Mutex<()>, Condvar),
}

/// A device's hook for abandonment: at most one at a time, run once.
#[derive(Default)]
struct AbandonHook(Mutex<Option<Box<dyn FnOnce() + Send>>>);

impl std::fmt::Debug for AbandonHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AbandonHook")
    }
}

impl RunControl {
    /// An iteration on `share` of the device (1.0: all of it; 0: held before its first
    /// kernel until [`RunControl::set_share`] gives it more).
    pub fn new(share: f64) -> RunControl {
        RunControl {
            share: AtomicU64::new(share.clamp(0.0, 1.0).to_bits()),
            background: false,
            abandon: AtomicBool::new(false),
            on_abandon: AbandonHook::default(),
            changed: (Mutex::new(()), Condvar::new()),
        }
    }

    /// Like [`RunControl::new`], for an iteration that runs in the background: on a device
    /// with a background priority ([`Device::has_background_priority`]) it uses only the
    /// compute the other iterations leave (an offline iteration under protection).
    pub fn background(share: f64) -> RunControl {
        RunControl {
            background: true,
            ..RunControl::new(share)
        }
    }

    /// True for an iteration made with [`RunControl::background`].
    pub fn is_background(&self) -> bool {
        self.background
    }

    /// The share of the device's compute it may use now, in [0, 1].
    pub fn share(&self) -> f64 {
        f64::from_bits(self.share.load(Ordering::Relaxed))
    }

    /// Changes the share from the iteration's next kernel on; 0 holds it between two
    /// kernels (its results are the same whatever the shares: kernels give the same
    /// answer on any number of threads).
    pub fn set_share(&self, share: f64) {
        self.share
            .store(share.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
        self.wake();
    }

    /// Asks the device to stop the iteration at its next chance (between two nodes on
    /// the cpu device); it then fails with [`ExecError::Abandoned`], changing nothing.
    pub fn abandon(&self) {
        self.abandon.store(true, Ordering::Relaxed);
        let mut hook = self.on_abandon.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(hook) = hook.take() {
            hook();
        }
        drop(hook);
        self.wake();
    }

    /// Has `hook` run when the iteration is abandoned (at once if it already is), unless
    /// [`RunControl::clear_on_abandon`] comes first; it replaces any hook set before. For
    /// a device that must hurry the work in progress when it is abandoned: the cpu device
    /// lifts a background iteration's threads out of the idle class, so that the kernel
    /// it is in ends (and the memory it holds is free) even on a host busy with other work.
    pub fn on_abandon(&self, hook: Box<dyn FnOnce() + Send>) {
        let mut slot = self.on_abandon.0.lock().unwrap_or_else(|e| e.into_inner());
        if self.abandoned() {
            drop(slot);
            hook();
        } else {
            *slot = Some(hook);
        }
    }

    /// Drops the hook [`RunControl::on_abandon`] set, if it has not run; once this
    /// returns, a hook that ran has finished.
    pub fn clear_on_abandon(&self) {
        self.on_abandon
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }

    /// True once [`RunControl::abandon`] was called.
    pub fn abandoned(&self) -> bool {
        self.abandon.load(Ordering::Relaxed)
    }

    /// Waits while the share is 0 and the iteration is not abandoned; returns the share.
    pub fn wait_for_share(&self) -> f64 {
        let (lock, changed) = &self.changed;
        let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let share = self.share();
            if share > 0.0 || self.abandoned() {
                return share;
            }
            guard = changed.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits `pause`, or less: until the share changes or the iteration is abandoned
    /// (a device pacing an iteration below its whole share sleeps here between kernels).
    pub fn pause(&self, pause: Duration) {
        let deadline = std::time::Instant::now() + pause;
        let share = self.share.load(Ordering::Relaxed);
        let (lock, changed) = &self.changed;
        let mut guard = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = std::time::Instant::now();
            if now >= deadline || self.abandoned() || self.share.load(Ordering::Relaxed) != share {
                return;
            }
            guard = changed
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn wake(&self) {
        // Taking the lock orders this change before a waiter's next look at the share.
        drop(self.changed.0.lock());
        self.changed.1.notify_all();
    }
}

/// Where a tensor lives, relative to the session's persistent block or its lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// At this offset in the session's persistent block.
    Persistent(u64),
    /// At this offset in the lane.
    Lane(u64),
}

/// Elements below which a tensor is "small": a graph of only such tensors runs on the
/// calling thread, since handing it to the kernels' thread pool costs more than it saves.
const SMALL_TENSOR: u64 = 1 << 14;

/// A validated graph with its memory plan: what a device runs, built once per session.
#[derive(Debug, Clone)]
pub struct Program {
    graph: Graph,
    plan: MemoryPlan,
    /// Each node's typed parameters, read from its attributes once by validation.
    params: Vec<OpParams>,
    feeds: Vec<TensorId>,
    expected_iteration: Option<Duration>,
    id: u64,
    layouts: Vec<layout::NodeLayout>,
    /// Every tensor is small enough that no kernel splits its work across threads.
    small: bool,
}

impl Program {
    /// Validates and plans `graph` with the portable kernels' scratch (the CPU and sim
    /// devices').
    pub fn new(graph: Graph, limits: &Limits) -> Result<Program, GraphError> {
        Program::with_scratch(graph, limits, &PortableScratch)
    }

    /// Validates and plans `graph` for `device`: each node's scratch is what that device's
    /// kernels will work in, so E is exact there.
    pub fn for_device(
        graph: Graph,
        limits: &Limits,
        device: &dyn Device,
    ) -> Result<Program, GraphError> {
        match device.scratch_sizer() {
            Some(sizer) => Program::with_scratch(graph, limits, sizer),
            None => Program::new(graph, limits),
        }
    }

    /// Validates and plans `graph`, each node's scratch as `sizer` gives it.
    pub fn with_scratch(
        graph: Graph,
        limits: &Limits,
        sizer: &dyn ScratchSizer,
    ) -> Result<Program, GraphError> {
        let CheckedGraph { plan, params, .. } = check_with(&graph, limits, sizer)?;
        let feeds = graph
            .tensors
            .iter()
            .enumerate()
            .filter(|(_, t)| t.role == Role::Feed)
            .map(|(id, _)| id)
            .collect();
        let layouts = layout::layouts(&graph, &plan);
        let small = graph
            .tensors
            .iter()
            .all(|t| t.ty.numel().is_some_and(|n| n < SMALL_TENSOR));
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Program {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            graph,
            plan,
            params,
            feeds,
            layouts,
            small,
            expected_iteration: None,
        })
    }

    /// The same program with a client's estimate of its iteration time, which the sim
    /// device uses instead of its cost model.
    pub fn with_expected_iteration(mut self, expected: Option<Duration>) -> Program {
        self.expected_iteration = expected;
        self
    }

    /// A number unique to this program in the process (clones share it): devices key what
    /// they derive from a program (lowered commands, captured graphs) by it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The client's estimate of one iteration's time, if it gave one.
    pub fn expected_iteration(&self) -> Option<Duration> {
        self.expected_iteration
    }

    /// Each node's operands, in node order: where a backend finds a node's inputs, outputs
    /// and scratch without computing a location per iteration.
    pub fn layouts(&self) -> &[layout::NodeLayout] {
        &self.layouts
    }

    /// True when every tensor has fewer than 16384 elements: no kernel would split its work
    /// across threads, so a backend may run the whole graph on the calling thread.
    pub fn is_small(&self) -> bool {
        self.small
    }

    /// Checks that `feeds` has one buffer of the right size per feed tensor.
    pub fn check_feeds(&self, feeds: &[&[u8]]) -> Result<(), ExecError> {
        if feeds.len() != self.feeds.len() {
            return Err(ExecError::FeedCount {
                expected: self.feeds.len(),
                given: feeds.len(),
            });
        }
        for (index, (&id, bytes)) in self.feeds.iter().zip(feeds).enumerate() {
            let t = &self.graph.tensors[id];
            let want = self.bytes(id);
            if bytes.len() as u64 != want {
                return Err(ExecError::Feed {
                    index,
                    name: t.name.clone(),
                    message: format!("{} needs {want} bytes, got {}", t.ty, bytes.len()),
                });
            }
        }
        Ok(())
    }

    /// The graph.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Node `node`'s typed parameters (every backend reads these, never the attributes).
    pub fn params(&self, node: usize) -> &OpParams {
        &self.params[node]
    }

    /// Every node's typed parameters, in node order.
    pub fn node_params(&self) -> &[OpParams] {
        &self.params
    }

    /// The memory plan: P is `plan().persistent_bytes`, E `plan().ephemeral_bytes`.
    pub fn plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// Feed tensors, in the order [`Device::run`] takes their bytes.
    pub fn feeds(&self) -> &[TensorId] {
        &self.feeds
    }

    /// Where a tensor lives, if it has memory.
    pub fn location(&self, id: TensorId) -> Option<Location> {
        if let Some(offset) = self.plan.persistent_offsets.get(id).copied().flatten() {
            return Some(Location::Persistent(offset));
        }
        self.plan.lane_offset(id).map(Location::Lane)
    }

    /// Bytes of a tensor.
    pub fn bytes(&self, id: TensorId) -> u64 {
        self.graph
            .tensors
            .get(id)
            .and_then(|t| t.ty.bytes())
            .unwrap_or(0)
    }
}

/// Where one iteration runs: the session's persistent block and its lane, as arena
/// offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Offset of the session's persistent block.
    pub persistent: u64,
    /// Offset of the lane.
    pub lane: u64,
}

/// What one iteration produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The fetched tensors' bytes, in the graph's fetch order.
    pub fetches: Vec<Vec<u8>>,
    /// How long the iteration took on the device.
    pub duration: Duration,
}

/// What a device reports of its own load over an interval (a GPU, through NVML), for
/// protection's health metrics; `None` where it cannot tell.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Fraction of the interval the device's compute units were busy, averaged over them,
    /// 0 to 1 (a GPU's SM activity).
    pub sm_activity: Option<f64>,
    /// The compute clock now and the highest it reaches, in MHz (a GPU's SM clock: below
    /// the highest when power or heat hold it back).
    pub sm_clock: Option<(f64, f64)>,
}

/// Reads a device's [`Load`]; each reading covers the time since the one before.
pub trait LoadMonitor: Send {
    /// The load since the last reading (the first: since the monitor was made).
    fn read(&mut self) -> Result<Load, String>;
}

/// A device: one arena of memory and a way to run iterations in it.
pub trait Device: Send + Sync {
    /// What it is, for status output ("cpu", "cuda:0 (H100)").
    fn name(&self) -> String;

    /// Bytes of its arena.
    fn capacity(&self) -> u64;

    /// Copies `bytes` into the arena at `offset` (uploading persistent tensors).
    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), ExecError>;

    /// Copies `len` bytes out of the arena at `offset`.
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ExecError>;

    /// Runs one iteration of `program` at `at`: `feeds` in (one byte buffer per feed, in
    /// [`Program::feeds`] order), fetches out, updates written into the persistent block
    /// after every node has run. On error the persistent block is unchanged.
    fn run(&self, program: &Program, at: Placement, feeds: &[&[u8]]) -> Result<Outcome, ExecError>;

    /// Runs like [`Device::run`] under `control`: using at most its share of the device's
    /// compute, leaving the rest to other lanes (the core's compute share for offline
    /// iterations beside online ones), and stopping early once it is abandoned. A device
    /// that can do neither runs the iteration as `run` does.
    fn run_with(
        &self,
        program: &Program,
        at: Placement,
        feeds: &[&[u8]],
        control: &RunControl,
    ) -> Result<Outcome, ExecError> {
        let _ = control;
        self.run(program, at, feeds)
    }

    /// True when [`Device::run_with`] runs background iterations ([`RunControl::background`])
    /// at a priority below the others, so that they take only the compute the others leave
    /// and yield it as soon as another iteration needs it (the cpu device: threads the OS
    /// runs only on otherwise idle cores; a GPU: streams of the least priority, whose
    /// blocks get SMs only when no other lane's are waiting). Protection then leaves
    /// online iterations the whole device beside offline ones.
    fn has_background_priority(&self) -> bool {
        false
    }

    /// The share of this device's compute an offline iteration should use while an online
    /// iteration runs (`ProtectionConfig::offline_compute_share`), where the device knows
    /// better than protection's default; `None` keeps the default (a share protection
    /// learns). The operator's `--offline-compute-share` overrides both. Either is fixed.
    fn offline_compute_share(&self) -> Option<f64> {
        None
    }

    /// A monitor of this device's load, or why there is none (the host devices report
    /// none; a GPU needs NVML).
    fn load_monitor(&self) -> Result<Box<dyn LoadMonitor>, String> {
        Err(format!("the {} device reports no load", self.name()))
    }

    /// How this device sizes a node's scratch when a program is planned for it
    /// ([`Program::for_device`]); `None`: the portable kernels' ([`PortableScratch`]).
    fn scratch_sizer(&self) -> Option<&dyn ScratchSizer> {
        None
    }

    /// `Err(reason)` once the device can no longer run anything correctly (a GPU context
    /// poisoned by a device error): the daemon then stops serving.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
}
