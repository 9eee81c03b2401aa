//! The CPU backend of salus: the [`CpuDevice`], the arena in host memory and kernels on
//! the host's cores. The embedded default device, and the reference the other backends
//! are checked against.
//!
//! Owns the CPU kernels of every op of the IR (`kernels`: plain loops over `f64` for every
//! dtype, typed f32 fast paths in `kernels::fast`) and the f32 matrix products (`blas`).
//! Must not touch: the device contract, programs, placements or the arena's rules (those
//! are `salus-exec`'s; this crate only uses them), other backends, sessions and policies.
//! `unsafe` is allowed in `kernels::fast::simd` (calling a function compiled for a CPU
//! feature detected at run time), `blas` and `idle` (the system call that moves a thread
//! into the OS's idle scheduling class) only.
//!
//! An iteration borrows its session's persistent block and its lane from the arena, copies
//! the feeds into the lane, runs every node with its inputs and outputs carved out of those
//! two regions at the plan's offsets (no allocation per tensor), copies the fetches out, and
//! only then writes the updates into the persistent block: an iteration that fails leaves
//! the session's state as it was.
//!
//! Running a node allocates nothing: its operands' ranges come from the program's layouts,
//! its argument lists reuse vectors the device keeps between iterations, its parameters
//! are the ones validation read once ([`Program::params`]), and kernels work in the lane
//! scratch the plan reserved for them.

mod blas;
mod idle;
mod kernels;

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use salus_exec::layout::{InputAt, Piece};
use salus_exec::{Arena, Device, ExecError, Location, Outcome, Placement, Program, RunControl};
use salus_graph::Node;

use crate::kernels::{Arg, Out};

/// The CPU device.
pub struct CpuDevice {
    arena: Arena,
    /// Argument lists kept between iterations (one set per concurrent iteration), so that
    /// running a node allocates nothing.
    spare: Mutex<Vec<ArgLists>>,
    /// Thread pools other than the kernels' own, made when first needed: an iteration
    /// given a share of the device, or running in the background, runs on one of them,
    /// which no other iteration uses meanwhile (two lanes with a share each never queue
    /// behind one another on one pool's threads).
    shares: Mutex<Vec<SharePool>>,
    /// Threads can enter the OS's idle class: background iterations run on pools of
    /// such threads ([`Device::has_background_priority`]).
    idle_class: bool,
}

impl CpuDevice {
    /// A CPU device managing `capacity` bytes of host memory.
    pub fn new(capacity: u64) -> Result<CpuDevice, ExecError> {
        Ok(CpuDevice {
            arena: Arena::new(capacity)?,
            spare: Mutex::new(Vec::new()),
            shares: Mutex::new(Vec::new()),
            idle_class: idle::available(),
        })
    }

    /// A pool of `threads` threads (in the OS's idle class for a `background` one) that
    /// no iteration is using, made when none is free; given back when the returned guard
    /// drops.
    fn pool(&self, threads: usize, background: bool) -> Option<PoolGuard<'_>> {
        let mut shares = self.shares.lock().ok()?;
        let free = |p: &SharePool| p.threads == threads && p.background == background && !p.busy;
        let index = match shares.iter().position(free) {
            Some(index) => index,
            None => {
                let tag = if background { "idle" } else { "share" };
                let ids = Arc::new(Mutex::new(Vec::with_capacity(threads)));
                let started = ids.clone();
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("salus-cpu-{tag}{threads}-{i}"))
                    .start_handler(move |_| {
                        if !background {
                            return;
                        }
                        if let Err(e) = idle::lower_this_thread() {
                            // Checked when the device was made: not expected.
                            eprintln!("salus-cpu: a background thread stays in its class: {e}");
                        }
                        if let Ok(mut ids) = started.lock() {
                            ids.push(idle::this_thread());
                        }
                    })
                    .build()
                    .ok()?;
                shares.push(SharePool {
                    threads,
                    background,
                    pool: Arc::new(pool),
                    ids,
                    busy: false,
                });
                shares.len() - 1
            }
        };
        shares[index].busy = true;
        Some(PoolGuard {
            device: self,
            index,
            pool: shares[index].pool.clone(),
            ids: shares[index].ids.clone(),
        })
    }

    /// Runs one iteration like [`Device::run`], recording how long each node took into
    /// `times` (one entry per node of the graph): for profiling.
    pub fn run_timed(
        &self,
        program: &Program,
        at: Placement,
        feeds: &[&[u8]],
        times: &mut Vec<Duration>,
    ) -> Result<Outcome, ExecError> {
        times.clear();
        times.resize(program.graph().nodes.len(), Duration::ZERO);
        self.iterate(program, at, feeds, Some(times), None)
    }
}

fn range(offset: u64, len: u64) -> Range<usize> {
    offset as usize..(offset + len) as usize
}

/// Empties a vector and gives back its allocation for another element type of the same
/// size and alignment (the standard library collects a mapped `IntoIter` in place).
fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter()
        .map(|_| unreachable!("the vector is empty"))
        .collect()
}

/// The vectors a node's arguments are gathered in, empty between nodes.
#[derive(Default)]
struct ArgLists {
    reads: Vec<(Range<usize>, &'static [u8])>,
    writes: Vec<Option<&'static mut [u8]>>,
    args: Vec<Arg<'static>>,
    outs: Vec<Option<Out<'static>>>,
}

/// Runs one node: inputs from the persistent block or the lane, outputs and scratch in
/// the lane, at the ranges its layout gives.
fn run_node(
    program: &Program,
    index: usize,
    node: &Node,
    persistent: &[u8],
    lane: &mut [u8],
    lists: &mut ArgLists,
) -> Result<(), ExecError> {
    let graph = program.graph();
    let layout = &program.layouts()[index];
    let fail = |message: String| ExecError::Node {
        index,
        name: node.name.clone(),
        op: node.op.name().to_string(),
        message,
    };
    if let Some(error) = &layout.error {
        return Err(fail(error.clone()));
    }
    if layout.skip {
        return Ok(());
    }
    let mut reads: Vec<(Range<usize>, &[u8])> = recycle(std::mem::take(&mut lists.reads));
    let mut writes: Vec<Option<&mut [u8]>> = recycle(std::mem::take(&mut lists.writes));
    let mut args: Vec<Arg<'_>> = recycle(std::mem::take(&mut lists.args));
    let mut outs: Vec<Option<Out<'_>>> = recycle(std::mem::take(&mut lists.outs));
    writes.resize_with(node.outputs.len(), || None);
    let mut scratch: &mut [u8] = &mut [];
    let mut rest: &mut [u8] = lane;
    let mut at = 0;
    for (r, piece) in &layout.cuts {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
        let (chunk, tail) = tail.split_at_mut(r.end - r.start);
        rest = tail;
        at = r.end;
        match piece {
            Piece::Read => reads.push((r.clone(), chunk)),
            Piece::Write(j) => writes[*j] = Some(chunk),
            Piece::Scratch => scratch = chunk,
        }
    }
    for &j in &layout.empty_outputs {
        writes[j] = Some(&mut []);
    }
    let lookup = |r: &Range<usize>| -> &[u8] {
        reads
            .iter()
            .find(|(span, _)| span.start <= r.start && r.end <= span.end)
            .map(|(span, bytes)| &bytes[r.start - span.start..r.end - span.start])
            .unwrap_or(&[])
    };
    for (input, at) in node.inputs.iter().zip(&layout.inputs) {
        let ty = input.map(|id| &graph.tensors[id].ty);
        args.push(match (ty, at) {
            (None, _) | (_, InputAt::Absent) => Arg::Absent,
            (Some(ty), InputAt::InOutput) => Arg::InOutput(ty),
            (Some(ty), InputAt::Lane(r)) => Arg::Tensor(ty, lookup(r)),
            (Some(ty), InputAt::Persistent(r)) => Arg::Tensor(ty, &persistent[r.clone()]),
            (Some(ty), InputAt::Empty) => Arg::Tensor(ty, &[]),
        });
    }
    for (o, bytes) in node.outputs.iter().zip(writes.drain(..)) {
        outs.push(o.zip(bytes).map(|(id, bytes)| Out {
            ty: &graph.tensors[id].ty,
            bytes,
        }));
    }
    let params = program.params(index);
    let result = kernels::run(node, params, &args, &mut outs, scratch).map_err(fail);
    lists.outs = recycle(outs);
    lists.args = recycle(args);
    lists.writes = recycle(writes);
    lists.reads = recycle(reads);
    result
}

impl CpuDevice {
    fn iterate(
        &self,
        program: &Program,
        at: Placement,
        feeds: &[&[u8]],
        mut times: Option<&mut Vec<Duration>>,
        control: Option<&RunControl>,
    ) -> Result<Outcome, ExecError> {
        let start = Instant::now();
        let plan = program.plan();
        let graph = program.graph();
        program.check_feeds(feeds)?;
        let mut persistent = self.arena.borrow(at.persistent, plan.persistent_bytes)?;
        let mut lane = self.arena.borrow(at.lane, plan.ephemeral_bytes)?;
        for (&id, bytes) in program.feeds().iter().zip(feeds) {
            if let Some(Location::Lane(off)) = program.location(id) {
                lane[range(off, program.bytes(id))].copy_from_slice(bytes);
            }
        }
        let mut lists = self
            .spare
            .lock()
            .ok()
            .and_then(|mut spare| spare.pop())
            .unwrap_or_default();
        // Runs nodes from `next` on until the last, or until the control's share asks for
        // another number of threads than `threads` (false then).
        let all = rayon::current_num_threads();
        let background = self.idle_class && control.is_some_and(RunControl::is_background);
        let mut next = 0;
        let mut run_from = |next: &mut usize, threads: usize| {
            while let Some(node) = graph.nodes.get(*next) {
                if let Some(control) = control {
                    if control.abandoned() {
                        // Updates are written only after the last node: nothing is kept.
                        return Err(ExecError::Abandoned);
                    }
                    if share_threads(control.share(), all) != threads {
                        return Ok(false);
                    }
                }
                let node_start = times.is_some().then(Instant::now);
                let result = run_node(program, *next, node, &persistent, &mut lane, &mut lists);
                if let (Some(times), Some(t)) = (times.as_deref_mut(), node_start) {
                    times[*next] = t.elapsed();
                }
                result?;
                *next += 1;
            }
            Ok::<bool, ExecError>(true)
        };
        // The nodes run as one job on the kernels' thread pool, or on a smaller pool of
        // the control's share of its threads (taken for as long as that share lasts, so
        // that the other cores stay free for lanes on the full pool): the kernels'
        // parallel loops then split work from inside the pool, which hands nothing to
        // another thread's queue per op (and allocates nothing for it). A graph of small
        // tensors runs right here: it would not split, and the hop to the pool would cost
        // more than its ops. Held at share 0, the iteration waits between two nodes. A
        // background iteration always runs on a pool of idle-class threads (one thread for
        // a graph of small tensors), so that any other thread that wants a core takes it.
        let result = loop {
            let threads = match control {
                Some(control) => share_threads(control.wait_for_share(), all),
                None => all,
            };
            let size = if program.is_small() { 1 } else { threads };
            let ran = if threads == 0 || (program.is_small() && !background) {
                run_from(&mut next, threads)
            } else if let Some(taken) = (background || threads < all)
                .then(|| self.pool(size, background))
                .flatten()
            {
                taken.install(control, || run_from(&mut next, threads))
            } else {
                rayon::scope(|_| run_from(&mut next, threads))
            };
            match ran {
                Ok(false) => continue,
                Ok(true) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        if let Ok(mut spare) = self.spare.lock() {
            spare.push(lists);
        }
        result?;
        let read = |id: usize, persistent: &[u8], lane: &[u8]| -> Vec<u8> {
            match program.location(id) {
                Some(Location::Lane(off)) => lane[range(off, program.bytes(id))].to_vec(),
                Some(Location::Persistent(off)) => {
                    persistent[range(off, program.bytes(id))].to_vec()
                }
                None => Vec::new(),
            }
        };
        let fetches = graph
            .fetches
            .iter()
            .map(|&f| read(f, &persistent, &lane))
            .collect();
        for u in &graph.updates {
            // Validation guarantees targets are persistent and values are not.
            if let (Some(Location::Persistent(target)), Some(Location::Lane(value))) =
                (program.location(u.target), program.location(u.value))
            {
                persistent[range(target, program.bytes(u.target))]
                    .copy_from_slice(&lane[range(value, program.bytes(u.value))]);
            }
        }
        Ok(Outcome {
            fetches,
            duration: start.elapsed(),
        })
    }
}

/// A thread pool for iterations on a share of the device, or in the background.
struct SharePool {
    threads: usize,
    /// Its threads are in the OS's idle class.
    background: bool,
    pool: Arc<rayon::ThreadPool>,
    /// The OS's ids of its threads, for a background pool (filled as they start).
    ids: Arc<Mutex<Vec<idle::ThreadId>>>,
    /// An iteration runs on it.
    busy: bool,
}

/// A pool taken by one iteration; free again when dropped.
struct PoolGuard<'a> {
    device: &'a CpuDevice,
    index: usize,
    pool: Arc<rayon::ThreadPool>,
    ids: Arc<Mutex<Vec<idle::ThreadId>>>,
}

impl PoolGuard<'_> {
    /// Runs `job` on the pool. A background iteration abandoned meanwhile has the pool's
    /// threads lifted out of the idle class until the job ends: the kernel in progress
    /// then ends even on a host whose other work wants every core (an online iteration
    /// may be waiting for the memory it holds), not when that work is done.
    fn install<R: Send>(&self, control: Option<&RunControl>, job: impl FnOnce() -> R + Send) -> R {
        let Some(control) = control.filter(|c| c.is_background()) else {
            return self.pool.install(job);
        };
        // The threads the hook lifted, to put back when the job ends.
        let raised = Arc::new(Mutex::new(Vec::new()));
        let (ids, lifted) = (self.ids.clone(), raised.clone());
        control.on_abandon(Box::new(move || {
            let ids = ids.lock().map(|ids| ids.clone()).unwrap_or_default();
            match idle::raise(&ids) {
                Ok(()) => *lifted.lock().unwrap_or_else(|e| e.into_inner()) = ids,
                Err(e) => idle::warn_once(&e),
            }
        }));
        let out = self.pool.install(job);
        // Once cleared, a hook that ran has finished: `raised` holds all it lifted.
        control.clear_on_abandon();
        let raised = std::mem::take(&mut *raised.lock().unwrap_or_else(|e| e.into_inner()));
        if let Err(e) = idle::lower(&raised) {
            eprintln!("salus-cpu: a background thread stays out of the idle class: {e}");
        }
        out
    }
}

impl Drop for PoolGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut shares) = self.device.shares.lock()
            && let Some(share) = shares.get_mut(self.index)
        {
            share.busy = false;
        }
    }
}

impl Device for CpuDevice {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn capacity(&self) -> u64 {
        self.arena.len()
    }

    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), ExecError> {
        let mut region = self.arena.borrow(offset, bytes.len() as u64)?;
        region.copy_from_slice(bytes);
        Ok(())
    }

    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ExecError> {
        Ok(self.arena.borrow(offset, len)?.to_vec())
    }

    fn run(&self, program: &Program, at: Placement, feeds: &[&[u8]]) -> Result<Outcome, ExecError> {
        self.iterate(program, at, feeds, None, None)
    }

    /// True where threads can enter the OS's idle class (Linux's `SCHED_IDLE`, which
    /// needs no privilege): a background iteration then runs on idle-class threads, which
    /// get a core only when no other thread of the host wants it.
    fn has_background_priority(&self) -> bool {
        self.idle_class
    }

    /// Zero: cores that an online iteration leaves free are not free of it. They share
    /// the last-level cache and memory bandwidth with its cores, and on most servers and
    /// virtual machines are SMT siblings of them; an offline thread there slowed a
    /// served model's requests threefold at the 99th percentile (`docs/benchmarks.md`).
    /// An offline iteration waits between two nodes while online work runs, and fills the
    /// cores between requests.
    fn offline_compute_share(&self) -> Option<f64> {
        Some(0.0)
    }

    /// Runs on the control's share of the kernels' threads (at least one), following it
    /// as the driver changes it, from the next node on (held between two nodes at share
    /// 0): the kernels split their work over the threads of the pool they run in, so the
    /// other cores stay free for the lanes running on the full pool; a background
    /// iteration runs on threads of the OS's idle class. The results are the same bit for
    /// bit: every kernel gives the same answer on any number of threads. Abandoned, it
    /// stops before its next node.
    fn run_with(
        &self,
        program: &Program,
        at: Placement,
        feeds: &[&[u8]],
        control: &RunControl,
    ) -> Result<Outcome, ExecError> {
        self.iterate(program, at, feeds, None, Some(control))
    }
}

/// The kernel threads a share of `all` stands for: at least one where the share is above
/// 0, none where it holds the iteration.
fn share_threads(share: f64, all: usize) -> usize {
    if share > 0.0 {
        ((share * all as f64).round() as usize).clamp(1, all)
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycling_keeps_the_allocation() {
        let data = [1u8, 2, 3];
        let mut v: Vec<(Range<usize>, &[u8])> = Vec::with_capacity(5);
        v.push((0..3, &data[..]));
        let ptr = v.as_ptr() as usize;
        let w: Vec<(Range<usize>, &'static [u8])> = recycle(v);
        assert_eq!((w.capacity(), w.as_ptr() as usize), (5, ptr));
        let mut args: Vec<Option<&mut [u8]>> = recycle(w);
        let cap = args.capacity();
        args.resize_with(3, || None);
        let back: Vec<Option<&'static mut [u8]>> = recycle(args);
        assert!(back.capacity() >= cap);
    }
}
