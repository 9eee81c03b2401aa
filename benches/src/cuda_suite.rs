//! The `cuda` suite, for a host with a GPU: each target model's training step on the CUDA
//! device (eager and with CUDA-graph replay) next to eager PyTorch on the same GPU in the
//! same run; the switch latency between two sessions on one lane; four jobs on four lanes
//! at once (packed) against one at a time. Without a usable GPU it says why and fails.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use salus_cuda::{CudaDevice, CudaOptions};
use salus_exec::{Device, Placement};
use salus_testkit::reference::ReferenceRun;
use serde::Serialize;

use crate::engine_suite::{median, torch_side};

#[derive(Debug, Serialize)]
struct ModelResult {
    salus_eager_ms: f64,
    salus_graph_ms: f64,
    torch_ms: f64,
    eager_ratio: f64,
    graph_ratio: f64,
}

#[derive(Debug, Serialize)]
struct CudaResult {
    gpu: String,
    torch_device: String,
    batch_size: u64,
    /// Mixed precision of both sides (bf16, f16), or none (f32).
    amp: Option<String>,
    models: BTreeMap<String, ModelResult>,
    /// Mean extra time of an iteration that follows another session's on the same lane.
    switch_us: f64,
    /// Iterations per second of four jobs, one lane each, all at once.
    packed_per_s: f64,
    /// Iterations per second of the same four jobs one after the other.
    one_at_a_time_per_s: f64,
}

/// Places a run at `persistent` with its lane right after, on 256-byte boundaries.
fn place(run: &ReferenceRun, persistent: u64) -> Placement {
    let plan = run.program.plan();
    Placement {
        persistent,
        lane: (persistent + plan.persistent_bytes).div_ceil(256) * 256,
    }
}

fn end_of(run: &ReferenceRun, at: Placement) -> u64 {
    (at.lane + run.program.plan().ephemeral_bytes).div_ceil(256) * 256
}

fn step_ms(
    run: &ReferenceRun,
    device: &dyn Device,
    at: Placement,
    iterations: usize,
) -> Result<f64, String> {
    for k in 0..3 {
        run.step(device, at, k).map_err(|e| e.to_string())?;
    }
    let times = (0..iterations)
        .map(|k| {
            let start = Instant::now();
            run.step(device, at, k).map_err(|e| e.to_string())?;
            Ok(start.elapsed())
        })
        .collect::<Result<Vec<Duration>, String>>()?;
    Ok(median(times).as_secs_f64() * 1e3)
}

pub fn run(
    dir: &Path,
    iterations: usize,
    models: &[String],
    amp: Option<&str>,
    json: bool,
) -> Result<(), String> {
    let result = measure(dir, iterations, models, amp);
    match (&result, json) {
        (Err(e), true) => println!("{}", serde_json::json!({ "error": e })),
        (Ok(r), true) => println!(
            "{}",
            serde_json::to_string_pretty(r).map_err(|e| e.to_string())?
        ),
        (Ok(r), false) => {
            println!(
                "GPU {} (PyTorch on {}), batch {}, {}",
                r.gpu,
                r.torch_device,
                r.batch_size,
                r.amp.as_deref().unwrap_or("f32")
            );
            println!(
                "{:<10} {:>10} {:>10} {:>10} {:>7} {:>7}",
                "model", "eager ms", "graph ms", "torch ms", "eager", "graph"
            );
            for (name, m) in &r.models {
                println!(
                    "{:<10} {:>10.3} {:>10.3} {:>10.3} {:>7.2} {:>7.2}",
                    name,
                    m.salus_eager_ms,
                    m.salus_graph_ms,
                    m.torch_ms,
                    m.eager_ratio,
                    m.graph_ratio
                );
            }
            println!(
                "switch between two sessions on one lane: {:.1} us",
                r.switch_us
            );
            println!(
                "four jobs: packed {:.1} it/s, one at a time {:.1} it/s ({:.2}x)",
                r.packed_per_s,
                r.one_at_a_time_per_s,
                r.packed_per_s / r.one_at_a_time_per_s
            );
        }
        (Err(_), false) => {}
    }
    result.map(|_| ())
}

/// The salus arena in this benchmark: room for the four models with lanes to spare.
const ARENA_BYTES: u64 = 16 << 30;

fn measure(
    dir: &Path,
    iterations: usize,
    names: &[String],
    amp: Option<&str>,
) -> Result<CudaResult, String> {
    let gpus = CudaDevice::probe().map_err(|e| format!("no usable GPU: {e}"))?;
    // PyTorch runs on the same GPU in the same run: leave it most of the memory.
    let mut options = CudaOptions::new(0);
    options.cap = Some(ARENA_BYTES);
    let device = Arc::new(CudaDevice::new(&options)?);
    let mut args = vec!["--device", "cuda"];
    for name in names {
        args.extend(["--model", name.as_str()]);
    }
    let torch = torch_side(dir, iterations, &args, amp)?;
    let mut models = BTreeMap::new();
    let mut runs = Vec::new();
    for (name, t) in torch["models"]
        .as_object()
        .ok_or("no models from torch_engine.py")?
    {
        let mut run = ReferenceRun::load(&dir.join(name))?;
        run.plan_for(&*device)?;
        let at = place(&run, 0);
        run.upload(&*device, at)?;
        device.set_graphs(false);
        let eager = step_ms(&run, &*device, at, iterations)?;
        device.set_graphs(true);
        let graph = step_ms(&run, &*device, at, iterations)?;
        let torch_ms = t["torch_ms"].as_f64().unwrap_or(f64::NAN);
        models.insert(
            name.clone(),
            ModelResult {
                salus_eager_ms: eager,
                salus_graph_ms: graph,
                torch_ms,
                eager_ratio: eager / torch_ms,
                graph_ratio: graph / torch_ms,
            },
        );
        runs.push(run);
    }
    // Four jobs, each with its own persistent block and lane.
    let mut placements = Vec::new();
    let mut next = 0;
    for run in &runs {
        let at = place(run, next);
        run.upload(&*device, at)?;
        next = end_of(run, at);
        placements.push(at);
    }
    let per_job = iterations.max(5);
    let start = Instant::now();
    for (run, &at) in runs.iter().zip(&placements) {
        for k in 0..per_job {
            run.step(&*device, at, k).map_err(|e| e.to_string())?;
        }
    }
    let serial = start.elapsed();
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = runs
            .iter()
            .zip(&placements)
            .map(|(run, &at)| {
                let device = device.clone();
                s.spawn(move || -> Result<(), String> {
                    for k in 0..per_job {
                        run.step(&*device, at, k).map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "a job panicked".to_string())?)
            .collect::<Result<Vec<()>, String>>()
    })?;
    let packed = start.elapsed();
    let total = (per_job * runs.len()) as f64;
    // Switch latency: two sessions alternating on one lane against each repeating.
    let switch_us = match (runs.first(), runs.get(1)) {
        (Some(a), Some(b)) => {
            let lane = next.div_ceil(256) * 256;
            let pa = lane
                + b.program
                    .plan()
                    .ephemeral_bytes
                    .max(a.program.plan().ephemeral_bytes)
                    .div_ceil(256)
                    * 256;
            let pb = (pa + a.program.plan().persistent_bytes).div_ceil(256) * 256;
            let (at_a, at_b) = (
                Placement {
                    persistent: pa,
                    lane,
                },
                Placement {
                    persistent: pb,
                    lane,
                },
            );
            a.upload(&*device, at_a)?;
            b.upload(&*device, at_b)?;
            let time = |order: &[(&ReferenceRun, Placement)]| -> Result<f64, String> {
                for &(r, at) in order {
                    r.step(&*device, at, 0).map_err(|e| e.to_string())?;
                }
                let start = Instant::now();
                for _ in 0..per_job {
                    for &(r, at) in order {
                        r.step(&*device, at, 0).map_err(|e| e.to_string())?;
                    }
                }
                Ok(start.elapsed().as_secs_f64() * 1e6 / (per_job * order.len()) as f64)
            };
            let alternating = time(&[(a, at_a), (b, at_b)])?;
            let same = (time(&[(a, at_a)])? + time(&[(b, at_b)])?) / 2.0;
            alternating - same
        }
        _ => 0.0,
    };
    Ok(CudaResult {
        gpu: gpus.first().map(|g| g.name.clone()).unwrap_or_default(),
        torch_device: torch["device"].as_str().unwrap_or("").to_string(),
        batch_size: torch["batch_size"].as_u64().unwrap_or(0),
        amp: amp.map(str::to_string),
        models,
        switch_us,
        packed_per_s: total / packed.as_secs_f64(),
        one_at_a_time_per_s: total / serial.as_secs_f64(),
    })
}
