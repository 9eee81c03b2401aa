//! The daemon's settings: command line, environment (`SALUS_*`), and a TOML config file,
//! in that order of precedence.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

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
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}; expected cpu, sim, cuda:N or auto")),
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
    /// Host memory waiting and suspended sessions may hold; `None` for the capacity.
    pub host_memory: Option<u64>,
    /// The policy at start.
    pub policy: PolicyKind,
    /// Where to serve Prometheus metrics.
    pub metrics: Option<SocketAddr>,
    /// The file holding the bearer token TCP clients must send.
    pub token_file: Option<PathBuf>,
    /// Accept TCP clients without a token.
    pub insecure_tcp: bool,
}

/// Default capacity of the cpu and sim devices.
pub const DEFAULT_MEMORY: u64 = 4 << 30;

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
            policy: PolicyKind::DEFAULT,
            metrics: None,
            token_file: None,
            insecure_tcp: false,
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
    /// `--policy`.
    pub policy: Option<String>,
    /// `--metrics`.
    pub metrics: Option<String>,
    /// `--token-file`.
    pub token_file: Option<PathBuf>,
    /// `--insecure-tcp`.
    pub insecure_tcp: Option<bool>,
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
    fn devices_parse() {
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("sim".parse(), Ok(DeviceChoice::Sim));
        assert_eq!("cuda:1".parse(), Ok(DeviceChoice::Cuda(1)));
        assert!("tpu".parse::<DeviceChoice>().is_err());
    }

    #[test]
    fn config_files_refuse_unknown_keys() {
        let good: FileConfig = toml::from_str("device = \"sim\"\nmemory = \"16GiB\"\n").unwrap();
        assert_eq!(good.device.as_deref(), Some("sim"));
        assert!(toml::from_str::<FileConfig>("memroy = \"1GiB\"").is_err());
    }
}
