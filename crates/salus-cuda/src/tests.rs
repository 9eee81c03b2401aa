use super::*;
use crate::image::fnv1a;

#[test]
fn probe_never_panics() {
    // On a host without a driver this is an Err with a reason; with one, a list.
    match CudaDevice::probe() {
        Ok(gpus) => assert!(!gpus.is_empty()),
        Err(reason) => assert!(!reason.is_empty()),
    }
}

#[test]
fn profile_batches_cover_every_timed_node_within_the_limit() {
    // Node 1 issues nothing; node 3 alone exceeds a batch.
    let lens = [3usize, 0, 100, 300, 30, 1];
    let mut spans = Vec::new();
    let mut at = 0;
    for len in lens {
        spans.push(at..at + len);
        at += len;
    }
    let timed: Vec<usize> = (0..spans.len()).filter(|&i| !spans[i].is_empty()).collect();
    let batches = profile_batches(&spans, &timed);
    assert_eq!(batches, vec![0..2, 2..3, 3..5]);
    for b in &batches {
        let count: usize = b.clone().map(|j| spans[timed[j]].len()).sum();
        assert!(b.len() == 1 || count <= PROFILE_BATCH);
    }
    assert!(profile_batches(&spans, &[]).is_empty());
}

#[test]
fn profiling_without_a_gpu_fails_cleanly() {
    // Where there is no GPU the device cannot open, so there is nothing to profile;
    // where there is one, tests/cuda.rs profiles on it.
    if CudaDevice::probe().is_err() {
        assert!(CudaDevice::new(&CudaOptions::new(0)).is_err());
    }
}

#[test]
fn cache_keys_differ_by_source_and_arch() {
    assert_ne!(fnv1a(&[b"a", b"sm_90"]), fnv1a(&[b"a", b"sm_80"]));
    assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
}
