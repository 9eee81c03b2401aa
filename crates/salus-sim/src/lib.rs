//! Discrete-event simulator for salus.
//!
//! Owns: the workload catalog of the Salus papers, job traces (JSON Lines), the contention
//! model of concurrent lanes, the driver that replays a trace through `salus-core` in
//! virtual time, the driver that replays inference requests through its request
//! schedulers on one worker, and the paper experiments (Salus ch. 2, Fluid ch. 3, ORLOJ
//! ch. 4). It must not contain scheduling or memory decisions: those belong to
//! `salus-core`, which this crate only drives, exactly as the daemon does. Fluid's
//! cluster experiment (`fluid`) drives `salus-fluid`'s planner across devices the same
//! way. The MuxFlow experiment (`muxflow`) drives the core on one GPU with online and
//! offline sessions; its cluster mode models MuxFlow's placement (Kuhn-Munkres matching)
//! and per-GPU sharing here, as the systems under comparison, not as salus' decisions.

pub mod catalog;
pub mod experiments;
pub mod fluid;
pub mod muxflow;
pub mod orloj;
pub mod queue_timing;
pub mod rng;
pub mod serving;
pub mod sim;
pub mod trace;

pub use sim::{JobOutcome, SimConfig, SimError, SimReport, Summary, simulate};
pub use trace::JobSpec;
