//! The `engine` suite: the CPU device's sgemm and convolution throughput, and each target
//! model's training-step time next to eager PyTorch's on the same machine in the same run.
//!
//! PyTorch's side runs through `benches/torch_engine.py` (with the project's `.venv`, or
//! the Python named by `SALUS_PYTHON`), which also writes the traced graphs and initial
//! state the CPU device runs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use salus_cpu::CpuDevice;
use salus_exec::{Device, Placement, Program};
use salus_graph::{Attr, DType, Graph, Limits, Node, Op, Role, Tensor, TensorType};
use salus_testkit::reference::ReferenceRun;
use serde::Serialize;

#[derive(Debug, Serialize)]
struct ModelResult {
    salus_ms: f64,
    torch_ms: f64,
    ratio: f64,
}

#[derive(Debug, Serialize)]
struct EngineResult {
    sgemm_gflops: f64,
    conv_gflops: f64,
    /// Convolutions with small output planes (the last stages of a CNN at low
    /// resolution, weight gradients written as convolutions), by shape.
    small_plane_conv_gflops: BTreeMap<String, f64>,
    threads: u64,
    batch_size: u64,
    /// Mixed precision of both sides (bf16, f16), or none (f32).
    amp: Option<String>,
    models: BTreeMap<String, ModelResult>,
}

pub(crate) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn one_node(
    op: Op,
    inputs: Vec<TensorType>,
    output: TensorType,
    attrs: Vec<(&str, Attr)>,
) -> Graph {
    let mut tensors: Vec<Tensor> = inputs
        .into_iter()
        .enumerate()
        .map(|(i, ty)| Tensor {
            name: format!("in{i}"),
            ty,
            role: Role::Feed,
            data: vec![],
        })
        .collect();
    let n = tensors.len();
    tensors.push(Tensor {
        name: "out".into(),
        ty: output,
        role: Role::Intermediate,
        data: vec![],
    });
    Graph {
        tensors,
        nodes: vec![Node {
            name: "op".into(),
            op,
            inputs: (0..n).map(Some).collect(),
            outputs: vec![Some(n)],
            attrs: attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            source: String::new(),
        }],
        fetches: vec![],
        updates: vec![],
        precision: Default::default(),
    }
}

/// GFLOP/s of one op run as a one-node graph on the CPU device.
fn op_gflops(graph: Graph, flops: f64, runs: usize) -> Result<f64, String> {
    let program = Program::new(graph, &Limits::default()).map_err(|e| e.to_string())?;
    let device = CpuDevice::new(program.plan().ephemeral_bytes).map_err(|e| e.to_string())?;
    let feeds: Vec<Vec<u8>> = program
        .feeds()
        .iter()
        .map(|&id| {
            let n = program.bytes(id) as usize / 4;
            (0..n)
                .flat_map(|i| (((i * 7) % 13) as f32 * 0.1 - 0.6).to_le_bytes())
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
    let at = Placement {
        persistent: 0,
        lane: 0,
    };
    device.run(&program, at, &refs).map_err(|e| e.to_string())?;
    let times = (0..runs)
        .map(|_| {
            device
                .run(&program, at, &refs)
                .map(|o| o.duration)
                .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(flops / median(times).as_secs_f64() / 1e9)
}

fn sgemm_gflops() -> Result<f64, String> {
    let n = 1024u64;
    let f32_ty = |s: Vec<u64>| TensorType::new(DType::F32, s);
    let graph = one_node(
        Op::Mm,
        vec![f32_ty(vec![n, n]), f32_ty(vec![n, n])],
        f32_ty(vec![n, n]),
        vec![],
    );
    op_gflops(graph, 2.0 * (n * n * n) as f64, 5)
}

fn conv_gflops() -> Result<f64, String> {
    conv_shape_gflops([8, 64, 32, 32], 64, 3, 1)
}

/// GFLOP/s of a convolution of a `[n, c, h, w]` input by `c_out` `kernel x kernel`
/// filters, stride 1, `padding` on each side.
fn conv_shape_gflops(
    input: [u64; 4],
    c_out: u64,
    kernel: u64,
    padding: u64,
) -> Result<f64, String> {
    let [n, c, h, w] = input;
    let (oh, ow) = (h + 2 * padding + 1 - kernel, w + 2 * padding + 1 - kernel);
    let f32_ty = |s: Vec<u64>| TensorType::new(DType::F32, s);
    let pad = padding as i64;
    let mut graph = one_node(
        Op::Convolution,
        vec![
            f32_ty(input.to_vec()),
            f32_ty(vec![c_out, c, kernel, kernel]),
        ],
        f32_ty(vec![n, c_out, oh, ow]),
        vec![
            ("stride", Attr::Ints(vec![1, 1])),
            ("padding", Attr::Ints(vec![pad, pad])),
            ("dilation", Attr::Ints(vec![1, 1])),
            ("transposed", Attr::Bool(false)),
            ("output_padding", Attr::Ints(vec![0, 0])),
            ("groups", Attr::Int(1)),
        ],
    );
    // The bias input is absent: add it as a third, optional input.
    graph.nodes[0].inputs.push(None);
    op_gflops(
        graph,
        2.0 * (n * c_out * c * kernel * kernel * oh * ow) as f64,
        5,
    )
}

/// [`conv_shape_gflops`] of convolutions whose output planes have 1 to 16 positions.
fn small_plane_conv_gflops() -> Result<BTreeMap<String, f64>, String> {
    let shapes = [
        ([32, 256, 2, 2], 1024, 1, 0),
        ([32, 128, 4, 4], 128, 3, 1),
        ([32, 512, 1, 1], 512, 3, 1),
        // resnet50's weight gradient of a 1x1 convolution at a 2x2 stage, as the HLO of
        // TensorFlow and JAX writes it: input channels as images, the batch as channels.
        ([256, 32, 2, 2], 1024, 2, 0),
    ];
    shapes
        .into_iter()
        .map(|(input, c_out, kernel, padding)| {
            let name = format!(
                "{}x{}x{}x{} {kernel}x{kernel} -> {c_out}",
                input[0], input[1], input[2], input[3]
            );
            Ok((name, conv_shape_gflops(input, c_out, kernel, padding)?))
        })
        .collect()
}

pub(crate) fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("SALUS_PYTHON") {
        return p.into();
    }
    let venv = Path::new(".venv/bin/python");
    if venv.exists() {
        venv.to_path_buf()
    } else {
        "python3".into()
    }
}

fn model_ms(dir: &Path, iterations: usize) -> Result<f64, String> {
    let run = ReferenceRun::load(dir)?;
    let (device, at) = run.on_cpu()?;
    for k in 0..2 {
        run.step(&device, at, k).map_err(|e| e.to_string())?;
    }
    let times = (0..iterations)
        .map(|k| {
            let start = Instant::now();
            run.step(&device, at, k).map_err(|e| e.to_string())?;
            Ok(start.elapsed())
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(median(times).as_secs_f64() * 1e3)
}

/// PyTorch's side of the model benchmarks: runs `benches/torch_engine.py`, which writes
/// the traced models into `dir` and times eager PyTorch on them (`args`: its options
/// beyond the directory and the iterations; `--amp` added when `amp` is given); its JSON.
pub(crate) fn torch_side(
    dir: &Path,
    iterations: usize,
    args: &[&str],
    amp: Option<&str>,
) -> Result<serde_json::Value, String> {
    let mut cmd = Command::new(python());
    cmd.arg("benches/torch_engine.py")
        .arg(dir)
        .args(["--iterations", &iterations.to_string()])
        .args(args);
    if let Some(amp) = amp {
        cmd.args(["--amp", amp]);
    }
    let out = cmd.output().map_err(|e| {
        format!("cannot run benches/torch_engine.py: {e} (run ./scripts/python-env.sh first)")
    })?;
    if !out.status.success() {
        return Err(format!(
            "benches/torch_engine.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

pub fn run(dir: &Path, iterations: usize, amp: Option<&str>, json: bool) -> Result<(), String> {
    let torch = torch_side(dir, iterations, &[], amp)?;
    let mut models = BTreeMap::new();
    for (name, t) in torch["models"]
        .as_object()
        .ok_or("no models from torch_engine.py")?
    {
        let torch_ms = t["torch_ms"].as_f64().unwrap_or(f64::NAN);
        let salus_ms = model_ms(&dir.join(name), iterations)?;
        models.insert(
            name.clone(),
            ModelResult {
                salus_ms,
                torch_ms,
                ratio: salus_ms / torch_ms,
            },
        );
    }
    let result = EngineResult {
        sgemm_gflops: sgemm_gflops()?,
        conv_gflops: conv_gflops()?,
        small_plane_conv_gflops: small_plane_conv_gflops()?,
        threads: torch["threads"].as_u64().unwrap_or(0),
        batch_size: torch["batch_size"].as_u64().unwrap_or(0),
        amp: amp.map(str::to_string),
        models,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!(
        "CPU device: sgemm 1024^3 {:.1} GFLOP/s, conv 8x64x32x32 3x3 {:.1} GFLOP/s ({} threads)",
        result.sgemm_gflops, result.conv_gflops, result.threads
    );
    for (shape, gflops) in &result.small_plane_conv_gflops {
        println!("conv {shape}: {gflops:.1} GFLOP/s");
    }
    println!(
        "training step, batch {}, {}: {:<10} {:>10} {:>10} {:>7}",
        result.batch_size,
        amp.unwrap_or("f32"),
        "model",
        "salus ms",
        "torch ms",
        "ratio"
    );
    for (name, m) in &result.models {
        println!(
            "{:<10} {:>10.2} {:>10.2} {:>7.2}",
            name, m.salus_ms, m.torch_ms, m.ratio
        );
    }
    Ok(())
}
