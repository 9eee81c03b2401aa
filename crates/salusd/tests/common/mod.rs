//! Shared by the daemon tests: a real `salusd` process on a temporary socket, and a small
//! real training graph (linear regression trained by SGD) with its data.

#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use salus_client::{Client, OpenOptions, Session, v1 as pb};
use salus_graph::Graph;

/// A salusd process; killed when dropped.
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
}

impl Daemon {
    /// Starts `salusd --socket <tmp> <args>` and waits until it answers.
    pub fn start(args: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("salusd.sock");
        Daemon::start_in(dir, socket, args)
    }

    /// Starts `salusd --socket <socket> <args>` and waits until it answers.
    pub fn start_at(socket: &std::path::Path, args: &[&str]) -> Daemon {
        Daemon::start_in(tempfile::tempdir().unwrap(), socket.to_path_buf(), args)
    }

    /// `start_at` with `env` set for salusd.
    pub fn start_with_env(socket: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Daemon::start_in_env(
            tempfile::tempdir().unwrap(),
            socket.to_path_buf(),
            args,
            env,
        )
    }

    fn start_in(dir: tempfile::TempDir, socket: PathBuf, args: &[&str]) -> Daemon {
        Daemon::start_in_env(dir, socket, args, &[])
    }

    fn start_in_env(
        dir: tempfile::TempDir,
        socket: PathBuf,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let log = std::fs::File::create(dir.path().join("salusd.log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_salusd"))
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut daemon = Daemon { child, dir, socket };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&daemon.socket).is_err() {
            let exited = daemon.child.try_wait().unwrap();
            assert!(
                exited.is_none() && Instant::now() < deadline,
                "salusd did not start ({exited:?}): {}",
                daemon.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon
    }

    /// A client over TCP at `address` (`host:port`), once the daemon answers there.
    pub async fn tcp_client(&self, address: &str, token: Option<&str>) -> Client {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match Client::connect_with_token(address, token.map(str::to_string)).await {
                Ok(client) => return client,
                Err(e) => assert!(Instant::now() < deadline, "{e}: {}", self.log()),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn address(&self) -> String {
        self.socket.display().to_string()
    }

    pub async fn client(&self) -> Client {
        Client::connect_with_token(&self.address(), None)
            .await
            .unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("salusd.log")).unwrap_or_default()
    }

    /// Sends a signal with `kill` (the tests need no libc).
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The metrics endpoint's whole answer (status line, headers, body) at `address`.
pub async fn scrape(address: String) -> String {
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(address).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    })
    .await
    .unwrap()
}

/// A free TCP address on the loopback interface.
pub fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// Runs salusd with `args` expecting it to refuse to start: its exit code and stderr.
pub fn refused_start(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_salusd"))
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "salusd {args:?} started");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Deterministic pseudo-random f32s in [-1, 1).
pub fn values(seed: u64, count: usize) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub fn bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A regression job: its graph, initial weights and batches.
#[derive(Clone)]
pub struct Job {
    pub name: String,
    pub n: u64,
    pub d: u64,
    pub k: u64,
    pub seed: u64,
    /// Whether the targets follow `x * w_true` (else they are the noise alone).
    pub signal: bool,
}

impl Job {
    pub fn new(name: &str, n: u64, d: u64, k: u64, seed: u64) -> Job {
        Job {
            name: name.into(),
            n,
            d,
            k,
            seed,
            signal: true,
        }
    }

    /// The same job with targets that are the noise alone: a large job whose batches cost
    /// this (unoptimised) test process nothing to make, for iterations that take a while.
    pub fn without_signal(self) -> Job {
        Job {
            signal: false,
            ..self
        }
    }

    pub fn graph(&self) -> Graph {
        // Rate 0.5 k: each step moves w a third of the way to the batch's least squares.
        salus_graph::samples::regression(self.n, self.d, self.k, 0.5 * self.k as f64)
    }

    pub fn initial(&self) -> Vec<u8> {
        bytes(&values(self.seed, (self.d * self.k) as usize))
    }

    /// Feeds of iteration `i`: `x` random, `y = x * w_true` plus noise (the noise alone
    /// without the signal).
    pub fn feeds(&self, i: u64) -> Vec<Vec<u8>> {
        let (n, d, k) = (self.n as usize, self.d as usize, self.k as usize);
        let x = values(self.seed * 1000 + i + 1, n * d);
        let noise = values(self.seed * 1000 + i + 500, n * k);
        if !self.signal {
            return vec![bytes(&x), bytes(&noise)];
        }
        let w_true = values(self.seed + 77, d * k);
        let mut y = vec![0f32; n * k];
        for r in 0..n {
            for c in 0..k {
                let mut acc = 0f32;
                for j in 0..d {
                    acc += x[r * d + j] * w_true[j * k + c];
                }
                y[r * k + c] = acc + 0.01 * noise[r * k + c];
            }
        }
        vec![bytes(&x), bytes(&y)]
    }

    pub fn options(&self) -> OpenOptions {
        OpenOptions {
            graph: self.graph().to_proto(),
            kind: pb::SessionKind::Training,
            hints: pb::Hints {
                name: self.name.clone(),
                ..Default::default()
            },
            initial: vec![(0, self.initial())],
        }
    }

    /// Runs `iterations` on a fresh CPU device in this process: what the job gives alone.
    pub fn alone(&self, iterations: u64) -> (Vec<f32>, Vec<u8>) {
        use salus_cpu::CpuDevice;
        use salus_exec::{Device, Placement, Program};
        let program = Program::new(self.graph(), &salus_graph::Limits::default()).unwrap();
        let plan = program.plan();
        let device = CpuDevice::new(plan.persistent_bytes + plan.ephemeral_bytes + 256).unwrap();
        let at = Placement {
            persistent: 0,
            lane: plan.persistent_bytes.next_multiple_of(256),
        };
        device.write(0, &self.initial()).unwrap();
        let mut losses = Vec::new();
        for i in 0..iterations {
            let feeds = self.feeds(i);
            let views: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
            let out = device.run(&program, at, &views).unwrap();
            losses.push(floats(&out.fetches[0])[0]);
        }
        let w = device.read(0, self.d * self.k * 4).unwrap();
        (losses, w)
    }

    /// Runs `iterations` through the daemon; the losses and the final weights.
    pub async fn on(&self, session: &Session, iterations: u64) -> (Vec<f32>, Vec<u8>) {
        let mut losses = Vec::new();
        for i in 0..iterations {
            let out = session.run(self.feeds(i)).await.unwrap();
            losses.push(floats(&out.fetches[0])[0]);
        }
        let w = session.read(&[0]).await.unwrap().remove(0).1;
        (losses, w)
    }
}

/// Waits until `check` holds, polling the daemon's session list.
pub async fn eventually(
    client: &Client,
    what: &str,
    check: impl Fn(&[pb::SessionInfo]) -> bool,
) -> Vec<pb::SessionInfo> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let sessions = client.list_sessions().await.unwrap();
        if check(&sessions) {
            return sessions;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {sessions:#?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A graph of the one node `name`: `op(tensors[0], tensors[1]) -> tensors[2]`, fetching its
/// result.
pub fn one_node_graph(tensors: Vec<salus_graph::Tensor>, name: &str, op: salus_graph::Op) -> Graph {
    Graph {
        tensors,
        nodes: vec![salus_graph::Node {
            name: name.into(),
            op,
            inputs: vec![Some(0), Some(1)],
            outputs: vec![Some(2)],
            attrs: Default::default(),
            source: String::new(),
        }],
        fetches: vec![2],
        updates: vec![],
        precision: salus_graph::Precision::IEEE,
    }
}
