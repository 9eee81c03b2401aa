//! `salusd`: serve one device to many deep-learning jobs. `salusd --help` explains each
//! setting; docs/operations.md covers sockets, access, metrics and systemd.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use salusd::config::{
    FileConfig, align_down, parse_bytes, parse_duration, parse_period, parse_switch,
};
use salusd::{Config, DeviceChoice};

/// The salus daemon: owns one device and runs many jobs' sessions on it, packed into
/// memory lanes and scheduled at iteration boundaries.
///
/// Settings come from the command line, then SALUS_* environment variables, then the
/// config file (--config), then defaults.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Unix socket to listen on [default: /run/salus/salusd.sock for root, else
    /// $XDG_RUNTIME_DIR/salus/salusd.sock or /tmp/salus-$UID/salusd.sock].
    #[arg(long, env = "SALUS_SOCKET")]
    socket: Option<PathBuf>,
    /// Also listen on this TCP address (host:port); needs --token-file or --insecure-tcp.
    #[arg(long, env = "SALUS_LISTEN")]
    listen: Option<String>,
    /// The device: cpu, sim (modeled time, accounted memory), cuda:N, cuda-emulated (the
    /// CUDA device's kernels run on the host: slow, to check the GPU path without a GPU),
    /// or auto (GPU 0 when one is usable, else cpu) [default: auto].
    #[arg(long, env = "SALUS_DEVICE")]
    device: Option<String>,
    /// Capacity C of the cpu and sim devices, e.g. 4GiB, 16GB [default: 4GiB]; caps the
    /// cuda arena when given.
    #[arg(long, env = "SALUS_MEMORY")]
    memory: Option<String>,
    /// Bytes kept free, never given to sessions [default: 0]; for cuda, GPU memory left
    /// out of the arena for the context, kernels and cuBLAS [default: 1GiB].
    #[arg(long, env = "SALUS_RESERVE")]
    reserve: Option<String>,
    /// Host memory that sessions not on the device (uploading, waiting for admission, or
    /// suspended) may hold in all [default: the device capacity].
    #[arg(long, env = "SALUS_HOST_MEMORY")]
    host_memory: Option<String>,
    /// The same for one user's sessions [default: half of --host-memory]; root and the
    /// daemon's own user are not held to it.
    #[arg(long, env = "SALUS_USER_HOST_MEMORY")]
    user_host_memory: Option<String>,
    /// Sessions one user may have open or opening [default: 64]; root and the daemon's own
    /// user are not held to it.
    #[arg(long, env = "SALUS_MAX_SESSIONS_PER_USER")]
    max_sessions_per_user: Option<u64>,
    /// How long a client may take from the start of its Open stream to `commit` (uploading
    /// the initial tensors), e.g. 300s, 5m [default: 5m]; past it the open is dropped and
    /// its host memory released.
    #[arg(long, env = "SALUS_OPEN_TIMEOUT")]
    open_timeout: Option<String>,
    /// Scheduling policy at start: share, pack, srtf, fair or fifo [default: share].
    #[arg(long, env = "SALUS_POLICY")]
    policy: Option<String>,
    /// The most of the device offline sessions may hold together, as a fraction of usable
    /// memory [default: 0.4].
    #[arg(long, env = "SALUS_OFFLINE_SHARE")]
    offline_share: Option<f64>,
    /// The share of the device's compute an offline iteration may use while an online
    /// iteration runs, in [0, 1], fixed; 0 holds it between two kernels [default: the
    /// device's, 0 on cpu; elsewhere learned, from 0.3, as online work allows].
    #[arg(long, env = "SALUS_OFFLINE_COMPUTE_SHARE")]
    offline_compute_share: Option<f64>,
    /// Protection of online sessions from offline ones: on or off (offline sessions are
    /// then scheduled like online ones) [default: on].
    #[arg(long, env = "SALUS_PROTECTION")]
    protection: Option<String>,
    /// How long an online session waits for memory offline sessions hold before their
    /// running iterations are abandoned (they run again later, unchanged) [default: 200ms].
    #[arg(long, env = "SALUS_OFFLINE_ABANDON_AFTER")]
    offline_abandon_after: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464).
    #[arg(long, env = "SALUS_METRICS")]
    metrics: Option<String>,
    /// File holding the bearer token that TCP clients must send (at least 16 bytes of
    /// visible ASCII; surrounding whitespace is ignored).
    #[arg(long, env = "SALUS_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Accept TCP clients without a token; they act as the unprivileged user nobody.
    #[arg(long, env = "SALUS_INSECURE_TCP")]
    insecure_tcp: bool,
    /// Serve TCP clients over TLS with this certificate chain (PEM); needs --tls-key and
    /// --listen. The Unix socket stays plain.
    #[arg(long, env = "SALUS_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, env = "SALUS_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Keep sessions across restarts: each session's snapshot (persistent tensors,
    /// programs, iterations done) is written here at shutdown and every --snapshot-every,
    /// and sessions found here at start wait for their clients to reattach.
    #[arg(long, env = "SALUS_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// How often to snapshot sessions besides at shutdown, e.g. 300s, 10m; 0 for only at
    /// shutdown [default: 5m]. A SIGKILL loses at most the work since the last snapshot.
    #[arg(long, env = "SALUS_SNAPSHOT_EVERY")]
    snapshot_every: Option<String>,
    /// How long a session restored at start waits for its client to reattach before it
    /// is closed [default: 10m].
    #[arg(long, env = "SALUS_REATTACH_TIMEOUT")]
    reattach_timeout: Option<String>,
    /// Log format: human or json [default: human]. RUST_LOG filters (default info).
    #[arg(long, env = "SALUS_LOG_FORMAT")]
    log_format: Option<String>,
    /// TOML config file with any of the settings above (keys as the long options, with _).
    #[arg(long, env = "SALUS_CONFIG")]
    config: Option<PathBuf>,
}

fn config(args: Args) -> Result<(Config, String), String> {
    let file = match &args.config {
        Some(path) => FileConfig::load(path)?,
        None => FileConfig::default(),
    };
    let socket = args
        .socket
        .or(file.socket)
        .unwrap_or_else(salus_proto::wire::default_socket_path);
    let mut config = Config::new(socket);
    if let Some(listen) = args.listen.or(file.listen) {
        config.listen = Some(
            listen
                .parse()
                .map_err(|e| format!("--listen {listen:?}: {e} (expected host:port)"))?,
        );
    }
    config.device = match args.device.or(file.device) {
        Some(device) => device.parse::<DeviceChoice>()?,
        None => DeviceChoice::Auto,
    };
    if let Some(memory) = args.memory.or(file.memory) {
        config.memory = align_down(parse_bytes(&memory).map_err(|e| format!("--memory: {e}"))?);
        config.memory_given = true;
    }
    if let Some(reserve) = args.reserve.or(file.reserve) {
        config.reserve = align_down(parse_bytes(&reserve).map_err(|e| format!("--reserve: {e}"))?);
    }
    if let Some(host) = args.host_memory.or(file.host_memory) {
        config.host_memory = Some(parse_bytes(&host).map_err(|e| format!("--host-memory: {e}"))?);
    }
    if let Some(user) = args.user_host_memory.or(file.user_host_memory) {
        config.user_host_memory =
            Some(parse_bytes(&user).map_err(|e| format!("--user-host-memory: {e}"))?);
    }
    if let Some(max) = args.max_sessions_per_user.or(file.max_sessions_per_user) {
        if max == 0 {
            return Err("--max-sessions-per-user 0: must be at least 1".into());
        }
        config.max_sessions_per_user = max;
    }
    if let Some(timeout) = args.open_timeout.or(file.open_timeout) {
        config.open_timeout =
            parse_duration(&timeout).map_err(|e| format!("--open-timeout: {e}"))?;
    }
    config.state_dir = args.state_dir.or(file.state_dir);
    if let Some(every) = args.snapshot_every.or(file.snapshot_every) {
        config.snapshot_every =
            parse_period(&every).map_err(|e| format!("--snapshot-every: {e}"))?;
    }
    if let Some(timeout) = args.reattach_timeout.or(file.reattach_timeout) {
        config.reattach_timeout =
            parse_duration(&timeout).map_err(|e| format!("--reattach-timeout: {e}"))?;
    }
    if let Some(share) = args.offline_share.or(file.offline_share) {
        config.protection.offline_memory_share = share;
    }
    if let Some(share) = args.offline_compute_share.or(file.offline_compute_share) {
        // A share the operator sets is fixed, not a start to learn from.
        config.protection.offline_compute_share = share;
        config.protection.dynamic_compute_share = false;
        config.offline_compute_share_given = true;
    }
    if let Some(after) = args.offline_abandon_after.or(file.offline_abandon_after) {
        config.protection.abandon_after =
            parse_duration(&after).map_err(|e| format!("--offline-abandon-after: {e}"))?;
    }
    if let Some(on) = args.protection.or(file.protection) {
        config.protection.enabled = parse_switch(&on).map_err(|e| format!("--protection: {e}"))?;
    }
    config
        .protection
        .validate()
        .map_err(|e| format!("protection: {e}"))?;
    if let Some(policy) = args.policy.or(file.policy) {
        config.policy = policy.parse().map_err(|e| format!("--policy: {e}"))?;
    }
    if let Some(metrics) = args.metrics.or(file.metrics) {
        config.metrics = Some(
            metrics
                .parse()
                .map_err(|e| format!("--metrics {metrics:?}: {e} (expected host:port)"))?,
        );
    }
    config.token_file = args.token_file.or(file.token_file);
    config.insecure_tcp = args.insecure_tcp || file.insecure_tcp.unwrap_or(false);
    config.tls_cert = args.tls_cert.or(file.tls_cert);
    config.tls_key = args.tls_key.or(file.tls_key);
    let log_format = args
        .log_format
        .or(file.log_format)
        .unwrap_or_else(|| "human".into());
    if log_format != "human" && log_format != "json" {
        return Err(format!(
            "--log-format {log_format:?}: expected human or json"
        ));
    }
    Ok((config, log_format))
}

async fn signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}

fn main() -> ExitCode {
    let (config, log_format) = match config(Args::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("salusd: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if log_format == "json" {
        logs.json().init();
    } else {
        logs.init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("salusd: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(salusd::run(config, signal())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("salusd: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
