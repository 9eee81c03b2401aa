//! The `plan` suite: for each serialized graph, its size, P, E, the lower bound on E, the
//! ratio E / bound (target <= 1.10), and how long validation and planning take.

use std::path::{Path, PathBuf};
use std::time::Instant;

use salus_graph::{Graph, Limits, check};
use serde::Serialize;

#[derive(Debug, Serialize)]
struct GraphResult {
    graph: String,
    tensors: usize,
    nodes: usize,
    persistent_bytes: u64,
    ephemeral_bytes: u64,
    lower_bound: u64,
    /// The largest kernel scratch buffer (part of E and of the lower bound: it is live).
    scratch_bytes: u64,
    ratio: f64,
    check_ms: f64,
}

fn name_of(path: &Path) -> String {
    // reference/<model>/graph.pb names the model; otherwise the file stem.
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
    match (stem.as_deref(), path.parent().and_then(Path::file_name)) {
        (Some("graph"), Some(dir)) => dir.to_string_lossy().into_owned(),
        (Some(stem), _) => stem.to_string(),
        _ => path.display().to_string(),
    }
}

pub fn run(paths: &[PathBuf], json: bool) -> Result<(), String> {
    let mut results = Vec::new();
    for path in paths {
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let start = Instant::now();
        let graph = Graph::decode(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let checked =
            check(&graph, &Limits::default()).map_err(|e| format!("{}: {e}", path.display()))?;
        let check_ms = start.elapsed().as_secs_f64() * 1e3;
        let plan = &checked.plan;
        results.push(GraphResult {
            graph: name_of(path),
            tensors: graph.tensors.len(),
            nodes: graph.nodes.len(),
            persistent_bytes: plan.persistent_bytes,
            ephemeral_bytes: plan.ephemeral_bytes,
            lower_bound: plan.lower_bound,
            scratch_bytes: plan.scratch_bytes,
            ratio: plan.overhead(),
            check_ms,
        });
    }
    if json {
        let value = serde_json::json!({ "graphs": results });
        println!(
            "{}",
            serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!(
        "{:<16} {:>8} {:>7} {:>12} {:>12} {:>12} {:>7} {:>9}",
        "graph", "tensors", "nodes", "P (bytes)", "E (bytes)", "bound", "E/bound", "check ms"
    );
    for r in &results {
        println!(
            "{:<16} {:>8} {:>7} {:>12} {:>12} {:>12} {:>7.3} {:>9.2}",
            r.graph,
            r.tensors,
            r.nodes,
            r.persistent_bytes,
            r.ephemeral_bytes,
            r.lower_bound,
            r.ratio,
            r.check_ms
        );
    }
    Ok(())
}
