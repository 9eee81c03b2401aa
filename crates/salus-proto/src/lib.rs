//! The salus API's protobuf messages, generated from `proto/salus/v1` at build time, the
//! codec both ends use ([`codec`]: undecodable messages are `INVALID_ARGUMENT`), and the
//! wire conventions both ends share ([`wire`]: default socket, message and chunk sizes,
//! bearer tokens, the peer's uid).
//!
//! Owns nothing else: conversions to and from the crates' own types live with those types
//! (`salus-graph` for the graph IR, `salusd`'s service for the daemon's replies).

pub mod codec;
pub mod wire;

/// Version 1 of the API.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/salus.v1.rs"));
}
