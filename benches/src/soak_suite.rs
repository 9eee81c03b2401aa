//! Load and soak: a real `salusd` process (cpu or sim device, `--state-dir`) and many
//! sessions from many client processes, some of them killed mid-iteration, some sessions
//! letting go of their connection mid-iteration, and salusd itself restarted (SIGTERM,
//! then started again on the same state directory) while they run; the clients take their
//! sessions back with their tokens.
//!
//! What it reports is what such a life could leak, each against a baseline of the same
//! run: the sessions still open (and snapshots still kept) once every client has gone,
//! the daemon's resident memory and open file descriptors (`/proc/PID`) at each quiet
//! moment (every round's end, only the victim open) of each daemon process, and a victim
//! session, in this process, that runs all along through every restart: its losses and
//! final weights against its solo run on a fresh cpu device (bit-identical expected on the
//! cpu device).
//!
//! Each round starts `--clients` processes (`salus-bench soak-worker`) sharing
//! `--sessions` sessions, each session on its own connection running `--iterations`
//! iterations; a `--kill` fraction of the processes is killed (SIGKILL) at a random moment,
//! and a `--drop` fraction of the sessions drops its connection mid-iteration. Rounds 1 to
//! `--restarts` each restart salusd in their middle (kills and restarts fall at random
//! moments within the time the last round without a restart took).
//!
//! A daemon's quiet moments are comparable only within one process: its resident memory
//! grows while the cpu device's arena pages are first touched and the allocator's pools
//! fill, then levels; a leak goes on growing round after round.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use salus_client::Client;
use serde::Serialize;

use crate::soak_worker::{self, Job, Rng, WorkerReport};

/// The soak's settings.
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    /// Sessions per round, over all client processes.
    pub sessions: u64,
    /// Client processes per round.
    pub clients: u64,
    /// Rounds.
    pub rounds: u64,
    /// Iterations of each session.
    pub iterations: u64,
    /// Fraction of client processes killed each round.
    pub kill: f64,
    /// Fraction of sessions that drop their connection mid-iteration.
    pub drop: f64,
    /// Restarts of salusd (in rounds 1, 2, ...).
    pub restarts: u64,
    /// `cpu` or `sim`.
    pub device: String,
    /// The salusd binary.
    #[serde(skip)]
    pub salusd: PathBuf,
    /// Seed of the kills, drops and restart moments.
    pub seed: u64,
    /// Leave salusd's logs and state directory in the temporary folder.
    pub keep_logs: bool,
}

/// One quiet moment: every client of the round gone, only the victim open.
#[derive(Debug, Serialize)]
struct Sample {
    round: u64,
    /// How long the round took, its clients' start to their end.
    round_ms: u64,
    /// Which daemon process (0 first, then one per restart).
    instance: u64,
    pid: u32,
    rss_bytes: u64,
    fds: u64,
    sessions: u64,
    /// How long the daemon took to close the round's sessions once their clients had gone.
    settle_ms: u64,
}

#[derive(Debug, Serialize)]
struct Victim {
    iterations: u64,
    reattached: u64,
    /// `None` on the sim device (it computes nothing).
    losses_identical: Option<bool>,
    weights_identical: Option<bool>,
    first_differing_iteration: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Leaks {
    /// Sessions open once every client (the victim included) had closed or gone.
    sessions_left: u64,
    /// Sessions still opening then.
    opening_left: u64,
    /// Snapshots left in the state directory after the last SIGTERM.
    snapshots_left: u64,
    /// The last daemon process: its quiet moment after its first whole round, and its
    /// last.
    rss_first_bytes: u64,
    rss_last_bytes: u64,
    fds_first: u64,
    fds_last: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    options: Options,
    wall_s: f64,
    clients_started: u64,
    clients_killed: u64,
    restarts: u64,
    /// What the client processes that were not killed did.
    clients: WorkerReport,
    samples: Vec<Sample>,
    victim: Victim,
    leaks: Leaks,
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A salusd process of the soak.
struct Daemon {
    child: Child,
    instance: u64,
}

impl Drop for Daemon {
    /// A soak that fails leaves no daemon behind.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn start_daemon(options: &Options, dir: &Path, instance: u64) -> Result<Daemon, String> {
    let socket = dir.join("salusd.sock");
    let log_path = dir.join(format!("salusd-{instance}.log"));
    let log = std::fs::File::create(&log_path).map_err(err)?;
    let child = Command::new(&options.salusd)
        .arg("--socket")
        .arg(&socket)
        .args(["--device", &options.device, "--memory", "1GiB"])
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--snapshot-every", "0", "--reattach-timeout", "10s"])
        .args(["--max-sessions-per-user", "100000"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", options.salusd.display()))?;
    let mut daemon = Daemon { child, instance };
    crate::await_daemon(
        &mut daemon.child,
        &socket,
        Duration::from_secs(30),
        &log_path,
    )?;
    Ok(daemon)
}

fn signal(pid: u32, name: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .map_err(err)?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| format!("kill -{name} {pid} failed"))
}

/// SIGTERM, then waits for a clean exit.
fn stop_daemon(mut daemon: Daemon) -> Result<(), String> {
    signal(daemon.child.id(), "TERM")?;
    let status = daemon.child.wait().map_err(err)?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| format!("salusd {} exited with {status}", daemon.instance))
}

fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// Waits until the daemon has `want` sessions open (or 30 s); how many it has and how
/// long that took. Asks over `admin`, one connection kept for the whole soak (so that the
/// daemon's descriptors count it at every quiet moment), made again after a restart.
async fn settle(
    admin: &mut Option<Client>,
    address: &str,
    want: usize,
) -> Result<(u64, Duration), String> {
    let start = Instant::now();
    loop {
        if admin.is_none() {
            *admin = Client::connect_with_token(address, None).await.ok();
        }
        let open = match admin.as_ref() {
            Some(client) => client.list_sessions().await.map(|s| s.len()).ok(),
            None => None,
        };
        if open.is_none() {
            *admin = None;
        }
        if open == Some(want) || start.elapsed() > Duration::from_secs(30) {
            return Ok((open.unwrap_or(usize::MAX) as u64, start.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The victim: one session all along, through every restart, until `stop` is set.
async fn victim(
    address: String,
    job: Job,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(Vec<u32>, Vec<u8>, u64), String> {
    let client = Client::connect_with_token(&address, None)
        .await
        .map_err(err)?;
    let mut session = client
        .open(job.options("victim".into()))
        .await
        .map_err(err)?;
    session.admitted().await.map_err(err)?;
    let (id, token) = (session.id, session.token.clone());
    let mut losses: Vec<u32> = Vec::new();
    let mut reattached = 0;
    while !*stop.borrow() {
        let i = losses.len() as u64;
        match session.run(job.feeds(i)).await {
            Ok(out) => losses.push(soak_worker::loss_bits(&out.fetches[0])?),
            Err(first) if !soak_worker::daemon_gone(&first) => {
                return Err(format!("victim, iteration {i}: {first}"));
            }
            Err(first) => {
                session = soak_worker::reattach(&address, id, &token)
                    .await
                    .map_err(|e| format!("victim: {first}; then {e}"))?;
                reattached += 1;
                let resumed = session.iterations as usize;
                if resumed > losses.len() {
                    return Err(format!(
                        "victim resumes from iteration {resumed} but saw only {}",
                        losses.len()
                    ));
                }
                losses.truncate(resumed);
            }
        }
        // Paced, so that its iterations span the whole soak.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let weights = session.read(&[0]).await.map_err(err)?.remove(0).1;
    session.close().await.map_err(err)?;
    Ok((losses, weights, reattached))
}

fn spawn_worker(
    options: &Options,
    address: &str,
    sessions: u64,
    seed: u64,
) -> Result<Child, String> {
    let exe = std::env::current_exe().map_err(err)?;
    Command::new(exe)
        .arg("soak-worker")
        .args(["--address", address])
        .args(["--sessions", &sessions.to_string()])
        .args(["--iterations", &options.iterations.to_string()])
        .args(["--seed", &seed.to_string()])
        .args(["--drop", &options.drop.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(err)
}

/// A round's client processes; those still running when it ends early are killed.
struct Workers(Vec<Option<Child>>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in self.0.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// What happens at a moment of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Moment {
    Kill(usize),
    Restart,
}

struct Soak<'a> {
    options: &'a Options,
    dir: PathBuf,
    address: String,
    runtime: tokio::runtime::Runtime,
    daemon: Option<Daemon>,
    admin: Option<Client>,
    rng: Rng,
    clients: WorkerReport,
    started: u64,
    killed: u64,
    restarts: u64,
    samples: Vec<Sample>,
    /// How long the last round without a restart took.
    last_round: Option<Duration>,
}

impl Soak<'_> {
    fn restart(&mut self) -> Result<(), String> {
        let old = self.daemon.take().ok_or("no daemon")?;
        let instance = old.instance + 1;
        stop_daemon(old)?;
        self.daemon = Some(start_daemon(self.options, &self.dir, instance)?);
        self.admin = None;
        self.restarts += 1;
        Ok(())
    }

    fn round(&mut self, round: u64) -> Result<(), String> {
        let clients = self.options.clients.max(1);
        let mut children = Workers(Vec::new());
        for c in 0..clients {
            let share =
                self.options.sessions / clients + u64::from(c < self.options.sessions % clients);
            let seed = self.options.seed * 1_000_000 + round * 1_000 + c + 1;
            children.0.push(Some(spawn_worker(
                self.options,
                &self.address,
                share,
                seed,
            )?));
            self.started += 1;
        }
        // When each thing happens, in milliseconds from the round's start: somewhere in
        // the middle of the round, judged by how long the last one took.
        let span = self
            .last_round
            .map_or(300, |d| d.as_millis() as u64)
            .max(50);
        let mut moments: BTreeSet<(u64, Moment)> = BTreeSet::new();
        let kills = (clients as f64 * self.options.kill).round() as u64;
        let mut chosen = BTreeSet::new();
        while (chosen.len() as u64) < kills.min(clients) {
            chosen.insert(self.rng.below(clients) as usize);
        }
        for c in chosen {
            moments.insert((span / 10 + self.rng.below(span * 8 / 10), Moment::Kill(c)));
        }
        if (1..=self.options.restarts).contains(&round) {
            moments.insert((span / 5 + self.rng.below(span * 6 / 10), Moment::Restart));
        }
        let start = Instant::now();
        let mut outputs = Vec::new();
        loop {
            while let Some(&(at, moment)) = moments.first() {
                if start.elapsed() < Duration::from_millis(at) {
                    break;
                }
                moments.pop_first();
                match moment {
                    Moment::Kill(c) => {
                        if let Some(child) = children.0[c].as_mut()
                            && child.try_wait().map_err(err)?.is_none()
                        {
                            child.kill().map_err(err)?;
                            let _ = child.wait();
                            children.0[c] = None;
                            self.killed += 1;
                        }
                    }
                    Moment::Restart => self.restart()?,
                }
            }
            for slot in children.0.iter_mut() {
                if let Some(child) = slot.as_mut()
                    && child.try_wait().map_err(err)?.is_some()
                {
                    let mut out = String::new();
                    if let Some(mut stdout) = child.stdout.take() {
                        let _ = stdout.read_to_string(&mut out);
                    }
                    outputs.push(out);
                    *slot = None;
                }
            }
            if children.0.iter().all(Option::is_none) && moments.is_empty() {
                break;
            }
            if start.elapsed() > Duration::from_secs(600) {
                return Err(format!("round {round} still running after 10 minutes"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let took = start.elapsed();
        if self.last_round.is_none() || !(1..=self.options.restarts).contains(&round) {
            self.last_round = Some(took);
        }
        for out in outputs {
            let line = out.lines().last().unwrap_or_default();
            let report: WorkerReport = serde_json::from_str(line)
                .map_err(|e| format!("a worker's report {line:?}: {e}"))?;
            self.clients.add(&report);
        }
        // Only the victim is left once the daemon has closed the round's sessions.
        let (sessions, settled) =
            self.runtime
                .block_on(settle(&mut self.admin, &self.address, 1))?;
        let daemon = self.daemon.as_ref().ok_or("no daemon")?;
        let pid = daemon.child.id();
        self.samples.push(Sample {
            round,
            instance: daemon.instance,
            pid,
            rss_bytes: rss_bytes(pid),
            fds: fds(pid),
            sessions,
            settle_ms: settled.as_millis() as u64,
            round_ms: took.as_millis() as u64,
        });
        Ok(())
    }
}

/// Runs the soak; prints its report.
pub fn run(options: &Options, json: bool) -> Result<(), String> {
    if !options.salusd.exists() {
        return Err(format!(
            "no salusd at {} (build it: cargo build --release -p salusd, or pass --salusd)",
            options.salusd.display()
        ));
    }
    let wall = Instant::now();
    let dir = std::env::temp_dir().join(format!("salus-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(err)?;
    let address = dir.join("salusd.sock").display().to_string();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(err)?;
    let daemon = start_daemon(options, &dir, 0)?;
    let job = Job::new(424_242);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let victim_task = runtime.spawn(victim(address.clone(), job, stopped));
    let mut soak = Soak {
        options,
        dir: dir.clone(),
        address: address.clone(),
        runtime,
        daemon: Some(daemon),
        admin: None,
        rng: Rng::new(options.seed),
        clients: WorkerReport::default(),
        started: 0,
        killed: 0,
        restarts: 0,
        samples: Vec::new(),
        last_round: None,
    };
    for round in 0..options.rounds {
        soak.round(round)?;
        if !json {
            let s = soak.samples.last().ok_or("no sample")?;
            eprintln!(
                "round {round} ({} ms): salusd {} rss {:.1} MiB, {} fds, {} sessions ({} ms to \
                 settle)",
                s.round_ms,
                s.instance,
                s.rss_bytes as f64 / (1 << 20) as f64,
                s.fds,
                s.sessions,
                s.settle_ms
            );
        }
    }
    stop.send_replace(true);
    let (losses, weights, victim_reattached) =
        soak.runtime.block_on(victim_task).map_err(err)??;
    let (sessions_left, _) = soak
        .runtime
        .block_on(settle(&mut soak.admin, &address, 0))?;
    let opening_left = match soak.admin.as_ref() {
        Some(client) => soak
            .runtime
            .block_on(client.status())
            .map_or(0, |s| s.opening_sessions),
        None => 0,
    };
    let daemon = soak.daemon.take().ok_or("no daemon")?;
    let last_instance = daemon.instance;
    stop_daemon(daemon)?;
    let snapshots_left = std::fs::read_dir(dir.join("state")).map_or(0, |d| d.count() as u64);
    let iterations = losses.len() as u64;
    let victim = if options.device == "cpu" {
        let (alone_losses, alone_weights) = job.alone(iterations)?;
        Victim {
            iterations,
            reattached: victim_reattached,
            losses_identical: Some(losses == alone_losses),
            weights_identical: Some(weights == alone_weights),
            first_differing_iteration: losses
                .iter()
                .zip(&alone_losses)
                .position(|(a, b)| a != b)
                .map(|i| i as u64),
        }
    } else {
        Victim {
            iterations,
            reattached: victim_reattached,
            losses_identical: None,
            weights_identical: None,
            first_differing_iteration: None,
        }
    };
    // The last daemon's quiet moments, from the end of its first whole round (the round
    // it started in had it for part of the time only).
    let mut last: Vec<&Sample> = soak
        .samples
        .iter()
        .filter(|s| s.instance == last_instance)
        .collect();
    if last_instance > 0 && last.len() > 1 {
        last.remove(0);
    }
    let (first, end) = (last.first(), last.last());
    let leaks = Leaks {
        sessions_left,
        opening_left,
        snapshots_left,
        rss_first_bytes: first.map_or(0, |s| s.rss_bytes),
        rss_last_bytes: end.map_or(0, |s| s.rss_bytes),
        fds_first: first.map_or(0, |s| s.fds),
        fds_last: end.map_or(0, |s| s.fds),
    };
    let report = Report {
        options: options.clone(),
        wall_s: wall.elapsed().as_secs_f64(),
        clients_started: soak.started,
        clients_killed: soak.killed,
        restarts: soak.restarts,
        clients: soak.clients.clone(),
        samples: std::mem::take(&mut soak.samples),
        victim,
        leaks,
    };
    drop(soak);
    if options.keep_logs {
        eprintln!("salusd's logs and state directory: {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    if json {
        println!("{}", serde_json::to_string(&report).map_err(err)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(r: &Report) {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "{} rounds in {:.0} s: {} client processes ({} killed), {} restarts of salusd",
        r.options.rounds, r.wall_s, r.clients_started, r.clients_killed, r.restarts
    );
    let c = &r.clients;
    println!(
        "sessions of surviving clients: {} opened, {} closed, {} dropped mid-iteration, {} taken \
         back after a restart, {} failed; {} iterations",
        c.opened, c.closed, c.dropped, c.reattached, c.errors, c.iterations
    );
    for e in &c.error_samples {
        println!("  failure: {e}");
    }
    let l = &r.leaks;
    println!(
        "left behind: {} sessions, {} opening, {} snapshots",
        l.sessions_left, l.opening_left, l.snapshots_left
    );
    println!(
        "last salusd, quiet after its first whole round and at the end: rss {:.1} -> {:.1} MiB, \
         fds {} -> {}",
        mib(l.rss_first_bytes),
        mib(l.rss_last_bytes),
        l.fds_first,
        l.fds_last
    );
    let v = &r.victim;
    match (v.losses_identical, v.weights_identical) {
        (Some(losses), Some(weights)) => println!(
            "victim: {} iterations, {} reattaches; losses identical to its solo run: {losses}, \
             final weights: {weights}",
            v.iterations, v.reattached
        ),
        _ => println!(
            "victim: {} iterations, {} reattaches (not compared on {})",
            v.iterations, v.reattached, r.options.device
        ),
    }
}
