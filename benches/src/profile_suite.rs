//! The `profile` suite, for a host with a GPU: where each model's training step spends
//! its device time on the CUDA device, by op family, next to PyTorch's kernel time for
//! the same families on the same GPU in the same run.
//!
//! PyTorch's side runs first, in `benches/torch_profile.py` (which also traces each model
//! into the reference-run format), so that it has the GPU to itself; then the CUDA device
//! opens, and for each model: its graph-replay iteration time, then one eagerly run
//! iteration with every node timed by CUDA events
//! ([`CudaDevice::profile_iteration`]). Both sides are grouped with the one mapping of
//! [`salus_cuda::profile::op_family`]. A model that cannot be traced or lowered reports
//! why (the missing op) and the others go on.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use salus_cuda::profile::{Family, GroupTime, op_family};
use salus_cuda::{CudaDevice, CudaOptions};
use salus_exec::{Device, Placement};
use salus_testkit::reference::ReferenceRun;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine_suite::{median, python};

/// The models profiled when none is named: the benchmark set of `salus-bench cuda`.
pub const DEFAULT_MODELS: [&str; 4] = ["mlp", "cnn", "gpt", "resnet18"];

/// One family's row: salus' device time and launches, PyTorch's kernel time and kernels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FamilyRow {
    pub family: String,
    /// Summed device time of the family's nodes in the profiled iteration, ms.
    pub salus_ms: Option<f64>,
    /// Device commands (kernel launches, cuBLAS calls, memsets) of those nodes.
    pub launches: Option<u64>,
    /// Nodes of the family.
    pub nodes: Option<u64>,
    /// PyTorch's kernel time for the family, ms per step.
    pub torch_ms: Option<f64>,
    /// PyTorch's kernels for the family per step.
    pub torch_kernels: Option<u64>,
}

/// One op of either side, with its family.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRow {
    pub op: String,
    pub family: String,
    pub ms: f64,
    pub launches: u64,
    /// Nodes (salus); 0 for PyTorch's ops.
    pub nodes: u64,
}

/// One model's profile.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub model: String,
    pub families: Vec<FamilyRow>,
    /// salus' ops, most time first (at most `--top`).
    pub salus_ops: Vec<OpRow>,
    /// PyTorch's ops, most time first (at most `--top`).
    pub torch_ops: Vec<OpRow>,
    /// Median wall time of an iteration replaying its CUDA graph (as `salus-bench cuda`).
    pub salus_graph_ms: Option<f64>,
    /// Median device time of the same iterations (first node to the updates' end).
    pub salus_graph_device_ms: Option<f64>,
    /// Sum of every node's device time in the profiled eager iteration.
    pub salus_eager_sum_ms: Option<f64>,
    pub salus_nodes: Option<u64>,
    pub salus_launches: Option<u64>,
    /// Median wall time of an eager PyTorch training step.
    pub torch_ms: Option<f64>,
    /// Sum of PyTorch's kernel times per step.
    pub torch_kernel_ms: Option<f64>,
    /// salus' persistent bytes (P) and peak ephemeral bytes (E) of the step.
    pub persistent_bytes: Option<u64>,
    pub ephemeral_bytes: Option<u64>,
    /// `torch.cuda.max_memory_allocated()` over one step.
    pub torch_max_memory_bytes: Option<u64>,
    /// The profile's gate gave up waiting: some node times may include launch gaps.
    pub gate_timed_out: bool,
    /// Why a part is missing: a missing op, a failed lowering, out of memory.
    pub errors: Vec<String>,
}

/// The whole run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileResult {
    pub gpu: String,
    pub torch_device: String,
    pub torch_version: String,
    pub tf32_cudnn: Option<bool>,
    pub tf32_matmul: Option<bool>,
    pub models: Vec<ModelProfile>,
}

/// PyTorch's ops of one model from `torch_profile.py`'s JSON, each with its family.
pub fn torch_ops(model: &Value) -> Vec<OpRow> {
    let mut ops: Vec<OpRow> = model["ops"]
        .as_array()
        .map(|ops| {
            ops.iter()
                .map(|o| {
                    let op = o["op"].as_str().unwrap_or("?").to_string();
                    let family = if o["optimizer"].as_bool().unwrap_or(false) {
                        Family::Optimizer
                    } else {
                        op_family(&op)
                    };
                    OpRow {
                        family: family.name().to_string(),
                        op,
                        ms: o["ms"].as_f64().unwrap_or(0.0),
                        launches: o["kernels"].as_u64().unwrap_or(0),
                        nodes: 0,
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    ops.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    ops
}

/// The family rows of a model: every family either side has, in [`Family::ALL`] order.
pub fn family_rows(salus: Option<&BTreeMap<Family, GroupTime>>, torch: &[OpRow]) -> Vec<FamilyRow> {
    let mut torch_by: BTreeMap<&str, (f64, u64)> = BTreeMap::new();
    for op in torch {
        let e = torch_by.entry(op.family.as_str()).or_default();
        e.0 += op.ms;
        e.1 += op.launches;
    }
    Family::ALL
        .iter()
        .filter_map(|&f| {
            let s = salus.and_then(|s| s.get(&f));
            let t = torch_by.get(f.name());
            if s.is_none() && t.is_none() {
                return None;
            }
            Some(FamilyRow {
                family: f.name().to_string(),
                salus_ms: salus.map(|_| s.map_or(0.0, |g| g.ms)),
                launches: salus.map(|_| s.map_or(0, |g| g.launches)),
                nodes: salus.map(|_| s.map_or(0, |g| g.nodes)),
                torch_ms: t.map(|t| t.0),
                torch_kernels: t.map(|t| t.1),
            })
        })
        .collect()
}

/// `bytes` for a person: `293.1 MiB`, `9.87 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b / 1024.0)
    }
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.3}"))
}

fn opt_u(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

fn share(part: Option<f64>, total: Option<f64>) -> String {
    match (part, total) {
        (Some(p), Some(t)) if t > 0.0 => format!("{:.1}%", 100.0 * p / t),
        _ => "-".into(),
    }
}

/// One model as text: totals, memory, the family table, the top ops, the errors.
pub fn render_model(m: &ModelProfile) -> String {
    let mut s = format!("== {}\n", m.model);
    s += &format!(
        "salus: graph replay {} ms, eager sum of nodes {} ms ({} nodes, {} launches); \
         PyTorch eager step {} ms (kernels {} ms); graph / PyTorch {}\n",
        opt_ms(m.salus_graph_ms),
        opt_ms(m.salus_eager_sum_ms),
        opt_u(m.salus_nodes),
        opt_u(m.salus_launches),
        opt_ms(m.torch_ms),
        opt_ms(m.torch_kernel_ms),
        ratio(m.salus_graph_ms, m.torch_ms),
    );
    if let (Some(p), Some(e)) = (m.persistent_bytes, m.ephemeral_bytes) {
        s += &format!(
            "memory: salus P {} + E {} = {}",
            human_bytes(p),
            human_bytes(e),
            human_bytes(p + e)
        );
        match m.torch_max_memory_bytes {
            Some(t) if t > 0 => {
                s += &format!(
                    "; PyTorch peak {} (P+E / peak {:.2})\n",
                    human_bytes(t),
                    (p + e) as f64 / t as f64
                )
            }
            _ => s += "\n",
        }
    }
    if !m.families.is_empty() {
        s += &format!(
            "{:<12} {:>10} {:>6} {:>8} {:>6} {:>10} {:>6} {:>8} {:>7}\n",
            "family",
            "salus ms",
            "share",
            "launches",
            "nodes",
            "torch ms",
            "share",
            "kernels",
            "ratio"
        );
        for r in &m.families {
            s += &format!(
                "{:<12} {:>10} {:>6} {:>8} {:>6} {:>10} {:>6} {:>8} {:>7}\n",
                r.family,
                opt_ms(r.salus_ms),
                share(r.salus_ms, m.salus_eager_sum_ms),
                opt_u(r.launches),
                opt_u(r.nodes),
                opt_ms(r.torch_ms),
                share(r.torch_ms, m.torch_kernel_ms),
                opt_u(r.torch_kernels),
                ratio(r.salus_ms, r.torch_ms),
            );
        }
        let torch_kernels: Option<u64> = m
            .families
            .iter()
            .map(|r| r.torch_kernels)
            .try_fold(0u64, |acc, k| Some(acc + k.unwrap_or(0)))
            .filter(|_| m.torch_kernel_ms.is_some());
        s += &format!(
            "{:<12} {:>10} {:>6} {:>8} {:>6} {:>10} {:>6} {:>8} {:>7}\n",
            "total",
            opt_ms(m.salus_eager_sum_ms),
            "",
            opt_u(m.salus_launches),
            opt_u(m.salus_nodes),
            opt_ms(m.torch_kernel_ms),
            "",
            opt_u(torch_kernels),
            ratio(m.salus_eager_sum_ms, m.torch_kernel_ms),
        );
    }
    for (side, ops) in [("salus", &m.salus_ops), ("PyTorch", &m.torch_ops)] {
        if ops.is_empty() {
            continue;
        }
        let list: Vec<String> = ops
            .iter()
            .map(|o| format!("{} [{}] {:.3} ms x{}", o.op, o.family, o.ms, o.launches))
            .collect();
        s += &format!("top {side} ops: {}\n", list.join(", "));
    }
    if m.gate_timed_out {
        s += "warning: the profile's gate timed out; some node times include launch gaps\n";
    }
    for e in &m.errors {
        s += &format!("error: {e}\n");
    }
    s
}

/// The whole run as text: a header, each model, then one summary line per model.
pub fn render(r: &ProfileResult) -> String {
    let tf32 = match (r.tf32_cudnn, r.tf32_matmul) {
        (Some(c), Some(m)) => format!(
            " (TF32: cuDNN {}, matmul {})",
            if c { "on" } else { "off" },
            if m { "on" } else { "off" }
        ),
        _ => String::new(),
    };
    let mut s = format!(
        "GPU {}; PyTorch {} on {}{tf32}\n\n",
        r.gpu, r.torch_version, r.torch_device
    );
    for m in &r.models {
        s += &render_model(m);
        s += "\n";
    }
    s += &format!(
        "{:<20} {:>10} {:>10} {:>10} {:>7} {:>12} {:>12}\n",
        "model", "graph ms", "eager sum", "torch ms", "ratio", "P+E", "torch peak"
    );
    for m in &r.models {
        let pe = match (m.persistent_bytes, m.ephemeral_bytes) {
            (Some(p), Some(e)) => human_bytes(p + e),
            _ => "-".into(),
        };
        s += &format!(
            "{:<20} {:>10} {:>10} {:>10} {:>7} {:>12} {:>12}{}\n",
            m.model,
            opt_ms(m.salus_graph_ms),
            opt_ms(m.salus_eager_sum_ms),
            opt_ms(m.torch_ms),
            ratio(m.salus_graph_ms, m.torch_ms),
            pe,
            m.torch_max_memory_bytes
                .map_or_else(|| "-".into(), human_bytes),
            if m.errors.is_empty() {
                ""
            } else {
                "  (errors)"
            },
        );
    }
    s
}

pub struct Options<'a> {
    pub dir: &'a Path,
    /// Print this saved `--json` output instead of measuring.
    pub from: Option<&'a Path>,
    pub models: &'a [String],
    pub iterations: usize,
    pub top: usize,
    pub arena_gib: Option<u64>,
    pub json: bool,
}

/// A profile saved with `--json`.
pub fn load(path: &Path) -> Result<ProfileResult, String> {
    let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let value: Value =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if let Some(e) = value.get("error").and_then(Value::as_str) {
        return Err(format!("{}: the profile failed: {e}", path.display()));
    }
    serde_json::from_value(value).map_err(|e| format!("{}: {e}", path.display()))
}

pub fn run(o: &Options<'_>) -> Result<(), String> {
    let result = match o.from {
        Some(path) => load(path),
        None => measure(o),
    };
    match (&result, o.json) {
        (Err(e), true) => println!("{}", serde_json::json!({ "error": e })),
        (Ok(r), true) => println!(
            "{}",
            serde_json::to_string_pretty(r).map_err(|e| e.to_string())?
        ),
        (Ok(r), false) => print!("{}", render(r)),
        (Err(_), false) => {}
    }
    result.map(|_| ())
}

/// Places a run at `persistent` with its lane right after, on 256-byte boundaries.
fn place(run: &ReferenceRun, persistent: u64) -> Placement {
    let plan = run.program.plan();
    Placement {
        persistent,
        lane: (persistent + plan.persistent_bytes).div_ceil(256) * 256,
    }
}

fn measure(o: &Options<'_>) -> Result<ProfileResult, String> {
    let gpus = CudaDevice::probe().map_err(|e| format!("no usable GPU: {e}"))?;
    let models: Vec<String> = if o.models.is_empty() {
        DEFAULT_MODELS.iter().map(|m| m.to_string()).collect()
    } else {
        o.models.to_vec()
    };
    // PyTorch first, alone on the GPU; its process ends before the arena is allocated.
    let mut cmd = Command::new(python());
    cmd.arg("benches/torch_profile.py").arg(o.dir).args([
        "--iterations",
        &o.iterations.to_string(),
        "--device",
        "cuda",
    ]);
    for m in &models {
        cmd.args(["--model", m]);
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run benches/torch_profile.py: {e}"))?;
    if !out.status.success() {
        return Err(format!("benches/torch_profile.py failed ({})", out.status));
    }
    let torch: Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("benches/torch_profile.py printed no JSON: {e}"))?;
    let mut options = CudaOptions::new(0);
    options.cap = o.arena_gib.map(|g| g << 30);
    let device = CudaDevice::new(&options)?;
    let mut result = ProfileResult {
        gpu: gpus.first().map(|g| g.name.clone()).unwrap_or_default(),
        torch_device: torch["device"].as_str().unwrap_or("").to_string(),
        torch_version: torch["torch"].as_str().unwrap_or("").to_string(),
        tf32_cudnn: torch["tf32_cudnn"].as_bool(),
        tf32_matmul: torch["tf32_matmul"].as_bool(),
        models: Vec::new(),
    };
    for name in &models {
        let t = &torch["models"][name];
        let started = Instant::now();
        let m = profile_model(&device, &o.dir.join(name), name, t, o);
        eprintln!(
            "salus-bench profile: {name}: {:.1} s{}",
            started.elapsed().as_secs_f64(),
            if m.errors.is_empty() {
                ""
            } else {
                " (with errors)"
            }
        );
        result.models.push(m);
    }
    Ok(result)
}

/// One model: PyTorch's numbers from `torch`, then salus' on `device`.
fn profile_model(
    device: &CudaDevice,
    dir: &Path,
    name: &str,
    torch: &Value,
    o: &Options<'_>,
) -> ModelProfile {
    let mut m = ModelProfile {
        model: name.to_string(),
        torch_ms: torch["torch_ms"].as_f64(),
        torch_kernel_ms: torch["kernel_ms"].as_f64(),
        torch_max_memory_bytes: torch["max_memory_bytes"].as_u64(),
        ..ModelProfile::default()
    };
    let all_torch_ops = torch_ops(torch);
    m.torch_ops = all_torch_ops.iter().take(o.top).cloned().collect();
    if torch.is_null() {
        m.errors.push("no result from torch_profile.py".into());
    }
    if let Some(e) = torch["torch_error"].as_str() {
        m.errors.push(format!("PyTorch: {e}"));
    }
    let salus = if let Some(e) = torch["trace_error"].as_str() {
        let missing: Vec<&str> = torch["missing_ops"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        m.errors.push(if missing.is_empty() {
            format!("cannot trace: {e}")
        } else {
            format!("cannot trace: missing ops {}", missing.join(", "))
        });
        None
    } else {
        match salus_side(device, dir, o, &mut m) {
            Ok(p) => Some(p),
            Err(e) => {
                m.errors.push(e);
                None
            }
        }
    };
    let by_family = salus.as_ref().map(|p| p.by_family());
    m.families = family_rows(by_family.as_ref(), &all_torch_ops);
    if let Some(p) = &salus {
        let mut ops: Vec<OpRow> = p
            .by_op()
            .into_iter()
            .map(|((op, family), g)| OpRow {
                op,
                family: family.name().to_string(),
                ms: g.ms,
                launches: g.launches,
                nodes: g.nodes,
            })
            .collect();
        ops.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        ops.truncate(o.top);
        m.salus_ops = ops;
    }
    m
}

/// salus' side of one model: replay times into `m`, then the node profile.
fn salus_side(
    device: &CudaDevice,
    dir: &Path,
    o: &Options<'_>,
    m: &mut ModelProfile,
) -> Result<salus_cuda::profile::Profile, String> {
    let mut run = ReferenceRun::load(dir)?;
    run.plan_for(device)?;
    let plan = run.program.plan();
    m.persistent_bytes = Some(plan.persistent_bytes);
    m.ephemeral_bytes = Some(plan.ephemeral_bytes);
    let at = place(&run, 0);
    let end = at.lane + plan.ephemeral_bytes;
    if end > device.capacity() {
        return Err(format!(
            "P + E = {} does not fit the {} arena",
            human_bytes(end),
            human_bytes(device.capacity())
        ));
    }
    run.upload(device, at)?;
    let feeds = run.feeds(0);
    device.set_graphs(true);
    // Eager, captured, replayed: the first replays are warm.
    for _ in 0..3 {
        device
            .run(&run.program, at, &feeds)
            .map_err(|e| e.to_string())?;
    }
    let mut wall = Vec::new();
    let mut on_device = Vec::new();
    for _ in 0..o.iterations.max(1) {
        let start = Instant::now();
        let outcome = device
            .run(&run.program, at, &feeds)
            .map_err(|e| e.to_string())?;
        wall.push(start.elapsed());
        on_device.push(outcome.duration);
    }
    m.salus_graph_ms = Some(ms(median(wall)));
    m.salus_graph_device_ms = Some(ms(median(on_device)));
    // The first profile warms what an eager run touches first; the second counts.
    device
        .profile_iteration(&run.program, at, &feeds)
        .map_err(|e| format!("profiling: {e}"))?;
    let profile = device
        .profile_iteration(&run.program, at, &feeds)
        .map_err(|e| format!("profiling: {e}"))?;
    m.salus_eager_sum_ms = Some(profile.total_ms());
    m.salus_nodes = Some(profile.nodes.len() as u64);
    m.salus_launches = Some(profile.launches());
    m.gate_timed_out = profile.gate_timed_out;
    Ok(profile)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use salus_cuda::profile::{NodeTime, Profile};

    fn torch_json() -> Value {
        serde_json::json!({
            "torch_ms": 10.0,
            "kernel_ms": 8.0,
            "max_memory_bytes": 3u64 << 30,
            "ops": [
                {"op": "aten::cudnn_convolution", "optimizer": false, "ms": 4.0, "kernels": 20},
                {"op": "aten::convolution_backward", "optimizer": false, "ms": 2.0, "kernels": 30},
                {"op": "aten::add_", "optimizer": true, "ms": 1.0, "kernels": 10},
                {"op": "aten::threshold_backward", "optimizer": false, "ms": 0.5, "kernels": 5},
                {"op": "aten::cudnn_batch_norm", "optimizer": false, "ms": 0.5, "kernels": 5}
            ]
        })
    }

    fn salus_profile() -> Profile {
        let node = |i: usize, op: &str, family, launches, ms| NodeTime {
            index: i,
            name: format!("n{i}"),
            op: op.into(),
            family,
            launches,
            ms,
        };
        Profile {
            nodes: vec![
                node(0, "convolution", Family::Conv, 33, 30.0),
                node(1, "relu", Family::Pointwise, 1, 1.0),
                node(2, "view", Family::CopyLayout, 0, 0.0),
                node(3, "add.Tensor", Family::Optimizer, 1, 2.0),
            ],
            update_launches: 1,
            gate_timed_out: false,
        }
    }

    #[test]
    fn torch_ops_get_the_families_of_the_shared_mapping() {
        let ops = torch_ops(&torch_json());
        let fam: Vec<(&str, &str)> = ops
            .iter()
            .map(|o| (o.op.as_str(), o.family.as_str()))
            .collect();
        assert_eq!(
            fam,
            vec![
                ("aten::cudnn_convolution", "conv"),
                ("aten::convolution_backward", "conv"),
                ("aten::add_", "optimizer"),
                ("aten::threshold_backward", "pointwise"),
                ("aten::cudnn_batch_norm", "reduce/norm"),
            ]
        );
        assert!(torch_ops(&Value::Null).is_empty());
    }

    #[test]
    fn family_rows_join_both_sides_in_family_order() {
        let torch = torch_ops(&torch_json());
        let salus = salus_profile().by_family();
        let rows = family_rows(Some(&salus), &torch);
        let names: Vec<&str> = rows.iter().map(|r| r.family.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "conv",
                "pointwise",
                "reduce/norm",
                "copy/layout",
                "optimizer"
            ]
        );
        assert_eq!(rows[0].salus_ms, Some(30.0));
        assert_eq!(rows[0].launches, Some(33));
        assert_eq!(rows[0].torch_ms, Some(6.0));
        assert_eq!(rows[0].torch_kernels, Some(50));
        // A family only PyTorch has: salus' side is 0, not unknown.
        assert_eq!(rows[2].salus_ms, Some(0.0));
        // Only salus: PyTorch's side is unknown.
        assert_eq!(rows[3].torch_ms, None);
        // Without a salus profile (the model did not lower) its columns are empty.
        let rows = family_rows(None, &torch);
        assert!(
            rows.iter()
                .all(|r| r.salus_ms.is_none() && r.torch_ms.is_some())
        );
    }

    fn sample_result() -> ProfileResult {
        let torch = torch_json();
        let profile = salus_profile();
        let all = torch_ops(&torch);
        let ok = ModelProfile {
            model: "resnet18".into(),
            families: family_rows(Some(&profile.by_family()), &all),
            salus_ops: vec![OpRow {
                op: "convolution".into(),
                family: "conv".into(),
                ms: 30.0,
                launches: 33,
                nodes: 1,
            }],
            torch_ops: all.iter().take(2).cloned().collect(),
            salus_graph_ms: Some(31.5),
            salus_graph_device_ms: Some(31.0),
            salus_eager_sum_ms: Some(profile.total_ms()),
            salus_nodes: Some(4),
            salus_launches: Some(profile.launches()),
            torch_ms: Some(10.0),
            torch_kernel_ms: Some(7.5),
            persistent_bytes: Some(100 << 20),
            ephemeral_bytes: Some(2 << 30),
            torch_max_memory_bytes: Some(3 << 30),
            gate_timed_out: false,
            errors: vec![],
        };
        let failed = ModelProfile {
            model: "transformer".into(),
            families: family_rows(None, &all),
            torch_ms: Some(12.0),
            errors: vec!["cannot trace: missing ops native_dropout".into()],
            ..ModelProfile::default()
        };
        ProfileResult {
            gpu: "NVIDIA H200".into(),
            torch_device: "NVIDIA H200".into(),
            torch_version: "2.11.0".into(),
            tf32_cudnn: Some(true),
            tf32_matmul: Some(false),
            models: vec![ok, failed],
        }
    }

    #[test]
    fn the_table_shows_totals_families_memory_and_errors() {
        let text = render(&sample_result());
        for want in [
            "GPU NVIDIA H200; PyTorch 2.11.0 on NVIDIA H200 (TF32: cuDNN on, matmul off)",
            "== resnet18",
            "graph replay 31.500 ms, eager sum of nodes 33.000 ms (4 nodes, 35 launches)",
            "PyTorch eager step 10.000 ms (kernels 7.500 ms); graph / PyTorch 3.15",
            "memory: salus P 100.0 MiB + E 2.00 GiB = 2.10 GiB; PyTorch peak 3.00 GiB (P+E / peak 0.70)",
            "top salus ops: convolution [conv] 30.000 ms x33",
            "== transformer",
            "error: cannot trace: missing ops native_dropout",
            "transformer",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
        let conv = text
            .lines()
            .find(|l| l.starts_with("conv "))
            .expect("a conv row");
        let cols: Vec<&str> = conv.split_whitespace().collect();
        assert_eq!(
            cols,
            vec![
                "conv", "30.000", "90.9%", "33", "1", "6.000", "80.0%", "50", "5.00"
            ]
        );
        let total = text
            .lines()
            .find(|l| l.starts_with("total "))
            .expect("a total row");
        assert_eq!(
            total.split_whitespace().collect::<Vec<_>>(),
            vec!["total", "33.000", "35", "4", "7.500", "70", "4.40"]
        );
        // The failed model's salus columns are dashes, PyTorch's are there.
        let failed_row = text
            .lines()
            .rev()
            .find(|l| l.starts_with("transformer"))
            .expect("a summary row");
        assert!(failed_row.contains("12.000") && failed_row.ends_with("(errors)"));
    }

    #[test]
    fn json_has_every_column() {
        let v = serde_json::to_value(sample_result()).expect("serializes");
        let m = &v["models"][0];
        for key in [
            "salus_graph_ms",
            "salus_eager_sum_ms",
            "torch_ms",
            "torch_kernel_ms",
            "persistent_bytes",
            "ephemeral_bytes",
            "torch_max_memory_bytes",
            "families",
            "salus_ops",
            "torch_ops",
            "errors",
        ] {
            assert!(!m[key].is_null(), "{key}");
        }
        assert_eq!(m["families"][0]["family"], "conv");
        assert_eq!(m["families"][0]["torch_kernels"], 50);
        assert!(v["models"][1]["salus_graph_ms"].is_null());
    }

    #[test]
    fn a_saved_profile_reads_back() {
        let dir = std::env::temp_dir().join(format!("salus-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("profile.json");
        let r = sample_result();
        std::fs::write(&path, serde_json::to_string(&r).expect("json")).expect("write");
        assert_eq!(load(&path), Ok(r));
        std::fs::write(&path, r#"{"error": "no usable GPU: no CUDA driver"}"#).expect("write");
        let err = load(&path).expect_err("a failed run");
        assert!(err.contains("no usable GPU"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bytes_read_as_a_person_would() {
        assert_eq!(human_bytes(512), "0.5 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert_eq!(human_bytes(5 << 29), "2.50 GiB");
    }
}
