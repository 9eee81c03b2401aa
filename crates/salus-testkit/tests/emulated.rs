//! The CUDA device's command lists and kernels, run on the host by `salus_cuda::Emulator`,
//! against the CPU device: the GPU path checked where there is no GPU.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use salus_cpu::CpuDevice;
use salus_cuda::Emulator;
use salus_exec::{Device, Placement, Program};
use salus_graph::{Graph, Limits, samples};

fn bytes_f32(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(4)
        .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
        .collect()
}

/// Runs `iterations` of `graph` on `device` from `init`; every iteration's fetches and the
/// final persistent block.
fn train(
    device: &dyn Device,
    graph: &Graph,
    init: &[u8],
    feeds: &[Vec<u8>],
    iterations: usize,
) -> (Vec<Vec<Vec<u8>>>, Vec<u8>) {
    let program = Program::for_device(graph.clone(), &Limits::default(), device).unwrap();
    let plan = program.plan().clone();
    let at = Placement {
        persistent: 0,
        lane: plan.persistent_bytes.div_ceil(256) * 256,
    };
    device.write(0, init).unwrap();
    let refs: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
    let outs = (0..iterations)
        .map(|_| device.run(&program, at, &refs).unwrap().fetches)
        .collect();
    (outs, device.read(0, plan.persistent_bytes).unwrap())
}

#[test]
fn training_steps_match_the_cpu_with_fusion_on_and_off() {
    let (n, d, k) = (64, 128, 32);
    let graph = samples::regression(n, d, k, 0.05);
    let mut rng = Rng::new(7);
    let w = bytes_f32(&rng.vec((d * k) as usize, -0.1, 0.1));
    let feeds = vec![
        bytes_f32(&rng.vec((n * d) as usize, -1.0, 1.0)),
        bytes_f32(&rng.vec((n * k) as usize, -1.0, 1.0)),
    ];
    let cpu = CpuDevice::new(64 << 20).unwrap();
    let (want, want_w) = train(&cpu, &graph, &w, &feeds, 5);
    let emulator = Emulator::new(64 << 20).unwrap();
    for fusion in [false, true] {
        emulator.set_fusion(fusion);
        let (got, got_w) = train(&emulator, &graph, &w, &feeds, 5);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(
                &f32s(&g[0]),
                &f32s(&w[0]),
                tol(1e-5, 1e-7),
                &format!("loss {i} (fusion {fusion})"),
            );
        }
        assert_close(
            &f32s(&got_w),
            &f32s(&want_w),
            tol(1e-5, 1e-7),
            &format!("weights (fusion {fusion})"),
        );
    }
}
