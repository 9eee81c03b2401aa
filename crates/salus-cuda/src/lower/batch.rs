//! Batched fused launches: a run of adjacent launches of one generated kernel, each over
//! flat operands, becomes one launch of the kernel's batched form (`FusedBatchArgs`, up to
//! [`FUSED_BATCH`] launches side by side in one grid). A traced optimizer updates its
//! parameters one after another by the same kernel (one fused region per parameter), so
//! its few hundred small launches become a few: PyTorch's multi-tensor (`foreach`) kernels
//! by another road.
//!
//! Launches batch only when running them side by side equals running them in order: no
//! launch of a run writes bytes an earlier one reads or writes, or reads bytes an earlier
//! one writes (a launch may still write its own inputs' bytes in place, as alone), and all
//! share one set of scalars.

use std::ops::Range;
use std::sync::Arc;

use super::fusion::FusedLaunch;
use super::{Command, grid_for};
use crate::abi::{
    DeviceDType, FUSED_BATCH, FusedBatchArgs, FusedSegment, IndexMode, MAX_FUSED_OPERANDS,
};
use crate::driver::Raw;

/// A batched fused kernel's launch (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct FusedBatchLaunch {
    pub name: String,
    pub grid: u32,
    pub block: u32,
    pub args: Arc<FusedBatchArgs>,
    pub function: Option<Raw<cudarc::driver::sys::CUfunction>>,
}

fn dt_bytes(code: i64) -> u64 {
    match code {
        c if c == DeviceDType::I64.code() => 8,
        c if c == DeviceDType::F32.code() || c == DeviceDType::I32.code() => 4,
        c if c == DeviceDType::F16.code() || c == DeviceDType::Bf16.code() => 2,
        _ => 1,
    }
}

/// Byte ranges of device memory.
type Bytes = Vec<Range<u64>>;

/// The bytes a launch reads and writes, if it indexes every operand flat.
fn footprint(f: &FusedLaunch) -> Option<(Bytes, Bytes)> {
    let a = &f.args;
    if a.mode != IndexMode::Flat.code() || a.n <= 0 {
        return None;
    }
    let (mut reads, mut writes) = (Vec::new(), Vec::new());
    for (k, op) in a.ops.iter().take(a.nops as usize).enumerate() {
        let count = if op.q != 0 { a.n as u64 } else { 1 };
        let bytes = op.ptr..op.ptr + count * dt_bytes(op.dt);
        if k < f.inputs {
            reads.push(bytes);
        } else {
            writes.push(bytes);
        }
    }
    Some((reads, writes))
}

fn overlaps(a: &[Range<u64>], b: &[Range<u64>]) -> bool {
    a.iter()
        .any(|x| b.iter().any(|y| x.start < y.end && y.start < x.end))
}

/// The batched launch of `run` (two or more launches of one kernel, flat, one set of
/// scalars), as kernel `name` (the kernel's batched form).
fn batched(run: &[&FusedLaunch], name: String) -> FusedBatchLaunch {
    let first = run[0];
    let mut args = FusedBatchArgs {
        count: run.len() as i64,
        s: first.args.s,
        ..FusedBatchArgs::default()
    };
    let mut block = 0i64;
    for (seg, f) in args.seg.iter_mut().zip(run) {
        let a = &f.args;
        let mut ptr = [0u64; MAX_FUSED_OPERANDS];
        let mut full = 0i64;
        for (k, op) in a.ops.iter().take(a.nops as usize).enumerate() {
            ptr[k] = op.ptr;
            if op.q != 0 {
                full |= 1 << k;
            }
        }
        *seg = FusedSegment {
            n: a.n,
            full,
            first: block,
            ptr,
        };
        block += i64::from(grid_for(a.n as u64));
    }
    args.blocks = block;
    FusedBatchLaunch {
        name,
        grid: block as u32,
        block: first.block,
        args: Arc::new(args),
        function: None,
    }
}

/// Batches the runs of `commands` that can be (see the module doc), renumbering `spans`
/// (each node's commands): a batch is its first launch's node's command; the other nodes
/// of the run keep none. Returns the commands and the batched kernels' sources.
pub(crate) fn batch_fused(
    commands: Vec<Command>,
    spans: &mut [Range<usize>],
) -> (Vec<Command>, Vec<(String, String)>) {
    let mut out = Vec::with_capacity(commands.len());
    let mut kernels: Vec<(String, String)> = Vec::new();
    // Where each position between old commands lands among the new ones.
    let mut moved = vec![0usize; commands.len() + 1];
    let mut i = 0;
    while i < commands.len() {
        moved[i] = out.len();
        let mut end = i + 1;
        if let Command::Fused(f) = &commands[i]
            && let Some((mut reads, mut writes)) = footprint(f)
        {
            while end < commands.len() && end - i < FUSED_BATCH {
                let Command::Fused(g) = &commands[end] else {
                    break;
                };
                if g.name != f.name || g.args.s != f.args.s {
                    break;
                }
                let Some((r, w)) = footprint(g) else {
                    break;
                };
                if overlaps(&w, &reads) || overlaps(&w, &writes) || overlaps(&r, &writes) {
                    break;
                }
                reads.extend(r);
                writes.extend(w);
                end += 1;
            }
        }
        if end - i >= 2 {
            let run: Vec<&FusedLaunch> = commands[i..end]
                .iter()
                .filter_map(|c| match c {
                    Command::Fused(f) => Some(f),
                    _ => None,
                })
                .collect();
            let (name, text) = run[0].spec.batch_source();
            if !kernels.iter().any(|(n, _)| *n == name) {
                kernels.push((name.clone(), text));
            }
            out.push(Command::FusedBatch(batched(&run, name)));
            for m in &mut moved[i + 1..end] {
                *m = out.len();
            }
            i = end;
            continue;
        }
        out.push(commands[i].clone());
        i += 1;
    }
    moved[commands.len()] = out.len();
    for span in spans.iter_mut() {
        *span = moved[span.start]..moved[span.end];
    }
    (out, kernels)
}
