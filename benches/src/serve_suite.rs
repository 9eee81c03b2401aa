//! `salus-bench serve`: a served model whose running time its input decides, under
//! open-loop load, through a real salusd, once per request scheduler.
//!
//! The model is `salus_graph::samples::countdown` served as a decoding loop: a request fed
//! `left = n` takes `n` steps, so its execution time is `n` times a step's. Requests come
//! from two applications, each with its own distribution of steps (a bimodal mix, as the
//! dissertation's appendix C cases), with Poisson arrivals at `load` times the rate one
//! unbatched worker could sustain. Each SLO is a multiple of the P99 of the solo
//! execution times (steps times the batch-of-one step time salusd measured at `Serve`).
//! For every scheduler and SLO it reports the finish rate (requests answered by their
//! deadline over requests sent), drops, latency percentiles, throughput and the
//! scheduler's time per event as salusd measured it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use salus_client::{Client, OpenOptions, v1 as pb};
use salus_graph::samples::countdown;
use serde::Serialize;

/// What the suite runs.
pub struct Options {
    /// The salusd binary.
    pub salusd: PathBuf,
    /// salusd's --device.
    pub device: String,
    /// Seconds of arrivals per scheduler and SLO.
    pub seconds: f64,
    /// Request schedulers, by name.
    pub schedulers: Vec<String>,
    /// SLOs as multiples of the P99 solo execution time.
    pub slos: Vec<f64>,
    /// Arrival rate over what one unbatched worker sustains.
    pub load: f64,
    /// The model's width and layers.
    pub width: u64,
    pub layers: usize,
    /// Seed of the weights, arrivals and steps.
    pub seed: u64,
}

const BATCH_SIZES: [u64; 4] = [1, 2, 4, 8];

/// Each application's steps: a normal distribution (mean, std), rounded, at least 1.
const APPS: [(f64, f64); 2] = [(3.0, 1.0), (12.0, 2.0)];

#[derive(Debug, Serialize)]
struct Phase {
    slo_ms: f64,
    sent: u64,
    finish_rate: f64,
    dropped: u64,
    late: u64,
    failed: u64,
    p50_ms: f64,
    p99_ms: f64,
    throughput: f64,
    mean_batch_requests: f64,
    scheduling_us_per_request: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    device: String,
    step_ms: f64,
    mean_execution_ms: f64,
    p99_execution_ms: f64,
    rate_per_s: f64,
    seconds_per_phase: f64,
    schedulers: std::collections::BTreeMap<String, Vec<Phase>>,
}

struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    fn exponential(&mut self, mean: f64) -> f64 {
        -mean * self.uniform().ln()
    }

    /// (application, steps) of one request.
    fn request(&mut self) -> (u32, u32) {
        let app = (self.uniform() * APPS.len() as f64) as usize % APPS.len();
        let (mean, std) = APPS[app];
        (
            app as u32,
            (mean + std * self.normal()).round().max(1.0) as u32,
        )
    }
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(options: &Options, dir: &Path) -> Result<(Daemon, String), String> {
    let socket = dir.join("salusd.sock");
    let log_path = dir.join("salusd.log");
    let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
    let child = Command::new(&options.salusd)
        .arg("--socket")
        .arg(&socket)
        .args(["--device", &options.device, "--memory", "1GiB"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", options.salusd.display()))?;
    let mut daemon = Daemon(child);
    crate::await_daemon(&mut daemon.0, &socket, Duration::from_secs(60), &log_path)?;
    Ok((daemon, socket.display().to_string()))
}

/// Opens a served countdown with `scheduler`; its id and the batch-of-one step time.
async fn serve(client: &Client, options: &Options, scheduler: &str) -> Result<(u64, f64), String> {
    let e = |e: salus_client::Error| e.to_string();
    let largest = *BATCH_SIZES.last().expect("sizes");
    let mut rng = Rng(options.seed);
    let scale = 1.0 / (options.width as f64).sqrt();
    let initial = (0..options.layers)
        .map(|l| {
            let w: Vec<u8> = (0..options.width * options.width)
                .flat_map(|_| ((rng.uniform() as f32 * 2.0 - 1.0) * scale as f32).to_le_bytes())
                .collect();
            (l as u32, w)
        })
        .collect();
    let session = client
        .open(OpenOptions {
            graph: countdown(largest, options.width, options.layers, options.layers).to_proto(),
            kind: pb::SessionKind::Inference,
            hints: pb::Hints {
                name: format!("countdown ({scheduler})"),
                ..Default::default()
            },
            initial,
        })
        .await
        .map_err(e)?;
    let mut programs = Vec::new();
    for size in BATCH_SIZES {
        let program = if size == largest {
            0
        } else {
            session
                .add_program(
                    countdown(size, options.width, options.layers, options.layers).to_proto(),
                )
                .await
                .map_err(e)?
                .program
        };
        programs.push(pb::BatchProgram {
            batch_size: size as u32,
            program,
        });
    }
    let served = session
        .serve(pb::ServeRequest {
            scheduler: scheduler.into(),
            variants: vec![pb::ServedVariant {
                name: "all layers".into(),
                programs,
            }],
            decode: Some(pb::Decode {
                carry: vec![
                    pb::Carry { fetch: 0, feed: 0 },
                    pb::Carry { fetch: 1, feed: 1 },
                ],
                done: 2,
                max_steps: 1000,
            }),
            ..Default::default()
        })
        .await
        .map_err(e)?;
    let step_ms = served
        .calibration
        .iter()
        .find(|t| t.batch_size == 1)
        .map_or(1.0, |t| t.ms);
    let id = session.id;
    // The session lives as long as the daemon: its lease is held by a leaked handle.
    std::mem::forget(session);
    Ok((id, step_ms))
}

/// One request's end: latency, whether on time, its batch's size in requests.
enum End {
    Answered {
        latency: Duration,
        on_time: bool,
        batch: u32,
    },
    Dropped,
    Failed,
}

/// Sends requests at Poisson arrivals for `seconds` from a thread that sleeps between
/// them (finer than the runtime's timer) and waits for every answer.
/// One phase's open-loop load on a served session.
struct Load {
    session: u64,
    width: u64,
    mean_gap: f64,
    slo_ms: f64,
    seconds: f64,
}

fn phase(
    runtime: &tokio::runtime::Runtime,
    client: &Client,
    load: &Load,
    rng: &mut Rng,
) -> (Vec<End>, Duration) {
    let ends = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let start = Instant::now();
    let mut next = 0.0;
    while next < load.seconds {
        let at = start + Duration::from_secs_f64(next);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let (app, steps) = rng.request();
        let h: Vec<u8> = (0..load.width)
            .flat_map(|i| (((i % 13) as f32 - 6.0) / 8.0).to_le_bytes())
            .collect();
        let request = pb::InferRequest {
            session: load.session,
            feeds: vec![h, (steps as f32).to_le_bytes().to_vec()],
            slo_ms: load.slo_ms,
            app,
            ..Default::default()
        };
        let (client, ends) = (client.clone(), ends.clone());
        tasks.push(runtime.spawn(async move {
            let end = match client.infer(request).await {
                Ok(a) => End::Answered {
                    latency: Duration::from_micros(a.latency_us),
                    on_time: a.met_deadline,
                    batch: a.batch_requests,
                },
                Err(salus_client::Error::Status(s))
                    if s.code() == tonic::Code::DeadlineExceeded =>
                {
                    End::Dropped
                }
                Err(_) => End::Failed,
            };
            ends.lock().expect("ends").push(end);
        }));
        next += rng.exponential(load.mean_gap);
    }
    runtime.block_on(async {
        for task in tasks {
            let _ = task.await;
        }
    });
    let elapsed = start.elapsed();
    let ends = std::mem::take(&mut *ends.lock().expect("ends"));
    (ends, elapsed)
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Runs the suite and prints its table (or JSON).
pub fn run(options: &Options, json: bool) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("salus-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    // Kept when it fails: salusd's log is there.
    let report = measure(options, &dir)?;
    let _ = std::fs::remove_dir_all(&dir);
    print(options, &report, json)
}

fn measure(options: &Options, dir: &Path) -> Result<Report, String> {
    let (_daemon, address) = start(options, dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let client = runtime
        .block_on(Client::connect(&address))
        .map_err(|e| e.to_string())?;
    let mut report = Report {
        device: options.device.clone(),
        step_ms: 0.0,
        mean_execution_ms: 0.0,
        p99_execution_ms: 0.0,
        rate_per_s: 0.0,
        seconds_per_phase: options.seconds,
        schedulers: Default::default(),
    };
    for scheduler in &options.schedulers {
        let (session, step_ms) = runtime.block_on(serve(&client, options, scheduler))?;
        if report.step_ms == 0.0 {
            // The workload is fixed by the first scheduler's measured step time.
            let mut rng = Rng(options.seed ^ 0x5eed);
            let mut solo: Vec<f64> = (0..20_000)
                .map(|_| rng.request().1 as f64 * step_ms)
                .collect();
            solo.sort_by(f64::total_cmp);
            report.step_ms = step_ms;
            report.mean_execution_ms = solo.iter().sum::<f64>() / solo.len() as f64;
            report.p99_execution_ms = quantile(&solo, 0.99);
            report.rate_per_s = options.load * 1e3 / report.mean_execution_ms;
        }
        let mut phases = Vec::new();
        for &multiple in &options.slos {
            let slo_ms = multiple * report.p99_execution_ms;
            let mut rng = Rng(options.seed.wrapping_add((multiple * 1000.0) as u64));
            let load = Load {
                session,
                width: options.width,
                mean_gap: 1.0 / report.rate_per_s,
                slo_ms,
                seconds: options.seconds,
            };
            let (ends, elapsed) = phase(&runtime, &client, &load, &mut rng);
            let info = runtime
                .block_on(client.list_sessions())
                .map_err(|e| e.to_string())?
                .into_iter()
                .find(|s| s.id == session)
                .and_then(|s| s.serving);
            let mut latencies = Vec::new();
            let (mut on_time, mut late, mut dropped, mut failed, mut batch) = (0, 0, 0, 0, 0u64);
            for end in &ends {
                match end {
                    End::Answered {
                        latency,
                        on_time: ok,
                        batch: b,
                    } => {
                        latencies.push(latency.as_secs_f64() * 1e3);
                        batch += *b as u64;
                        if *ok {
                            on_time += 1;
                        } else {
                            late += 1;
                        }
                    }
                    End::Dropped => dropped += 1,
                    End::Failed => failed += 1,
                }
            }
            latencies.sort_by(f64::total_cmp);
            let sent = ends.len() as u64;
            phases.push(Phase {
                slo_ms,
                sent,
                finish_rate: on_time as f64 / sent.max(1) as f64,
                dropped,
                late,
                failed,
                p50_ms: quantile(&latencies, 0.5),
                p99_ms: quantile(&latencies, 0.99),
                throughput: latencies.len() as f64 / elapsed.as_secs_f64(),
                mean_batch_requests: batch as f64 / latencies.len().max(1) as f64,
                scheduling_us_per_request: info.map_or(0.0, |i| i.scheduling_us_per_request),
            });
        }
        report.schedulers.insert(scheduler.clone(), phases);
    }
    Ok(report)
}

fn print(options: &Options, report: &Report, json: bool) -> Result<(), String> {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    println!(
        "device {}: step {:.3} ms alone; execution mean {:.2} ms, p99 {:.2} ms; {:.0} requests/s \
         (load {}); {} s per phase",
        report.device,
        report.step_ms,
        report.mean_execution_ms,
        report.p99_execution_ms,
        report.rate_per_s,
        options.load,
        options.seconds
    );
    println!(
        "{:<10} {:>8} {:>6} {:>8} {:>6} {:>6} {:>6} {:>8} {:>8} {:>9} {:>6} {:>12}",
        "scheduler",
        "SLO ms",
        "sent",
        "finish",
        "drop",
        "late",
        "fail",
        "p50 ms",
        "p99 ms",
        "answers/s",
        "batch",
        "sched us/req"
    );
    for (scheduler, phases) in &report.schedulers {
        for p in phases {
            println!(
                "{:<10} {:>8.2} {:>6} {:>8.3} {:>6} {:>6} {:>6} {:>8.2} {:>8.2} {:>9.0} {:>6.2} {:>12.2}",
                scheduler,
                p.slo_ms,
                p.sent,
                p.finish_rate,
                p.dropped,
                p.late,
                p.failed,
                p.p50_ms,
                p.p99_ms,
                p.throughput,
                p.mean_batch_requests,
                p.scheduling_us_per_request
            );
        }
    }
    Ok(())
}
