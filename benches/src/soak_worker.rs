//! One client process of the soak suite (`salus-bench soak-worker`, started by `soak`):
//! opens its sessions, each on its own connection, runs their iterations, lets some of
//! them go mid-iteration, takes them back after a restart of salusd, and prints what it
//! did as one JSON line.
//!
//! Also the job every soak session runs, shared with the suite (its victim and the victim's
//! solo run): linear regression trained by SGD, with deterministic weights and batches.

use std::time::{Duration, Instant};

use salus_client::{Client, OpenOptions, Session, v1 as pb};
use salus_graph::Graph;
use serde::{Deserialize, Serialize};

/// How long a session waits for salusd to come back after losing it.
pub const REATTACH_DEADLINE: Duration = Duration::from_secs(60);

/// A small xorshift generator: the soak's randomness, reproducible from its seed.
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// The regression job of one session: its graph, weights and batches from its seed.
#[derive(Debug, Clone, Copy)]
pub struct Job {
    /// Batch rows.
    pub n: u64,
    /// Inputs.
    pub d: u64,
    /// Outputs.
    pub k: u64,
    /// Where its weights and batches come from.
    pub seed: u64,
}

fn floats(seed: u64, count: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|_| ((rng.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        .collect()
}

fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Job {
    /// The soak's job: x f32[16, 8], w f32[8, 2].
    pub fn new(seed: u64) -> Job {
        Job {
            n: 16,
            d: 8,
            k: 2,
            seed,
        }
    }

    /// One SGD step of least squares.
    pub fn graph(&self) -> Graph {
        salus_graph::samples::regression(self.n, self.d, self.k, 0.05)
    }

    /// The initial weights.
    pub fn initial(&self) -> Vec<u8> {
        bytes(&floats(self.seed, self.d * self.k))
    }

    /// Iteration `i`'s batch: x random, y = x w_true plus noise.
    pub fn feeds(&self, i: u64) -> Vec<Vec<u8>> {
        let (n, d, k) = (self.n as usize, self.d as usize, self.k as usize);
        let base = self.seed.wrapping_mul(1000).wrapping_add(i);
        let x = floats(base.wrapping_add(1), self.n * self.d);
        let w_true = floats(self.seed.wrapping_add(77), self.d * self.k);
        let noise = floats(base.wrapping_add(500), self.n * self.k);
        let mut y = vec![0f32; n * k];
        for r in 0..n {
            for c in 0..k {
                let acc: f32 = (0..d).map(|j| x[r * d + j] * w_true[j * k + c]).sum();
                y[r * k + c] = acc + 0.01 * noise[r * k + c];
            }
        }
        vec![bytes(&x), bytes(&y)]
    }

    /// How a client opens it.
    pub fn options(&self, name: String) -> OpenOptions {
        OpenOptions {
            graph: self.graph().to_proto(),
            kind: pb::SessionKind::Training,
            hints: pb::Hints {
                name,
                ..Default::default()
            },
            initial: vec![(0, self.initial())],
        }
    }

    /// `iterations` alone on a fresh cpu device in this process: the losses' bits and the
    /// final weights, what the job must give through salusd too.
    pub fn alone(&self, iterations: u64) -> Result<(Vec<u32>, Vec<u8>), String> {
        use salus_exec::{Device, Placement, Program};
        let program = Program::new(self.graph(), &salus_graph::Limits::default())
            .map_err(|e| e.to_string())?;
        let plan = program.plan();
        let device = salus_cpu::CpuDevice::new(plan.persistent_bytes + plan.ephemeral_bytes + 256)
            .map_err(|e| e.to_string())?;
        let at = Placement {
            persistent: 0,
            lane: plan.persistent_bytes.next_multiple_of(256),
        };
        device
            .write(0, &self.initial())
            .map_err(|e| e.to_string())?;
        let mut losses = Vec::new();
        for i in 0..iterations {
            let feeds = self.feeds(i);
            let views: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
            let out = device
                .run(&program, at, &views)
                .map_err(|e| e.to_string())?;
            losses.push(loss_bits(&out.fetches[0])?);
        }
        let w = device
            .read(0, self.d * self.k * 4)
            .map_err(|e| e.to_string())?;
        Ok((losses, w))
    }
}

/// The bits of a fetched f32 loss.
pub fn loss_bits(fetch: &[u8]) -> Result<u32, String> {
    let bytes: [u8; 4] = fetch
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| format!("a loss of {} bytes", fetch.len()))?;
    Ok(u32::from_le_bytes(bytes))
}

/// Takes session `id` back after salusd restarted (or retries until `deadline`): the
/// session and the iteration it resumes from.
pub async fn reattach(address: &str, id: u64, token: &[u8]) -> Result<Session, String> {
    let deadline = Instant::now() + REATTACH_DEADLINE;
    let mut last = String::new();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let client = match Client::connect_with_token(address, None).await {
            Ok(client) => client,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        match client.reattach(id, token.to_vec()).await {
            Ok(session) => return Ok(session),
            Err(e) => last = e.to_string(),
        }
    }
    Err(format!("session {id} not taken back: {last}"))
}

/// What a worker did, printed as its last line.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Sessions opened.
    pub opened: u64,
    /// Sessions closed by their client at the end.
    pub closed: u64,
    /// Iterations answered.
    pub iterations: u64,
    /// Sessions let go mid-iteration (their connection dropped).
    pub dropped: u64,
    /// Sessions taken back after a restart.
    pub reattached: u64,
    /// Sessions that failed otherwise.
    pub errors: u64,
    /// The first few failures.
    pub error_samples: Vec<String>,
}

impl WorkerReport {
    /// Adds `other` into this one.
    pub fn add(&mut self, other: &WorkerReport) {
        self.opened += other.opened;
        self.closed += other.closed;
        self.iterations += other.iterations;
        self.dropped += other.dropped;
        self.reattached += other.reattached;
        self.errors += other.errors;
        for e in &other.error_samples {
            if self.error_samples.len() < 5 {
                self.error_samples.push(e.clone());
            }
        }
    }

    fn error(&mut self, what: String) {
        self.errors += 1;
        if self.error_samples.len() < 5 {
            self.error_samples.push(what);
        }
    }
}

/// Whether a failed call looks like salusd going away (a restart) rather than a refusal:
/// then the session is taken back with its token.
pub fn daemon_gone(error: &salus_client::Error) -> bool {
    match error {
        salus_client::Error::Status(status) => matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
        ),
        salus_client::Error::Connect { .. } | salus_client::Error::Protocol(_) => true,
    }
}

/// Opens a session of `job`, trying again while salusd restarts.
async fn open(address: &str, job: &Job, name: String) -> Result<Session, String> {
    let deadline = Instant::now() + REATTACH_DEADLINE;
    loop {
        let error = match Client::connect_with_token(address, None).await {
            Ok(client) => match client.open(job.options(name.clone())).await {
                Ok(session) => return Ok(session),
                Err(e) if daemon_gone(&e) => e.to_string(),
                Err(e) => return Err(format!("open: {e}")),
            },
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            return Err(format!("open: {error}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One session of a worker, from open to close (or to its drop).
async fn session(address: String, seed: u64, iterations: u64, drop_p: f64) -> WorkerReport {
    let mut report = WorkerReport::default();
    let mut rng = Rng::new(seed);
    let job = Job::new(seed);
    let mut session = match open(&address, &job, format!("soak-{seed}")).await {
        Ok(session) => session,
        Err(e) => {
            report.error(e);
            return report;
        }
    };
    report.opened += 1;
    let (id, token) = (session.id, session.token.clone());
    // Which iteration this session lets go in the middle of, if any.
    let drop_at = rng.chance(drop_p).then(|| rng.below(iterations));
    let mut i = 0;
    while i < iterations {
        if drop_at == Some(i) {
            // Let go mid-iteration: the request is in flight when the connection (the
            // session's own) drops.
            let run = session.run(job.feeds(i));
            let _ = tokio::time::timeout(Duration::from_micros(rng.below(2000)), run).await;
            drop(session);
            report.dropped += 1;
            return report;
        }
        match session.run(job.feeds(i)).await {
            Ok(_) => {
                report.iterations += 1;
                i += 1;
            }
            Err(first) if daemon_gone(&first) => match reattach(&address, id, &token).await {
                Ok(back) => {
                    session = back;
                    i = session.iterations;
                    report.reattached += 1;
                }
                Err(e) => {
                    report.error(format!("{first}; then {e}"));
                    return report;
                }
            },
            Err(e) => {
                report.error(format!("iteration {i}: {e}"));
                return report;
            }
        }
    }
    // A close that meets salusd restarting closes the session once it is back.
    let mut closing = session.close().await;
    if let Err(e) = &closing
        && daemon_gone(e)
    {
        closing = match reattach(&address, id, &token).await {
            Ok(back) => back.close().await,
            Err(again) => Err(salus_client::Error::Protocol(again)),
        };
    }
    match closing {
        Ok(()) => report.closed += 1,
        Err(e) => report.error(format!("close: {e}")),
    }
    report
}

/// Runs a worker: `sessions` sessions at once; prints its report as one JSON line.
pub fn run(
    address: &str,
    sessions: u64,
    iterations: u64,
    seed: u64,
    drop_p: f64,
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let report = runtime.block_on(async {
        let tasks: Vec<_> = (0..sessions)
            .map(|s| {
                tokio::spawn(session(
                    address.to_string(),
                    seed.wrapping_mul(1_000_003).wrapping_add(s),
                    iterations,
                    drop_p,
                ))
            })
            .collect();
        let mut report = WorkerReport::default();
        for task in tasks {
            match task.await {
                Ok(r) => report.add(&r),
                Err(e) => report.error(format!("a session task failed: {e}")),
            }
        }
        report
    });
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| e.to_string())?
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_feeds_its_graph_and_its_solo_run_repeats_bit_for_bit() {
        let job = Job::new(42);
        let graph = job.graph();
        let feeds: Vec<u64> = graph
            .tensors
            .iter()
            .filter(|t| t.role == salus_graph::Role::Feed)
            .map(|t| t.ty.bytes().unwrap_or(0))
            .collect();
        let sizes: Vec<u64> = job.feeds(3).iter().map(|f| f.len() as u64).collect();
        assert_eq!(sizes, feeds);
        let (losses, weights) = job.alone(5).expect("runs");
        assert_eq!(losses.len(), 5);
        assert_eq!(job.alone(5).expect("runs"), (losses, weights));
        assert_ne!(job.feeds(0), Job::new(43).feeds(0), "jobs differ by seed");
    }

    #[test]
    fn only_a_daemon_going_away_sends_a_session_back_for_its_token() {
        let status = |code| salus_client::Error::Status(tonic::Status::new(code, ""));
        assert!(daemon_gone(&status(tonic::Code::Unavailable)));
        assert!(daemon_gone(&status(tonic::Code::Unknown)));
        assert!(!daemon_gone(&status(tonic::Code::NotFound)));
        assert!(!daemon_gone(&status(tonic::Code::InvalidArgument)));
    }
}
