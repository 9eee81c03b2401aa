//! Wire conventions both ends of the API share: where the daemon listens by default, how
//! clients name it and authenticate, how big messages and tensor chunks may be, and who
//! the peer of a Unix-socket call is.
//!
//! The daemon (`salusd`) and the clients (`salus-client`, `salusctl`) both read these, so
//! neither depends on the other to agree.

use std::path::{Path, PathBuf};

use crate::v1 as pb;

/// The environment variable naming the daemon: a Unix socket path or `host:port`.
pub const ADDRESS_ENV: &str = "SALUS_ADDRESS";
/// The environment variable naming a file that holds the bearer token for TCP.
pub const TOKEN_FILE_ENV: &str = "SALUS_TOKEN_FILE";
/// The environment variable naming the CA certificate (PEM) a client trusts for `https://`
/// addresses: the one that signed the daemon's `--tls-cert`.
pub const TLS_CA_ENV: &str = "SALUS_TLS_CA";
/// Largest message either side accepts: feeds and fetches of one iteration travel whole.
pub const MAX_MESSAGE_BYTES: usize = 1 << 30;
/// HTTP/2's flow-control window of one stream (one call), both ways: what a receiver
/// takes of a call it is not reading yet.
pub const STREAM_WINDOW_BYTES: u32 = 1 << 20;
/// HTTP/2's window of a whole connection, both ways: 64 streams' windows. A stream whose
/// receiver stopped reading (a `RunStream` the daemon holds back, or whose answers its
/// client leaves unread) keeps its window's worth of the connection's; with the two
/// windows equal (hyper's defaults for a server), one such stream stalled every other
/// call on its connection, the sessions of the same client with it.
pub const CONNECTION_WINDOW_BYTES: u32 = 64 * STREAM_WINDOW_BYTES;
/// Size of the chunks tensors travel in.
pub const CHUNK_BYTES: usize = 4 << 20;
/// The metadata key that carries a TCP client's bearer token.
pub const AUTHORIZATION: &str = "authorization";

/// The default Unix socket: `/run/salus/salusd.sock` for root (a system service),
/// `$XDG_RUNTIME_DIR/salus/salusd.sock` for other users, or `/tmp/salus-$UID/salusd.sock`
/// when there is no runtime directory.
pub fn default_socket_path() -> PathBuf {
    let uid = current_uid();
    if uid == 0 {
        return PathBuf::from("/run/salus/salusd.sock");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Path::new(&dir).join("salus/salusd.sock"),
        _ => PathBuf::from(format!("/tmp/salus-{uid}/salusd.sock")),
    }
}

/// The uid of this process, from `/proc/self` (no libc needed).
pub fn current_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}

/// Where a daemon listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A Unix socket path.
    Unix(PathBuf),
    /// A TCP `host:port`.
    Tcp(String),
    /// A TCP `host:port` spoken over TLS.
    Tls(String),
}

impl Address {
    /// Parses `unix:PATH`, a path (anything with a `/`), `http://host:port` or `host:port`
    /// (plain TCP), or `https://host:port` (TCP over TLS).
    pub fn parse(address: &str) -> Address {
        if let Some(path) = address.strip_prefix("unix://") {
            Address::Unix(PathBuf::from(path))
        } else if let Some(path) = address.strip_prefix("unix:") {
            Address::Unix(PathBuf::from(path))
        } else if let Some(host) = address.strip_prefix("http://") {
            Address::Tcp(host.to_string())
        } else if let Some(host) = address.strip_prefix("https://") {
            Address::Tls(host.to_string())
        } else if address.contains('/') {
            Address::Unix(PathBuf::from(address))
        } else {
            Address::Tcp(address.to_string())
        }
    }
}

/// The [`AUTHORIZATION`] value a client sends with `token`.
pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// The bearer token a request carries, if any.
pub fn bearer_token<T>(request: &tonic::Request<T>) -> Option<&str> {
    request
        .metadata()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// Who is on the other end of a call, as the transport tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// A Unix socket; the kernel's `SO_PEERCRED` uid, when it gave one.
    Unix {
        /// The peer's uid.
        uid: Option<u32>,
    },
    /// A TCP connection, plain or over TLS (it proves itself with a bearer token).
    Tcp,
    /// Neither (an in-process transport).
    Unknown,
}

/// The peer of a request served by tonic's server.
pub fn peer<T>(request: &tonic::Request<T>) -> Peer {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};
    let extensions = request.extensions();
    if let Some(info) = extensions.get::<UdsConnectInfo>() {
        Peer::Unix {
            uid: info.peer_cred.map(|cred| cred.uid()),
        }
    } else if extensions.get::<TcpConnectInfo>().is_some()
        || extensions.get::<TlsConnectInfo<TcpConnectInfo>>().is_some()
    {
        Peer::Tcp
    } else {
        Peer::Unknown
    }
}

/// `bytes` of one tensor as chunks of at most [`CHUNK_BYTES`] (one, possibly empty, at
/// least).
pub fn chunks(tensor: u32, bytes: &[u8]) -> Vec<pb::TensorChunk> {
    if bytes.is_empty() {
        return vec![pb::TensorChunk {
            tensor,
            offset: 0,
            data: Vec::new(),
        }];
    }
    bytes
        .chunks(CHUNK_BYTES)
        .enumerate()
        .map(|(i, data)| pb::TensorChunk {
            tensor,
            offset: (i * CHUNK_BYTES) as u64,
            data: data.to_vec(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_as_paths_or_hosts() {
        assert_eq!(
            Address::parse("unix:/tmp/s.sock"),
            Address::Unix("/tmp/s.sock".into())
        );
        assert_eq!(
            Address::parse("unix:///tmp/s.sock"),
            Address::Unix("/tmp/s.sock".into())
        );
        assert_eq!(Address::parse("./s.sock"), Address::Unix("./s.sock".into()));
        assert_eq!(
            Address::parse("http://h:50051"),
            Address::Tcp("h:50051".into())
        );
        assert_eq!(Address::parse("h:50051"), Address::Tcp("h:50051".into()));
        assert_eq!(
            Address::parse("https://h:50051"),
            Address::Tls("h:50051".into())
        );
    }

    #[test]
    fn chunks_cover_the_tensor_in_order() {
        let bytes = vec![7u8; CHUNK_BYTES + 3];
        let parts = chunks(4, &bytes);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1].offset, CHUNK_BYTES as u64);
        assert_eq!(parts[1].data.len(), 3);
        assert_eq!(chunks(4, &[]).len(), 1, "an empty tensor still travels");
    }

    #[test]
    fn bearer_tokens_round_trip_through_metadata() {
        let mut request = tonic::Request::new(());
        request
            .metadata_mut()
            .insert(AUTHORIZATION, bearer("s3cret").parse().expect("ascii"));
        assert_eq!(bearer_token(&request), Some("s3cret"));
        assert_eq!(peer(&request), Peer::Unknown);
    }
}
