//! The Salus experiments, reproduced in virtual time: the long training trace (Table 2.1),
//! hyperparameter tuning makespan (Fig. 2.10) and fair sharing (Fig. 2.9).
//!
//! Every experiment takes a seed; the generated workloads vary with it and the conclusions
//! must hold for any of them.

use std::collections::BTreeMap;

use salus_core::PolicyKind;
use serde::Serialize;

use crate::catalog::{self, Workload};
use crate::rng::{Rng, bounded_pareto_quantile};
use crate::sim::{SimConfig, SimError, Summary, simulate};
use crate::trace::JobSpec;

/// Jobs in the long training trace.
pub const TRAINING_JOBS: usize = 100;
/// Mean time between arrivals in the training trace, in seconds.
pub const TRAINING_MEAN_INTERARRIVAL_S: f64 = 5.0;
/// Shape of the bounded Pareto job-duration distribution (heavy tail: most jobs take
/// minutes, a few take hours).
pub const TRAINING_DURATION_ALPHA: f64 = 0.5;
/// Shortest and longest solo job duration in the training trace, in seconds.
pub const TRAINING_DURATION_RANGE_S: (f64, f64) = (15.0, 7200.0);

fn job_from(workload: &Workload, id: String, arrival_s: f64, solo_s: f64) -> JobSpec {
    JobSpec {
        id,
        arrival_s,
        iterations: ((solo_s / workload.iteration_s).round() as u64).max(1),
        iteration_s: workload.iteration_s,
        persistent_bytes: workload.persistent_bytes,
        ephemeral_bytes: workload.ephemeral_bytes,
        compute_share: workload.compute_share,
        workload: Some(workload.name()),
    }
}

/// The long training trace. Solo durations are the 100 evenly spaced quantiles of a
/// bounded Pareto distribution (the heavy tail production clusters show), so every seed
/// has the same duration mix; the seed decides which job gets which duration, which of
/// the 45 catalog workloads each job runs (uniformly), and the Poisson arrival times.
pub fn training_trace(seed: u64) -> Vec<JobSpec> {
    let mut rng = Rng::new(seed);
    let workloads = catalog::catalog();
    let (lo, hi) = TRAINING_DURATION_RANGE_S;
    let mut durations: Vec<f64> = (0..TRAINING_JOBS)
        .map(|i| {
            let u = (i as f64 + 0.5) / TRAINING_JOBS as f64;
            bounded_pareto_quantile(u, TRAINING_DURATION_ALPHA, lo, hi)
        })
        .collect();
    rng.shuffle(&mut durations);
    let mut arrival = 0.0;
    durations
        .into_iter()
        .enumerate()
        .map(|(i, solo)| {
            if i > 0 {
                arrival += rng.exponential(TRAINING_MEAN_INTERARRIVAL_S);
            }
            let workload = &workloads[rng.index(workloads.len())];
            job_from(workload, format!("job{i:03}"), arrival, solo)
        })
        .collect()
}

/// Results of [`training`]: the papers' statistics per policy.
#[derive(Debug, Clone, Serialize)]
pub struct TrainingResult {
    /// The seed the trace was drawn with.
    pub seed: u64,
    /// Jobs in the trace.
    pub jobs: usize,
    /// Per policy name.
    pub policies: BTreeMap<String, Summary>,
}

/// Replays `jobs` under each policy on the reference GPU.
pub fn compare_policies(jobs: &[JobSpec], seed: u64) -> Result<TrainingResult, SimError> {
    let mut policies = BTreeMap::new();
    for policy in PolicyKind::ALL {
        let report = simulate(jobs, &SimConfig::reference(policy))?;
        policies.insert(policy.name().to_string(), report.summary());
    }
    Ok(TrainingResult {
        seed,
        jobs: jobs.len(),
        policies,
    })
}

/// Salus Table 2.1: the long training trace under FIFO, SRTF, PACK and FAIR.
pub fn training(seed: u64) -> Result<TrainingResult, SimError> {
    compare_policies(&training_trace(seed), seed)
}

/// Jobs per hyperparameter tuning set.
pub const TUNING_JOBS: usize = 300;
/// The two tuning sets of the paper.
pub const TUNING_SETS: [&str; 2] = ["superres_128", "resnet50_50"];
/// Solo duration range of one tuning trial, in seconds (trials differ by hyperparameters).
pub const TUNING_DURATION_RANGE_S: (f64, f64) = (30.0, 90.0);

/// One tuning set's makespans.
#[derive(Debug, Clone, Serialize)]
pub struct TuningSet {
    /// Makespan running the trials one at a time.
    pub fifo_makespan_s: f64,
    /// Makespan packing trials into lanes.
    pub pack_makespan_s: f64,
    /// `fifo_makespan_s / pack_makespan_s`.
    pub speedup: f64,
}

/// Results of [`tuning`].
#[derive(Debug, Clone, Serialize)]
pub struct TuningResult {
    /// The seed the trial durations were drawn with.
    pub seed: u64,
    /// Per workload name.
    pub sets: BTreeMap<String, TuningSet>,
}

/// A tuning set: `TUNING_JOBS` trials of one workload, all arriving at once.
pub fn tuning_trace(workload: &Workload, seed: u64) -> Vec<JobSpec> {
    let mut rng = Rng::new(seed);
    let (lo, hi) = TUNING_DURATION_RANGE_S;
    (0..TUNING_JOBS)
        .map(|i| job_from(workload, format!("trial{i:03}"), 0.0, rng.uniform(lo, hi)))
        .collect()
}

/// Salus Fig. 2.10: makespan of 300 trials of resnet50_50 and of superres_128, FIFO vs PACK.
pub fn tuning(seed: u64) -> Result<TuningResult, SimError> {
    let mut sets = BTreeMap::new();
    for name in TUNING_SETS {
        let Some(workload) = catalog::by_name(name) else {
            continue;
        };
        let jobs = tuning_trace(workload, seed);
        let fifo = simulate(&jobs, &SimConfig::reference(PolicyKind::Fifo))?.summary();
        let pack = simulate(&jobs, &SimConfig::reference(PolicyKind::Pack))?.summary();
        sets.insert(
            name.to_string(),
            TuningSet {
                fifo_makespan_s: fifo.makespan_s,
                pack_makespan_s: pack.makespan_s,
                speedup: fifo.makespan_s / pack.makespan_s,
            },
        );
    }
    Ok(TuningResult { seed, sets })
}

/// The workload of the fair-sharing experiment.
pub const FAIR_WORKLOAD: &str = "inception3_50";
/// When the three jobs start, in seconds.
pub const FAIR_STARTS_S: [f64; 3] = [0.0, 15.0, 30.0];
/// Width of the windows shares are measured over, in seconds.
pub const FAIR_WINDOW_S: f64 = 30.0;

/// One point of the fair-sharing time series.
#[derive(Debug, Clone, Serialize)]
pub struct SharePoint {
    /// Start of the window, in seconds.
    pub t_s: f64,
    /// Each job's share of the images processed in the window.
    pub shares: Vec<f64>,
    /// All jobs together, images per second.
    pub images_per_s: f64,
}

/// Results of [`fair_share`].
#[derive(Debug, Clone, Serialize)]
pub struct FairShareResult {
    /// The seed the job lengths were drawn with.
    pub seed: u64,
    /// Workload of all three jobs.
    pub workload: String,
    /// When each job started and finished, in seconds.
    pub jobs: Vec<(f64, f64)>,
    /// Width of the share windows, in seconds.
    pub window_s: f64,
    /// Shares per window, sliding by one second.
    pub series: Vec<SharePoint>,
    /// Largest relative gap between a job's share and an equal share, over windows that
    /// lie wholly in the time all three jobs run.
    pub max_share_deviation: f64,
    /// The same measure with windows of 10 s: closer to one iteration per job per slot, so
    /// it shows the granularity of iteration-level time sharing.
    pub max_share_deviation_10s: f64,
}

/// The fair-sharing trace: three jobs of `workload` starting at [`FAIR_STARTS_S`], each
/// 180-240 s long alone.
pub fn fair_share_trace(workload: &Workload, seed: u64) -> Vec<JobSpec> {
    let mut rng = Rng::new(seed);
    FAIR_STARTS_S
        .iter()
        .enumerate()
        .map(|(i, &start)| {
            job_from(
                workload,
                format!("job{i}"),
                start,
                rng.uniform(180.0, 240.0),
            )
        })
        .collect()
}

/// Salus Fig. 2.9: three inception3_50 jobs starting at 0, 15 and 30 s under FAIR; each
/// job's share of the GPU's throughput over time.
pub fn fair_share(seed: u64) -> Result<FairShareResult, SimError> {
    let workload = catalog::by_name(FAIR_WORKLOAD).ok_or_else(|| SimError::Stalled {
        at_s: 0.0,
        unfinished: 0,
        detail: format!("{FAIR_WORKLOAD} missing from the catalog"),
    })?;
    let jobs = fair_share_trace(workload, seed);
    let config = SimConfig {
        sample_s: Some(1.0),
        ..SimConfig::reference(PolicyKind::Fair)
    };
    let report = simulate(&jobs, &config)?;
    let spans: Vec<(f64, f64)> = report
        .jobs
        .iter()
        .map(|j| (j.arrival_s, j.finished_s.unwrap_or(f64::NAN)))
        .collect();
    let all_start = FAIR_STARTS_S.iter().copied().fold(0.0, f64::max);
    let all_end = spans.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
    let images = |progress: f64| progress / workload.iteration_s * batch_size(workload);
    let window_stats = |width: usize, t: usize| {
        let sums: Vec<f64> = (0..jobs.len())
            .map(|j| {
                report.progress[t..(t + width).min(report.progress.len())]
                    .iter()
                    .map(|b| b[j])
                    .sum()
            })
            .collect();
        let total: f64 = sums.iter().sum();
        let shares: Vec<f64> = sums
            .iter()
            .map(|s| if total > 0.0 { s / total } else { 0.0 })
            .collect();
        (shares, images(total) / width as f64)
    };
    let deviation = |width: f64| {
        let w = width as usize;
        let mut worst: f64 = 0.0;
        let mut t = all_start.ceil() as usize;
        while (t + w) as f64 <= all_end {
            let (shares, _) = window_stats(w, t);
            let equal = 1.0 / jobs.len() as f64;
            for s in shares {
                worst = worst.max((s - equal).abs() / equal);
            }
            t += 1;
        }
        worst
    };
    let w = FAIR_WINDOW_S as usize;
    let series = (0..report.progress.len().saturating_sub(w - 1))
        .map(|t| {
            let (shares, images_per_s) = window_stats(w, t);
            SharePoint {
                t_s: t as f64,
                shares,
                images_per_s,
            }
        })
        .collect();
    Ok(FairShareResult {
        seed,
        workload: FAIR_WORKLOAD.to_string(),
        jobs: spans,
        window_s: FAIR_WINDOW_S,
        series,
        max_share_deviation: deviation(FAIR_WINDOW_S),
        max_share_deviation_10s: deviation(10.0),
    })
}

/// Every trace family the experiments draw, by name, for one seed: the long training trace,
/// the two tuning sets and the fair-sharing trace.
pub fn trace_families(seed: u64) -> Vec<(String, Vec<JobSpec>)> {
    let mut families = vec![("training".to_string(), training_trace(seed))];
    for name in TUNING_SETS {
        if let Some(w) = catalog::by_name(name) {
            families.push((format!("tuning {name}"), tuning_trace(w, seed)));
        }
    }
    if let Some(w) = catalog::by_name(FAIR_WORKLOAD) {
        families.push(("fair-share".to_string(), fair_share_trace(w, seed)));
    }
    families
}

/// One trace family under every policy.
#[derive(Debug, Clone, Serialize)]
pub struct FamilyResult {
    /// The family's name.
    pub family: String,
    /// Per policy name.
    pub policies: BTreeMap<String, Summary>,
}

/// How far one policy is from the best policy of each run, over seeds: for each measure,
/// the policy's value over the best value any policy reached on the same trace.
#[derive(Debug, Clone, Serialize)]
pub struct BehindBest {
    /// Trace family.
    pub family: String,
    /// Policy name.
    pub policy: String,
    /// Average JCT over the best: median and worst over the seeds.
    pub avg_jct: (f64, f64),
    /// 95th percentile JCT over the best: median and worst.
    pub p95_jct: (f64, f64),
    /// Makespan over the best: median and worst.
    pub makespan: (f64, f64),
    /// Best utilisation over this policy's: median and worst.
    pub utilisation: (f64, f64),
}

/// Results of [`policies`].
#[derive(Debug, Clone, Serialize)]
pub struct PoliciesResult {
    /// The seed of the detailed tables.
    pub seed: u64,
    /// Every family under every policy, for `seed`.
    pub families: Vec<FamilyResult>,
    /// Seeds 1..=`seeds` summarised per family and policy.
    pub seeds: u64,
    /// Each policy's distance from the best, per family.
    pub behind_best: Vec<BehindBest>,
}

fn median_and_max(mut v: Vec<f64>) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}

/// Every policy on every trace family: the detailed results for `seed`, and each policy's
/// ratio to the best policy of each trace over seeds `1..=seeds`.
pub fn policies(seed: u64, seeds: u64) -> Result<PoliciesResult, SimError> {
    let run = |jobs: &[JobSpec]| -> Result<BTreeMap<String, Summary>, SimError> {
        let mut out = BTreeMap::new();
        for policy in PolicyKind::ALL {
            out.insert(
                policy.name().to_string(),
                simulate(jobs, &SimConfig::reference(policy))?.summary(),
            );
        }
        Ok(out)
    };
    let families = trace_families(seed)
        .into_iter()
        .map(|(family, jobs)| {
            Ok(FamilyResult {
                family,
                policies: run(&jobs)?,
            })
        })
        .collect::<Result<Vec<_>, SimError>>()?;
    // ratios[family][policy] = per-seed ratios of (avg JCT, p95 JCT, makespan, utilisation).
    let mut ratios: BTreeMap<(usize, String), [Vec<f64>; 4]> = BTreeMap::new();
    let mut names: Vec<String> = Vec::new();
    for s in 1..=seeds {
        for (f, (family, jobs)) in trace_families(s).into_iter().enumerate() {
            if names.len() <= f {
                names.push(family);
            }
            let results = run(&jobs)?;
            let best = |get: &dyn Fn(&Summary) -> f64, lowest: bool| {
                results.values().map(get).fold(
                    if lowest { f64::INFINITY } else { 0.0 },
                    if lowest { f64::min } else { f64::max },
                )
            };
            let b_jct = best(&|x| x.avg_jct_s, true);
            let b_p95 = best(&|x| x.p95_jct_s, true);
            let b_mk = best(&|x| x.makespan_s, true);
            let b_util = best(&|x| x.utilisation, false);
            for (name, x) in &results {
                let r = ratios.entry((f, name.clone())).or_default();
                r[0].push(x.avg_jct_s / b_jct);
                r[1].push(x.p95_jct_s / b_p95);
                r[2].push(x.makespan_s / b_mk);
                r[3].push(b_util / x.utilisation);
            }
        }
    }
    let behind_best = ratios
        .into_iter()
        .map(|((f, policy), [jct, p95, mk, util])| BehindBest {
            family: names[f].clone(),
            policy,
            avg_jct: median_and_max(jct),
            p95_jct: median_and_max(p95),
            makespan: median_and_max(mk),
            utilisation: median_and_max(util),
        })
        .collect();
    Ok(PoliciesResult {
        seed,
        families,
        seeds,
        behind_best,
    })
}

fn batch_size(workload: &Workload) -> f64 {
    workload.batch.parse().unwrap_or(1.0)
}

/// One target of the issue that set up these experiments, checked against a result.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    /// What is measured.
    pub name: &'static str,
    /// The measured value.
    pub value: f64,
    /// The goal, in words.
    pub goal: &'static str,
    /// Whether the value meets the goal.
    pub met: bool,
}

impl TargetCheck {
    /// A checked target.
    pub fn new(name: &'static str, value: f64, goal: &'static str, met: bool) -> Self {
        TargetCheck {
            name,
            value,
            goal,
            met,
        }
    }
}

/// Table 2.1 targets: SRTF average JCT at least 3x better than FIFO's; PACK makespan below
/// FIFO's; FAIR average JCT between SRTF's and FIFO's.
pub fn training_targets(result: &TrainingResult) -> Vec<TargetCheck> {
    let get = |p: &str| result.policies.get(p).copied();
    let (Some(fifo), Some(srtf), Some(pack), Some(fair)) =
        (get("fifo"), get("srtf"), get("pack"), get("fair"))
    else {
        return Vec::new();
    };
    let srtf_gain = fifo.avg_jct_s / srtf.avg_jct_s;
    let pack_gain = fifo.makespan_s / pack.makespan_s;
    let fair_position = (fifo.avg_jct_s - fair.avg_jct_s) / (fifo.avg_jct_s - srtf.avg_jct_s);
    vec![
        TargetCheck::new(
            "FIFO / SRTF average JCT",
            srtf_gain,
            ">= 3 (paper 3.19)",
            srtf_gain >= 3.0,
        ),
        TargetCheck::new(
            "FIFO / PACK makespan",
            pack_gain,
            "> 1 (paper 1.06)",
            pack_gain > 1.0,
        ),
        TargetCheck::new(
            "FAIR average JCT, 0 = FIFO's, 1 = SRTF's",
            fair_position,
            "strictly between 0 and 1 (paper 0.63)",
            fair_position > 0.0 && fair_position < 1.0,
        ),
    ]
}

/// Fig. 2.10 targets: superres_128 PACK makespan at least 2x better than FIFO's;
/// resnet50_50 close to 1 (at most 1.2x).
pub fn tuning_targets(result: &TuningResult) -> Vec<TargetCheck> {
    let speedup = |name: &str| result.sets.get(name).map_or(f64::NAN, |s| s.speedup);
    let superres = speedup("superres_128");
    let resnet = speedup("resnet50_50");
    vec![
        TargetCheck::new(
            "superres_128 FIFO / PACK makespan",
            superres,
            ">= 2 (paper 2.38)",
            superres >= 2.0,
        ),
        TargetCheck::new(
            "resnet50_50 FIFO / PACK makespan",
            resnet,
            "close to 1: [1, 1.2] (paper 1.07)",
            (1.0..=1.2).contains(&resnet),
        ),
    ]
}

/// Fig. 2.9 target: every job's share within 5% of an equal share while all three run.
pub fn fair_share_targets(result: &FairShareResult) -> Vec<TargetCheck> {
    vec![TargetCheck::new(
        "largest relative gap from an equal share",
        result.max_share_deviation,
        "<= 0.05",
        result.max_share_deviation <= 0.05,
    )]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_trace_is_heavy_tailed_and_reproducible() {
        let a = training_trace(1);
        assert_eq!(a, training_trace(1));
        assert_ne!(a, training_trace(2));
        assert_eq!(a.len(), TRAINING_JOBS);
        let mut solo: Vec<f64> = a
            .iter()
            .map(|j| j.iterations as f64 * j.iteration_s)
            .collect();
        solo.sort_by(f64::total_cmp);
        let median = solo[solo.len() / 2];
        let mean = solo.iter().sum::<f64>() / solo.len() as f64;
        assert!(
            mean > 1.5 * median,
            "heavy tail: mean {mean} vs median {median}"
        );
        assert!(a.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
    }

    #[test]
    fn tuning_trials_arrive_together() {
        let w = catalog::by_name("superres_128").unwrap();
        let jobs = tuning_trace(w, 3);
        assert_eq!(jobs.len(), TUNING_JOBS);
        assert!(jobs.iter().all(|j| j.arrival_s == 0.0));
    }
}
