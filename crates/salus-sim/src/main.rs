//! `salus-sim`: replay job traces through the salus scheduler in virtual time and
//! reproduce the Salus experiments.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use salus_core::PolicyKind;
use salus_sim::experiments::{self, FairShareResult, TrainingResult, TuningResult};
use salus_sim::{SimConfig, catalog, simulate, trace};

/// Replay job traces through the salus scheduler in virtual time, and reproduce the
/// experiments of the Salus paper (Table 2.1, Fig. 2.9, Fig. 2.10) on any machine.
#[derive(Debug, Parser)]
#[command(name = "salus-sim", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one of the paper's experiments.
    Experiment {
        #[command(subcommand)]
        which: Experiment,
    },
    /// Replay a JSON Lines trace (one job per line) under one policy.
    Replay {
        /// The trace file.
        trace: PathBuf,
        /// fifo, pack, srtf, fair or share.
        #[arg(long, default_value = "pack")]
        policy: PolicyKind,
        /// Device memory in bytes (default: the 16 GB P100 of the papers).
        #[arg(long, default_value_t = catalog::REFERENCE_CAPACITY_BYTES)]
        capacity: u64,
        /// Bytes kept free.
        #[arg(long, default_value_t = 0)]
        reserve: u64,
        /// Accepted for uniformity with the experiments; a replay draws nothing at random.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write the generated trace of the training experiment as JSON Lines.
    Trace {
        /// Seed of the generated trace.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Print the workload catalog (the papers' 15 models x 3 batch sizes).
    Catalog {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum Experiment {
    /// 100 training jobs arriving online; FIFO vs SRTF vs PACK vs FAIR (Table 2.1).
    Training {
        /// Seed of the generated trace.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Two sets of 300 tuning trials arriving at once; FIFO vs PACK makespan (Fig. 2.10).
    Tuning {
        /// Seed of the trial durations.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run all three experiments for seeds 1..=COUNT and report, per target, how many
    /// seeds meet it and which do not.
    Seeds {
        /// How many seeds to run.
        #[arg(long, default_value_t = 100)]
        count: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Every policy on every trace family (training, both tuning sets, fair-share): the
    /// results for one seed, and each policy's ratio to the best policy over seeds 1..=COUNT.
    Policies {
        /// Seed of the detailed tables.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Seeds to summarise.
        #[arg(long, default_value_t = 10)]
        count: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Inference requests with deadlines: ORLOJ, Clockwork, Nexus, Clipper, EDF and FIFO
    /// on the execution time distributions of appendix C (Tables C.1-C.3), SLO 1.5-5x P99.
    Orloj {
        /// First seed of the generated traces.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Seeds averaged (seed, seed + 1, ...).
        #[arg(long, default_value_t = salus_sim::orloj::DEFAULT_SEEDS)]
        seeds: u64,
        /// Only these cases (repeatable), e.g. std-1, eight-modal, resnet-imagenet.
        #[arg(long = "case")]
        cases: Vec<String>,
        /// Mean arrival rate over what the worker serves in full batches of 16.
        #[arg(long, default_value_t = salus_sim::orloj::LOAD)]
        load: f64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// MuxFlow: online services and offline training sharing GPUs. One GPU
    /// through the core (salus with and without protection, time-sharing, online-only)
    /// and a 16-GPU cluster (MuxFlow's matching, online-only, time-sharing, PB-time-sharing,
    /// salus' protection with matching).
    Muxflow {
        /// Seed of the requests, loads and offline jobs.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// salus' latency target (SLO) over each service's p99 alone.
        #[arg(long, default_value_t = salus_sim::muxflow::DEFAULT_SLO_FACTOR)]
        slo_factor: f64,
        /// The share of the device an offline iteration gets while an online iteration
        /// runs, fixed (the protection's offline_compute_share; default: learned by the
        /// core from its default).
        #[arg(long)]
        compute_share: Option<f64>,
        /// The protection controller's setpoint: the mean slowdown of online iterations
        /// it steers to (default: the core's).
        #[arg(long)]
        target_load: Option<f64>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// ORLOJ's priority queue timed on this machine (Fig. 4.12): insertion and query with
    /// 10 to 10,000 requests pending (wall-clock time; build with --release).
    OrlojQueue {
        /// Seed of the random points.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Fluid (dissertation ch. 3, Fig. 3.7 and 3.8): grid, Hyperband, SyncBOHB, ASHA, BOHB
    /// and PBT on 8 devices under FIFO (a trial per device), plain PACK, StaticFluid and
    /// StaticFluid + DynamicFluid; makespan and utilization.
    Fluid {
        /// Seed of the algorithms' sampling and the accuracy noise.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Three inception3_50 jobs under FAIR starting at 0, 15 and 30 s (Fig. 2.9).
    FairShare {
        /// Seed of the job lengths.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("salus-sim: {message}");
            ExitCode::FAILURE
        }
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> Result<String, String> {
    serde_json::to_string_pretty(value).map_err(|e| e.to_string())
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Experiment { which } => match which {
            Experiment::Training { seed, json } => {
                let result = experiments::training(seed).map_err(|e| e.to_string())?;
                if json {
                    println!("{}", to_json(&result)?);
                } else {
                    print_training(&result, true);
                    print_targets(&experiments::training_targets(&result));
                }
            }
            Experiment::Tuning { seed, json } => {
                let result = experiments::tuning(seed).map_err(|e| e.to_string())?;
                if json {
                    println!("{}", to_json(&result)?);
                } else {
                    print_tuning(&result);
                    print_targets(&experiments::tuning_targets(&result));
                }
            }
            Experiment::Seeds { count, json } => {
                let sweep = seed_sweep(count)?;
                if json {
                    println!("{}", to_json(&sweep)?);
                } else {
                    print_sweep(&sweep, count);
                }
            }
            Experiment::Policies { seed, count, json } => {
                let result = experiments::policies(seed, count).map_err(|e| e.to_string())?;
                if json {
                    println!("{}", to_json(&result)?);
                } else {
                    print_policies(&result);
                }
            }
            Experiment::Orloj {
                seed,
                seeds,
                cases,
                load,
                json,
            } => {
                if !(load > 0.0 && load.is_finite()) {
                    return Err(format!("--load must be positive, got {load}"));
                }
                let all = salus_sim::orloj::cases();
                let chosen: Vec<_> = if cases.is_empty() {
                    all
                } else {
                    let mut chosen = Vec::new();
                    for name in &cases {
                        let case =
                            all.iter()
                                .find(|c| c.name == name.as_str())
                                .ok_or_else(|| {
                                    let names: Vec<&str> = all.iter().map(|c| c.name).collect();
                                    format!(
                                        "unknown case {name:?}; expected one of {}",
                                        names.join(", ")
                                    )
                                })?;
                        chosen.push(case.clone());
                    }
                    chosen
                };
                let result = salus_sim::orloj::orloj_cases(&chosen, seed, seeds, load)
                    .map_err(|e| e.to_string())?;
                if json {
                    println!("{}", to_json(&result)?);
                } else {
                    print_orloj(&result, &chosen);
                }
            }
            Experiment::Muxflow {
                seed,
                slo_factor,
                compute_share,
                target_load,
                json,
            } => {
                if !(slo_factor >= 1.0 && slo_factor.is_finite()) {
                    return Err(format!("--slo-factor must be at least 1, got {slo_factor}"));
                }
                let mut knobs = salus_sim::muxflow::Knobs {
                    slo_factor,
                    ..Default::default()
                };
                if let Some(share) = compute_share {
                    if !(0.0..=1.0).contains(&share) {
                        return Err(format!("--compute-share must be in [0, 1], got {share}"));
                    }
                    knobs.compute_share = Some(share);
                }
                if let Some(load) = target_load {
                    if !(load >= 1.0 && load.is_finite()) {
                        return Err(format!("--target-load must be at least 1, got {load}"));
                    }
                    knobs.target_load = load;
                }
                let result =
                    salus_sim::muxflow::experiment_with(seed, knobs).map_err(|e| e.to_string())?;
                if json {
                    println!("{}", to_json(&result)?);
                } else {
                    print_muxflow(&result);
                    print_targets(&salus_sim::muxflow::targets(&result));
                }
            }
            Experiment::OrlojQueue { seed, json } => {
                let timings = salus_sim::queue_timing::queue_timing(seed);
                if json {
                    println!("{}", to_json(&timings)?);
                } else {
                    println!(
                        "ORLOJ's priority queue (dynamic convex hull), microseconds per operation"
                    );
                    println!(
                        "{:>8} {:>10} {:>10} {:>10} {:>16} {:>16}",
                        "pending", "insert", "replace", "query", "replace (hull)", "query (hull)"
                    );
                    for t in &timings {
                        println!(
                            "{:>8} {:>10.3} {:>10.3} {:>10.3} {:>16.3} {:>16.3}",
                            t.pending,
                            t.insert_us,
                            t.replace_us,
                            t.query_us,
                            t.replace_all_on_hull_us,
                            t.query_all_on_hull_us
                        );
                    }
                    println!("(hull): every point on the hull");
                    print_targets(&salus_sim::queue_timing::queue_targets(&timings));
                }
            }
            Experiment::Fluid { seed, json } => {
                let result = salus_sim::fluid::fluid(seed).map_err(|e| e.to_string())?;
                if json {
                    println!("{}", to_json(&result)?);
                } else {
                    print_fluid(&result);
                }
            }
            Experiment::FairShare { seed, json } => {
                let result = experiments::fair_share(seed).map_err(|e| e.to_string())?;
                if json {
                    println!("{}", to_json(&result)?);
                } else {
                    print_fair_share(&result);
                    print_targets(&experiments::fair_share_targets(&result));
                }
            }
        },
        Command::Replay {
            trace: path,
            policy,
            capacity,
            reserve,
            seed: _,
            json,
        } => {
            let jobs = trace::read_trace(&path).map_err(|e| match e.line {
                // I/O errors name the file themselves.
                0 => e.message,
                _ => format!("{}: {e}", path.display()),
            })?;
            let config = SimConfig {
                capacity,
                reserve,
                ..SimConfig::reference(policy)
            };
            let report = simulate(&jobs, &config).map_err(|e| e.to_string())?;
            let summary = report.summary();
            if json {
                let outcomes: Vec<_> = report
                    .jobs
                    .iter()
                    .map(|j| {
                        serde_json::json!({
                            "id": j.id,
                            "arrival_s": j.arrival_s,
                            "admitted_s": j.admitted_s,
                            "finished_s": j.finished_s,
                            "rejected": j.rejected,
                        })
                    })
                    .collect();
                let value = serde_json::json!({
                    "policy": policy.name(),
                    "summary": summary,
                    "jobs": outcomes,
                });
                println!("{}", to_json(&value)?);
            } else {
                println!("{} jobs from {} under {policy}", jobs.len(), path.display());
                print_summary_header();
                print_summary_row(policy.name(), &summary, None);
                for job in report.jobs.iter().filter(|j| j.rejected.is_some()) {
                    println!(
                        "rejected {}: {}",
                        job.id,
                        job.rejected.as_deref().unwrap_or("")
                    );
                }
            }
        }
        Command::Trace { seed } => {
            for job in experiments::training_trace(seed) {
                println!("{}", job.to_json_line());
            }
        }
        Command::Catalog { json } => {
            if json {
                let rows: Vec<_> = catalog::catalog()
                    .iter()
                    .map(|w| {
                        serde_json::json!({
                            "name": w.name(),
                            "persistent_bytes": w.persistent_bytes,
                            "ephemeral_bytes": w.ephemeral_bytes,
                            "iteration_s": w.iteration_s,
                            "compute_share": w.compute_share,
                        })
                    })
                    .collect();
                println!("{}", to_json(&rows)?);
            } else {
                println!(
                    "{:<18} {:>10} {:>10} {:>12} {:>8}",
                    "workload", "P (MB)", "E (MB)", "iteration s", "share"
                );
                for w in catalog::catalog() {
                    println!(
                        "{:<18} {:>10.1} {:>10.1} {:>12.4} {:>8.2}",
                        w.name(),
                        w.persistent_bytes as f64 / 1e6,
                        w.ephemeral_bytes as f64 / 1e6,
                        w.iteration_s,
                        w.compute_share
                    );
                }
            }
        }
    }
    Ok(())
}

/// Table 2.1 of the papers, in minutes: makespan, average queuing, average JCT, 95% JCT.
const PAPER_TABLE_2_1: [(&str, [f64; 4]); 4] = [
    ("fifo", [303.4, 167.6, 170.6, 251.1]),
    ("srtf", [306.0, 28.6, 53.4, 217.0]),
    ("pack", [287.4, 129.9, 145.5, 266.1]),
    ("fair", [301.6, 58.5, 96.6, 281.2]),
];

fn print_summary_header() {
    println!(
        "{:<8} {:>12} {:>12} {:>12} {:>12}",
        "policy", "makespan", "avg queue", "avg JCT", "95% JCT"
    );
}

fn print_summary_row(name: &str, s: &salus_sim::Summary, paper: Option<[f64; 4]>) {
    let min = |x: f64| format!("{:.1} min", x / 60.0);
    println!(
        "{:<8} {:>12} {:>12} {:>12} {:>12}",
        name,
        min(s.makespan_s),
        min(s.avg_queue_s),
        min(s.avg_jct_s),
        min(s.p95_jct_s)
    );
    if let Some(p) = paper {
        println!(
            "{:<8} {:>12} {:>12} {:>12} {:>12}",
            "  paper",
            format!("{:.1} min", p[0]),
            format!("{:.1} min", p[1]),
            format!("{:.1} min", p[2]),
            format!("{:.1} min", p[3])
        );
    }
}

fn print_training(result: &TrainingResult, with_paper: bool) {
    println!(
        "Long training trace: {} jobs (seed {}), one 16 GB P100 simulated",
        result.jobs, result.seed
    );
    print_summary_header();
    for (name, paper) in PAPER_TABLE_2_1 {
        if let Some(s) = result.policies.get(name) {
            print_summary_row(name, s, with_paper.then_some(paper));
        }
    }
    // Policies beyond the paper's four (the daemon's default, share).
    for (name, s) in &result.policies {
        if !PAPER_TABLE_2_1.iter().any(|(p, _)| p == name) {
            print_summary_row(name, s, None);
        }
    }
    let jct = |p: &str| result.policies.get(p).map_or(f64::NAN, |s| s.avg_jct_s);
    println!(
        "avg JCT, FIFO / SRTF: {:.2}x (paper 3.19x); FIFO / FAIR: {:.2}x (paper 1.77x)",
        jct("fifo") / jct("srtf"),
        jct("fifo") / jct("fair")
    );
}

fn print_policies(result: &experiments::PoliciesResult) {
    let min = |x: f64| format!("{:.1} min", x / 60.0);
    println!("Every policy on every trace family (seed {})", result.seed);
    println!(
        "{:<22} {:<7} {:>11} {:>11} {:>11} {:>6}",
        "family", "policy", "makespan", "avg JCT", "95% JCT", "util"
    );
    for family in &result.families {
        for policy in PolicyKind::ALL {
            if let Some(s) = family.policies.get(policy.name()) {
                println!(
                    "{:<22} {:<7} {:>11} {:>11} {:>11} {:>5.1}%",
                    family.family,
                    policy.name(),
                    min(s.makespan_s),
                    min(s.avg_jct_s),
                    min(s.p95_jct_s),
                    100.0 * s.utilisation
                );
            }
        }
    }
    println!();
    println!(
        "Over seeds 1..={}: each measure over the best policy's on the same trace (1 = best), median / worst",
        result.seeds
    );
    println!(
        "{:<22} {:<7} {:>13} {:>13} {:>13} {:>13}",
        "family", "policy", "avg JCT", "95% JCT", "makespan", "best util /"
    );
    let families: Vec<&str> = result.families.iter().map(|f| f.family.as_str()).collect();
    for family in families {
        for policy in PolicyKind::ALL {
            if let Some(b) = result
                .behind_best
                .iter()
                .find(|b| b.family == family && b.policy == policy.name())
            {
                let pair = |(m, w): (f64, f64)| format!("{m:.2} / {w:.2}");
                println!(
                    "{:<22} {:<7} {:>13} {:>13} {:>13} {:>13}",
                    family,
                    policy.name(),
                    pair(b.avg_jct),
                    pair(b.p95_jct),
                    pair(b.makespan),
                    pair(b.utilisation)
                );
            }
        }
    }
}

fn print_tuning(result: &TuningResult) {
    println!(
        "Hyperparameter tuning: {} trials per set, all arriving at once (seed {})",
        experiments::TUNING_JOBS,
        result.seed
    );
    println!(
        "{:<14} {:>14} {:>14} {:>9} {:>7}",
        "set", "FIFO makespan", "PACK makespan", "speedup", "paper"
    );
    for (name, set) in &result.sets {
        let paper = if name == "superres_128" {
            "2.38x"
        } else {
            "1.07x"
        };
        println!(
            "{:<14} {:>12.1} m {:>12.1} m {:>8.2}x {:>7}",
            name,
            set.fifo_makespan_s / 60.0,
            set.pack_makespan_s / 60.0,
            set.speedup,
            paper
        );
    }
}

fn print_fluid(result: &salus_sim::fluid::FluidResult) {
    println!(
        "Fluid: tuning algorithms on {} devices (seed {}); makespan in minutes, utilization, \
         improvement over FIFO",
        result.devices, result.seed
    );
    println!(
        "{:<10} {:>3} {:>3} {:>16} {:>16} {:>16} {:>16} {:>10}",
        "algorithm", "c", "d", "fifo", "pack", "static_fluid", "fluid", "chapter"
    );
    for (name, r) in &result.algorithms {
        print!("{:<10} {:>3} {:>3}", name, r.c, r.d);
        for system in salus_sim::fluid::SYSTEMS {
            let cell = format!(
                "{:.1} {:>3.0}% {:>+4.0}%",
                r.makespan_s[system] / 60.0,
                100.0 * r.utilization[system],
                100.0 * r.speedup_vs_fifo[system]
            );
            print!(" {cell:>16}");
        }
        let chapter = r.chapter_speedup.map_or("-".to_string(), |(lo, hi)| {
            format!("+{:.0}-{:.0}%", lo * 100.0, hi * 100.0)
        });
        println!(" {chapter:>10}");
        print!("{:<18}", "  best accuracy");
        for system in salus_sim::fluid::SYSTEMS {
            print!(" {:>16.3}", r.best_accuracy[system]);
        }
        println!();
    }
    for check in salus_sim::fluid::fluid_targets(result) {
        println!(
            "[{}] {}: {:.3} (goal {})",
            if check.met { "met" } else { "MISSED" },
            check.name,
            check.value,
            check.goal
        );
    }
}

fn print_fair_share(result: &FairShareResult) {
    println!(
        "Fair sharing: three {} jobs under FAIR (seed {})",
        result.workload, result.seed
    );
    for (i, (start, end)) in result.jobs.iter().enumerate() {
        println!("  job{i}: {start:>6.1} s -> {end:>7.1} s");
    }
    println!(
        "shares over {:.0} s windows (every 15 s), and all jobs together:",
        result.window_s
    );
    println!(
        "{:>8} {:>7} {:>7} {:>7} {:>10}",
        "t (s)", "job0", "job1", "job2", "images/s"
    );
    for point in result.series.iter().step_by(15) {
        print!("{:>8.0}", point.t_s);
        for share in &point.shares {
            print!(" {share:>7.3}");
        }
        println!(" {:>10.1}", point.images_per_s);
    }
    println!(
        "largest gap from an equal share while all three run: {:.1}% ({:.0} s windows), {:.1}% (10 s windows)",
        result.max_share_deviation * 100.0,
        result.window_s,
        result.max_share_deviation_10s * 100.0
    );
}

fn print_orloj(result: &salus_sim::orloj::OrlojResult, cases: &[salus_sim::orloj::Case]) {
    use salus_core::serving::RequestSchedulerKind;
    println!(
        "Finish rate by SLO (x P99 solo time); load {:.2}, mean of seeds {}..={}; \
         paper: appendix C (Clipper, Nexus, Clockwork, ORLOJ)",
        result.load,
        result.seed,
        result.seed + result.seeds - 1
    );
    let names: Vec<&str> = RequestSchedulerKind::ALL.iter().map(|k| k.name()).collect();
    print!("{:<19} {:>4}", "case", "SLO");
    for name in &names {
        print!(" {name:>9}");
    }
    println!("   paper: clip  nexus  clock  orloj");
    for case in cases {
        let Some(r) = result.cases.get(case.name) else {
            continue;
        };
        let paper = salus_sim::orloj::appendix_c(case.name);
        for (j, slo) in r.slo.iter().enumerate() {
            let label = if j == 0 {
                format!("{} ({:.0} ms)", case.name, r.p99_ms)
            } else {
                String::new()
            };
            print!("{label:<19} {slo:>4}");
            for name in &names {
                print!(
                    " {:>9.2}",
                    r.finish_rate.get(*name).map_or(f64::NAN, |v| v[j])
                );
            }
            if let Some(p) = &paper {
                print!("         ");
                for name in ["clipper", "nexus", "clockwork", "orloj"] {
                    print!(" {:>5.2} ", p[name][j]);
                }
            }
            println!();
        }
    }
    let (checks, misses) = salus_sim::orloj::orloj_targets(result);
    print_targets(&checks);
    for miss in misses {
        println!(
            "  {} at {}x P99: ORLOJ {:+.3} against {}",
            miss.case, miss.slo, miss.margin, miss.against
        );
    }
}

/// `x` with `digits` decimals, or "-" when there is nothing (0).
fn or_dash(x: f64, digits: usize) -> String {
    if x > 0.0 && x.is_finite() {
        format!("{x:.digits$}")
    } else {
        "-".to_string()
    }
}

fn print_muxflow(result: &salus_sim::muxflow::MuxflowResult) {
    let single = &result.single_gpu;
    println!(
        "One GPU through the core (seed {}): a {} service, 20-190 requests/s over {:.0} s, \
         SLO {:.2} ms; offline jobs one after another: {}",
        result.seed,
        single.service,
        salus_sim::muxflow::single::SPAN_S,
        single.slo_ms,
        single.offline_jobs.join(", ")
    );
    println!(
        "{:<21} {:>9} {:>9} {:>7} {:>7} {:>8} {:>8} {:>5} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6}",
        "system",
        "mean ms",
        "p99 ms",
        "mean/x",
        "p99/x",
        "offline",
        "/idle",
        "jobs",
        "JCT/x",
        "util",
        "gain",
        "admit",
        "runs",
        "duty"
    );
    for name in salus_sim::muxflow::single::SYSTEMS {
        let Some(s) = single.systems.get(name) else {
            continue;
        };
        println!(
            "{:<21} {:>9.2} {:>9.2} {:>7.3} {:>7.3} {:>8.3} {:>8.3} {:>5} {:>7.2} {:>6.3} {:>5.2}x {:>6.2} {:>6.2} {:>6.2}",
            name,
            s.online_mean_ms,
            s.online_p99_ms,
            s.online_mean_slowdown,
            s.online_p99_slowdown,
            s.offline_throughput_fraction,
            s.offline_idle_capacity_fraction,
            s.offline_finished,
            s.offline_jct_slowdown,
            s.utilization,
            s.utilization_gain,
            s.offline_admitted_fraction,
            s.offline_running_fraction,
            s.mean_duty
        );
    }
    for name in ["online_only", "salus_protection", "salus_protection_slo"] {
        if let Some(s) = single.systems.get(name) {
            let health: Vec<String> = s
                .health
                .iter()
                .map(|(k, v)| format!("{k} {:.0}%", 100.0 * v))
                .collect();
            println!(
                "{name}: health {}; online slowdown metric (p99, median sample) {:.2}",
                health.join(", "),
                s.online_slowdown_metric
            );
        }
    }
    println!(
        "x: online-only's; offline: work done over an offline job alone on the device all \
         along; /idle: over what the compute the service leaves idle allows; JCT/x: over \
         solo time; admit: fraction of the run an offline session was admitted; runs: an \
         offline iteration ran; duty: the controller's, sampled each second while admitted"
    );
    let c = &result.cluster;
    println!();
    println!(
        "Cluster: {} GPUs, one online service each (mean load alone {:.1}%), {} offline jobs \
         ({:.0} solo GPU-hours); latency and utilization over one day",
        c.gpus,
        100.0 * c.online_load,
        c.offline_jobs,
        c.offline_solo_h
    );
    println!(
        "{:<18} {:>8} {:>8} {:>7} {:>7} {:>8} {:>6} {:>7} {:>7} {:>8} {:>6} {:>6} {:>5} {:>4}",
        "system",
        "mean ms",
        "p99 ms",
        "mean/x",
        "p99/x",
        "offline",
        "/idle",
        "JCT h",
        "JCT/mf",
        "span h",
        "util",
        "gain",
        "moves",
        "evic"
    );
    let mf_jct = c
        .systems
        .get("muxflow")
        .map_or(f64::NAN, |m| m.offline_avg_jct_h);
    for system in salus_sim::muxflow::cluster::SYSTEMS {
        let Some(s) = c.systems.get(system.name) else {
            continue;
        };
        println!(
            "{:<18} {:>8.2} {:>8.2} {:>7.3} {:>7.3} {:>8.3} {:>6.3} {:>7} {:>7} {:>8} {:>6.3} {:>5.2}x {:>5} {:>4}",
            system.name,
            s.online_mean_ms,
            s.online_p99_ms,
            s.online_mean_slowdown,
            s.online_p99_slowdown,
            s.offline_throughput_fraction,
            s.offline_idle_capacity_fraction,
            or_dash(s.offline_avg_jct_h, 2),
            or_dash(s.offline_avg_jct_h / mf_jct, 2),
            or_dash(s.offline_makespan_h, 1),
            s.utilization,
            s.utilization_gain,
            s.migrations,
            s.evictions
        );
    }
    println!(
        "x: online-only's; offline: work done over the same jobs alone on idle GPUs \
         (Eq. 3); /idle: over what the compute the service leaves idle allows; JCT/mf: over \
         MuxFlow's"
    );
}

fn print_targets(checks: &[experiments::TargetCheck]) {
    for check in checks {
        println!(
            "[{}] {}: {:.3} (goal {})",
            if check.met { "met" } else { "MISSED" },
            check.name,
            check.value,
            check.goal
        );
    }
}

/// Per target: values over all seeds and the seeds that miss it.
#[derive(Debug, serde::Serialize)]
struct TargetSweep {
    name: &'static str,
    goal: &'static str,
    min: f64,
    median: f64,
    max: f64,
    met: usize,
    missed_seeds: Vec<u64>,
}

fn seed_sweep(count: u64) -> Result<Vec<TargetSweep>, String> {
    let mut rows: Vec<(u64, experiments::TargetCheck)> = Vec::new();
    for seed in 1..=count {
        let err = |e: salus_sim::SimError| format!("seed {seed}: {e}");
        let training = experiments::training(seed).map_err(err)?;
        let tuning = experiments::tuning(seed).map_err(err)?;
        let fair = experiments::fair_share(seed).map_err(err)?;
        rows.extend(
            experiments::training_targets(&training)
                .into_iter()
                .chain(experiments::tuning_targets(&tuning))
                .chain(experiments::fair_share_targets(&fair))
                .map(|c| (seed, c)),
        );
    }
    let mut names: Vec<&'static str> = Vec::new();
    for (_, c) in &rows {
        if !names.contains(&c.name) {
            names.push(c.name);
        }
    }
    Ok(names
        .into_iter()
        .map(|name| {
            let of_name: Vec<&(u64, experiments::TargetCheck)> =
                rows.iter().filter(|(_, c)| c.name == name).collect();
            let mut values: Vec<f64> = of_name.iter().map(|(_, c)| c.value).collect();
            values.sort_by(f64::total_cmp);
            TargetSweep {
                name,
                goal: of_name.first().map_or("", |(_, c)| c.goal),
                min: values.first().copied().unwrap_or(f64::NAN),
                median: values.get(values.len() / 2).copied().unwrap_or(f64::NAN),
                max: values.last().copied().unwrap_or(f64::NAN),
                met: of_name.iter().filter(|(_, c)| c.met).count(),
                missed_seeds: of_name
                    .iter()
                    .filter(|(_, c)| !c.met)
                    .map(|(s, _)| *s)
                    .collect(),
            }
        })
        .collect())
}

fn print_sweep(sweep: &[TargetSweep], count: u64) {
    println!("Targets over seeds 1..={count}:");
    println!(
        "{:<44} {:>8} {:>8} {:>8} {:>8}  missed by seeds",
        "target (goal)", "min", "median", "max", "met"
    );
    for t in sweep {
        println!(
            "{:<44} {:>8.3} {:>8.3} {:>8.3} {:>4}/{:<3}  {:?}",
            t.name, t.min, t.median, t.max, t.met, count, t.missed_seeds
        );
        println!("  goal: {}", t.goal);
    }
}
