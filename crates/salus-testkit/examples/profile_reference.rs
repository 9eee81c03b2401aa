//! Times every node of a reference run's training step on the CPU device and prints where
//! the time goes, per op and per node:
//! `cargo run --release -p salus-testkit --example profile_reference -- target/engine-bench/cnn
//! [STEPS [NODES]]` (NODES: how many of the slowest nodes to list, 12 by default).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use salus_testkit::reference::ReferenceRun;

fn run(dir: &Path, steps: usize, listed: usize) -> Result<(), String> {
    let run = ReferenceRun::load(dir)?;
    let (device, at) = run.on_cpu()?;
    for k in 0..2 {
        run.step(&device, at, k).map_err(|e| e.to_string())?;
    }
    let graph = run.program.graph();
    let mut total = vec![Duration::ZERO; graph.nodes.len()];
    let mut times = Vec::new();
    let mut whole = Duration::ZERO;
    for k in 0..steps {
        let outcome = device
            .run_timed(&run.program, at, &run.feeds(k), &mut times)
            .map_err(|e| e.to_string())?;
        whole += outcome.duration;
        for (t, d) in total.iter_mut().zip(&times) {
            *t += *d;
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
    let mut by_op: BTreeMap<&str, (Duration, usize)> = BTreeMap::new();
    for (node, t) in graph.nodes.iter().zip(&total) {
        let e = by_op.entry(node.op.name()).or_default();
        e.0 += *t;
        e.1 += 1;
    }
    let mut ops: Vec<_> = by_op.into_iter().collect();
    ops.sort_by_key(|o| std::cmp::Reverse(o.1.0));
    println!("{}: {:.3} ms per step", dir.display(), ms(whole));
    for (op, (t, n)) in ops {
        println!("  {op:<36} {:>9.3} ms {n:>5} nodes", ms(t));
    }
    let mut nodes: Vec<usize> = (0..graph.nodes.len()).collect();
    nodes.sort_by_key(|&i| std::cmp::Reverse(total[i]));
    println!("slowest nodes:");
    for &i in nodes.iter().take(listed) {
        let node = &graph.nodes[i];
        let shapes: Vec<String> = node
            .inputs
            .iter()
            .map(|t| t.map_or("-".into(), |t| graph.tensors[t].ty.to_string()))
            .collect();
        println!(
            "  {:>9.3} ms {} {} [{}]",
            ms(total[i]),
            node.op.name(),
            node.name,
            shapes.join(", ")
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(dir) = args.next() else {
        eprintln!("usage: profile_reference DIR [STEPS [NODES]]");
        return ExitCode::FAILURE;
    };
    let steps = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let listed = args.next().and_then(|s| s.parse().ok()).unwrap_or(12);
    match run(Path::new(&dir), steps, listed) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
