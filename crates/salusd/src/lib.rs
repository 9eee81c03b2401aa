//! `salusd`: the salus daemon.
//!
//! Owns serving one device to many jobs: the gRPC services (sessions and admin) on a Unix
//! socket and optionally TCP, the engine task that drives `salus-core` and runs iterations
//! on a `salus-exec` device (`salus-cpu`, `salus-cuda` or the sim device), access control,
//! Prometheus metrics, and orderly shutdown. `salus-core` decides; the devices compute;
//! this crate connects them to clients.

pub mod auth;
pub mod config;
pub mod engine;
pub mod keeper;
pub mod metrics;
pub mod service;
pub mod serving;
pub mod state;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use salus_cpu::CpuDevice;
use salus_cuda::{CudaDevice, CudaOptions, Emulator};
use salus_exec::{CostModel, Device, SimDevice};
use salus_proto::{v1 as pb, wire};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tonic::transport::{Identity, Server, ServerTlsConfig};

pub use config::{Config, DeviceChoice};
use engine::{Engine, EngineConfig};
use service::AnswerMissingMessage;

/// How long shutdown waits for clients to let go after every session is closed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Why the daemon did not start, or stopped serving.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DaemonError {
    /// A setting cannot be used: the message names it.
    #[error("{0}")]
    Settings(String),
    /// Anything else: another daemon on the socket, a device that cannot be opened or
    /// that failed.
    #[error("{0}")]
    Failure(String),
}

impl DaemonError {
    /// The process's exit code: 2 for bad settings, 1 for failures (docs/operations.md).
    pub fn exit_code(&self) -> u8 {
        match self {
            DaemonError::Settings(_) => 2,
            DaemonError::Failure(_) => 1,
        }
    }
}

/// Builds the device `config` asks for. `Auto` takes GPU 0 when it is usable and the CPU
/// otherwise, and logs which and why.
pub fn open_device(config: &Config) -> Result<Arc<dyn Device>, String> {
    match config.device {
        DeviceChoice::Cpu => Ok(Arc::new(
            CpuDevice::new(config.memory).map_err(|e| format!("cpu device: {e}"))?,
        )),
        DeviceChoice::Sim => {
            let device = SimDevice::new(config.memory, CostModel::default());
            // Fault injection for tests of recovery from a device fault.
            Ok(Arc::new(match std::env::var("SALUS_SIM_FAULT_AFTER") {
                Ok(runs) => device.with_fault_after(runs.trim().parse().map_err(|_| {
                    format!("SALUS_SIM_FAULT_AFTER={runs:?}: not a number of iterations")
                })?),
                Err(_) => device,
            }))
        }
        DeviceChoice::Cuda(n) => Ok(Arc::new(
            CudaDevice::new(&cuda_options(config, n))
                .map_err(|e| format!("--device cuda:{n}: {e}"))?,
        )),
        DeviceChoice::CudaEmulated => Ok(Arc::new(
            Emulator::new(config.memory).map_err(|e| format!("--device cuda-emulated: {e}"))?,
        )),
        DeviceChoice::Auto => match CudaDevice::new(&cuda_options(config, 0)) {
            Ok(device) => {
                tracing::info!(device = %device.name(), "using the GPU");
                Ok(Arc::new(device))
            }
            Err(reason) => {
                tracing::info!("no usable GPU ({reason}); using cpu");
                Ok(Arc::new(
                    CpuDevice::new(config.memory).map_err(|e| format!("cpu device: {e}"))?,
                ))
            }
        },
    }
}

fn cuda_options(config: &Config, n: u32) -> CudaOptions {
    let mut options = CudaOptions::new(n as usize);
    if config.reserve > 0 {
        options.reserve = config.reserve;
    }
    options.cap = config.memory_given.then_some(config.memory);
    options
}

/// How often salusd reads the device's load (SM activity and clock) for protection.
pub const LOAD_INTERVAL: Duration = Duration::from_millis(500);

/// The protection the core runs with on `device`: the configured one, with what only the
/// device knows (whether it has a background priority) and, unless the operator set one,
/// the device's own offline compute share. A share the operator or the device sets is
/// fixed; otherwise it is learned from the configured one.
pub fn protection_for(config: &Config, device: &dyn Device) -> salus_core::ProtectionConfig {
    let device_share = device
        .offline_compute_share()
        .filter(|_| !config.offline_compute_share_given);
    salus_core::ProtectionConfig {
        background_priority: device.has_background_priority(),
        offline_compute_share: device_share.unwrap_or(config.protection.offline_compute_share),
        dynamic_compute_share: config.protection.dynamic_compute_share
            && device_share.is_none()
            && !config.offline_compute_share_given,
        ..config.protection.clone()
    }
}

/// The reserve the core keeps inside the device's capacity: the configured one for the
/// host devices; none for cuda, whose reserve stays outside its arena.
fn core_reserve(config: &Config, device: &dyn Device) -> u64 {
    if device.name().starts_with("cuda") {
        0
    } else {
        config.reserve
    }
}

/// Binds the Unix socket: refuses a path that is something other than a socket (a file,
/// a directory, a symbolic link), refuses when another daemon answers on it, replaces a
/// stale socket, creates the directory, and makes the socket group-accessible (0660), not
/// world-writable.
/// Makes (or checks) the state directory: a directory only the daemon's user may enter,
/// since snapshots hold every session's tensors and reattach tokens.
fn state_dir(path: &Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let settings =
        |what: String| DaemonError::Settings(format!("--state-dir {}: {what}", path.display()));
    if !path.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| settings(e.to_string()))?;
    }
    let meta = std::fs::symlink_metadata(path).map_err(|e| settings(e.to_string()))?;
    if !meta.is_dir() {
        return Err(settings("not a directory".into()));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(settings(format!(
            "mode {:o}: others may read the sessions' tensors (make it 0700)",
            meta.permissions().mode() & 0o777
        )));
    }
    Ok(())
}

fn bind_socket(path: &Path) -> Result<UnixListener, DaemonError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let failure = DaemonError::Failure;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        let kind = meta.file_type();
        if !kind.is_socket() {
            let what = if kind.is_dir() {
                "a directory"
            } else if kind.is_symlink() {
                "a symbolic link"
            } else if kind.is_file() {
                "a regular file"
            } else {
                "not a socket"
            };
            return Err(DaemonError::Settings(format!(
                "--socket {}: the path exists and is {what}; salusd replaces only a stale \
                 socket of its own: choose another path or remove it",
                path.display()
            )));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(failure(format!(
                "another salusd is listening on {}; stop it or choose --socket",
                path.display()
            )));
        }
        std::fs::remove_file(path)
            .map_err(|e| failure(format!("removing the stale socket {}: {e}", path.display())))?;
    }
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir)
            .map_err(|e| failure(format!("creating {}: {e}", dir.display())))?;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| failure(format!("binding {}: {e}", path.display())))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(|e| {
        failure(format!(
            "setting the permissions of {}: {e}",
            path.display()
        ))
    })?;
    Ok(listener)
}

/// The TLS identity `--tls-cert` and `--tls-key` give, read and checked at start.
fn tls_identity(config: &Config) -> Result<Option<ServerTlsConfig>, DaemonError> {
    let settings = DaemonError::Settings;
    let (cert, key) = match (&config.tls_cert, &config.tls_key) {
        (None, None) => return Ok(None),
        (Some(cert), Some(key)) => (cert, key),
        _ => {
            return Err(settings(
                "--tls-cert and --tls-key go together: give both or neither".into(),
            ));
        }
    };
    if config.listen.is_none() {
        return Err(settings(
            "--tls-cert serves TCP clients: it needs --listen (the Unix socket stays plain)".into(),
        ));
    }
    let read = |flag: &str, path: &Path| {
        std::fs::read(path)
            .map_err(|e| settings(format!("{flag}: reading {}: {e}", path.display())))
    };
    let tls = ServerTlsConfig::new().identity(Identity::from_pem(
        read("--tls-cert", cert)?,
        read("--tls-key", key)?,
    ));
    // Builds the TLS acceptor now, so that a certificate or key that cannot be used stops
    // salusd at start rather than failing every client.
    Server::builder().tls_config(tls.clone()).map_err(|e| {
        settings(format!(
            "--tls-cert {} / --tls-key {}: {e} (expected a PEM certificate chain and its PEM \
             private key)",
            cert.display(),
            key.display()
        ))
    })?;
    Ok(Some(tls))
}

/// The two gRPC services as salusd serves them (message sizes included), answering from
/// `engine` and authenticating with `access`: what every listener routes to, and what the
/// fuzz targets drive in process.
pub fn services(
    engine: &Engine,
    access: &auth::Access,
    servers: &serving::Servers,
) -> (
    AnswerMissingMessage<pb::sessions_server::SessionsServer<service::Service>>,
    AnswerMissingMessage<pb::admin_server::AdminServer<service::Service>>,
) {
    let service = service::Service::new(engine.clone(), access.clone(), servers.clone());
    (
        AnswerMissingMessage::new(
            pb::sessions_server::SessionsServer::new(service.clone())
                .max_decoding_message_size(wire::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(wire::MAX_MESSAGE_BYTES),
        ),
        AnswerMissingMessage::new(pb::admin_server::AdminServer::new(service)),
    )
}

fn router(
    engine: &Engine,
    access: &auth::Access,
    servers: &serving::Servers,
    tls: Option<ServerTlsConfig>,
) -> Result<tonic::transport::server::Router, DaemonError> {
    let mut server = Server::builder();
    if let Some(tls) = tls {
        server = server
            .tls_config(tls)
            .map_err(|e| DaemonError::Settings(format!("--tls-cert: {e}")))?;
    }
    let (sessions, admin) = services(engine, access, servers);
    Ok(server
        .tcp_nodelay(true)
        .initial_stream_window_size(wire::STREAM_WINDOW_BYTES)
        .initial_connection_window_size(wire::CONNECTION_WINDOW_BYTES)
        .add_service(sessions)
        .add_service(admin))
}

/// A running daemon: its engine (for in-process benchmarks) and where it listens.
pub struct Daemon {
    /// The engine.
    pub engine: Engine,
}

/// Runs the daemon until `shutdown` completes, then stops admitting, lets running
/// iterations finish, closes every session and removes the socket.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), DaemonError> {
    run_with(config, shutdown, |_| {}).await
}

/// [`run`], calling `started` with the daemon once it listens.
pub async fn run_with(
    config: Config,
    shutdown: impl Future<Output = ()>,
    started: impl FnOnce(&Daemon),
) -> Result<(), DaemonError> {
    let failure = DaemonError::Failure;
    // Settings first: a bad one stops salusd before it touches the device.
    let token = match &config.token_file {
        Some(path) => Some(config::read_token(path).map_err(DaemonError::Settings)?),
        None => None,
    };
    if config.listen.is_some() && token.is_none() && !config.insecure_tcp {
        return Err(DaemonError::Settings(
            "--listen needs --token-file (clients send that token) or --insecure-tcp".into(),
        ));
    }
    let tls = tls_identity(&config)?;
    let device = open_device(&config).map_err(failure)?;
    let memory = salus_core::MemoryConfig::new(device.capacity(), core_reserve(&config, &*device));
    let host_memory = config.host_memory.unwrap_or(config.memory);
    let daemon_uid = wire::current_uid();
    let engine = Engine::start(EngineConfig {
        device: device.clone(),
        memory,
        policy: config.policy,
        protection: protection_for(&config, &*device),
        limits: salus_graph::Limits::default(),
        daemon_uid,
        host_memory,
        user_host_memory: config.user_host_memory.unwrap_or(host_memory / 2),
        max_sessions_per_user: config.max_sessions_per_user,
        open_timeout: config.open_timeout,
    })
    .map_err(failure)?;
    engine.watch_load(&*device, LOAD_INTERVAL);
    let access = auth::Access {
        daemon_uid,
        token,
        insecure_tcp: config.insecure_tcp,
    };
    // Sessions kept across a restart are back before anything is served: a client's call
    // in between would find no session instead of one waiting for it to reattach.
    let keeper = match &config.state_dir {
        Some(dir) => {
            state_dir(dir)?;
            keeper::restore(&engine, dir, config.reattach_timeout).await;
            Some(tokio::spawn(keeper::keep(
                engine.clone(),
                dir.clone(),
                config.snapshot_every,
            )))
        }
        None => None,
    };
    // One registry of served models for every listener and the metrics endpoint.
    let served = serving::Servers::default();
    let listener = bind_socket(&config.socket)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|&s| s).await;
    };
    let mut servers = Vec::new();
    servers.push(tokio::spawn(
        router(&engine, &access, &served, None)?.serve_with_incoming_shutdown(
            UnixListenerStream::new(listener),
            stopped(stop_rx.clone()),
        ),
    ));
    if let Some(addr) = config.listen {
        let tcp = TcpListener::bind(addr)
            .await
            .map_err(|e| failure(format!("binding {addr}: {e}")))?;
        tracing::info!(%addr, insecure = config.insecure_tcp, tls = tls.is_some(), "listening on TCP");
        servers.push(tokio::spawn(
            router(&engine, &access, &served, tls)?.serve_with_incoming_shutdown(
                TcpListenerStream::new(tcp),
                stopped(stop_rx.clone()),
            ),
        ));
    }
    let metrics = match config.metrics {
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| failure(format!("binding the metrics address {addr}: {e}")))?;
            tracing::info!(%addr, "metrics at http://{addr}/metrics");
            Some(tokio::spawn(metrics::serve(
                listener,
                engine.clone(),
                served.clone(),
            )))
        }
        None => None,
    };
    tracing::info!(
        socket = %config.socket.display(),
        device = %device.name(),
        capacity = device.capacity(),
        reserve = memory.reserve,
        policy = %config.policy,
        "salusd ready"
    );
    started(&Daemon {
        engine: engine.clone(),
    });
    let failed = tokio::select! {
        () = shutdown => None,
        reason = engine.device_failed() => Some(reason),
    };
    tracing::info!("shutting down: admitting nothing, finishing running iterations");
    if let Some(keeper) = keeper {
        keeper.abort();
    }
    let kept = engine.shutdown(config.state_dir.is_some()).await;
    if let Some(dir) = &config.state_dir {
        tracing::info!(sessions = kept.snapshots.len(), dir = %dir.display(), "sessions kept for the restart");
        keeper::keep_only(dir, kept).await;
    }
    stop_tx.send_replace(true);
    for server in servers {
        match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "server ended with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "server task failed"),
            Err(_) => tracing::warn!("clients still connected after the grace period; leaving"),
        }
    }
    if let Some(metrics) = metrics {
        metrics.abort();
    }
    let _ = std::fs::remove_file(&config.socket);
    tracing::info!("salusd stopped");
    match failed {
        Some(reason) => Err(failure(format!(
            "the device failed ({reason}); salusd stopped serving"
        ))),
        None => Ok(()),
    }
}
