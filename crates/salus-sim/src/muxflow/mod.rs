//! MuxFlow (Zhao et al., "MuxFlow: Efficient and Safe GPU Sharing in Large-Scale
//! Production Deep Learning Clusters", §4-5 and 7) in the simulator: online services and
//! offline training sharing GPUs.
//!
//! - [`single`]: one GPU driven through the real `salus_core::Scheduler` (an online
//!   serving session and offline training sessions): salus with protection, without it,
//!   time-sharing and online-only.
//! - [`cluster`]: a cluster of GPUs with an analytic per-GPU sharing model ([`gpu`]),
//!   offline jobs placed by MuxFlow's matching ([`km`] over [`predictor`]'s predicted
//!   speeds) or first fit, against MuxFlow's baselines (Fig. 11): online-only,
//!   time-sharing, priority-based time-sharing.
//!
//! `salus-sim experiment muxflow` runs both and checks the targets.

pub mod cluster;
pub mod gpu;
pub mod km;
pub mod predictor;
pub mod single;
pub mod workload;

#[cfg(test)]
mod tests;

use salus_core::protection::{OfflineShare, ProtectionConfig};
use serde::Serialize;

use crate::experiments::TargetCheck;
use crate::sim::SimError;

/// Both parts of the experiment for one seed.
#[derive(Debug, Clone, Serialize)]
pub struct MuxflowResult {
    /// The seed.
    pub seed: u64,
    /// One GPU through the core.
    pub single_gpu: single::SingleExperiment,
    /// The cluster mode.
    pub cluster: cluster::ClusterExperiment,
}

/// The SLO salus' protection is given unless told otherwise: 1.05 times the service's
/// p99 alone (its dedicated deployment's figure, as an operator would set it).
pub const DEFAULT_SLO_FACTOR: f64 = 1.05;

/// What the experiment lets one vary of salus' protection.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Knobs {
    /// The online SLO over each service's p99 alone (`--slo-factor`).
    pub slo_factor: f64,
    /// `ProtectionConfig::offline_compute_share` fixed (`--compute-share`): the share of
    /// the device an offline iteration gets while an online iteration runs. `None`: the
    /// core learns it, from its default (`OfflineShare`).
    pub compute_share: Option<f64>,
    /// `ProtectionConfig::target_load` (`--target-load`): the controller's setpoint, the
    /// mean slowdown of online iterations it steers to (one GPU through the core).
    pub target_load: f64,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            slo_factor: DEFAULT_SLO_FACTOR,
            compute_share: None,
            target_load: salus_core::protection::ProtectionConfig::default().target_load,
        }
    }
}

impl Knobs {
    /// The protection the core runs with for these knobs (salus with protection).
    pub fn protection(&self) -> ProtectionConfig {
        let default = ProtectionConfig::default();
        ProtectionConfig {
            offline_compute_share: self.compute_share.unwrap_or(default.offline_compute_share),
            dynamic_compute_share: self.compute_share.is_none(),
            target_load: self.target_load,
            ..default
        }
    }

    /// The offline share salus' protection starts from, learned or fixed as the knobs say.
    pub fn offline_share(&self) -> OfflineShare {
        OfflineShare::new(&self.protection())
    }
}

/// `salus-sim experiment muxflow` for `seed`.
pub fn experiment(seed: u64) -> Result<MuxflowResult, SimError> {
    experiment_with(seed, Knobs::default())
}

/// [`experiment`] with salus' protection as `knobs` say.
pub fn experiment_with(seed: u64, knobs: Knobs) -> Result<MuxflowResult, SimError> {
    Ok(MuxflowResult {
        seed,
        single_gpu: single::single_with(seed, knobs)?,
        cluster: cluster::cluster_with(seed, knobs),
    })
}

/// The targets, for salus with protection on one GPU and salus' protection with
/// matching on the cluster: online p99 within 10% of online-only (MuxFlow: 15.3%),
/// offline throughput at least 80% of what the idle capacity allows, GPU utilisation at
/// least 2.9 times online-only's (MuxFlow's production gain, 26% to 76%).
pub fn targets(result: &MuxflowResult) -> Vec<TargetCheck> {
    let mut checks = Vec::new();
    let mut three = |p99: f64, idle: f64, gain: f64, names: [&'static str; 3]| {
        checks.push(TargetCheck::new(
            names[0],
            p99,
            "<= 1.10 (MuxFlow 1.153)",
            p99 <= 1.10,
        ));
        checks.push(TargetCheck::new(names[1], idle, ">= 0.80", idle >= 0.80));
        checks.push(TargetCheck::new(
            names[2],
            gain,
            ">= 2.9 (MuxFlow production: 76% / 26%)",
            gain >= 2.9,
        ));
    };
    if let Some(s) = result.single_gpu.systems.get("salus_protection") {
        three(
            s.online_p99_slowdown,
            s.offline_idle_capacity_fraction,
            s.utilization_gain,
            [
                "one GPU, salus with protection: online p99 / online-only",
                "one GPU, salus with protection: offline work / idle capacity",
                "one GPU, salus with protection: utilization / online-only",
            ],
        );
    }
    if let Some(s) = result.cluster.systems.get("salus_matching") {
        three(
            s.online_p99_slowdown,
            s.offline_idle_capacity_fraction,
            s.utilization_gain,
            [
                "cluster, salus protection + matching: online p99 / online-only",
                "cluster, salus protection + matching: offline work / idle capacity",
                "cluster, salus protection + matching: utilization / online-only",
            ],
        );
    }
    checks
}
