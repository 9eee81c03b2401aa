//! Runs a reference run written by `python -m salus.reference` on the CPU device (or with
//! `--device cuda`, GPU 0; with `--device cuda-emulated`, the CUDA device's command lists and
//! kernels on the host) and prints, as JSON, the loss of every step and how far each
//! final persistent tensor is from PyTorch's:
//! `cargo run -p salus-testkit --example replay_reference -- OUT_DIR/mlp [--device cuda]`.

use std::path::Path;
use std::process::ExitCode;

use salus_cuda::{CudaDevice, CudaOptions, Emulator};
use salus_exec::{Device, Placement};
use salus_testkit::reference::ReferenceRun;
use serde_json::{Value, json};

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Places the run after planning it for `device` (as salusd plans a session for its
/// device: cuDNN workspaces and split sums in its scratch) and uploads its state.
fn place(run: &mut ReferenceRun, device: &dyn Device) -> Result<Placement, String> {
    run.plan_for(device)?;
    let plan = run.program.plan();
    let at = Placement {
        persistent: 0,
        lane: plan.persistent_bytes.next_multiple_of(256),
    };
    if at.lane + plan.ephemeral_bytes > device.capacity() {
        return Err(format!(
            "the run needs {} bytes, the device's arena holds {}",
            at.lane + plan.ephemeral_bytes,
            device.capacity()
        ));
    }
    run.upload(device, at)?;
    Ok(at)
}

fn run(dir: &Path, device: &str) -> Result<Value, String> {
    let mut run = ReferenceRun::load(dir)?;
    let (device, at): (Box<dyn Device>, Placement) = match device {
        "cuda" => {
            let device = CudaDevice::new(&CudaOptions::new(0))?;
            let at = place(&mut run, &device)?;
            (Box::new(device), at)
        }
        "cuda-emulated" => {
            // Sized from the CPU's plan, with room for the CUDA kernels' larger scratch.
            let plan = run.program.plan();
            let bytes = 2 * (plan.persistent_bytes + plan.ephemeral_bytes) + (16 << 20);
            let device = Emulator::new(bytes)?;
            let at = place(&mut run, &device)?;
            (Box::new(device), at)
        }
        "cpu" => {
            let (device, at) = run.on_cpu()?;
            (Box::new(device), at)
        }
        other => {
            return Err(format!(
                "unknown device {other:?} (cpu, cuda or cuda-emulated)"
            ));
        }
    };
    let device = &*device;
    let losses = (0..run.batches.len())
        .map(|k| {
            run.step(device, at, k)
                .map(f64::from)
                .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut errors = serde_json::Map::new();
    for (name, expected) in &run.final_state {
        let ours = device
            .read(run.offset_of(at, name)?, expected.len() as u64)
            .map_err(|e| e.to_string())?;
        let dtype_is_f32 = run
            .program
            .graph()
            .tensors
            .iter()
            .find(|t| &t.name == name)
            .is_some_and(|t| t.ty.dtype == salus_graph::DType::F32);
        if !dtype_is_f32 {
            continue;
        }
        let (a, b) = (f32s(&ours), f32s(expected));
        let max_abs = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from((x - y).abs()))
            .fold(0.0, f64::max);
        let scale = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
        errors.insert(
            name.clone(),
            json!({"max_abs": max_abs, "max_value": scale}),
        );
    }
    Ok(json!({"losses": losses, "final": errors}))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let device = args
        .windows(2)
        .find(|w| w[0] == "--device")
        .map_or("cpu", |w| w[1].as_str());
    let Some(dir) = args.first().filter(|a| !a.starts_with("--")) else {
        eprintln!(
            "usage: replay_reference REFERENCE_DIR/<model> [--device cpu|cuda|cuda-emulated]"
        );
        return ExitCode::FAILURE;
    };
    match run(Path::new(dir), device) {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("replay_reference: {e}");
            ExitCode::FAILURE
        }
    }
}
