//! Runs a reference run written by `python -m salus.reference` on the CPU device (or with
//! `--device cuda`, GPU 0) and prints, as JSON, the loss of every step and how far each
//! final persistent tensor is from PyTorch's:
//! `cargo run -p salus-testkit --example replay_reference -- OUT_DIR/mlp [--device cuda]`.

use std::path::Path;
use std::process::ExitCode;

use salus_cuda::{CudaDevice, CudaOptions};
use salus_exec::{Device, Placement};
use salus_testkit::reference::ReferenceRun;
use serde_json::{Value, json};

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn run(dir: &Path, cuda: bool) -> Result<Value, String> {
    let mut run = ReferenceRun::load(dir)?;
    let (device, at): (Box<dyn Device>, Placement) = if cuda {
        // The whole GPU (less the reserve), then the program planned for it, as salusd
        // plans a session for its device: cuDNN workspaces and split sums in its scratch.
        let device = CudaDevice::new(&CudaOptions::new(0))?;
        run.plan_for(&device)?;
        let plan = run.program.plan();
        let at = Placement {
            persistent: 0,
            lane: plan.persistent_bytes.next_multiple_of(256),
        };
        if at.lane + plan.ephemeral_bytes > device.capacity() {
            return Err(format!(
                "the run needs {} bytes, the GPU's arena holds {}",
                at.lane + plan.ephemeral_bytes,
                device.capacity()
            ));
        }
        run.upload(&device, at)?;
        (Box::new(device), at)
    } else {
        let (device, at) = run.on_cpu()?;
        (Box::new(device), at)
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
    let cuda = args
        .windows(2)
        .any(|w| w[0] == "--device" && w[1] == "cuda");
    let Some(dir) = args.first().filter(|a| !a.starts_with("--")) else {
        eprintln!("usage: replay_reference REFERENCE_DIR/<model> [--device cuda]");
        return ExitCode::FAILURE;
    };
    match run(Path::new(dir), cuda) {
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
