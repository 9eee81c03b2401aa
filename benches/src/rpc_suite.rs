//! The daemon over its Unix socket: iteration round trip, throughput with 8 sessions,
//! switch latency on a shared lane, and memory per idle session.
//!
//! The daemon runs in this process (its own multi-threaded runtime) and the clients talk
//! to it through a real Unix socket and real gRPC, exactly as separate processes would.
//!
//! The baseline is a bare tonic server on another Unix socket, also in its own runtime,
//! whose `Run` echoes the feeds back as fetches: the same messages over the same kind of
//! transport with no engine behind them. The iteration round trip is reported also as a
//! ratio to that echo, measured in the same run, so what the service itself adds shows
//! whatever machine runs it.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::time::{Duration, Instant};

use salus_client::{Client, OpenOptions, Session, v1 as pb};
use salus_graph::{DType, Graph, Node, Op, Role, Tensor, TensorType};
use serde::Serialize;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

#[derive(Debug, Serialize)]
struct Percentiles {
    p50: f64,
    p99: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    iteration_rtt_us: Percentiles,
    /// The bare tonic echo of the same messages, measured beside it.
    echo_rtt_us: Percentiles,
    /// The iteration round trip over the echo's, per percentile.
    rtt_over_echo: Percentiles,
    iterations_per_s_8_sessions: f64,
    switch_us: Percentiles,
    idle_session_bytes: f64,
}

/// relu of a 4-element feed: the smallest real iteration.
fn trivial() -> Graph {
    let t = |name: &str, role| Tensor {
        name: name.into(),
        ty: TensorType::new(DType::F32, vec![4]),
        role,
        data: vec![],
    };
    Graph {
        tensors: vec![t("x", Role::Feed), t("y", Role::Intermediate)],
        nodes: vec![Node {
            name: "relu".into(),
            op: Op::Relu,
            inputs: vec![Some(0)],
            outputs: vec![Some(1)],
            attrs: BTreeMap::new(),
            source: String::new(),
        }],
        fetches: vec![1],
        updates: vec![],
        precision: Default::default(),
    }
}

fn options(name: &str) -> OpenOptions {
    OpenOptions {
        graph: trivial().to_proto(),
        kind: pb::SessionKind::Inference,
        hints: pb::Hints {
            name: name.into(),
            ..Default::default()
        },
        initial: vec![],
    }
}

fn percentiles(mut samples: Vec<Duration>) -> Percentiles {
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i].as_secs_f64() * 1e6
    };
    Percentiles {
        p50: at(0.50),
        p99: at(0.99),
    }
}

/// Resident memory of this process, from /proc.
fn rss_bytes() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "no VmRSS in /proc/self/status".into())
}

async fn open(client: &Client, name: &str) -> Result<Session, String> {
    let mut session = client
        .open(options(name))
        .await
        .map_err(|e| e.to_string())?;
    session.admitted().await.map_err(|e| e.to_string())?;
    Ok(session)
}

/// A bare tonic `Sessions` server whose `Run` echoes its feeds as fetches; nothing else.
struct Echo;

type Unimplemented<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl pb::sessions_server::Sessions for Echo {
    type OpenStream = Unimplemented<pb::SessionUpdate>;
    type RunStreamStream = Unimplemented<pb::RunResponse>;
    type ReadTensorsStream = Unimplemented<pb::TensorChunk>;

    async fn open(
        &self,
        _: Request<Streaming<pb::OpenRequest>>,
    ) -> Result<Response<Self::OpenStream>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn run(
        &self,
        request: Request<pb::RunRequest>,
    ) -> Result<Response<pb::RunResponse>, Status> {
        let pb::RunRequest { feeds, tag, .. } = request.into_inner();
        Ok(Response::new(pb::RunResponse {
            tag,
            fetches: feeds,
            ..Default::default()
        }))
    }

    async fn run_stream(
        &self,
        _: Request<Streaming<pb::RunRequest>>,
    ) -> Result<Response<Self::RunStreamStream>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn read_tensors(
        &self,
        _: Request<pb::ReadTensorsRequest>,
    ) -> Result<Response<Self::ReadTensorsStream>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn write_tensors(
        &self,
        _: Request<Streaming<pb::WriteTensorsRequest>>,
    ) -> Result<Response<pb::WriteTensorsResponse>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn close(
        &self,
        _: Request<pb::CloseRequest>,
    ) -> Result<Response<pb::CloseResponse>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn add_program(
        &self,
        _: Request<pb::AddProgramRequest>,
    ) -> Result<Response<pb::AddProgramResponse>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn attach_buffer(
        &self,
        _: Request<pb::AttachBufferRequest>,
    ) -> Result<Response<pb::AttachBufferResponse>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn serve(
        &self,
        _: Request<pb::ServeRequest>,
    ) -> Result<Response<pb::ServeResponse>, Status> {
        Err(Status::unimplemented("echo"))
    }

    async fn infer(
        &self,
        _: Request<pb::InferRequest>,
    ) -> Result<Response<pb::InferResponse>, Status> {
        Err(Status::unimplemented("echo"))
    }
}

/// Serves [`Echo`] on `socket` from its own multi-threaded runtime (as the daemon is
/// served) until `stop` fires.
fn serve_echo(
    socket: std::path::PathBuf,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<std::thread::JoinHandle<Result<(), String>>, String> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
        runtime.block_on(async move {
            let listener = tokio::net::UnixListener::bind(&socket).map_err(|e| e.to_string())?;
            let _ = ready_tx.send(());
            tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .add_service(pb::sessions_server::SessionsServer::new(Echo))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = stop.await;
                    },
                )
                .await
                .map_err(|e| e.to_string())
        })
    });
    ready_rx
        .recv()
        .map_err(|_| "the echo server did not start".to_string())?;
    Ok(server)
}

async fn measure(
    address: &str,
    echo_address: &str,
    daemon: &salusd::engine::Engine,
    rtt_iterations: usize,
) -> Result<Report, String> {
    let err = |e: salus_client::Error| e.to_string();
    let client = Client::connect_with_token(address, None)
        .await
        .map_err(err)?;
    let feeds = || vec![vec![0u8; 16]];

    // Round trip of one iteration, one client, nothing else running; beside it, the same
    // request echoed by a bare tonic server. They alternate in blocks of back-to-back
    // calls, so that both see the same machine and each runs as it would alone (calls
    // alternating one by one let each server's threads go idle between its calls).
    let echo_client = Client::connect_with_token(echo_address, None)
        .await
        .map_err(err)?;
    let mut echo = pb::sessions_client::SessionsClient::new(echo_client.channel());
    let echo_request = || pb::RunRequest {
        session: 0,
        feeds: feeds(),
        tag: 0,
        ..Default::default()
    };
    let session = open(&client, "rtt").await?;
    for _ in 0..200 {
        session.run(feeds()).await.map_err(err)?;
        echo.run(echo_request()).await.map_err(|e| e.to_string())?;
    }
    const BLOCK: usize = 100;
    let mut rtt = Vec::with_capacity(rtt_iterations);
    let mut echo_rtt = Vec::with_capacity(rtt_iterations);
    while rtt.len() < rtt_iterations {
        let calls = BLOCK.min(rtt_iterations - rtt.len());
        for _ in 0..calls {
            let start = Instant::now();
            echo.run(echo_request()).await.map_err(|e| e.to_string())?;
            echo_rtt.push(start.elapsed());
        }
        for _ in 0..calls {
            let start = Instant::now();
            session.run(feeds()).await.map_err(err)?;
            rtt.push(start.elapsed());
        }
    }
    session.close().await.map_err(err)?;

    // Eight sessions iterating as fast as they can, each on its own connection.
    let mut tasks = Vec::new();
    let window = Duration::from_secs(2);
    for i in 0..8 {
        let client = Client::connect_with_token(address, None)
            .await
            .map_err(err)?;
        let session = open(&client, &format!("load{i}")).await?;
        tasks.push(tokio::spawn(async move {
            let start = Instant::now();
            let mut done = 0u64;
            while start.elapsed() < window {
                if session.run(vec![vec![0u8; 16]]).await.is_ok() {
                    done += 1;
                }
            }
            let _ = session.close().await;
            (done, start.elapsed())
        }));
    }
    let mut rate = 0.0;
    for task in tasks {
        let (done, elapsed) = task.await.map_err(|e| e.to_string())?;
        rate += done as f64 / elapsed.as_secs_f64();
    }

    // Two sessions time-sharing one lane (FAIR), both always ready.
    client.policy(Some("fair")).await.map_err(err)?;
    let a = open(&client, "switch-a").await?;
    let b = open(&client, "switch-b").await?;
    let before = daemon.stats().switches.len();
    let requests = |n| (0..n).map(|_| vec![vec![0u8; 16]]).collect::<Vec<_>>();
    let (mut sa, mut sb) = (
        a.run_stream(requests(3000)).await.map_err(err)?,
        b.run_stream(requests(3000)).await.map_err(err)?,
    );
    use tokio_stream::StreamExt;
    let drain_a = async { while sa.next().await.is_some() {} };
    let drain_b = async { while sb.next().await.is_some() {} };
    tokio::join!(drain_a, drain_b);
    let switches: Vec<Duration> = daemon.stats().switches.into_iter().skip(before).collect();
    if switches.len() < 100 {
        return Err(format!("only {} switches observed", switches.len()));
    }
    a.close().await.map_err(err)?;
    b.close().await.map_err(err)?;
    client.policy(Some("pack")).await.map_err(err)?;

    // Memory per idle session (an upper bound: the clients' side of each session lives in
    // this process too).
    let idle = 500;
    let base = rss_bytes()?;
    let mut held = Vec::with_capacity(idle);
    for i in 0..idle {
        held.push(open(&client, &format!("idle{i}")).await?);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let grown = rss_bytes()?.saturating_sub(base);
    drop(held);

    let (iteration_rtt_us, echo_rtt_us) = (percentiles(rtt), percentiles(echo_rtt));
    Ok(Report {
        rtt_over_echo: Percentiles {
            p50: iteration_rtt_us.p50 / echo_rtt_us.p50,
            p99: iteration_rtt_us.p99 / echo_rtt_us.p99,
        },
        iteration_rtt_us,
        echo_rtt_us,
        iterations_per_s_8_sessions: rate,
        switch_us: percentiles(switches),
        idle_session_bytes: grown as f64 / idle as f64,
    })
}

/// Runs the suite.
pub fn run(iterations: usize, json: bool) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("salus-bench-rpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("salusd.sock");
    let mut config = salusd::Config::new(socket.clone());
    config.memory = 1 << 30;
    config.policy = salus_core::PolicyKind::Pack;
    let (engine_tx, engine_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let daemon = std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
        runtime
            .block_on(salusd::run_with(
                config,
                async {
                    let _ = stopped.await;
                },
                |d| {
                    let _ = engine_tx.send(d.engine.clone());
                },
            ))
            .map_err(|e| e.to_string())
    });
    let engine = engine_rx
        .recv()
        .map_err(|_| "the daemon did not start".to_string())?;
    let echo_socket = dir.join("echo.sock");
    let (stop_echo, echo_stopped) = tokio::sync::oneshot::channel::<()>();
    let echo = serve_echo(echo_socket.clone(), echo_stopped)?;
    let client_runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let report = client_runtime.block_on(measure(
        &socket.display().to_string(),
        &echo_socket.display().to_string(),
        &engine,
        iterations,
    ));
    // Dropping the clients' runtime closes their connections, so both servers can finish
    // their graceful shutdown.
    drop(client_runtime);
    let _ = stop.send(());
    let _ = stop_echo.send(());
    echo.join()
        .map_err(|_| "the echo server panicked".to_string())??;
    daemon
        .join()
        .map_err(|_| "the daemon panicked".to_string())??;
    let _ = std::fs::remove_dir_all(&dir);
    let report = report?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "iteration round trip  p50 {:.1} us  p99 {:.1} us",
            report.iteration_rtt_us.p50, report.iteration_rtt_us.p99
        );
        println!(
            "tonic echo (baseline) p50 {:.1} us  p99 {:.1} us",
            report.echo_rtt_us.p50, report.echo_rtt_us.p99
        );
        println!(
            "round trip / echo     p50 {:.2}x    p99 {:.2}x",
            report.rtt_over_echo.p50, report.rtt_over_echo.p99
        );
        println!(
            "8 sessions            {:.0} iterations/s",
            report.iterations_per_s_8_sessions
        );
        println!(
            "switch on one lane    p50 {:.1} us  p99 {:.1} us",
            report.switch_us.p50, report.switch_us.p99
        );
        println!(
            "idle session          {:.0} bytes",
            report.idle_session_bytes
        );
    }
    Ok(())
}
