//! The daemon's settings: command line, environment (`SALUS_*`), and a TOML config file,
//! in that order of precedence.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use salus_core::PolicyKind;
use serde::Deserialize;

/// Which device the daemon owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The host's cores and memory.
    Cpu,
    /// Modeled time, accounted memory.
    Sim,
    /// A CUDA GPU by index.
    Cuda(u32),
    /// The CUDA device's command lists and kernels run on the host (`salus_cuda::Emulator`):
    /// slow, for checking the GPU path where there is no GPU.
    CudaEmulated,
    /// GPU 0 when one is usable, the CPU otherwise (what `salusd` does without
    /// `--device`).
    Auto,
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "sim" => Ok(DeviceChoice::Sim),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            "auto" => Ok(DeviceChoice::Auto),
            "cuda-emulated" => Ok(DeviceChoice::CudaEmulated),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| {
                    format!(
                        "unknown device {s:?}; expected cpu, sim, cuda:N, cuda-emulated or auto"
                    )
                }),
        }
    }
}

/// Everything the daemon needs to start.
#[derive(Debug, Clone)]
pub struct Config {
    /// The Unix socket to listen on.
    pub socket: PathBuf,
    /// A TCP address to listen on as well.
    pub listen: Option<SocketAddr>,
    /// The device.
    pub device: DeviceChoice,
    /// Capacity C in bytes (the arena for cpu and sim; for cuda, a cap on the arena when
    /// `memory_given`).
    pub memory: u64,
    /// True when `memory` was set explicitly (it then caps the cuda arena too).
    pub memory_given: bool,
    /// Bytes kept free: inside the arena for cpu and sim; for cuda, GPU memory left out of
    /// the arena (0: the cuda default, 1 GiB).
    pub reserve: u64,
    /// Host memory opening, waiting and suspended sessions may hold in all; `None` for the
    /// capacity.
    pub host_memory: Option<u64>,
    /// The same for one user's sessions; `None` for half of `host_memory`.
    pub user_host_memory: Option<u64>,
    /// Sessions one user may have open or opening.
    pub max_sessions_per_user: u64,
    /// How long an `Open` stream may take from its start to `commit`.
    pub open_timeout: Duration,
    /// The policy at start.
    pub policy: PolicyKind,
    /// How online sessions are protected from offline ones.
    pub protection: salus_core::ProtectionConfig,
    /// The operator set `protection.offline_compute_share`; otherwise the device's own
    /// share applies where it has one (`Device::offline_compute_share`).
    pub offline_compute_share_given: bool,
    /// Where to serve Prometheus metrics.
    pub metrics: Option<SocketAddr>,
    /// The file holding the bearer token TCP clients must send.
    pub token_file: Option<PathBuf>,
    /// Accept TCP clients without a token.
    pub insecure_tcp: bool,
    /// The certificate chain (PEM) TCP clients are served TLS with.
    pub tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// Where sessions' snapshots are kept across restarts; `None`: nowhere.
    pub state_dir: Option<PathBuf>,
    /// How often running sessions are snapshotted besides at shutdown (zero: only then).
    pub snapshot_every: Duration,
    /// How long a session restored at start waits for its client to reattach.
    pub reattach_timeout: Duration,
}

/// Default capacity of the cpu and sim devices.
pub const DEFAULT_MEMORY: u64 = 4 << 30;

/// Default of `--max-sessions-per-user`: room for a tuning sweep's trials, not for a
/// flood.
pub const DEFAULT_MAX_SESSIONS_PER_USER: u64 = 64;

/// Default of `--open-timeout`: time to upload tens of GB over a slow link.
pub const DEFAULT_OPEN_TIMEOUT: Duration = Duration::from_secs(300);

/// Default of `--snapshot-every`.
pub const DEFAULT_SNAPSHOT_EVERY: Duration = Duration::from_secs(300);

/// Default of `--reattach-timeout`.
pub const DEFAULT_REATTACH_TIMEOUT: Duration = Duration::from_secs(600);

/// The shortest bearer token salusd accepts, in bytes.
pub const MIN_TOKEN_BYTES: usize = 16;

impl Config {
    /// Defaults: the per-user socket, the cpu device with 4 GiB, no reserve, the sharing
    /// policy ([`PolicyKind::DEFAULT`], share).
    pub fn new(socket: PathBuf) -> Config {
        Config {
            socket,
            listen: None,
            device: DeviceChoice::Cpu,
            memory: DEFAULT_MEMORY,
            memory_given: false,
            reserve: 0,
            host_memory: None,
            user_host_memory: None,
            max_sessions_per_user: DEFAULT_MAX_SESSIONS_PER_USER,
            open_timeout: DEFAULT_OPEN_TIMEOUT,
            policy: PolicyKind::DEFAULT,
            protection: salus_core::ProtectionConfig::default(),
            offline_compute_share_given: false,
            metrics: None,
            token_file: None,
            insecure_tcp: false,
            tls_cert: None,
            tls_key: None,
            state_dir: None,
            snapshot_every: DEFAULT_SNAPSHOT_EVERY,
            reattach_timeout: DEFAULT_REATTACH_TIMEOUT,
        }
    }
}

/// The config file's keys: the long option names, with `_` for `-`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `--socket`.
    pub socket: Option<PathBuf>,
    /// `--listen`.
    pub listen: Option<String>,
    /// `--device`.
    pub device: Option<String>,
    /// `--memory`.
    pub memory: Option<String>,
    /// `--reserve`.
    pub reserve: Option<String>,
    /// `--host-memory`.
    pub host_memory: Option<String>,
    /// `--user-host-memory`.
    pub user_host_memory: Option<String>,
    /// `--max-sessions-per-user`.
    pub max_sessions_per_user: Option<u64>,
    /// `--open-timeout`.
    pub open_timeout: Option<String>,
    /// `--policy`.
    pub policy: Option<String>,
    /// `--offline-share`.
    pub offline_share: Option<f64>,
    /// `--offline-compute-share`.
    pub offline_compute_share: Option<f64>,
    /// `--protection`.
    pub protection: Option<String>,
    /// `--offline-abandon-after`.
    pub offline_abandon_after: Option<String>,
    /// `--metrics`.
    pub metrics: Option<String>,
    /// `--token-file`.
    pub token_file: Option<PathBuf>,
    /// `--insecure-tcp`.
    pub insecure_tcp: Option<bool>,
    /// `--tls-cert`.
    pub tls_cert: Option<PathBuf>,
    /// `--tls-key`.
    pub tls_key: Option<PathBuf>,
    /// `--state-dir`.
    pub state_dir: Option<PathBuf>,
    /// `--snapshot-every`.
    pub snapshot_every: Option<String>,
    /// `--reattach-timeout`.
    pub reattach_timeout: Option<String>,
    /// `--log-format`.
    pub log_format: Option<String>,
}

impl FileConfig {
    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<FileConfig, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading the config file {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("config file {}: {e}", path.display()))
    }
}

/// Parses a byte size: `4GiB`, `512MiB`, `1.5G`, `100000`. Binary (KiB, MiB, GiB, TiB) and
/// decimal (K/KB, M/MB, G/GB, T/TB) units; B optional.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 4GiB, 512MiB, 1000000)"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    let bytes = value * scale as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// Parses a duration: `300s`, `5m`, `1h`, `250ms`, or seconds (`300`, `1.5`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    parse_interval(s)?
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{s:?} is out of range (more than 0, less than centuries)"))
}

/// Parses how often something recurs, where `0` (in any unit) means never, as
/// `--snapshot-every` takes it.
pub fn parse_period(s: &str) -> Result<Duration, String> {
    parse_interval(s)?
        .ok_or_else(|| format!("{s:?} is out of range (0 for never, or less than centuries)"))
}

/// A duration's value, zero included; `Ok(None)` when it does not fit a `Duration`.
fn parse_interval(s: &str) -> Result<Option<Duration>, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (examples: 300s, 5m, 1h)"))?;
    let seconds = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1e3,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => return Err(format!("unknown duration unit {other:?} in {s:?}")),
    };
    Ok(Duration::try_from_secs_f64(seconds).ok())
}

/// Reads the bearer token from `path`: the file's content without surrounding whitespace.
/// Refuses a token a client could guess or could not send: empty, shorter than
/// [`MIN_TOKEN_BYTES`], or with characters other than visible ASCII.
pub fn read_token(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--token-file: reading {}: {e}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!(
            "--token-file: {} holds no token (it is empty or only whitespace); put a random \
             secret of at least {MIN_TOKEN_BYTES} bytes in it, e.g. `openssl rand -hex 32`",
            path.display()
        ));
    }
    if token.len() < MIN_TOKEN_BYTES {
        return Err(format!(
            "--token-file: the token in {} is {} bytes; it must be at least {MIN_TOKEN_BYTES} \
             (e.g. `openssl rand -hex 32`)",
            path.display(),
            token.len()
        ));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "--token-file: the token in {} has characters other than visible ASCII (spaces, \
             control characters, non-ASCII); clients could not send it in a header",
            path.display()
        ));
    }
    Ok(token.to_string())
}

/// Parses `--protection`: `on` or `off`.
pub fn parse_switch(s: &str) -> Result<bool, String> {
    match s.trim() {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("{other:?} is neither on nor off")),
    }
}

/// Rounds down to the core's 256-byte alignment.
pub fn align_down(bytes: u64) -> u64 {
    bytes & !(salus_core::MemoryConfig::DEFAULT_ALIGNMENT - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("100000"), Ok(100_000));
        assert!(parse_bytes("4 parsecs").is_err());
        assert!(parse_bytes("GiB").is_err());
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("300"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("1e30").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn periods_may_be_zero_for_never() {
        assert_eq!(parse_period("0"), Ok(Duration::ZERO));
        assert_eq!(parse_period("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_period("0ms"), Ok(Duration::ZERO));
        assert_eq!(parse_period("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_period("-1").is_err());
        assert!(parse_period("1e30").is_err());
        assert!(parse_period("often").is_err());
    }

    #[test]
    fn tokens_must_be_long_visible_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let good = "0123456789abcdef";
        assert_eq!(
            read_token(&file("good", &format!("{good}\n"))),
            Ok(good.into())
        );
        for (text, needle) in [
            ("", "holds no token"),
            (" \n\t\n", "holds no token"),
            ("short", "is 5 bytes; it must be at least 16"),
            ("0123456789 abcdef", "other than visible ASCII"),
        ] {
            let error = read_token(&file("bad", text)).unwrap_err();
            assert!(error.contains(needle), "{text:?}: {error}");
        }
    }

    #[test]
    fn devices_parse() {
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("sim".parse(), Ok(DeviceChoice::Sim));
        assert_eq!("cuda:1".parse(), Ok(DeviceChoice::Cuda(1)));
        assert_eq!("cuda-emulated".parse(), Ok(DeviceChoice::CudaEmulated));
        assert!("tpu".parse::<DeviceChoice>().is_err());
    }

    #[test]
    fn config_files_refuse_unknown_keys() {
        let good: FileConfig = toml::from_str("device = \"sim\"\nmemory = \"16GiB\"\n").unwrap();
        assert_eq!(good.device.as_deref(), Some("sim"));
        assert!(toml::from_str::<FileConfig>("memroy = \"1GiB\"").is_err());
    }
}
