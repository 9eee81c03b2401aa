//! Runs a reference run written by `python -m salus.reference` on the CPU device and
//! prints, as JSON, the loss of every step and how far each final persistent tensor is
//! from PyTorch's: `cargo run -p salus-exec --example replay_reference -- OUT_DIR/mlp`.

use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;

use salus_exec::{CpuDevice, Device, Location, Placement, Program};
use salus_graph::{Graph, Limits};
use serde_json::{Value, json};

fn tensors(dir: &Path, section: &Value) -> Result<HashMap<String, Vec<u8>>, String> {
    let file = section["file"].as_str().ok_or("section without a file")?;
    let bytes = std::fs::read(dir.join(file)).map_err(|e| format!("{file}: {e}"))?;
    let mut out = HashMap::new();
    for t in section["tensors"]
        .as_array()
        .ok_or("section without tensors")?
    {
        let name = t["name"].as_str().ok_or("tensor without a name")?;
        let offset = t["offset"].as_u64().ok_or("tensor without an offset")? as usize;
        let len = t["nbytes"].as_u64().ok_or("tensor without nbytes")? as usize;
        out.insert(name.to_string(), bytes[offset..offset + len].to_vec());
    }
    Ok(out)
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn run(dir: &Path) -> Result<Value, String> {
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(dir.join("manifest.json")).map_err(|e| format!("manifest.json: {e}"))?,
    )
    .map_err(|e| e.to_string())?;
    let graph = Graph::decode(&std::fs::read(dir.join("graph.pb")).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let program = Program::new(graph, &Limits::default()).map_err(|e| e.to_string())?;
    let plan = program.plan();
    let at = Placement {
        persistent: 0,
        lane: plan.persistent_bytes,
    };
    let device =
        CpuDevice::new(plan.persistent_bytes + plan.ephemeral_bytes).map_err(|e| e.to_string())?;
    let names: HashMap<&str, usize> = program
        .graph()
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let offset_of = |name: &str| -> Result<u64, String> {
        match names.get(name).and_then(|&id| program.location(id)) {
            Some(Location::Persistent(off)) => Ok(at.persistent + off),
            _ => Err(format!("{name} is not a persistent tensor of the graph")),
        }
    };
    for (name, bytes) in tensors(dir, &manifest["initial"])? {
        device
            .write(offset_of(&name)?, &bytes)
            .map_err(|e| e.to_string())?;
    }
    let mut losses = Vec::new();
    for batch in manifest["batches"].as_array().ok_or("no batches")? {
        let feeds = tensors(dir, batch)?;
        let ordered: Vec<&[u8]> = program
            .feeds()
            .iter()
            .map(|&id| {
                feeds
                    .get(&program.graph().tensors[id].name)
                    .map(Vec::as_slice)
                    .unwrap_or(&[])
            })
            .collect();
        let outcome = device
            .run(&program, at, &ordered)
            .map_err(|e| e.to_string())?;
        losses.push(f64::from(f32s(&outcome.fetches[0])[0]));
    }
    let mut errors = serde_json::Map::new();
    for t in manifest["final"]["tensors"]
        .as_array()
        .ok_or("no final tensors")?
    {
        let name = t["name"].as_str().unwrap_or_default();
        let expected = tensors(dir, &manifest["final"])?
            .remove(name)
            .unwrap_or_default();
        if t["dtype"] != "f32" {
            continue;
        }
        let ours = device
            .read(offset_of(name)?, expected.len() as u64)
            .map_err(|e| e.to_string())?;
        let (a, b) = (f32s(&ours), f32s(&expected));
        let max_abs = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from((x - y).abs()))
            .fold(0.0, f64::max);
        let scale = b.iter().map(|y| f64::from(y.abs())).fold(0.0, f64::max);
        errors.insert(
            name.to_string(),
            json!({"max_abs": max_abs, "max_value": scale, "f32_error": t["f32_error"]}),
        );
    }
    Ok(json!({"losses": losses, "final": errors}))
}

fn main() -> ExitCode {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: replay_reference REFERENCE_DIR/<model>");
        return ExitCode::FAILURE;
    };
    match run(Path::new(&dir)) {
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
