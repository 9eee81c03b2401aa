//! Fluid's evaluation (dissertation ch. 3, Fig. 3.7 and 3.8) in virtual time: each tuning
//! algorithm on a cluster of [`DEVICES`] devices, under four systems:
//!
//! - `fifo`: one trial per device, in order (Ray Tune's default of one GPU per trial);
//! - `pack`: every trial sent at once to the device with the fewest trials where its
//!   memory fits, each device's salusd packing them under PACK;
//! - `static_fluid`: `salus-fluid`'s planner with StaticFluid alone: packing degree `c`
//!   from profiled iteration times (Eq. 3.1), scaling degree `d`, widths by remaining
//!   runtime (Algorithm 3.1);
//! - `fluid`: StaticFluid and DynamicFluid (Algorithm 3.2): freed devices go to the
//!   running trials that gain most, at a rescale cost.
//!
//! Asynchronous algorithms keep as many trials out as the system runs at once: one per
//! device under FIFO, as many as memory allows under PACK, `c` per device under Fluid.

pub mod algorithms;
pub mod cluster;
pub mod dispatch;
pub mod workload;

use std::collections::BTreeMap;

use salus_fluid::{PlannerConfig, RuntimeModel, packing_degree};
use serde::Serialize;

use crate::sim::SimError;
use algorithms::{ALGORITHMS, algorithm};
use dispatch::Dispatcher;
use workload::{Config, DEVICE_BYTES, DEVICES, RESCALE_COST_S, packed_iteration_s, scaling_factor};

/// The compared systems, by their names in the output.
pub const SYSTEMS: [&str; 4] = ["fifo", "pack", "static_fluid", "fluid"];

/// Eq. 3.1's threshold `O_th`: packing one more trial must save at least 10% of a trial's
/// time.
pub const PACKING_THRESHOLD: f64 = 0.1;
/// The scaling threshold: one more device must save at least half a device's worth.
pub const SCALING_THRESHOLD: f64 = 0.5;
/// Iterations Fluid runs at each packing level when profiling. Profiling happens the first
/// time the planner packs trials (a run where every trial gets whole devices needs no `c`)
/// and is charged as a pause of the whole cluster before the first trial starts.
pub const PROFILE_ITERATIONS: f64 = 3.0;
/// Packing levels Fluid profiles at most.
pub const PROFILE_MAX_PACKING: usize = 6;

/// What Fluid's profiling found for a configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Profile {
    /// Mean iteration time with 1, 2, ... copies of the trial on one device.
    pub packing_times_s: Vec<f64>,
    /// Iteration time on 1, 2, ... devices (modelled, as Paleo estimates it).
    pub scaling_times_s: Vec<f64>,
    /// The packing degree `c` (also capped by memory).
    pub c: usize,
    /// The scaling degree `d`.
    pub d: usize,
    /// Seconds the profiling took, before the first trial starts.
    pub cost_s: f64,
    /// The runtime model DynamicFluid compares widths with.
    pub model: RuntimeModel,
}

/// Fluid's profiling of `config`: packing levels 1, 2, ... until the marginal benefit
/// (Eq. 3.1) drops to the threshold, then the model cut at the degrees.
pub fn profile(config: &Config) -> Profile {
    let mut times = vec![packed_iteration_s(config, 1)];
    while times.len() < PROFILE_MAX_PACKING
        && packing_degree(&times, PACKING_THRESHOLD) == times.len()
    {
        times.push(packed_iteration_s(config, times.len() + 1));
    }
    let scaling: Vec<f64> = (1..=DEVICES)
        .map(|w| config.iteration_s() * scaling_factor(w))
        .collect();
    let mut model =
        RuntimeModel::from_measurements(&times, PACKING_THRESHOLD, &scaling, SCALING_THRESHOLD);
    let fits = (DEVICE_BYTES / (config.persistent_bytes() + config.ephemeral_bytes())) as usize;
    model.packing.truncate(fits.max(1));
    Profile {
        cost_s: times.iter().map(|t| t * PROFILE_ITERATIONS).sum(),
        packing_times_s: times,
        scaling_times_s: scaling,
        c: model.c(),
        d: model.d(),
        model,
    }
}

/// One algorithm under one system.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SystemRun {
    /// From the start to the last trial's end, profiling included.
    pub makespan_s: f64,
    /// Average busy fraction of the devices.
    pub utilization: f64,
    /// Trials resized by DynamicFluid.
    pub rescales: u64,
    /// The best accuracy a trial reached at the full budget.
    pub best_accuracy: f64,
}

/// Runs algorithm `name` (seed `seed`) under `system`.
pub fn run_system(
    name: &str,
    seed: u64,
    system: &str,
) -> Result<(SystemRun, Option<Profile>), SimError> {
    let unknown = |what: &str| SimError::Stalled {
        at_s: 0.0,
        unfinished: 0,
        detail: format!("unknown {what}"),
    };
    let mut algo = algorithm(name, seed).ok_or_else(|| unknown(name))?;
    // The largest configuration's footprint bounds PACK's packing.
    let largest = Config { size: 1.0, lr: 0.5 };
    let per_device_fit =
        (DEVICE_BYTES / (largest.persistent_bytes() + largest.ephemeral_bytes())) as usize;
    let (dispatcher, concurrency, profiled) = match system {
        "fifo" => (Dispatcher::fifo(DEVICES), DEVICES, None),
        "pack" => (
            Dispatcher::pack(DEVICES, DEVICE_BYTES),
            DEVICES * per_device_fit,
            None,
        ),
        "static_fluid" | "fluid" => {
            // Profile a trial of the first group: the algorithm's first configuration.
            let mut probe = algorithm(name, seed).ok_or_else(|| unknown(name))?;
            let first = probe.next(DEVICES).first().map_or(0, |r| r.trial);
            let p = profile(&probe.config(first));
            let config = PlannerConfig {
                devices: DEVICES,
                model: p.model.clone(),
                rescale_cost_s: RESCALE_COST_S,
                dynamic: system == "fluid",
            };
            (Dispatcher::fluid(config), DEVICES * p.c, Some(p))
        }
        other => return Err(unknown(other)),
    };
    let report = cluster::run(algo.as_mut(), dispatcher, DEVICES, concurrency, 0.0)?;
    let profiling_s = match &profiled {
        Some(p) if report.shared_placements > 0 => p.cost_s,
        _ => 0.0,
    };
    let makespan_s = report.makespan_s + profiling_s;
    Ok((
        SystemRun {
            makespan_s,
            utilization: report.utilization * report.makespan_s / makespan_s,
            rescales: report.rescales,
            best_accuracy: report.best_accuracy.unwrap_or(f64::NAN),
        },
        profiled,
    ))
}

/// One algorithm under every system.
#[derive(Debug, Clone, Serialize)]
pub struct AlgorithmResult {
    /// Per system.
    pub makespan_s: BTreeMap<String, f64>,
    /// Per system.
    pub utilization: BTreeMap<String, f64>,
    /// FIFO's makespan over each system's, less 1 (the chapter's "speed-up").
    pub speedup_vs_fifo: BTreeMap<String, f64>,
    /// Trials resized, per system.
    pub rescales: BTreeMap<String, u64>,
    /// The best accuracy reached at the full budget, per system (the algorithms decide
    /// from results as they arrive, so the order trials finish in can change it).
    pub best_accuracy: BTreeMap<String, f64>,
    /// The packing degree `c` Fluid measured.
    pub c: usize,
    /// The scaling degree `d`.
    pub d: usize,
    /// The chapter's improvement range for this algorithm, as fractions (Fig. 3.7).
    pub chapter_speedup: Option<(f64, f64)>,
}

/// Results of [`fluid`].
#[derive(Debug, Clone, Serialize)]
pub struct FluidResult {
    /// Seed of the algorithms' sampling and the accuracy noise.
    pub seed: u64,
    /// Devices of the cluster.
    pub devices: usize,
    /// Per algorithm.
    pub algorithms: BTreeMap<String, AlgorithmResult>,
}

/// The chapter's reported makespan improvement of Fluid over the default execution, per
/// algorithm (Section 3.6.2): 30-100% for the synchronous stage-based ones, 10-30% for the
/// asynchronous ones; "limited" for PBT and not given for grid search (which the chapter
/// uses for microbenchmarks).
pub fn chapter_speedup(algorithm: &str) -> Option<(f64, f64)> {
    match algorithm {
        "hyperband" | "sync_bohb" => Some((0.3, 1.0)),
        "asha" | "bohb" => Some((0.1, 0.3)),
        _ => None,
    }
}

/// Fig. 3.7 and 3.8: every algorithm under every system.
pub fn fluid(seed: u64) -> Result<FluidResult, SimError> {
    let mut algorithms = BTreeMap::new();
    for name in ALGORITHMS {
        let mut result = AlgorithmResult {
            makespan_s: BTreeMap::new(),
            utilization: BTreeMap::new(),
            speedup_vs_fifo: BTreeMap::new(),
            rescales: BTreeMap::new(),
            best_accuracy: BTreeMap::new(),
            c: 1,
            d: 1,
            chapter_speedup: chapter_speedup(name),
        };
        for system in SYSTEMS {
            let (run, profile) = run_system(name, seed, system)?;
            if let Some(p) = profile {
                result.c = p.c;
                result.d = p.d;
            }
            result.makespan_s.insert(system.into(), run.makespan_s);
            result.utilization.insert(system.into(), run.utilization);
            result.rescales.insert(system.into(), run.rescales);
            result
                .best_accuracy
                .insert(system.into(), run.best_accuracy);
        }
        let fifo = result.makespan_s["fifo"];
        for (system, m) in &result.makespan_s {
            result
                .speedup_vs_fifo
                .insert(system.clone(), fifo / m - 1.0);
        }
        algorithms.insert(name.to_string(), result);
    }
    Ok(FluidResult {
        seed,
        devices: DEVICES,
        algorithms,
    })
}

/// One target checked against a result.
#[derive(Debug, Clone, Serialize)]
pub struct FluidCheck {
    /// What is measured.
    pub name: String,
    /// The measured value.
    pub value: f64,
    /// The goal, in words.
    pub goal: String,
    /// Whether the value meets it.
    pub met: bool,
}

/// The targets: Fluid (StaticFluid + DynamicFluid) improves on FIFO at least as much as the
/// chapter's lower figure for each algorithm it gives one for, and its makespan is never
/// longer than plain PACK's.
pub fn fluid_targets(result: &FluidResult) -> Vec<FluidCheck> {
    let mut checks = Vec::new();
    for (name, r) in &result.algorithms {
        let speedup = r.speedup_vs_fifo.get("fluid").copied().unwrap_or(f64::NAN);
        if let Some((lo, hi)) = r.chapter_speedup {
            checks.push(FluidCheck {
                name: format!("{name}: FIFO / Fluid makespan - 1"),
                value: speedup,
                goal: format!(">= {lo:.2} (chapter {:.0}-{:.0}%)", lo * 100.0, hi * 100.0),
                met: speedup >= lo,
            });
        }
        let ratio = r.makespan_s["fluid"] / r.makespan_s["pack"];
        checks.push(FluidCheck {
            name: format!("{name}: Fluid / PACK makespan"),
            value: ratio,
            goal: "<= 1".into(),
            met: ratio <= 1.0 + 1e-9,
        });
    }
    checks
}

#[cfg(test)]
mod tests;
