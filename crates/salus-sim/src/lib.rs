//! Discrete-event simulator for salus.
//!
//! Owns: the workload catalog of the Salus papers, job traces (JSON Lines), the contention
//! model of concurrent lanes, and the driver that replays a trace through `salus-core` in
//! virtual time. It must not contain scheduling or memory decisions: those belong to
//! `salus-core`, which this crate only drives.

pub mod catalog;
pub mod trace;
