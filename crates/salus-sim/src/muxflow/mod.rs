//! MuxFlow (Zhao et al., "MuxFlow: Efficient and Safe GPU Sharing in Large-Scale
//! Production Deep Learning Clusters") in the simulator: online services and offline
//! training sharing GPUs.

pub mod cluster;
pub mod gpu;
pub mod km;
pub mod predictor;
#[cfg(test)]
mod probe_test;
pub mod workload;
