//! The CUDA backend of salus: the [`CudaDevice`] on one GPU, one context, one allocation,
//! one stream per lane.
//!
//! Owns everything that talks to CUDA: probing GPUs ([`GpuInfo`]), opening one
//! ([`CudaOptions`]), the calls into the driver, cuBLAS and NVRTC (`driver`), lowering a
//! program's nodes to kernel launches and cuBLAS products (`lower`, one file per op
//! family), the interface between the two sides (`abi`: kernels, argument structs and
//! codes, described once in Rust, from which the CUDA prelude is generated) and the
//! kernels' source (`src/kernels/*.cu`, one file per op family, joined after the prelude
//! into one NVRTC program), and the [`Emulator`] that runs the same command lists and
//! kernel source on the host, for tests where there is no GPU. Must not touch: the device contract, programs, placements and node layouts
//! (`salus-exec`'s; this crate only uses them), the CPU backend (whose results its kernels
//! reproduce, checked by `salus-testkit`'s tests), sessions and policies. `unsafe` is
//! allowed in one module only, `driver`.
//!
//! The backend is always compiled: it loads the CUDA libraries at run time and reports a
//! clear error where there are none.
//!
//! At start the device takes the primary context of one GPU, allocates its whole arena in
//! one `cuMemAlloc` (the capacity: free memory minus a reserve, optionally capped), and
//! compiles its kernels (the generated prelude and `src/kernels/*.cu`) with NVRTC for the GPU's architecture, caching the
//! machine code on disk keyed by architecture, NVRTC version and source hash.
//! Persistent blocks and lanes are offsets into the arena, as the core assigns them.
//!
//! Each lane (keyed by its offset) gets a stream, a cuBLAS handle with its own workspace,
//! a small error block and two events; iterations of one lane run in order, lanes run
//! concurrently. A lane of background (offline) iterations gets a stream of the least
//! priority and the others the greatest, so the GPU's block scheduler gives SMs to the
//! others' blocks first; it runs each iteration in pieces, held to the share of the GPU
//! the scheduler gives it, in SM partitions (green contexts) or paced (`pieces`). NVML,
//! where the host has it, reports the GPU's SM activity and clock (`monitor`) for
//! protection's health metrics. A program at a placement is lowered once into a command
//! list (see `lower`); its first iteration runs the list eagerly, the second captures it
//! into a CUDA graph (one per piece), and later ones replay it. A moved lane is a new
//! placement: captured anew.
//!
//! Updates are written after the fetches have been read, by a kernel that does nothing
//! when any kernel of the iteration reported an error (an out-of-range index), so a failed
//! iteration leaves the persistent block unchanged.
//!
//! Memory outside the arena (the context, the loaded kernels, each lane's 4 MiB cuBLAS
//! workspace and 256-byte error block, cuBLAS's own state) comes out of the reserve.
//!
//! After an error that poisons the context (an illegal address, a failed launch), the
//! device refuses every later call with that error, and [`Device::health`] reports it:
//! salusd then fails the affected iterations and shuts down cleanly rather than serve from
//! a broken context. It does not try to recover (that would need host copies of every
//! session's persistent tensors).

mod abi;
mod cudnn;
mod driver;
pub mod emulator;
mod image;
mod lower;
mod monitor;
mod open;
mod pieces;
pub mod profile;

pub use emulator::Emulator;
pub use image::cache_dir;
use image::{cached_image, tracing_note};
pub use open::{CudaOptions, GpuInfo};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::driver::sys;

use salus_exec::{
    Device, ExecError, LoadMonitor, Location, Outcome, Placement, Program, RunControl,
};
use salus_graph::{Graph, OpParams, PortableScratch, ScratchSizer};

use self::driver::{Raw, driver_error};
use self::lower::Command;
use self::profile::{NodeTime, Profile};

/// The CUDA version the bindings are built for (the `cuda-12080` feature of cudarc).
const MIN_DRIVER: i32 = 12080;

/// Reserve kept out of the arena when none is given: the context, kernels, cuBLAS.
pub const DEFAULT_RESERVE: u64 = 1 << 30;

/// Bytes of each lane's cuBLAS workspace.
const WORKSPACE: usize = 4 << 20;

/// Bytes of each lane's error block.
const ERROR_BLOCK: usize = 256;

/// Most program placements a lane keeps lowered (and captured) at once.
const ENTRIES_PER_LANE: usize = 32;

/// Most commands a profiled iteration issues behind one gate (well below the driver's
/// launch queue, so issuing never waits for the gated stream).
const PROFILE_BATCH: usize = 128;

/// A lowered program at one placement, and its captured graphs.
struct Entry {
    commands: Vec<Command>,
    /// The commands of each node, by node index (empty for a node that issues none).
    spans: Vec<std::ops::Range<usize>>,
    /// The commands of each piece the iteration runs in: all of them on a foreground lane,
    /// up to [`pieces::MAX_PIECES`] on a background lane (see `pieces`).
    pieces: Vec<std::ops::Range<usize>>,
    updates: Vec<Command>,
    runs: u64,
    /// Each piece's graph, by piece and the SM partition it was captured in (0: the
    /// lane's own stream).
    graphs: HashMap<(usize, u32), Raw<sys::CUgraphExec>>,
    capture_failed: bool,
    last_used: u64,
}

impl Entry {
    fn destroy_graphs(&mut self) {
        for (_, g) in self.graphs.drain() {
            driver::destroy_exec(g);
        }
    }
}

/// One lane's stream and what goes with it.
struct Lane {
    stream: Raw<sys::CUstream>,
    blas: Raw<cudarc::cublas::sys::cublasHandle_t>,
    /// The lane's cuDNN handle, on its stream, when the device uses cuDNN.
    dnn: Option<driver::cudnn::Handle>,
    workspace: u64,
    err: u64,
    start: Raw<sys::CUevent>,
    end: Raw<sys::CUevent>,
    entries: HashMap<(u64, u64), Entry>,
    tick: u64,
    /// A background lane's streams in SM partitions, by level, made on first use.
    partitioned: pieces::PartitionStreams,
    /// A background lane's events between pieces, made on first use.
    marks: Option<driver::Events>,
}

impl Drop for Lane {
    fn drop(&mut self) {
        let _ = driver::sync(self.stream);
        self.partitioned.clear();
        for e in self.entries.values_mut() {
            e.destroy_graphs();
        }
        driver::destroy_blas(self.blas);
        if let Some(h) = self.dnn {
            driver::cudnn::destroy_handle(h);
        }
        driver::destroy_event(self.start);
        driver::destroy_event(self.end);
        driver::destroy_stream(self.stream);
        driver::free(self.workspace);
        driver::free(self.err);
    }
}

/// A lane, and whether it runs background iterations (its stream has the least
/// priority).
type LaneSlot = (bool, Arc<Mutex<Lane>>);

/// The CUDA device.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    name: String,
    base: u64,
    capacity: u64,
    functions: Vec<Raw<sys::CUfunction>>,
    /// Lanes by offset.
    lanes: Mutex<HashMap<u64, LaneSlot>>,
    transfer: Mutex<Raw<sys::CUstream>>,
    graphs: AtomicBool,
    poisoned: Mutex<Option<String>>,
    /// The GPU's architecture (e.g. 90), for compiling generated kernels.
    arch: u32,
    /// Fuse pointwise regions into generated kernels (`SALUS_CUDA_FUSION=0`: off).
    fusion: AtomicBool,
    /// f32 attention runs the register-tiled forward rather than cuBLAS
    /// (`set_tiled_attention`).
    tiled_attention: AtomicBool,
    /// The generated kernels loaded so far, by name.
    fused: Mutex<HashMap<String, Raw<sys::CUfunction>>>,
    /// cuDNN, or why the device runs its own convolution kernels.
    dnn: Result<cudnn::Dnn, String>,
    /// The stream priorities of background and other lanes, where the GPU has more than
    /// one: `(least, greatest)`.
    priorities: Option<(i32, i32)>,
    /// Its place on the PCI bus, for NVML.
    pci_bus_id: String,
    /// The SM partitions background iterations run in, made on first use.
    partitions: pieces::Partitions,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("capacity", &self.capacity)
            .finish()
    }
}

fn dev_err(what: &str, e: cudarc::driver::DriverError) -> ExecError {
    ExecError::Device(driver_error(what, e))
}

/// Runs `f`, turning a panic inside cudarc into an error: the probe must never panic.
pub(crate) fn no_panic<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err("the CUDA libraries failed while loading".into()))
}

impl CudaDevice {
    /// The cuDNN the device uses ("cuDNN 9.10.2 from <folder>"), or why it uses none.
    pub fn cudnn(&self) -> Result<&str, &str> {
        match &self.dnn {
            Ok(dnn) => Ok(&dnn.version),
            Err(why) => Err(why),
        }
    }

    /// The cuDNN calls `program`'s convolutions make, as lowered: `(node, workspace bytes
    /// given, scratch bytes planned)` each. For checking that E holds every workspace.
    pub fn cudnn_calls(&self, program: &Program) -> Result<Vec<(usize, u64, u64)>, ExecError> {
        self.bind()?;
        let at = Placement {
            persistent: 0,
            lane: 0,
        };
        let entry = self.lower(program, at, 0, 1)?;
        Ok(entry
            .commands
            .iter()
            .filter_map(|c| match c {
                Command::Dnn(call) => {
                    let scratch = program.plan().scratch(call.node).map_or(0, |s| s.1);
                    Some((call.node, call.choice.workspace, scratch))
                }
                _ => None,
            })
            .collect())
    }

    /// How background iterations are held to their share of the GPU: "SM partitions ..."
    /// (green contexts) or "paced (why)"; a partition that fails to be made turns it to
    /// pacing from then on.
    pub fn background_mode(&self) -> String {
        self.partitions.describe()
    }

    /// Turns CUDA-graph capture and replay on or off (for measuring the difference).
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, Ordering::Relaxed);
    }

    /// Turns the fusion of pointwise regions on or off for programs lowered from now on
    /// (for comparison; `SALUS_CUDA_FUSION=0` starts with it off).
    pub fn set_fusion(&self, on: bool) {
        self.fusion.store(on, Ordering::Relaxed);
    }

    /// Runs f32 attention's forward in register tiles (head dims up to 64) rather than
    /// through cuBLAS, for programs lowered from now on (for comparison;
    /// `SALUS_CUDA_ATTENTION=tiled` starts with it on).
    pub fn set_tiled_attention(&self, on: bool) {
        self.tiled_attention.store(on, Ordering::Relaxed);
    }

    /// Bytes the GPU has in use now, by everyone (total minus free).
    pub fn memory_in_use(&self) -> Result<u64, ExecError> {
        self.bind()?;
        let (free, total) = driver::mem_info().map_err(|e| dev_err("cuMemGetInfo", e))?;
        Ok((total - free) as u64)
    }

    fn bind(&self) -> Result<(), ExecError> {
        if let Some(reason) = self.poisoned.lock().ok().and_then(|p| p.clone()) {
            return Err(ExecError::Device(format!(
                "the CUDA context is unusable after an earlier error: {reason}"
            )));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| dev_err("binding the context", e))
    }

    /// Records a sticky error: every later call fails with it.
    fn check(&self, what: &str, e: cudarc::driver::DriverError) -> ExecError {
        let message = driver_error(what, e);
        if driver::is_sticky(&e)
            && let Ok(mut p) = self.poisoned.lock()
        {
            p.get_or_insert(message.clone());
        }
        ExecError::Device(message)
    }

    fn range(&self, offset: u64, len: u64) -> Result<u64, ExecError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity => Ok(self.base + offset),
            _ => Err(ExecError::Device(format!(
                "bytes {offset}..{} are outside the {}-byte arena",
                offset.saturating_add(len),
                self.capacity
            ))),
        }
    }

    /// The lane at `offset`, made on first use. A background lane's stream has the least
    /// priority and the others' the greatest, so that the GPU's block scheduler gives
    /// SMs that free up to the others' kernels first. The core never mixes classes in a
    /// lane; a lane at an offset where one of the other class was is a new lane.
    fn lane(&self, offset: u64, background: bool) -> Result<Arc<Mutex<Lane>>, ExecError> {
        let mut lanes = self
            .lanes
            .lock()
            .map_err(|_| ExecError::Device("lane table lock poisoned".into()))?;
        if let Some((b, l)) = lanes.get(&offset)
            && *b == background
        {
            return Ok(l.clone());
        }
        let stream = match self.priorities {
            Some((least, greatest)) => {
                driver::new_stream_at(if background { least } else { greatest })
            }
            None => driver::new_stream(),
        }
        .map_err(|e| self.check("creating a stream", e))?;
        let workspace = driver::malloc(WORKSPACE)
            .map_err(|e| self.check("allocating a cuBLAS workspace", e))?;
        let err =
            driver::malloc(ERROR_BLOCK).map_err(|e| self.check("allocating an error block", e))?;
        let blas = driver::new_blas(stream, workspace, WORKSPACE).map_err(ExecError::Device)?;
        let dnn = match &self.dnn {
            Ok(_) => Some(driver::cudnn::new_handle(Some(stream)).map_err(ExecError::Device)?),
            Err(_) => None,
        };
        let start = driver::new_event().map_err(|e| self.check("creating an event", e))?;
        let end = driver::new_event().map_err(|e| self.check("creating an event", e))?;
        let lane = Arc::new(Mutex::new(Lane {
            stream,
            blas,
            dnn,
            workspace,
            err,
            start,
            end,
            entries: HashMap::new(),
            tick: 0,
            partitioned: pieces::PartitionStreams::default(),
            marks: None,
        }));
        lanes.insert(offset, (background, lane.clone()));
        Ok(lane)
    }

    /// Lowers `program` at `at` for a lane whose error block is `err`, with its pointwise
    /// regions fused when fusion is on (and unfused should their kernels fail to build),
    /// in as many pieces as `pieces` at most.
    fn lower(
        &self,
        program: &Program,
        at: Placement,
        err: u64,
        pieces: usize,
    ) -> Result<Entry, ExecError> {
        let mut entry = self.lower_fused(program, at, err)?;
        entry.pieces = pieces::pieces(&entry.spans, entry.commands.len(), pieces);
        Ok(entry)
    }

    fn lower_fused(&self, program: &Program, at: Placement, err: u64) -> Result<Entry, ExecError> {
        if self.fusion.load(Ordering::Relaxed) {
            let fusion = lower::fusion::plan(program);
            if !fusion.regions.is_empty() {
                match self.lower_with(program, at, err, &fusion) {
                    Err(ExecError::Device(message)) if message.starts_with("fused kernels") => {
                        tracing_note(&message)
                    }
                    other => return other,
                }
            }
        }
        self.lower_with(program, at, err, &lower::fusion::FusionPlan::none())
    }

    /// Loads the generated kernels the commands launch (compiling those not loaded yet, in
    /// one NVRTC program) and fills in their function handles.
    fn link(&self, commands: &mut [Command], kernels: &[(String, String)]) -> Result<(), String> {
        let mut loaded = self
            .fused
            .lock()
            .map_err(|_| "fused kernels: lock poisoned".to_string())?;
        let missing: Vec<&(String, String)> = kernels
            .iter()
            .filter(|(name, _)| !loaded.contains_key(name))
            .collect();
        if !missing.is_empty() {
            let source = abi::fused_kernel_source(missing.iter().map(|(_, text)| text.as_str()));
            let image =
                cached_image(&source, self.arch).map_err(|e| format!("fused kernels: {e}"))?;
            let module = driver::load_module(&image)
                .map_err(|e| format!("fused kernels: {}", driver_error("loading", e)))?;
            for (name, _) in missing {
                let f = driver::function(module, name)
                    .map_err(|e| format!("fused kernels: {}", driver_error(name, e)))?;
                loaded.insert(name.clone(), f);
            }
        }
        for command in commands {
            match command {
                Command::Fused(f) => f.function = loaded.get(&f.name).copied(),
                Command::FusedBatch(f) => f.function = loaded.get(&f.name).copied(),
                _ => {}
            }
        }
        Ok(())
    }

    fn lower_with(
        &self,
        program: &Program,
        at: Placement,
        err: u64,
        fusion: &lower::fusion::FusionPlan,
    ) -> Result<Entry, ExecError> {
        let plan = program.plan();
        let persistent = self.range(at.persistent, plan.persistent_bytes)?;
        let lane = self.range(at.lane, plan.ephemeral_bytes)?;
        let dnn = self.dnn.as_ref().ok();
        let lower::CommandList {
            mut commands,
            spans,
            kernels,
            updates,
        } = lower::lower_program(
            program,
            (persistent, lane, err),
            dnn,
            fusion,
            self.tiled_attention.load(Ordering::Relaxed),
        )?;
        if !kernels.is_empty() {
            self.link(&mut commands, &kernels)
                .map_err(ExecError::Device)?;
        }
        Ok(Entry {
            commands,
            spans,
            pieces: Vec::new(),
            updates,
            runs: 0,
            graphs: HashMap::new(),
            capture_failed: false,
            last_used: 0,
        })
    }

    /// Issues `commands` on `stream`: the lane's own, or one of its SM partitions' (the
    /// lane's cuBLAS and cuDNN handles follow it there and back).
    fn issue(
        &self,
        lane: &Lane,
        stream: Raw<sys::CUstream>,
        commands: &[Command],
    ) -> Result<(), ExecError> {
        self.with_handles_on(lane, stream, || self.issue_on(lane, stream, commands))?
    }

    /// Runs `f` with the lane's cuBLAS and cuDNN handles ordered on `stream` (pointed
    /// there before and back at the lane's own stream after, when it is another).
    fn with_handles_on<T>(
        &self,
        lane: &Lane,
        stream: Raw<sys::CUstream>,
        f: impl FnOnce() -> T,
    ) -> Result<T, ExecError> {
        let moved = stream.0 != lane.stream.0;
        if moved {
            self.point_handles(lane, stream)?;
        }
        let out = f();
        if moved {
            self.point_handles(lane, lane.stream)?;
        }
        Ok(out)
    }

    fn point_handles(&self, lane: &Lane, stream: Raw<sys::CUstream>) -> Result<(), ExecError> {
        driver::set_blas_stream(lane.blas, stream, lane.workspace, WORKSPACE)
            .map_err(ExecError::Device)?;
        if let Some(h) = lane.dnn {
            driver::cudnn::set_stream(h, stream).map_err(ExecError::Device)?;
        }
        Ok(())
    }

    fn issue_on(
        &self,
        lane: &Lane,
        stream: Raw<sys::CUstream>,
        commands: &[Command],
    ) -> Result<(), ExecError> {
        for command in commands {
            match command {
                Command::Launch(l) => driver::launch(
                    self.functions[l.kernel as usize],
                    l.grid,
                    l.block,
                    &*l.args,
                    stream,
                )
                .map_err(|e| self.check(l.kernel.name(), e))?,
                Command::Zero { ptr, bytes } => driver::zero(*ptr, *bytes as usize, stream)
                    .map_err(|e| self.check("cuMemsetD8Async", e))?,
                Command::Gemm(g) => driver::gemm(lane.blas, g).map_err(ExecError::Device)?,
                Command::Fused(f) => {
                    self.launch_generated(&f.name, f.function, (f.grid, f.block), &*f.args, stream)?
                }
                Command::FusedBatch(f) => {
                    self.launch_generated(&f.name, f.function, (f.grid, f.block), &*f.args, stream)?
                }
                Command::Dnn(call) => {
                    let h = lane.dnn.ok_or_else(|| {
                        ExecError::Device("internal: a cuDNN call on a lane without cuDNN".into())
                    })?;
                    driver::cudnn::convolve(h, call)
                        .map_err(|e| ExecError::Device(format!("node {}: {e}", call.node)))?
                }
            }
        }
        Ok(())
    }

    /// Launches generated kernel `name` (loaded as `function` by `link`), `grid` blocks of
    /// `block` threads.
    fn launch_generated(
        &self,
        name: &str,
        function: Option<Raw<sys::CUfunction>>,
        (grid, block): (u32, u32),
        args: &dyn abi::LaunchArgs,
        stream: Raw<sys::CUstream>,
    ) -> Result<(), ExecError> {
        let function =
            function.ok_or_else(|| ExecError::Device(format!("internal: {name} is not loaded")))?;
        driver::launch(function, (grid, 1), block, args, stream).map_err(|e| self.check(name, e))
    }

    /// Clears the lane's error block and copies the feeds into the lane, on its stream.
    fn start_iteration(
        &self,
        program: &Program,
        lane: &Lane,
        lane_base: u64,
        feeds: &[&[u8]],
    ) -> Result<(), ExecError> {
        driver::zero(lane.err, ERROR_BLOCK, lane.stream)
            .map_err(|e| self.check("cuMemsetD8Async", e))?;
        for (&id, bytes) in program.feeds().iter().zip(feeds) {
            if let Some(Location::Lane(off)) = program.location(id) {
                driver::htod(lane_base + off, bytes, lane.stream)
                    .map_err(|e| self.check("copying a feed", e))?;
            }
        }
        Ok(())
    }

    /// Runs the nodes of one iteration of `program` at `at` eagerly (never a captured
    /// graph), with a CUDA event on the lane's stream just before each node's first
    /// command and just after its last, and returns each node's device time.
    ///
    /// The updates are not written, so the session's persistent tensors are unchanged
    /// and no fetch is read. To keep host launch latency out of the times, the stream
    /// is held by a gate while each batch of up to 128 commands is issued, then let go
    /// and synchronised: a node's time is its kernels running back to back. Normal
    /// iterations ([`Device::run`]) are untouched by this: they keep their own lowered
    /// and captured commands, and a profile neither adds to nor evicts them.
    pub fn profile_iteration(
        &self,
        program: &Program,
        at: Placement,
        feeds: &[&[u8]],
    ) -> Result<Profile, ExecError> {
        program.check_feeds(feeds)?;
        self.bind()?;
        let lane = self.lane(at.lane, false)?;
        let lane = lane
            .lock()
            .map_err(|_| ExecError::Device("lane lock poisoned".into()))?;
        let entry = self.lower(program, at, lane.err, 1)?;
        let lane_base = self.range(at.lane, program.plan().ephemeral_bytes)?;
        let stream = lane.stream;
        self.start_iteration(program, &lane, lane_base, feeds)?;
        driver::sync(stream).map_err(|e| self.check("copying the feeds", e))?;
        let timed: Vec<usize> = (0..entry.spans.len())
            .filter(|&i| !entry.spans[i].is_empty())
            .collect();
        let events =
            driver::Events::new(2 * timed.len()).map_err(|e| self.check("cuEventCreate", e))?;
        let mut gate_timed_out = false;
        for batch in profile_batches(&entry.spans, &timed) {
            // After one timeout the rest runs ungated: a second wait would only repeat it.
            let gate = if gate_timed_out {
                None
            } else {
                Some(driver::Gate::hold(stream).map_err(|e| self.check("cuLaunchHostFunc", e))?)
            };
            let issued = batch.clone().try_for_each(|j| {
                driver::record(events.get(2 * j), stream)
                    .map_err(|e| self.check("cuEventRecord", e))?;
                self.issue(
                    &lane,
                    stream,
                    &entry.commands[entry.spans[timed[j]].clone()],
                )?;
                driver::record(events.get(2 * j + 1), stream)
                    .map_err(|e| self.check("cuEventRecord", e))
            });
            if let Some(gate) = &gate {
                gate.open();
            }
            let synced =
                driver::sync(stream).map_err(|e| self.check("running the profiled nodes", e));
            gate_timed_out |= gate.as_ref().is_some_and(driver::Gate::timed_out);
            issued?;
            synced?;
        }
        let mut err = [0u8; 40];
        driver::dtoh(&mut err, lane.err, stream)
            .map_err(|e| self.check("reading the error block", e))?;
        driver::sync(stream).map_err(|e| self.check("reading the error block", e))?;
        if let Some(e) = reported_error(program, &err) {
            return Err(e);
        }
        let mut ms = vec![0.0; entry.spans.len()];
        for (j, &i) in timed.iter().enumerate() {
            let t = driver::elapsed_ms(events.get(2 * j), events.get(2 * j + 1))
                .map_err(|e| self.check("cuEventElapsedTime", e))?;
            ms[i] = f64::from(t.max(0.0));
        }
        let nodes = program
            .graph()
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| NodeTime {
                index: i,
                name: node.name.clone(),
                op: node.op.name().to_string(),
                family: profile::node_family(node.op.name(), &node.source),
                launches: entry.spans[i].len() as u32,
                ms: ms[i],
            })
            .collect();
        Ok(Profile {
            nodes,
            update_launches: entry.updates.len() as u32,
            gate_timed_out,
        })
    }

    fn iterate(
        &self,
        program: &Program,
        at: Placement,
        feeds: &[&[u8]],
        control: Option<&RunControl>,
    ) -> Result<Outcome, ExecError> {
        program.check_feeds(feeds)?;
        self.bind()?;
        let background = control.is_some_and(RunControl::is_background);
        let lane = self.lane(at.lane, background)?;
        let mut lane = lane
            .lock()
            .map_err(|_| ExecError::Device("lane lock poisoned".into()))?;
        let key = (program.id(), at.persistent);
        lane.tick += 1;
        let tick = lane.tick;
        if !lane.entries.contains_key(&key) {
            let pieces = if background { pieces::MAX_PIECES } else { 1 };
            let entry = self.lower(program, at, lane.err, pieces)?;
            if lane.entries.len() >= ENTRIES_PER_LANE
                && let Some(old) = lane
                    .entries
                    .iter()
                    .min_by_key(|(_, e)| e.last_used)
                    .map(|(k, _)| *k)
                && let Some(mut e) = lane.entries.remove(&old)
            {
                e.destroy_graphs();
            }
            lane.entries.insert(key, entry);
        }
        let plan = program.plan();
        let lane_base = self.range(at.lane, plan.ephemeral_bytes)?;
        let persistent_base = self.range(at.persistent, plan.persistent_bytes)?;
        let stream = lane.stream;
        self.start_iteration(program, &lane, lane_base, feeds)?;
        driver::record(lane.start, stream).map_err(|e| self.check("cuEventRecord", e))?;
        match control.filter(|_| background) {
            Some(control) => self.run_pieces(&mut lane, key, control)?,
            None => self.piece(&mut lane, key, 0, stream, 0)?,
        }
        let graph = program.graph();
        let mut fetches: Vec<Vec<u8>> = graph
            .fetches
            .iter()
            .map(|&f| vec![0u8; program.bytes(f) as usize])
            .collect();
        for (&f, out) in graph.fetches.iter().zip(fetches.iter_mut()) {
            let src = match program.location(f) {
                Some(Location::Lane(off)) => lane_base + off,
                Some(Location::Persistent(off)) => persistent_base + off,
                None => continue,
            };
            driver::dtoh(out, src, stream).map_err(|e| self.check("copying a fetch", e))?;
        }
        let updates = lane
            .entries
            .get(&key)
            .map(|e| e.updates.clone())
            .unwrap_or_default();
        self.issue(&lane, stream, &updates)?;
        driver::record(lane.end, stream).map_err(|e| self.check("cuEventRecord", e))?;
        let mut err = [0u8; 40];
        driver::dtoh(&mut err, lane.err, stream)
            .map_err(|e| self.check("reading the error block", e))?;
        driver::sync(stream).map_err(|e| self.check("running the iteration", e))?;
        if let Some(entry) = lane.entries.get_mut(&key) {
            entry.runs += 1;
            entry.last_used = tick;
        }
        if let Some(e) = reported_error(program, &err) {
            return Err(e);
        }
        let ms = driver::elapsed_ms(lane.start, lane.end)
            .map_err(|e| self.check("cuEventElapsedTime", e))?;
        Ok(Outcome {
            fetches,
            duration: Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3),
        })
    }
}

/// The error a kernel reported in a lane's error block (its first 40 bytes), if any.
pub(crate) fn reported_error(program: &Program, err: &[u8; 40]) -> Option<ExecError> {
    let word = |k: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&err[k * 8..k * 8 + 8]);
        u64::from_le_bytes(w)
    };
    if word(0) == 0 {
        return None;
    }
    let index = word(1) as usize;
    let node = program.graph().nodes.get(index);
    Some(ExecError::Node {
        index,
        name: node.map(|n| n.name.clone()).unwrap_or_default(),
        op: node.map(|n| n.op.name().to_string()).unwrap_or_default(),
        message: match program.node_params().get(index) {
            Some(salus_graph::OpParams::Assert { message })
                if word(2) == abi::IndexErrorKind::Assert.code() as u64 =>
            {
                message.clone()
            }
            _ => abi::index_error(word(2), word(3) as i64, word(4) as i64),
        },
    })
}

/// Splits the nodes that issue commands (`timed`, node indices) into batches of at most
/// [`PROFILE_BATCH`] commands each (a larger node alone), as ranges of `timed`.
fn profile_batches(
    spans: &[std::ops::Range<usize>],
    timed: &[usize],
) -> Vec<std::ops::Range<usize>> {
    let mut batches = Vec::new();
    let mut start = 0;
    while start < timed.len() {
        let mut end = start;
        let mut count = 0;
        while end < timed.len() {
            let len = spans[timed[end]].len();
            if end > start && count + len > PROFILE_BATCH {
                break;
            }
            count += len;
            end += 1;
        }
        batches.push(start..end);
        start = end;
    }
    batches
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        if let Ok(mut lanes) = self.lanes.lock() {
            lanes.clear();
        }
        self.partitions.clear();
        if let Ok(t) = self.transfer.lock() {
            driver::destroy_stream(*t);
        }
        driver::free(self.base);
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), ExecError> {
        self.bind()?;
        let dst = self.range(offset, bytes.len() as u64)?;
        let stream = *self
            .transfer
            .lock()
            .map_err(|_| ExecError::Device("transfer lock poisoned".into()))?;
        driver::htod(dst, bytes, stream).map_err(|e| self.check("cuMemcpyHtoDAsync", e))?;
        driver::sync(stream).map_err(|e| self.check("writing", e))
    }

    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ExecError> {
        self.bind()?;
        let src = self.range(offset, len)?;
        let stream = *self
            .transfer
            .lock()
            .map_err(|_| ExecError::Device("transfer lock poisoned".into()))?;
        let mut out = vec![0u8; len as usize];
        driver::dtoh(&mut out, src, stream).map_err(|e| self.check("cuMemcpyDtoHAsync", e))?;
        driver::sync(stream).map_err(|e| self.check("reading", e))?;
        Ok(out)
    }

    fn run(&self, program: &Program, at: Placement, feeds: &[&[u8]]) -> Result<Outcome, ExecError> {
        self.iterate(program, at, feeds, None)
    }

    /// A background iteration runs on a stream of the least priority (where the GPU has
    /// stream priorities), in pieces: between two it is held while its share is 0, stops
    /// once abandoned, and runs in an SM partition of its share (or, without green
    /// contexts, paced to it); see `pieces`. An abandoned iteration stops before it
    /// starts. Other iterations run whole, on the whole GPU.
    fn run_with(
        &self,
        program: &Program,
        at: Placement,
        feeds: &[&[u8]],
        control: &RunControl,
    ) -> Result<Outcome, ExecError> {
        if control.abandoned() {
            return Err(ExecError::Abandoned);
        }
        self.iterate(program, at, feeds, Some(control))
    }

    fn has_background_priority(&self) -> bool {
        self.priorities.is_some()
    }

    fn load_monitor(&self) -> Result<Box<dyn LoadMonitor>, String> {
        monitor::Monitor::open(&self.pci_bus_id).map(|m| Box::new(m) as Box<dyn LoadMonitor>)
    }

    fn health(&self) -> Result<(), String> {
        match self.poisoned.lock().ok().and_then(|p| p.clone()) {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }

    fn scratch_sizer(&self) -> Option<&dyn ScratchSizer> {
        Some(self)
    }
}

/// A node that runs on cuDNN works in the largest workspace of its calls; a reduction that
/// splits its elements over many blocks in its partial results
/// ([`lower::reduce::reduce_scratch_bytes`]); batch norm in its per-channel sums
/// ([`lower::batch_norm::batch_norm_scratch_bytes`]); fused attention's backward in one f32
/// per query ([`lower::attention::attention_scratch_bytes`]); layer norm's backward in its
/// column sums' partials ([`lower::reduce::layer_norm_backward_scratch_bytes`]); every other node in what the backend's own kernels
/// need.
impl ScratchSizer for CudaDevice {
    fn scratch_bytes(&self, graph: &Graph, node: usize, params: &OpParams) -> u64 {
        if let Ok(dnn) = &self.dnn
            && self.ctx.bind_to_thread().is_ok()
            && let Some(plan) = dnn.plan_node(graph, node, params)
        {
            return plan.workspace();
        }
        kernel_scratch_bytes(graph, node, params)
    }

    fn extra_reads(&self, graph: &Graph, params: &[OpParams]) -> Vec<(usize, usize)> {
        lower::folds::extra_reads(graph, params)
    }
}

/// The scratch of a node this backend's own kernels run (no cuDNN): a reduction's partial
/// results, batch norm's sums, attention's per-query f32; what the portable planner gives
/// every other node, less the widening of 16-bit convolutions the direct kernels need not.
pub(crate) fn kernel_scratch_bytes(graph: &Graph, node: usize, params: &OpParams) -> u64 {
    let sizers: [fn(&Graph, usize, &OpParams) -> u64; 4] = [
        lower::reduce::reduce_scratch_bytes,
        lower::batch_norm::batch_norm_scratch_bytes,
        lower::attention::attention_scratch_bytes,
        lower::reduce::layer_norm_backward_scratch_bytes,
    ];
    if let Some(bytes) = sizers
        .iter()
        .map(|size| size(graph, node, params))
        .find(|&b| b > 0)
    {
        return bytes;
    }
    if widened_conv(graph, node, params) {
        return 0; // this device's direct kernels run it (`lower::conv`), with no scratch
    }
    PortableScratch.scratch_bytes(graph, node, params)
}

/// A 16-bit convolution the portable planner gives scratch to widen it to f32 (for the
/// CPU's f32 kernel; `salus_graph::plan::widened_conv_bytes`).
fn widened_conv(graph: &Graph, node: usize, params: &OpParams) -> bool {
    let node = &graph.nodes[node];
    let Some(conv) = params.conv() else {
        return false;
    };
    let ty = |id: &Option<usize>| id.map(|id| &graph.tensors[id].ty);
    let inputs: Vec<_> = node.inputs.iter().map(ty).collect();
    let outputs: Vec<_> = node.outputs.iter().map(ty).collect();
    salus_graph::plan::widened_conv_bytes(node.op, conv, &inputs, &outputs).is_some()
}

#[cfg(test)]
mod tests;
