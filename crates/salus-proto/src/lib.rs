//! The salus API's protobuf messages, generated from `proto/salus/v1` at build time.
//!
//! Owns nothing but the generated types: conversions to and from the crates' own types
//! live with those types (`salus-graph` for the graph IR).

/// Version 1 of the API.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/salus.v1.rs"));
}
