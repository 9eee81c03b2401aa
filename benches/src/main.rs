//! `salus-bench`: benchmarks of salus, one suite per subsystem. Every suite prints ratios
//! or rates measured in the same run, so results compare across noisy shared machines.
//!
//! ```text
//! cargo run --release -p salus-bench -- core --json
//! cargo run --release -p salus-bench -- plan target/reference/*/graph.pb
//! cargo run --release -p salus-bench -- rpc --json
//! cargo run --release -p salus-bench -- cuda --json     # on a host with a GPU
//! cargo run --release -p salus-bench -- cuda --amp bf16 --model resnet50   # autocast
//! cargo run --release -p salus-bench -- profile --model resnet50   # where the GPU time goes
//! cargo build --release -p salusd && cargo run --release -p salus-bench -- soak --json
//! cargo build --release -p salusd && cargo run --release -p salus-bench -- serve --json
//! ```

mod core_suite;
mod cuda_suite;
mod engine_suite;
mod plan_suite;
mod profile_suite;
mod rpc_suite;
mod serve_suite;
mod soak_suite;
mod soak_worker;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Benchmarks of salus.
#[derive(Debug, Parser)]
#[command(name = "salus-bench", version)]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
}

#[derive(Debug, Subcommand)]
enum Suite {
    /// A served model whose running time its input decides, under open-loop load through a
    /// real salusd: finish rate per SLO, latency and throughput for each request scheduler.
    Serve {
        /// The salusd binary (default: the one beside this binary).
        #[arg(long)]
        salusd: Option<std::path::PathBuf>,
        /// salusd's device: cpu or cuda.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Seconds of arrivals per scheduler and SLO.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Request schedulers, comma-separated.
        #[arg(
            long,
            default_value = "orloj,clockwork,nexus,clipper,edf,fifo",
            value_delimiter = ','
        )]
        schedulers: Vec<String>,
        /// SLOs as multiples of the P99 solo execution time, comma-separated.
        #[arg(long, default_value = "1.5,2,3,5", value_delimiter = ',')]
        slo: Vec<f64>,
        /// Arrival rate over what one worker running requests one at a time sustains.
        #[arg(long, default_value_t = 1.0)]
        load: f64,
        /// The model's width.
        #[arg(long, default_value_t = 128)]
        width: u64,
        /// The model's layers per step.
        #[arg(long, default_value_t = 2)]
        layers: usize,
        /// Seed of the weights, the arrivals and the steps.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The scheduling core: decision throughput with many sessions, lane-finding latency.
    Core {
        /// Open sessions during the measurement.
        #[arg(long, default_value_t = 1000)]
        sessions: u64,
        /// Events to feed per policy.
        #[arg(long, default_value_t = 2_000_000)]
        events: u64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The execution engine: sgemm and convolution GFLOP/s on the CPU device, and each
    /// target model's training step next to eager PyTorch's (needs ./scripts/python-env.sh).
    Engine {
        /// Where the traced models are written.
        #[arg(long, default_value = "target/engine-bench")]
        dir: std::path::PathBuf,
        /// Timed iterations per model.
        #[arg(long, default_value_t = 10)]
        iterations: usize,
        /// Mixed precision on both sides: bf16 or f16 (the graph traced under autocast,
        /// eager PyTorch under autocast on its device; f16 with a GradScaler).
        #[arg(long, value_parser = ["bf16", "f16"])]
        amp: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The CUDA device (needs a GPU and ./scripts/python-env.sh): each model's training
    /// step eager and with CUDA graphs next to eager PyTorch on the same GPU, switch
    /// latency on one lane, four jobs packed against one at a time.
    Cuda {
        /// Where the traced models are written.
        #[arg(long, default_value = "target/cuda-bench")]
        dir: std::path::PathBuf,
        /// Timed iterations per model.
        #[arg(long, default_value_t = 20)]
        iterations: usize,
        /// A model to run (repeatable): mlp, cnn, gpt, resnet18 (the default four), or
        /// the large resnet50, vit_b_16, transformer, transformer_nodrop, gpt512.
        #[arg(long = "model")]
        models: Vec<String>,
        /// Mixed precision on both sides: bf16 or f16 (the graph traced under autocast,
        /// eager PyTorch under autocast on its device; f16 with a GradScaler).
        #[arg(long, value_parser = ["bf16", "f16"])]
        amp: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Where the GPU time goes (needs a GPU and PyTorch with CUDA): per model, the CUDA
    /// device's device time by op family (one eager iteration, each node timed with CUDA
    /// events) and its launches, next to PyTorch's kernel time for the same families
    /// from torch.profiler on the same GPU; graph-replay, eager-sum and PyTorch step
    /// times; salus' P + E against PyTorch's peak memory.
    Profile {
        /// Where the traced models are written.
        #[arg(long, default_value = "target/profile-bench")]
        dir: std::path::PathBuf,
        /// A model to profile (repeatable): mlp, cnn, gpt, resnet18 (the default four),
        /// resnet50, vit_b_16, transformer, transformer_nodrop, gpt512.
        #[arg(long = "model")]
        models: Vec<String>,
        /// Timed iterations per model (graph replay and PyTorch's eager step).
        #[arg(long, default_value_t = 10)]
        iterations: usize,
        /// Ops listed per side and model.
        #[arg(long, default_value_t = 8)]
        top: usize,
        /// Cap the salus arena at this many GiB (default: the free memory less 1 GiB).
        #[arg(long)]
        arena_gib: Option<u64>,
        /// Print a profile saved with --json as tables instead of measuring (no GPU).
        #[arg(long)]
        from: Option<std::path::PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The daemon over its Unix socket: iteration round trip (p50, p99), iterations per
    /// second with 8 sessions, switch latency on a shared lane, memory per idle session.
    Rpc {
        /// Timed round trips.
        #[arg(long, default_value_t = 5000)]
        iterations: usize,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Load and soak: a real salusd (with --state-dir), many sessions from many client
    /// processes, clients killed and connections dropped mid-iteration, salusd restarted
    /// (SIGTERM) while they run; what is left behind (sessions, snapshots, the daemon's
    /// resident memory and file descriptors) and a victim session against its solo run.
    Soak {
        /// Sessions per round, over all client processes (each on its own connection).
        #[arg(long, default_value_t = 200)]
        sessions: u64,
        /// Client processes per round.
        #[arg(long, default_value_t = 8)]
        clients: u64,
        /// Rounds.
        #[arg(long, default_value_t = 12)]
        rounds: u64,
        /// Iterations of each session.
        #[arg(long, default_value_t = 200)]
        iterations: u64,
        /// Fraction of client processes killed (SIGKILL) at a random moment of each round.
        #[arg(long, default_value_t = 0.25)]
        kill: f64,
        /// Fraction of sessions that drop their connection in the middle of an iteration.
        #[arg(long, default_value_t = 0.05)]
        drop: f64,
        /// Restarts of salusd (SIGTERM, then a new process on the same state directory),
        /// one in each of rounds 1, 2, ...
        #[arg(long, default_value_t = 3)]
        restarts: u64,
        /// The device: cpu or sim.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// The salusd binary (default: the one beside this binary).
        #[arg(long)]
        salusd: Option<std::path::PathBuf>,
        /// Seed of the kills, drops and restart moments.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Leave salusd's logs and state directory in the temporary folder (a failed soak
        /// always does).
        #[arg(long)]
        keep_logs: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One client process of `soak` (started by it).
    #[command(hide = true)]
    SoakWorker {
        /// salusd's address.
        #[arg(long)]
        address: String,
        /// Sessions of this process, each on its own connection.
        #[arg(long)]
        sessions: u64,
        /// Iterations of each session.
        #[arg(long)]
        iterations: u64,
        /// Where its sessions' jobs and drops come from.
        #[arg(long)]
        seed: u64,
        /// Fraction of its sessions that drop their connection mid-iteration.
        #[arg(long)]
        drop: f64,
    },
    /// The graph planner: validate and plan serialized graphs (`salus.v1.Graph` files,
    /// e.g. from `python -m salus.reference`); P, E, the lower bound and their ratio.
    Plan {
        /// Graph files (`.pb`).
        #[arg(required = true)]
        graphs: Vec<std::path::PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Waits until the salusd `child` answers on `socket`, at most `within`; says why it
/// never will when it exits first (its stderr is in `log`).
fn await_daemon(
    child: &mut std::process::Child,
    socket: &std::path::Path,
    within: std::time::Duration,
    log: &std::path::Path,
) -> Result<(), String> {
    let deadline = std::time::Instant::now() + within;
    while std::os::unix::net::UnixStream::connect(socket).is_err() {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return Err(format!(
                "salusd exited at start ({status}); see {}",
                log.display()
            ));
        }
        if std::time::Instant::now() > deadline {
            return Err(format!("salusd did not start within {within:?}"));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

/// The salusd binary beside this one (cargo puts both in the same target folder).
fn beside_this_binary() -> Result<std::path::PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    Ok(exe.with_file_name("salusd"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.suite {
        Suite::Core {
            sessions,
            events,
            json,
        } => core_suite::run(sessions, events, json),
        Suite::Plan { graphs, json } => plan_suite::run(&graphs, json),
        Suite::Rpc { iterations, json } => rpc_suite::run(iterations, json),
        Suite::Serve {
            salusd,
            device,
            seconds,
            schedulers,
            slo,
            load,
            width,
            layers,
            seed,
            json,
        } => salusd
            .map_or_else(beside_this_binary, Ok)
            .and_then(|salusd| {
                serve_suite::run(
                    &serve_suite::Options {
                        salusd,
                        device,
                        seconds,
                        schedulers,
                        slos: slo,
                        load,
                        width,
                        layers,
                        seed,
                    },
                    json,
                )
            }),
        Suite::Soak {
            sessions,
            clients,
            rounds,
            iterations,
            kill,
            drop,
            restarts,
            device,
            salusd,
            seed,
            keep_logs,
            json,
        } => salusd
            .map_or_else(beside_this_binary, Ok)
            .and_then(|salusd| {
                soak_suite::run(
                    &soak_suite::Options {
                        sessions,
                        clients,
                        rounds,
                        iterations,
                        kill,
                        drop,
                        restarts,
                        device,
                        salusd,
                        seed,
                        keep_logs,
                    },
                    json,
                )
            }),
        Suite::SoakWorker {
            address,
            sessions,
            iterations,
            seed,
            drop,
        } => soak_worker::run(&address, sessions, iterations, seed, drop),
        Suite::Engine {
            dir,
            iterations,
            amp,
            json,
        } => engine_suite::run(&dir, iterations, amp.as_deref(), json),
        Suite::Cuda {
            dir,
            iterations,
            models,
            amp,
            json,
        } => cuda_suite::run(&dir, iterations, &models, amp.as_deref(), json),
        Suite::Profile {
            dir,
            models,
            iterations,
            top,
            arena_gib,
            from,
            json,
        } => profile_suite::run(&profile_suite::Options {
            dir: &dir,
            from: from.as_deref(),
            models: &models,
            iterations,
            top,
            arena_gib,
            json,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("salus-bench: {message}");
            ExitCode::FAILURE
        }
    }
}
