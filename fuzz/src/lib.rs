//! What the fuzz targets share: the graph path a session's graph takes in salusd (decode,
//! conversion, validation, planning) with the invariants its result must hold, graphs
//! built from structured input, and an in-process salusd driven through its real gRPC
//! services by scripts of requests.
//!
//! Everything here panics on a broken invariant: libFuzzer reports the panic as a crash
//! with the input that caused it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod graphs;
pub mod rpc;
pub mod structured;
