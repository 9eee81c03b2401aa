//! The CUDA device against the CPU device. The comparisons of results run on GPU 0, or
//! where there is none (CI) on the emulator: the same command lists and kernel source,
//! run on the host (`salus_cuda::Emulator`). The tests of what only a GPU has (graphs,
//! profiles, concurrent lanes, memory, priorities) print why and pass without running
//! there. The op tests of `tests/ops.rs` run on the GPU with `SALUS_TEST_DEVICE=cuda`, on
//! the emulator with `SALUS_TEST_DEVICE=cuda-emulated`.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use common::*;
use salus_cpu::CpuDevice;
use salus_cuda::{CudaDevice, CudaOptions, Emulator};
use salus_exec::{Device, ExecError, Placement, Program};
use salus_graph::{
    Attr, DType, Graph, Limits, Node, Op, Precision, Role, Tensor, TensorType, Update, samples,
};

/// The GPU, or `None` with the reason printed (the test then passes without running).
fn gpu(test: &str, cap: u64) -> Option<CudaDevice> {
    let mut options = CudaOptions::new(0);
    options.cap = Some(cap);
    match CudaDevice::new(&options) {
        Ok(d) => Some(d),
        Err(reason) => {
            eprintln!("{test}: skipped: no usable GPU ({reason})");
            None
        }
    }
}

/// Where a comparison with the CPU runs: GPU 0, else the emulator.
enum Kernels {
    Gpu(Arc<CudaDevice>),
    Host(Arc<Emulator>),
}

/// GPU 0 with an arena of `cap`, else the emulator with one (printed), else `None` with
/// the reasons printed (the test then passes without running).
fn kernels(test: &str, cap: u64) -> Option<Kernels> {
    let mut options = CudaOptions::new(0);
    options.cap = Some(cap);
    match CudaDevice::new(&options) {
        Ok(d) => Some(Kernels::Gpu(Arc::new(d))),
        Err(no_gpu) => match Emulator::new(cap) {
            Ok(e) => {
                eprintln!("{test}: on the emulator: no usable GPU ({no_gpu})");
                Some(Kernels::Host(Arc::new(e)))
            }
            Err(why) => {
                eprintln!("{test}: skipped: no usable GPU ({no_gpu}), no emulator ({why})");
                None
            }
        },
    }
}

impl Kernels {
    fn device(&self) -> Arc<dyn Device> {
        match self {
            Kernels::Gpu(d) => d.clone(),
            Kernels::Host(e) => e.clone(),
        }
    }

    fn set_fusion(&self, on: bool) {
        match self {
            Kernels::Gpu(d) => d.set_fusion(on),
            Kernels::Host(e) => e.set_fusion(on),
        }
    }

    fn set_tiled_attention(&self, on: bool) {
        match self {
            Kernels::Gpu(d) => d.set_tiled_attention(on),
            Kernels::Host(e) => e.set_tiled_attention(on),
        }
    }

    /// CUDA graphs on the GPU; the emulator runs every iteration's commands as they are.
    fn set_graphs(&self, on: bool) {
        if let Kernels::Gpu(d) = self {
            d.set_graphs(on);
        }
    }
}

#[test]
fn probe_reports_without_panicking() {
    match CudaDevice::probe() {
        Ok(gpus) => {
            for g in &gpus {
                eprintln!(
                    "cuda:{} {} sm_{}{} {} MiB",
                    g.ordinal,
                    g.name,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.total_bytes >> 20
                );
            }
            assert!(!gpus.is_empty());
        }
        Err(reason) => eprintln!("no GPU: {reason}"),
    }
}

#[test]
fn opening_without_a_driver_is_a_clean_error() {
    if CudaDevice::probe().is_ok() {
        return;
    }
    let err = CudaDevice::new(&CudaOptions::new(0)).unwrap_err();
    assert!(!err.is_empty());
}

fn bytes_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(4)
        .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
        .collect()
}

/// Runs `iterations` of `graph` on `device` from the same initial parameters; returns
/// every iteration's fetches and the final persistent block.
fn train(
    device: &dyn Device,
    graph: &Graph,
    init: &[u8],
    feeds: &[Vec<u8>],
    iterations: usize,
) -> (Vec<Vec<Vec<u8>>>, Vec<u8>) {
    let program = Program::new(graph.clone(), &Limits::default()).unwrap();
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
fn training_steps_match_the_cpu_with_and_without_graphs() {
    let Some(kernels) = kernels("training_steps", 256 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let (n, d, k) = (64, 128, 32);
    let graph = samples::regression(n, d, k, 0.05);
    let mut rng = Rng::new(7);
    let w: Vec<f32> = rng
        .vec((d * k) as usize, -0.1, 0.1)
        .iter()
        .map(|&v| v as f32)
        .collect();
    let x: Vec<f32> = rng
        .vec((n * d) as usize, -1.0, 1.0)
        .iter()
        .map(|&v| v as f32)
        .collect();
    let y: Vec<f32> = rng
        .vec((n * k) as usize, -1.0, 1.0)
        .iter()
        .map(|&v| v as f32)
        .collect();
    let feeds = vec![bytes_f32(&x), bytes_f32(&y)];
    let cpu = CpuDevice::new(64 << 20).unwrap();
    let (want, want_w) = train(&cpu, &graph, &bytes_f32(&w), &feeds, 5);
    for (graphs, fusion) in [(false, false), (true, false), (false, true), (true, true)] {
        kernels.set_graphs(graphs);
        kernels.set_fusion(fusion);
        let (got, got_w) = train(&*gpu, &graph, &bytes_f32(&w), &feeds, 5);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(
                &f32s(&g[0]),
                &f32s(&w[0]),
                tol(1e-4, 1e-6),
                &format!("loss {i} (graphs {graphs}, fusion {fusion})"),
            );
        }
        assert_close(
            &f32s(&got_w),
            &f32s(&want_w),
            tol(1e-4, 1e-6),
            &format!("weights after 5 steps (graphs {graphs}, fusion {fusion})"),
        );
    }
}

fn f32t(name: &str, shape: &[u64], role: Role) -> Tensor {
    Tensor {
        name: name.into(),
        ty: TensorType::new(DType::F32, shape.to_vec()),
        role,
        data: vec![],
    }
}

fn pointwise(op: Op, inputs: &[usize], output: usize, attrs: &[(&str, Attr)]) -> Node {
    Node {
        name: format!("{op}.{output}"),
        op,
        inputs: inputs.iter().map(|&i| Some(i)).collect(),
        outputs: vec![Some(output)],
        attrs: attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
        source: String::new(),
    }
}

/// Pointwise chains the CUDA device fuses: x [64, 96] + b [96], times 2, gelu (fetched),
/// minus x, tanh (fetched); and two parameter updates, w minus 0.1 sigmoid(g) and v minus
/// 0.1 sigmoid(h), their ops interleaved as traced optimizers lay them out.
fn fusable_step() -> Graph {
    let f = |v: f64| Attr::Float(v);
    Graph {
        tensors: vec![
            f32t("x", &[64, 96], Role::Feed),
            f32t("b", &[96], Role::Parameter),
            f32t("t0", &[64, 96], Role::Intermediate),
            f32t("t1", &[64, 96], Role::Intermediate),
            f32t("t2", &[64, 96], Role::Intermediate),
            f32t("t3", &[64, 96], Role::Intermediate),
            f32t("t4", &[64, 96], Role::Intermediate),
            f32t("w", &[300], Role::Parameter),
            f32t("v", &[300], Role::Parameter),
            f32t("g", &[300], Role::Feed),
            f32t("h", &[300], Role::Feed),
            f32t("sg", &[300], Role::Intermediate),
            f32t("sh", &[300], Role::Intermediate),
            f32t("w2", &[300], Role::Intermediate),
            f32t("v2", &[300], Role::Intermediate),
        ],
        nodes: vec![
            pointwise(Op::AddTensor, &[0, 1], 2, &[]),
            pointwise(Op::MulScalar, &[2], 3, &[("other", f(2.0))]),
            pointwise(Op::Gelu, &[3], 4, &[]),
            pointwise(Op::SubTensor, &[4, 0], 5, &[]),
            pointwise(Op::Tanh, &[5], 6, &[]),
            pointwise(Op::Sigmoid, &[9], 11, &[]),
            pointwise(Op::Sigmoid, &[10], 12, &[]),
            pointwise(Op::SubTensor, &[7, 11], 13, &[("alpha", f(0.1))]),
            pointwise(Op::SubTensor, &[8, 12], 14, &[("alpha", f(0.1))]),
        ],
        fetches: vec![4, 6],
        updates: vec![
            Update {
                target: 7,
                value: 13,
            },
            Update {
                target: 8,
                value: 14,
            },
        ],
        precision: Precision::IEEE,
    }
}

#[test]
fn fused_chains_match_the_cpu_with_fusion_on_and_off() {
    let Some(kernels) = kernels("fused_chains", 64 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let graph = fusable_step();
    let mut rng = Rng::new(19);
    let mut f32s_of = |n: usize, lo: f64, hi: f64| -> Vec<f32> {
        rng.vec(n, lo, hi).iter().map(|&v| v as f32).collect()
    };
    // The whole persistent block (b, w, v, wherever the plan puts them), all f32.
    let block = Program::new(graph.clone(), &Limits::default())
        .unwrap()
        .plan()
        .persistent_bytes;
    let init = bytes_f32(&f32s_of(block as usize / 4, -1.0, 1.0));
    let feeds = vec![
        bytes_f32(&f32s_of(64 * 96, -2.0, 2.0)),
        bytes_f32(&f32s_of(300, -3.0, 3.0)),
        bytes_f32(&f32s_of(300, -3.0, 3.0)),
    ];
    let cpu = CpuDevice::new(64 << 20).unwrap();
    let (want, want_state) = train(&cpu, &graph, &init, &feeds, 3);
    for (graphs, fusion) in [(false, false), (false, true), (true, true)] {
        kernels.set_graphs(graphs);
        kernels.set_fusion(fusion);
        let (got, got_state) = train(&*gpu, &graph, &init, &feeds, 3);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            for k in 0..2 {
                assert_close(
                    &f32s(&g[k]),
                    &f32s(&w[k]),
                    tol(1e-5, 1e-6),
                    &format!("fetch {k} of step {i} (graphs {graphs}, fusion {fusion})"),
                );
            }
        }
        assert_close(
            &f32s(&got_state),
            &f32s(&want_state),
            tol(1e-5, 1e-6),
            &format!("parameters after 3 steps (graphs {graphs}, fusion {fusion})"),
        );
    }
    kernels.set_fusion(true);
}

/// A fused NCHW chain: x [4, 6, 5, 7] times a per-channel scale [1, 6, 1, 1], plus `e`,
/// relu (fetched), times x (fetched): with `e` [4, 6, 1, 1] the fused kernel takes the
/// broadcast index mode, with [4, 1, 1, 7] the generic one.
fn nchw_chain(e: &[u64]) -> Graph {
    let nchw = [4u64, 6, 5, 7];
    Graph {
        tensors: vec![
            f32t("x", &nchw, Role::Feed),
            f32t("s", &[1, 6, 1, 1], Role::Parameter),
            f32t("e", e, Role::Feed),
            f32t("t0", &nchw, Role::Intermediate),
            f32t("t1", &nchw, Role::Intermediate),
            f32t("t2", &nchw, Role::Intermediate),
            f32t("t3", &nchw, Role::Intermediate),
        ],
        nodes: vec![
            pointwise(Op::MulTensor, &[0, 1], 3, &[]),
            pointwise(Op::AddTensor, &[3, 2], 4, &[]),
            pointwise(Op::Relu, &[4], 5, &[]),
            pointwise(Op::MulTensor, &[5, 0], 6, &[]),
        ],
        fetches: vec![5, 6],
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[test]
fn the_nchw_chains_run_on_the_cpu() {
    for e in [&[4u64, 6, 1, 1][..], &[4, 1, 1, 7]] {
        let graph = nchw_chain(e);
        let block = Program::new(graph.clone(), &Limits::default())
            .unwrap()
            .plan()
            .persistent_bytes;
        let init = vec![0u8; block as usize];
        let feeds = vec![
            bytes_f32(&vec![1.0; 4 * 6 * 5 * 7]),
            bytes_f32(&vec![1.0; e.iter().product::<u64>() as usize]),
        ];
        let cpu = CpuDevice::new(64 << 20).unwrap();
        let (outs, _) = train(&cpu, &graph, &init, &feeds, 1);
        assert_eq!(
            f32s(&outs[0][1]),
            vec![1.0; 4 * 6 * 5 * 7],
            "relu(x 0 + 1) x"
        );
    }
}

#[test]
fn fused_nchw_broadcasts_match_the_cpu() {
    let Some(kernels) = kernels("fused_nchw", 64 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let mut rng = Rng::new(23);
    let mut f32s_of =
        |n: usize| -> Vec<f32> { rng.vec(n, -2.0, 2.0).iter().map(|&v| v as f32).collect() };
    for e in [&[4u64, 6, 1, 1][..], &[4, 1, 1, 7]] {
        let graph = nchw_chain(e);
        let block = Program::new(graph.clone(), &Limits::default())
            .unwrap()
            .plan()
            .persistent_bytes;
        let init = bytes_f32(&f32s_of(block as usize / 4));
        let feeds = vec![
            bytes_f32(&f32s_of(4 * 6 * 5 * 7)),
            bytes_f32(&f32s_of(e.iter().product::<u64>() as usize)),
        ];
        let cpu = CpuDevice::new(64 << 20).unwrap();
        let (want, _) = train(&cpu, &graph, &init, &feeds, 1);
        for fusion in [false, true] {
            kernels.set_fusion(fusion);
            let (got, _) = train(&*gpu, &graph, &init, &feeds, 1);
            for k in 0..2 {
                assert_close(
                    &f32s(&got[0][k]),
                    &f32s(&want[0][k]),
                    tol(1e-6, 1e-7),
                    &format!("fetch {k} with e {e:?} (fusion {fusion})"),
                );
            }
        }
    }
    kernels.set_fusion(true);
}

/// Softmax, log-softmax, layer norm (and their backward) and sums over the last dim and
/// over rows, at row lengths around the warp and block kernels' bounds.
fn row_cases() -> Vec<Case> {
    let mut rng = Rng::new(23);
    let mut cases = Vec::new();
    for len in [1u64, 31, 32, 1000, 1025, 4096] {
        let shape = [3u64, len];
        let x = rng.f32s(&shape, -3.0, 3.0);
        let g = rng.f32s(&shape, -1.0, 1.0);
        let y = rng.f32s(&shape, 0.0, 1.0);
        let w = rng.f32s(&[len], 0.5, 1.5);
        let bias = rng.f32s(&[len], -1.0, 1.0);
        let stats = rng.f32s(&[3, 1], 0.5, 1.5);
        for op in [Op::Softmax, Op::LogSoftmax] {
            cases.push(
                Case::new(op)
                    .input(x.clone())
                    .int("dim", -1)
                    .flag("half_to_float", false)
                    .output(DType::F32, &shape),
            );
        }
        for op in [Op::SoftmaxBackwardData, Op::LogSoftmaxBackwardData] {
            cases.push(
                Case::new(op)
                    .input(g.clone())
                    .input(y.clone())
                    .int("dim", -1)
                    .dtype("input_dtype", DType::F32)
                    .output(DType::F32, &shape),
            );
        }
        cases.push(
            Case::new(Op::NativeLayerNorm)
                .input(x.clone())
                .input(w.clone())
                .input(bias.clone())
                .ints("normalized_shape", &[len as i64])
                .float("eps", 1e-5)
                .output(DType::F32, &shape)
                .output(DType::F32, &[3, 1])
                .output(DType::F32, &[3, 1]),
        );
        cases.push(
            Case::new(Op::NativeLayerNormBackward)
                .input(g.clone())
                .input(x.clone())
                .input(stats.clone())
                .input(stats.clone())
                .input(w.clone())
                .input(bias.clone())
                .ints("normalized_shape", &[len as i64])
                .attr("output_mask", Attr::Bools(vec![true, true, true]))
                .output(DType::F32, &shape)
                .output(DType::F32, &[len])
                .output(DType::F32, &[len]),
        );
        for (dim, out) in [(1i64, vec![3u64]), (0, vec![len])] {
            for op in [Op::SumDimIntList, Op::Amax, Op::VarCorrection] {
                cases.push(
                    Case::new(op)
                        .input(x.clone())
                        .ints("dim", &[dim])
                        .output(DType::F32, &out),
                );
            }
        }
    }
    // Layer norm's weight and bias gradients over many rows: row chunks summed apart, then
    // added (a last chunk short of the others), with either gradient alone.
    for (rows, len, mask) in [
        (1000u64, 96u64, [true, true, true]),
        (2049, 33, [false, true, false]),
        (64, 768, [true, false, true]),
    ] {
        let shape = [rows, len];
        let stats = rng.f32s(&[rows, 1], 0.5, 1.5);
        let mut case = Case::new(Op::NativeLayerNormBackward)
            .input(rng.f32s(&shape, -1.0, 1.0))
            .input(rng.f32s(&shape, -3.0, 3.0))
            .input(stats.clone())
            .input(stats)
            .input(rng.f32s(&[len], 0.5, 1.5))
            .input(rng.f32s(&[len], -1.0, 1.0))
            .ints("normalized_shape", &[len as i64])
            .attr("output_mask", Attr::Bools(mask.to_vec()));
        for (k, wanted) in mask.into_iter().enumerate() {
            let out = if k == 0 { vec![rows, len] } else { vec![len] };
            case = if wanted {
                case.output(DType::F32, &out)
            } else {
                case.unused()
            };
        }
        cases.push(case);
    }
    cases
}

#[test]
fn the_row_cases_run_on_the_cpu() {
    for case in row_cases() {
        case.try_run_on(None).unwrap();
    }
}

/// The row kernels (a warp or a block per row, column sums) against the CPU.
#[test]
fn row_kernels_match_the_cpu() {
    let Some(kernels) = kernels("row_kernels", 256 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let mut failures = Vec::new();
    for case in row_cases() {
        let shapes: Vec<_> = case
            .input_values()
            .iter()
            .map(|v| v.ty.shape.clone())
            .collect();
        match (case.try_run_on(None), case.try_run_on(Some(gpu.clone()))) {
            (Ok(want), Ok(got)) => {
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    let scale = w.iter().fold(0.0f64, |s, v| s.max(v.abs())).max(1.0);
                    let worst = g
                        .iter()
                        .zip(w)
                        .map(|(g, w)| (g - w).abs())
                        .fold(0.0, f64::max);
                    if g.len() != w.len() || worst > 2e-5 * scale {
                        failures.push(format!(
                            "{} of {shapes:?}: output {k} differs by {worst:e} (scale {scale})",
                            case.op()
                        ));
                    }
                }
            }
            (w, g) => failures.push(format!(
                "{} of {shapes:?}: cpu {:?}, gpu {:?}",
                case.op(),
                w.err(),
                g.err()
            )),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_profiled_iteration_times_every_node_and_leaves_the_state() {
    let Some(gpu) = gpu("profile", 256 << 20) else {
        return;
    };
    let (n, d, k) = (64, 128, 32);
    let graph = samples::regression(n, d, k, 0.05);
    let program = Program::new(graph.clone(), &Limits::default()).unwrap();
    let mut rng = Rng::new(11);
    let mut data = |len: u64| -> Vec<u8> {
        let v: Vec<f32> = rng
            .vec(len as usize, -1.0, 1.0)
            .iter()
            .map(|&v| v as f32)
            .collect();
        bytes_f32(&v)
    };
    let (w, x, y) = (data(d * k), data(n * d), data(n * k));
    let feeds = vec![x, y];
    let refs: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
    let plan = program.plan().clone();
    let at = Placement {
        persistent: 0,
        lane: plan.persistent_bytes.div_ceil(256) * 256,
    };
    gpu.write(0, &w).unwrap();
    // A captured graph first: profiling must not disturb it.
    let first = gpu.run(&program, at, &refs).unwrap();
    gpu.run(&program, at, &refs).unwrap();
    let before = gpu.read(0, plan.persistent_bytes).unwrap();
    let profile = gpu.profile_iteration(&program, at, &refs).unwrap();
    assert_eq!(
        gpu.read(0, plan.persistent_bytes).unwrap(),
        before,
        "a profile must not write the updates"
    );
    assert_eq!(profile.nodes.len(), graph.nodes.len());
    assert!(!profile.gate_timed_out, "the gate timed out");
    assert!(profile.launches() > 0);
    assert!(profile.total_ms() > 0.0 && profile.total_ms() < 1000.0);
    for node in &profile.nodes {
        assert!(node.ms >= 0.0, "{node:?}");
        if node.launches == 0 {
            assert_eq!(node.ms, 0.0, "{node:?}");
        }
    }
    let by_family = profile.by_family();
    let summed: u64 = by_family.values().map(|g| g.launches).sum();
    assert_eq!(summed, profile.launches());
    eprintln!(
        "profile: {} nodes, {} launches, {:.3} ms: {:?}",
        profile.nodes.len(),
        profile.launches(),
        profile.total_ms(),
        by_family
    );
    // The next iterations go on as if no profile had run: the third step's loss is the
    // CPU's third.
    let cpu = CpuDevice::new(64 << 20).unwrap();
    let (want, _) = train(&cpu, &graph, &w, &feeds, 3);
    assert_close(
        &f32s(&first.fetches[0]),
        &f32s(&want[0][0]),
        tol(1e-4, 1e-6),
        "loss 0",
    );
    let third = gpu.run(&program, at, &refs).unwrap();
    assert_close(
        &f32s(&third.fetches[0]),
        &f32s(&want[2][0]),
        tol(1e-4, 1e-6),
        "loss 2 after a profile",
    );
}

#[test]
fn a_bad_index_fails_the_iteration_and_leaves_the_state() {
    let Some(kernels) = kernels("bad_index", 64 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let program = Program::new(samples::embedding_sum(), &Limits::default()).unwrap();
    let at = Placement {
        persistent: 0,
        lane: 4096,
    };
    let table: Vec<f32> = (0..8).map(|v| v as f32).collect();
    gpu.write(0, &bytes_f32(&table)).unwrap();
    let ids = |v: [i64; 3]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    for _ in 0..3 {
        // Eager, then captured, then replayed: each must fail the same way.
        let err = gpu.run(&program, at, &[&ids([0, 7, 1])]).unwrap_err();
        match &err {
            ExecError::Node { index, message, .. } => {
                assert_eq!(*index, 0);
                assert_mentions(message, &["embedding index", "7", "size 4"]);
            }
            other => panic!("expected a node error, got {other:?}"),
        }
        assert_eq!(
            gpu.read(0, 32).unwrap(),
            bytes_f32(&table),
            "the state must not change"
        );
    }
    assert!(
        gpu.health().is_ok(),
        "a bad index must not poison the device"
    );
    let out = gpu.run(&program, at, &[&ids([0, 3, -1])]).unwrap();
    assert_eq!(
        f32s(&out.fetches[0]),
        vec![0.0 + 1.0 + 6.0 + 7.0 + 6.0 + 7.0]
    );
    let halved: Vec<f32> = table.iter().map(|v| v * 0.5).collect();
    assert_eq!(gpu.read(0, 32).unwrap(), bytes_f32(&halved));
}

#[test]
fn two_lanes_run_concurrently() {
    let Some(gpu) = gpu("two_lanes", 512 << 20) else {
        return;
    };
    let gpu = Arc::new(gpu);
    let (n, d, k) = (512, 1024, 512);
    let graph = samples::regression(n, d, k, 0.01);
    let program = Arc::new(Program::new(graph, &Limits::default()).unwrap());
    let plan = program.plan().clone();
    let lane_bytes = plan.ephemeral_bytes.div_ceil(256) * 256;
    let block = plan.persistent_bytes.div_ceil(256) * 256;
    let mut rng = Rng::new(3);
    let x = bytes_f32(
        &rng.vec((n * d) as usize, -1.0, 1.0)
            .iter()
            .map(|&v| v as f32)
            .collect::<Vec<_>>(),
    );
    let y = bytes_f32(
        &rng.vec((n * k) as usize, -1.0, 1.0)
            .iter()
            .map(|&v| v as f32)
            .collect::<Vec<_>>(),
    );
    let run = |lane: u64, persistent: u64, iterations: usize| {
        let at = Placement { persistent, lane };
        for _ in 0..iterations {
            gpu.run(&program, at, &[&x, &y]).unwrap();
        }
    };
    let lanes = [2 * block, 2 * block + lane_bytes];
    run(lanes[0], 0, 3);
    run(lanes[1], block, 3);
    let t = Instant::now();
    run(lanes[0], 0, 20);
    run(lanes[1], block, 20);
    let sequential = t.elapsed();
    let t = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| run(lanes[0], 0, 20));
        s.spawn(|| run(lanes[1], block, 20));
    });
    let concurrent = t.elapsed();
    eprintln!("two lanes: sequential {sequential:?}, concurrent {concurrent:?}");
    assert!(
        concurrent < sequential,
        "two lanes together ({concurrent:?}) should beat one after the other ({sequential:?})"
    );
}

#[test]
fn memory_in_use_is_the_arena_within_the_reserve() {
    if CudaDevice::probe().is_err() {
        eprintln!("memory_in_use: skipped: no usable GPU");
        return;
    }
    let cap = 1u64 << 30;
    let Some(gpu) = gpu("memory_in_use", cap) else {
        return;
    };
    let graph = samples::regression(256, 512, 256, 0.01);
    let program = Program::new(graph, &Limits::default()).unwrap();
    let plan = program.plan().clone();
    let lane = plan.persistent_bytes.div_ceil(256) * 256;
    let before_lane = gpu.memory_in_use().unwrap();
    let zeros = |n: u64| vec![0u8; n as usize];
    gpu.run(
        &program,
        Placement {
            persistent: 0,
            lane,
        },
        &[&zeros(256 * 512 * 4), &zeros(256 * 256 * 4)],
    )
    .unwrap();
    let after = gpu.memory_in_use().unwrap();
    // Later iterations in the same lane take nothing more: no per-tensor memory.
    gpu.run(
        &program,
        Placement {
            persistent: 0,
            lane,
        },
        &[&zeros(256 * 512 * 4), &zeros(256 * 256 * 4)],
    )
    .unwrap();
    assert_eq!(
        gpu.memory_in_use().unwrap(),
        after,
        "an iteration allocates nothing"
    );
    eprintln!(
        "arena {cap} bytes; GPU memory in use {before_lane} before the first lane, {after} after; plan P {} E {}",
        plan.persistent_bytes, plan.ephemeral_bytes
    );
    assert_eq!(gpu.capacity(), cap);
    assert!(before_lane >= cap, "the arena is allocated up front");
    // Measured on an H200 (CUDA 13 libraries): about 70 MiB for the first lane (its
    // stream, cuBLAS handle and workspace, error block, and the first module loads).
    assert!(
        after - before_lane <= 128 << 20,
        "running a lane may add only its stream, cuBLAS state and error block, not per-tensor memory"
    );
    assert!(
        after - cap <= salus_cuda::DEFAULT_RESERVE,
        "everything outside the arena fits in the reserve"
    );
}

/// A few ops of each family on random inputs.
fn cases() -> Vec<Case> {
    let mut rng = Rng::new(11);
    let x = rng.f32s(&[4, 6, 5], -2.0, 2.0);
    let m = rng.f32s(&[6, 5], -1.0, 1.0);
    let a = rng.f32s(&[16, 24], -1.0, 1.0);
    let b = rng.f32s(&[24, 8], -1.0, 1.0);
    let img = rng.f32s(&[2, 3, 9, 9], -1.0, 1.0);
    let w = rng.f32s(&[4, 3, 3, 3], -1.0, 1.0);
    let idx = i64v(&[4], &[3, 0, 5, 1]);
    let cases = vec![
        Case::new(Op::AddTensor)
            .input(x.clone())
            .input(m.clone())
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::Gelu)
            .input(x.clone())
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::Exp)
            .input(x.clone())
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::Permute)
            .input(x.clone())
            .ints("dims", &[2, 0, 1])
            .output(DType::F32, &[5, 4, 6]),
        Case::new(Op::SumDimIntList)
            .input(x.clone())
            .ints("dim", &[0, 2])
            .output(DType::F32, &[6]),
        Case::new(Op::Amax)
            .input(x.clone())
            .ints("dim", &[1])
            .output(DType::F32, &[4, 5]),
        Case::new(Op::VarCorrection)
            .input(x.clone())
            .ints("dim", &[2])
            .output(DType::F32, &[4, 6]),
        Case::new(Op::Softmax)
            .input(x.clone())
            .int("dim", 1)
            .flag("half_to_float", false)
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::Mm)
            .input(a.clone())
            .input(b.clone())
            .output(DType::F32, &[16, 8]),
        Case::new(Op::Convolution)
            .input(img.clone())
            .input(w.clone())
            .absent()
            .ints("stride", &[2, 2])
            .ints("padding", &[1, 1])
            .ints("dilation", &[1, 1])
            .flag("transposed", false)
            .ints("output_padding", &[0, 0])
            .int("groups", 1)
            .output(DType::F32, &[2, 4, 5, 5]),
        Case::new(Op::IndexSelect)
            .input(m.clone())
            .int("dim", 0)
            .input(idx.clone())
            .output(DType::F32, &[4, 5]),
    ];
    let mut cases = cases;
    cases.extend(unet_cases(&mut rng));
    cases.extend(batch_norm_cases(&mut rng));
    cases.extend(attention_cases(&mut rng));
    cases
}

/// Fused attention and its backward at lengths around the kernels' tiles (16 and 8
/// queries a block, 32 keys a tile), head dims up to the fused kernels' largest (128) and
/// past it (f32 attention runs as cuBLAS products, which have no such bound), causal,
/// with bool and float masks.
fn attention_cases(rng: &mut Rng) -> Vec<Case> {
    let mut cases = Vec::new();
    for (b, h, l, s, e, ev, causal, mask) in [
        (2u64, 3u64, 37u64, 37u64, 64u64, 64u64, true, 0),
        (1, 2, 5, 70, 32, 16, false, 0),
        (2, 2, 33, 40, 128, 128, false, 1),
        (1, 3, 17, 17, 8, 24, true, 2),
        (3, 1, 1, 1, 4, 4, false, 0),
        (1, 2, 20, 24, 160, 192, true, 2),
        // Past the register tiles' 64 queries and 32 keys, causal and not.
        (2, 2, 130, 130, 64, 48, true, 0),
        (1, 1, 65, 33, 33, 7, false, 2),
    ] {
        let q = rng.f32s(&[b, h, l, e], -1.0, 1.0);
        let k = rng.f32s(&[b, h, s, e], -1.0, 1.0);
        let v = rng.f32s(&[b, h, s, ev], -1.0, 1.0);
        let m = match mask {
            1 => Some(val(
                DType::Bool,
                &[l, s],
                (0..l * s)
                    .map(|i| f64::from(i % s == 0 || i % 3 != 0))
                    .collect(),
            )),
            2 => Some(rng.f32s(&[b, 1, l, s], -2.0, 0.5)),
            _ => None,
        };
        let with_mask = |case: Case| match &m {
            Some(m) => case.input(m.clone()),
            None => case.absent(),
        };
        let forward = with_mask(
            Case::new(Op::ScaledDotProductAttention)
                .input(q.clone())
                .input(k.clone())
                .input(v.clone()),
        )
        .float("dropout_p", 0.0)
        .flag("is_causal", causal)
        .output(DType::F32, &[b, h, l, ev])
        .output(DType::F32, &[b, h, l]);
        // The backward from the forward's own results, computed on the CPU.
        let fwd = forward.try_run_on(None).expect("attention runs on the CPU");
        cases.push(forward);
        let g = rng.f32s(&[b, h, l, ev], -1.0, 1.0);
        cases.push(
            with_mask(
                Case::new(Op::ScaledDotProductAttentionBackward)
                    .input(g)
                    .input(q)
                    .input(k)
                    .input(v)
                    .input(f32v(&[b, h, l, ev], fwd[0].clone()))
                    .input(f32v(&[b, h, l], fwd[1].clone())),
            )
            .float("dropout_p", 0.0)
            .flag("is_causal", causal)
            .output(DType::F32, &[b, h, l, e])
            .output(DType::F32, &[b, h, s, e])
            .output(DType::F32, &[b, h, s, ev]),
        );
    }
    cases
}

/// Training-mode batch norm and its backward at shapes that take each path of the
/// kernels: rows shorter and longer than a block, one element per row (BatchNorm1d),
/// runs of images split over many blocks, channels offset from zero.
fn batch_norm_cases(rng: &mut Rng) -> Vec<Case> {
    let mut cases = Vec::new();
    for (shape, affine) in [
        (&[4u64, 3, 5, 7][..], true),
        (&[3, 2, 300][..], false),
        (&[64, 5][..], true),
        (&[16, 3, 2048][..], true),
        (&[6, 4, 2, 3, 3][..], true),
    ] {
        let c = &[shape[1]][..];
        let inner: u64 = shape[2..].iter().product();
        let mut x = rng.f32s(shape, -2.0, 2.0);
        for (i, v) in x.data.iter_mut().enumerate() {
            *v += 5.0 * ((i as u64 / inner) % shape[1]) as f64;
        }
        let g = rng.f32s(shape, -1.0, 1.0);
        let (w, b) = (rng.f32s(c, 0.5, 1.5), rng.f32s(c, -1.0, 1.0));
        let (rm, rv) = (rng.f32s(c, -0.5, 0.5), rng.f32s(c, 0.5, 2.0));
        let (mean, rstd) = (rng.f32s(c, 4.0, 6.0), rng.f32s(c, 0.5, 1.5));
        let forward = Case::new(Op::NativeBatchNorm).input(x.clone());
        let forward = if affine {
            forward.input(w.clone()).input(b)
        } else {
            forward.absent().absent()
        };
        cases.push(
            forward
                .input(rm.clone())
                .input(rv.clone())
                .flag("training", true)
                .float("momentum", 0.1)
                .float("eps", 1e-5)
                .output(DType::F32, shape)
                .output(DType::F32, c)
                .output(DType::F32, c)
                .output(DType::F32, c)
                .output(DType::F32, c),
        );
        let backward = Case::new(Op::NativeBatchNormBackward).input(g).input(x);
        let backward = if affine {
            backward.input(w)
        } else {
            backward.absent()
        };
        cases.push(
            backward
                .input(rm)
                .input(rv)
                .input(mean)
                .input(rstd)
                .flag("train", true)
                .float("eps", 1e-5)
                .attr("output_mask", Attr::Bools(vec![true, affine, affine]))
                .output(DType::F32, shape)
                .output(DType::F32, c)
                .output(DType::F32, c),
        );
    }
    cases
}

/// The ops a U-Net's training step adds (group norm, transposed convolutions, upsampling
/// by indexing, padding) and cumsum, flip, maximum and the tensor comparisons.
fn unet_cases(rng: &mut Rng) -> Vec<Case> {
    let img = rng.f32s(&[2, 6, 5, 7], -1.0, 1.0);
    let small = rng.f32s(&[2, 4, 3, 3], -1.0, 1.0);
    let wt = rng.f32s(&[4, 3, 3, 3], -1.0, 1.0);
    let up = rng.f32s(&[2, 3, 6, 6], -1.0, 1.0);
    let x = rng.f32s(&[4, 6, 5], -2.0, 2.0);
    let y = rng.f32s(&[6, 1], -2.0, 2.0);
    let rows = i64v(&[10, 1], &[0, 0, 1, 1, 2, 2, 3, 3, 4, -1]);
    let cols = i64v(&[14], &[0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, -1]);
    let transposed = |op: Op| {
        Case::new(op)
            .ints("stride", &[2, 2])
            .ints("padding", &[1, 1])
            .ints("dilation", &[1, 1])
            .flag("transposed", true)
            .ints("output_padding", &[1, 1])
            .int("groups", 1)
    };
    vec![
        Case::new(Op::Maximum)
            .input(x.clone())
            .input(y.clone())
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::Minimum)
            .input(x.clone())
            .input(y.clone())
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::GtTensor)
            .input(x.clone())
            .input(y.clone())
            .output(DType::Bool, &[4, 6, 5]),
        Case::new(Op::Cumsum)
            .input(x.clone())
            .int("dim", 1)
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::Flip)
            .input(x.clone())
            .ints("dims", &[0, 2])
            .output(DType::F32, &[4, 6, 5]),
        Case::new(Op::ConstantPadNd)
            .input(img.clone())
            .ints("pad", &[1, 2, -1, 3])
            .float("value", 0.25)
            .output(DType::F32, &[2, 6, 7, 10]),
        Case::new(Op::ReflectionPad2d)
            .input(img.clone())
            .ints("padding", &[2, 1, 3, 4])
            .output(DType::F32, &[2, 6, 12, 10]),
        Case::new(Op::ReflectionPad2dBackward)
            .input(rng.f32s(&[2, 6, 12, 10], -1.0, 1.0))
            .input(img.clone())
            .ints("padding", &[2, 1, 3, 4])
            .output(DType::F32, &[2, 6, 5, 7]),
        Case::new(Op::NativeGroupNorm)
            .input(img.clone())
            .input(rng.f32s(&[6], 0.5, 1.5))
            .input(rng.f32s(&[6], -1.0, 1.0))
            .int("N", 2)
            .int("C", 6)
            .int("HxW", 35)
            .int("group", 3)
            .float("eps", 1e-5)
            .output(DType::F32, &[2, 6, 5, 7])
            .output(DType::F32, &[2, 3])
            .output(DType::F32, &[2, 3]),
        // Nearest upsampling x2 as PyTorch decomposes it, forward and backward.
        Case::new(Op::IndexTensor)
            .input(img.clone())
            .absent()
            .absent()
            .input(rows.clone())
            .input(cols.clone())
            .int("indices.len", 4)
            .output(DType::F32, &[2, 6, 10, 14]),
        Case::new(Op::IndexPut)
            .input(f32v(&[2, 6, 5, 7], vec![0.0; 420]))
            .absent()
            .absent()
            .input(rows)
            .input(cols)
            .input(rng.f32s(&[2, 6, 10, 14], -1.0, 1.0))
            .int("indices.len", 4)
            .flag("accumulate", true)
            .output(DType::F32, &[2, 6, 5, 7]),
        // ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1): 3x3 -> 6x6.
        transposed(Op::Convolution)
            .input(small.clone())
            .input(wt.clone())
            .input(rng.f32s(&[3], -1.0, 1.0))
            .output(DType::F32, &[2, 3, 6, 6]),
        transposed(Op::ConvolutionBackward)
            .input(up)
            .input(small)
            .input(wt)
            .ints("bias_sizes", &[3])
            .attr("output_mask", Attr::Bools(vec![true, true, true]))
            .output(DType::F32, &[2, 4, 3, 3])
            .output(DType::F32, &[4, 3, 3, 3])
            .output(DType::F32, &[3]),
    ]
}

#[test]
fn the_gpu_cases_run_on_the_cpu() {
    for case in cases() {
        case.try_run_on(None).unwrap();
    }
}

/// The cases above, GPU against CPU.
#[test]
fn ops_match_the_cpu_on_random_inputs() {
    let Some(kernels) = kernels("ops_match", 256 << 20) else {
        return;
    };
    let failures = mismatches(&kernels.device(), cases(), 1e-4);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The cases whose outputs on `gpu` differ from the CPU device's by more than `rtol` of
/// each output's scale (at least 1), or that fail on either; NaN matches NaN.
fn mismatches(gpu: &Arc<dyn Device>, cases: Vec<Case>, rtol: f64) -> Vec<String> {
    let mut failures = Vec::new();
    for case in cases {
        match (case.try_run_on(None), case.try_run_on(Some(gpu.clone()))) {
            (Ok(want), Ok(got)) => {
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    let scale = w.iter().fold(0.0f64, |s, v| s.max(v.abs())).max(1.0);
                    let same = |g: &f64, w: &f64| {
                        (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= rtol * scale
                    };
                    if g.len() != w.len() || !g.iter().zip(w).all(|(g, w)| same(g, w)) {
                        failures.push(format!("{}: output {k} differs", case.op()));
                    }
                }
            }
            (w, g) => failures.push(format!(
                "{}: cpu {:?}, gpu {:?}",
                case.op(),
                w.err(),
                g.err()
            )),
        }
    }
    failures
}

/// f32 attention with the register-tiled forward (not cuBLAS) against the CPU, and its
/// backward from there.
#[test]
fn tiled_attention_matches_the_cpu() {
    let Some(kernels) = kernels("tiled_attention", 256 << 20) else {
        return;
    };
    kernels.set_tiled_attention(true);
    let failures = mismatches(&kernels.device(), attention_cases(&mut Rng::new(31)), 1e-5);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Efficient attention's geometry: (batch, heads, queries, keys, head dim, value dim,
/// causal, mask: 0 none, 1 a bool [l, s], 2 a float bias [b, 1, l, s]).
type Geometry = (u64, u64, u64, u64, u64, u64, bool, u8);

/// `_scaled_dot_product_efficient_attention` in `dtype` at `geometry` with `dropout` from
/// the generator `state`, its backward from the CPU device's forward results, and the
/// flash op on the same inputs.
fn efficient_attention(
    rng: &mut Rng,
    dtype: DType,
    (b, h, l, s, e, ev, causal, mask): Geometry,
    dropout: f64,
    state: i64,
) -> [Case; 3] {
    let mut values = |shape: &[u64], lo, hi| val(dtype, shape, rng.vec(numel(shape), lo, hi));
    let (q, k, v) = (
        values(&[b, h, l, e], -1.0, 1.0),
        values(&[b, h, s, e], -1.0, 1.0),
        values(&[b, h, s, ev], -1.0, 1.0),
    );
    let bias = match mask {
        1 => Some(val(
            DType::Bool,
            &[l, s],
            (0..l * s)
                .map(|i| f64::from(i % s == 0 || i % 3 != 0))
                .collect(),
        )),
        2 => Some(values(&[b, 1, l, s], -2.0, 0.5)),
        _ => None,
    };
    let g = values(&[b, h, l, ev], -1.0, 1.0);
    let with_bias = |case: Case| match &bias {
        Some(m) => case.input(m.clone()),
        None => case.absent(),
    };
    let qkv = |op| {
        with_bias(
            Case::new(op)
                .input(q.clone())
                .input(k.clone())
                .input(v.clone()),
        )
        .float("dropout_p", dropout)
        .flag("is_causal", causal)
    };
    let (out, lse) = ([b, h, l, ev], [b, h, l.next_multiple_of(32)]);
    let forward = qkv(Op::EfficientAttention)
        .input(i64v(&[], &[state]))
        .output(dtype, &out)
        .output(DType::F32, &lse)
        .output(DType::I64, &[])
        .output(DType::I64, &[]);
    let fwd = forward
        .try_run_on(None)
        .expect("efficient attention runs on the CPU");
    let backward = with_bias(
        Case::new(Op::EfficientAttentionBackward)
            .input(g)
            .input(q.clone())
            .input(k.clone())
            .input(v.clone()),
    )
    .input(val(dtype, &out, fwd[0].clone()))
    .input(f32v(&lse, fwd[1].clone()))
    .input(val(DType::I64, &[], fwd[2].clone()))
    .input(val(DType::I64, &[], fwd[3].clone()))
    .float("dropout_p", dropout)
    .flag("is_causal", causal)
    .attr(
        "grad_input_mask",
        Attr::Bools(vec![true, true, true, false]),
    )
    .output(dtype, &[b, h, l, e])
    .output(dtype, &[b, h, s, e])
    .output(dtype, &[b, h, s, ev])
    .unused();
    let flash = qkv(Op::ScaledDotProductAttention)
        .output(dtype, &out)
        .output(DType::F32, &[b, h, l]);
    [forward, backward, flash]
}

/// Attention with dropout (the efficient ops; dropout 0.3, and 0) against the CPU at
/// lengths off the tiles, causal or not, with a bool mask, a float bias or neither: f32
/// through cuBLAS and through the register tiles, f16 and bf16 through the tiles and (f16,
/// head dims past 64) the one-score-per-lane kernels. The seed is the CPU's, the offset 0,
/// the log-sum-exps past the queries 0 (over a lane left dirty), and without dropout the
/// forward is the flash op's bit for bit.
#[test]
fn efficient_attention_matches_the_cpu() {
    let Some(kernels) = kernels("efficient_attention", 256 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let state = exact_seed_state(12345);
    let mut rng = Rng::new(43);
    let tiles: &[Geometry] = &[
        (2, 2, 37, 45, 32, 24, false, 0),
        (1, 3, 37, 45, 16, 16, true, 1),
        (2, 1, 45, 37, 64, 40, true, 2),
    ];
    let f16: &[Geometry] = &[
        tiles[0],
        tiles[1],
        tiles[2],
        (1, 2, 37, 45, 80, 80, true, 1),
    ];
    let dirty = Case::new(Op::Neg)
        .input(f32v(&[1 << 18], vec![f64::NAN; 1 << 18]))
        .output(DType::F32, &[1 << 18]);
    let mut failures = Vec::new();
    for (dtype, tiled, geometries, rtol) in [
        (DType::F32, false, tiles, 1e-4),
        (DType::F32, true, tiles, 1e-5),
        (DType::F16, false, f16, 2e-3),
        (DType::Bf16, false, tiles, 1e-2),
    ] {
        kernels.set_tiled_attention(tiled);
        for &geometry in geometries {
            for dropout in [0.3, 0.0] {
                let what = format!("{dtype} tiled {tiled} {geometry:?} dropout {dropout}");
                let [forward, backward, flash] =
                    efficient_attention(&mut rng, dtype, geometry, dropout, state);
                dirty.try_run_on(Some(gpu.clone())).unwrap();
                let got = forward.try_run_on(Some(gpu.clone())).unwrap();
                let want = forward.try_run_on(None).unwrap();
                assert_eq!((&got[2], &got[3]), (&want[2], &vec![0.0]), "{what}: seed");
                let l = geometry.2 as usize;
                let heads: Vec<&[f64]> = got[1].chunks(l.next_multiple_of(32)).collect();
                let padding = heads.iter().flat_map(|head| &head[l..]);
                assert!(padding.copied().all(|x| x == 0.0), "{what}: lse padding");
                if dropout == 0.0 {
                    let plain = flash.try_run_on(Some(gpu.clone())).unwrap();
                    let lse: Vec<f64> = heads.iter().flat_map(|head| &head[..l]).copied().collect();
                    let same = |a: &[f64], b: &[f64]| {
                        a.len() == b.len()
                            && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                    };
                    assert!(
                        same(&got[0], &plain[0]) && same(&lse, &plain[1]),
                        "{what}: not the flash op's"
                    );
                }
                for failure in mismatches(&gpu, vec![forward, backward], rtol) {
                    failures.push(format!("{what}: {failure}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Random data of `dtype` (ints for the integer types, 0/1 for bool).
fn random_of(rng: &mut Rng, dtype: DType, shape: &[u64]) -> Value {
    let n = shape.iter().product::<u64>() as usize;
    let data = match dtype {
        DType::I64 => rng
            .ints(n, -(1 << 40), 1 << 40)
            .iter()
            .map(|&v| v as f64)
            .collect(),
        DType::I32 => rng
            .ints(n, -(1 << 30), 1 << 30)
            .iter()
            .map(|&v| v as f64)
            .collect(),
        DType::Bool => rng.ints(n, 0, 2).iter().map(|&v| v as f64).collect(),
        _ => rng.vec(n, -4.0, 4.0),
    };
    val(dtype, shape, data)
}

fn permuted(shape: &[u64], dims: &[usize]) -> Vec<u64> {
    dims.iter().map(|&d| shape[d]).collect()
}

/// Every order of `0..n`.
fn orders(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for rest in orders(n - 1) {
        for at in 0..=rest.len() {
            let mut o = rest.clone();
            o.insert(at, n - 1);
            out.push(o);
        }
    }
    out
}

const COPY_DTYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::Bf16,
    DType::I64,
    DType::I32,
    DType::Bool,
];

/// Layout copies: the routes of `copy_rows`, `copy_transpose` and `ew` (permutes in every
/// order, the attention shapes, odd sizes in every element size, expands, slices at odd
/// offsets, cat).
fn copy_cases() -> Vec<Case> {
    let mut rng = Rng::new(41);
    let mut cases = Vec::new();
    let permute = |x: Value, dims: &[usize]| {
        let out = permuted(&x.ty.shape, dims);
        let dtype = x.ty.dtype;
        let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        Case::new(Op::Permute)
            .input(x)
            .ints("dims", &dims)
            .output(dtype, &out)
    };
    let x = rng.f32s(&[2, 3, 4, 5], -1.0, 1.0);
    for dims in orders(4) {
        cases.push(permute(x.clone(), &dims));
    }
    let x = rng.f32s(&[32, 128, 8, 64], -1.0, 1.0);
    cases.push(permute(x.clone(), &[0, 2, 1, 3]));
    cases.push(permute(x, &[0, 1, 3, 2]));
    for dtype in COPY_DTYPES {
        let x = random_of(&mut rng, dtype, &[3, 33, 17]);
        for dims in orders(3) {
            cases.push(permute(x.clone(), &dims));
        }
        let x = random_of(&mut rng, dtype, &[2, 37, 3, 65]);
        for dims in [[0, 2, 1, 3], [0, 1, 3, 2], [3, 0, 1, 2]] {
            cases.push(permute(x.clone(), &dims));
        }
        for (from, to) in [
            (vec![4u64, 1, 64], vec![4u64, 16, 64]),
            (vec![8, 1], vec![8, 32]),
            (vec![3, 1, 17], vec![3, 33, 17]),
            (vec![1, 33, 1], vec![5, 33, 7]),
            (vec![17], vec![3, 33, 17]),
        ] {
            let size: Vec<i64> = to.iter().map(|&v| v as i64).collect();
            cases.push(
                Case::new(Op::Expand)
                    .input(random_of(&mut rng, dtype, &from))
                    .ints("size", &size)
                    .output(dtype, &to),
            );
        }
        // Slices of the innermost dim starting at an odd element: narrow accesses.
        let x = random_of(&mut rng, dtype, &[5, 40]);
        for (start, end, step) in [(1i64, 33i64, 1i64), (3, 40, 1), (1, 40, 2)] {
            let n = ((end - start) + step - 1) / step;
            cases.push(
                Case::new(Op::SliceTensor)
                    .input(x.clone())
                    .int("dim", 1)
                    .int("start", start)
                    .int("end", end)
                    .int("step", step)
                    .output(dtype, &[5, n as u64]),
            );
        }
        cases.push(
            Case::new(Op::Cat)
                .int("tensors.len", 2)
                .int("dim", -1)
                .input(random_of(&mut rng, dtype, &[6, 3, 5]))
                .input(random_of(&mut rng, dtype, &[6, 3, 8]))
                .output(dtype, &[6, 3, 13]),
        );
    }
    cases
}

#[test]
fn the_copy_cases_run_on_the_cpu() {
    for case in copy_cases() {
        case.try_run_on(None).unwrap();
    }
}

/// Layout copies on the GPU, bit for bit against the CPU.
#[test]
fn layout_copies_match_the_cpu_bitwise() {
    let Some(kernels) = kernels("layout_copies", 512 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let mut failures = Vec::new();
    for case in copy_cases() {
        let what = format!(
            "{} of {:?} {:?}",
            case.op(),
            case.input_values()
                .iter()
                .map(|v| (v.ty.dtype, v.ty.shape.clone()))
                .collect::<Vec<_>>(),
            case.graph().nodes[0].attrs
        );
        match (case.try_run_on(None), case.try_run_on(Some(gpu.clone()))) {
            (Ok(want), Ok(got)) => {
                let bits = |v: &Vec<Vec<f64>>| -> Vec<Vec<u64>> {
                    v.iter()
                        .map(|o| o.iter().map(|x| x.to_bits()).collect())
                        .collect()
                };
                if bits(&want) != bits(&got) {
                    let first = want[0]
                        .iter()
                        .zip(&got[0])
                        .position(|(w, g)| w.to_bits() != g.to_bits());
                    failures.push(format!("{what}: differs, first at {first:?}"));
                }
            }
            (w, g) => failures.push(format!("{what}: cpu {:?}, gpu {:?}", w.err(), g.err())),
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures: {failures:#?}",
        failures.len()
    );
}

/// Pointwise ops at shapes that take each index mode of `ew`: flat (contiguous operands,
/// numel-1 operands of any rank; float4 where n is a multiple of 4), broadcast (a bias along the outer dims, an NCHW x [N, C,
/// 1, 1] and x [1, C, 1, 1] along the inner or both, mixed with scalars and full operands,
/// the broadcast operand first or last) and generic ([N, 1, W] against [N, C, W]), at odd
/// sizes. Add, mul, div and where round once from exact or correctly rounded f64 values,
/// so the GPU must match the CPU bit for bit.
fn pointwise_mode_cases() -> Vec<Case> {
    let mut rng = Rng::new(43);
    let mut cases = Vec::new();
    let binary = |op: Op, a: Value, b: Value, out: &[u64]| {
        Case::new(op).input(a).input(b).output(DType::F32, out)
    };
    let shapes: [(&[u64], &[u64], &[u64]); 15] = [
        // Flat, 4 f32 elements a thread (n a multiple of 4).
        (&[64, 100], &[64, 100], &[64, 100]),
        (&[64, 100], &[], &[64, 100]),
        (&[1, 1], &[8, 50], &[8, 50]),
        // Flat, one element a thread.
        (&[3, 1001], &[3, 1001], &[3, 1001]),
        (&[37, 41], &[37, 41], &[37, 41]),
        (&[5, 333], &[], &[5, 333]),
        (&[1, 1], &[7, 13, 3], &[7, 13, 3]),
        // Outer broadcast.
        (&[129, 77], &[77], &[129, 77]),
        (&[1, 77], &[129, 77], &[129, 77]),
        // Inner broadcast and both.
        (&[6, 10, 7, 9], &[6, 10, 1, 1], &[6, 10, 7, 9]),
        (&[6, 10, 7, 9], &[1, 10, 1, 1], &[6, 10, 7, 9]),
        (&[1, 10, 1, 1], &[6, 10, 7, 9], &[6, 10, 7, 9]),
        (&[3, 5, 1], &[1, 1, 11], &[3, 5, 11]),
        // Generic: two walked runs with a broadcast between; and an outer product.
        (&[4, 1, 5], &[4, 3, 5], &[4, 3, 5]),
        (&[6, 1, 4], &[1, 3, 1], &[6, 3, 4]),
    ];
    for (a, b, out) in shapes {
        for op in [Op::AddTensor, Op::MulTensor, Op::DivTensor] {
            let x = rng.f32s(a, -2.0, 2.0);
            let y = if op == Op::DivTensor {
                rng.f32s(b, 0.5, 3.0)
            } else {
                rng.f32s(b, -2.0, 2.0)
            };
            cases.push(binary(op, x, y, out));
        }
    }
    // Mixed, three operands: where(mask [S, S], x [B, H, S, S], fill []) and where(cond
    // [B, 1, 1, S], x [1, H, 1, S] ...) as attention masks lay them out.
    for (c, x, y, out) in [
        (
            &[7u64, 9][..],
            &[6u64, 10, 7, 9][..],
            &[][..],
            &[6u64, 10, 7, 9][..],
        ),
        (
            &[6, 1, 1, 9],
            &[6, 10, 7, 9],
            &[1, 10, 1, 1],
            &[6, 10, 7, 9],
        ),
        (&[6, 10, 7, 9], &[9], &[6, 10, 7, 9], &[6, 10, 7, 9]),
        (
            &[6, 1, 7, 1],
            &[6, 10, 7, 9],
            &[6, 10, 7, 9],
            &[6, 10, 7, 9],
        ),
    ] {
        cases.push(
            Case::new(Op::WhereSelf)
                .input(random_of(&mut rng, DType::Bool, c))
                .input(rng.f32s(x, -2.0, 2.0))
                .input(rng.f32s(y, -2.0, 2.0))
                .output(DType::F32, out),
        );
    }
    cases
}

#[test]
fn the_pointwise_mode_cases_run_on_the_cpu() {
    for case in pointwise_mode_cases() {
        case.try_run_on(None).unwrap();
    }
}

/// Pointwise ops in every index mode on the GPU, bit for bit against the CPU.
#[test]
fn pointwise_index_modes_match_the_cpu_bitwise() {
    let Some(kernels) = kernels("pointwise_index_modes", 256 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let mut failures = Vec::new();
    for case in pointwise_mode_cases() {
        let what = format!(
            "{} of {:?}",
            case.op(),
            case.input_values()
                .iter()
                .map(|v| v.ty.shape.clone())
                .collect::<Vec<_>>()
        );
        match (case.try_run_on(None), case.try_run_on(Some(gpu.clone()))) {
            (Ok(want), Ok(got)) => {
                let first = want[0]
                    .iter()
                    .zip(&got[0])
                    .position(|(w, g)| w.to_bits() != g.to_bits());
                if want[0].len() != got[0].len() || first.is_some() {
                    failures.push(format!("{what}: differs, first at {first:?}"));
                }
            }
            (w, g) => failures.push(format!("{what}: cpu {:?}, gpu {:?}", w.err(), g.err())),
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures: {failures:#?}",
        failures.len()
    );
}

/// Sums, means, maxima and variances over rows, columns, planes (NCHW over (0, 2, 3)) and
/// everything, at sizes that take the single-pass kernels and the split ones (partials in
/// planned scratch, then combined in a fixed order).
fn split_reduction_cases() -> Vec<Case> {
    let mut rng = Rng::new(41);
    let mut layouts: Vec<(Vec<u64>, Vec<i64>)> = Vec::new();
    for n in [1u64, 31, 1000] {
        layouts.push((vec![n, 7], vec![0, 1])); // full
        layouts.push((vec![n, 700], vec![0])); // columns
        layouts.push((vec![5, n * 40], vec![1])); // rows
        layouts.push((vec![n, 5, n], vec![0, 2])); // planes
    }
    layouts.push((vec![4096, 512], vec![0])); // columns: a bias gradient
    layouts.push((vec![4096, 512], vec![0, 1])); // full
    layouts.push((vec![4096, 512], vec![1])); // rows, many
    layouts.push((vec![8, 300_000], vec![1])); // rows, few and long
    layouts.push((vec![32, 64, 56, 56], vec![0, 2, 3])); // planes: batch norm statistics
    layouts.push((vec![32, 2048, 7, 7], vec![0, 2, 3])); // planes, many channels
    let mut cases = Vec::new();
    for (shape, dims) in layouts {
        let x = rng.f32s(&shape, -3.0, 3.0);
        let out: Vec<u64> = (0..shape.len())
            .filter(|d| !dims.contains(&(*d as i64)))
            .map(|d| shape[d])
            .collect();
        for op in [Op::SumDimIntList, Op::MeanDim, Op::Amax, Op::VarCorrection] {
            cases.push(
                Case::new(op)
                    .input(x.clone())
                    .ints("dim", &dims)
                    .output(DType::F32, &out),
            );
        }
        if dims.len() == shape.len() {
            cases.push(Case::new(Op::Mean).input(x.clone()).output(DType::F32, &[]));
        }
    }
    cases
}

/// The reductions against the CPU, and bit for bit the same on a second run (where
/// neither a GPU nor the emulator is usable, the cases still run on the CPU).
#[test]
fn split_reductions_match_the_cpu_and_repeat_bitwise() {
    let Some(kernels) = kernels("split_reductions", 1 << 30) else {
        for case in split_reduction_cases() {
            case.try_run_on(None).unwrap();
        }
        return;
    };
    let gpu = kernels.device();
    let mut failures = Vec::new();
    for case in split_reduction_cases() {
        let shape = case.input_values()[0].ty.shape.clone();
        let got = case.try_run_on(Some(gpu.clone()));
        // A second run on the GPU, whose blocks may finish in any order; the emulator's
        // run in a fixed order, so once is enough there.
        let again = match kernels {
            Kernels::Gpu(_) => case.try_run_on(Some(gpu.clone())),
            Kernels::Host(_) => got.clone(),
        };
        let runs = (case.try_run_on(None), got, again);
        match runs {
            (Ok(want), Ok(got), Ok(again)) => {
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    let scale = w.iter().fold(0.0f64, |s, v| s.max(v.abs())).max(1.0);
                    let worst = g
                        .iter()
                        .zip(w)
                        .map(|(g, w)| {
                            if g.is_nan() && w.is_nan() {
                                0.0
                            } else {
                                (g - w).abs()
                            }
                        })
                        .fold(
                            0.0,
                            |m: f64, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
                        );
                    if g.len() != w.len() || worst > 2e-5 * scale {
                        failures.push(format!(
                            "{} of {shape:?}: output {k} differs by {worst:e} (scale {scale})",
                            case.op()
                        ));
                    }
                }
                let bits = |r: &Vec<Vec<f64>>| -> Vec<Vec<u64>> {
                    r.iter()
                        .map(|o| o.iter().map(|v| v.to_bits()).collect())
                        .collect()
                };
                if bits(&got) != bits(&again) {
                    failures.push(format!("{} of {shape:?}: two runs differ", case.op()));
                }
            }
            (w, g, a) => failures.push(format!(
                "{} of {shape:?}: cpu {:?}, gpu {:?}, again {:?}",
                case.op(),
                w.err(),
                g.err(),
                a.err()
            )),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_background_lane_computes_the_same_and_leaves_the_gpu_to_the_others() {
    let Some(gpu) = gpu("background_lane", 512 << 20) else {
        return;
    };
    // Every GPU CUDA supports has at least two stream priorities.
    assert!(gpu.has_background_priority());
    let gpu = Arc::new(gpu);
    let (n, d, k) = (512, 1024, 512);
    let program = Program::new(samples::regression(n, d, k, 0.01), &Limits::default()).unwrap();
    let plan = program.plan().clone();
    let lane_bytes = plan.ephemeral_bytes.div_ceil(256) * 256;
    let block = plan.persistent_bytes.div_ceil(256) * 256;
    let mut rng = Rng::new(5);
    let mut data = |len: u64| {
        bytes_f32(
            &rng.vec(len as usize, -1.0, 1.0)
                .iter()
                .map(|&v| v as f32)
                .collect::<Vec<_>>(),
        )
    };
    let (x, y) = (data(n * d), data(n * k));
    let foreground = Placement {
        persistent: 0,
        lane: 2 * block,
    };
    let background = Placement {
        persistent: block,
        lane: 2 * block + lane_bytes,
    };
    let zeros = vec![0u8; plan.persistent_bytes as usize];
    gpu.write(0, &zeros).unwrap();
    gpu.write(block, &zeros).unwrap();
    let low = salus_exec::RunControl::background(1.0);
    // The same steps from the same state give the same losses at either priority.
    for _ in 0..3 {
        let a = gpu.run(&program, foreground, &[&x, &y]).unwrap();
        let b = gpu.run_with(&program, background, &[&x, &y], &low).unwrap();
        assert_eq!(a.fetches, b.fetches);
    }
    // How much a background lane running flat out slows the foreground one (printed for
    // scripts/gpu-check.sh; the GPU's block scheduler decides, so nothing is asserted).
    let steps = 30;
    let alone = Instant::now();
    for _ in 0..steps {
        gpu.run(&program, foreground, &[&x, &y]).unwrap();
    }
    let alone = alone.elapsed();
    let done = std::sync::atomic::AtomicBool::new(false);
    let beside = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                gpu.run_with(&program, background, &[&x, &y], &low).unwrap();
            }
        });
        let t = Instant::now();
        for _ in 0..steps {
            gpu.run(&program, foreground, &[&x, &y]).unwrap();
        }
        let beside = t.elapsed();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        beside
    });
    eprintln!(
        "background lane: foreground {steps} steps alone {alone:?}, beside a background lane \
         {beside:?} ({:.2}x)",
        beside.as_secs_f64() / alone.as_secs_f64()
    );
    // NVML reads the GPU's load where the host has it.
    match gpu.load_monitor() {
        Ok(mut monitor) => {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let load = monitor.read().unwrap();
            eprintln!("background lane: NVML load {load:?}");
            assert!(load.sm_clock.is_some() || load.sm_activity.is_some());
            if let Some((clock, highest)) = load.sm_clock {
                assert!(clock > 0.0 && clock <= highest * 1.01, "{load:?}");
            }
            if let Some(activity) = load.sm_activity {
                assert!((0.0..=1.0).contains(&activity), "{load:?}");
            }
        }
        Err(why) => eprintln!("background lane: no NVML load ({why})"),
    }
}

/// Attention's heads split from one projection and put back: `qkv` [2, 4, 18] ([B, S,
/// 3 H D] with H 2, D 3) split in three, each viewed as [2, 4, 2, 3] and put heads first
/// (the forward), times 2, then each put back as [B, S, H, D], viewed as [2, 4, 6] and cat
/// with a feed between (the backward's mirror). The CUDA device plans it with the folded
/// reads (each permute copies from the projection; the cat copies from the scaled heads),
/// and must give the CPU's elements bit for bit.
#[test]
fn folded_head_splits_and_cats_match_the_cpu_bitwise() {
    let Some(kernels) = kernels("folded_heads", 64 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let ints = |v: &[i64]| Attr::Ints(v.to_vec());
    let mut tensors = vec![
        f32t("qkv", &[2, 4, 18], Role::Feed),
        f32t("mid", &[2, 4, 5], Role::Feed),
    ];
    let mut nodes = vec![Node {
        name: "split".into(),
        op: Op::SplitWithSizes,
        inputs: vec![Some(0)],
        outputs: vec![Some(2), Some(3), Some(4)],
        attrs: [
            ("split_sizes".to_string(), ints(&[6, 6, 6])),
            ("dim".to_string(), Attr::Int(-1)),
        ]
        .into_iter()
        .collect(),
        source: String::new(),
    }];
    for k in 0..3 {
        tensors.push(f32t(&format!("part{k}"), &[2, 4, 6], Role::Intermediate));
    }
    let mut back = Vec::new();
    for k in 0..3 {
        let at = tensors.len();
        for (name, shape) in [
            ("heads", &[2u64, 4, 2, 3][..]),
            ("first", &[2, 2, 4, 3]),
            ("scaled", &[2, 2, 4, 3]),
            ("last", &[2, 4, 2, 3]),
            ("rows", &[2, 4, 6]),
        ] {
            tensors.push(f32t(&format!("{name}{k}"), shape, Role::Intermediate));
        }
        let dims = || ("dims", ints(&[0, 2, 1, 3]));
        nodes.push(pointwise(
            Op::View,
            &[2 + k],
            at,
            &[("size", ints(&[2, 4, 2, 3]))],
        ));
        nodes.push(pointwise(Op::Permute, &[at], at + 1, &[dims()]));
        nodes.push(pointwise(
            Op::MulScalar,
            &[at + 1],
            at + 2,
            &[("other", Attr::Float(2.0))],
        ));
        nodes.push(pointwise(Op::Permute, &[at + 2], at + 3, &[dims()]));
        nodes.push(pointwise(
            Op::View,
            &[at + 3],
            at + 4,
            &[("size", ints(&[2, 4, 6]))],
        ));
        back.push(at + 4);
    }
    let out = tensors.len();
    tensors.push(f32t("out", &[2, 4, 23], Role::Intermediate));
    let mut cat = pointwise(
        Op::Cat,
        &[back[0], 1, back[1], back[2]],
        out,
        &[("tensors.len", Attr::Int(4)), ("dim", Attr::Int(-1))],
    );
    cat.name = "cat".into();
    nodes.push(cat);
    let graph = Graph {
        tensors,
        nodes,
        fetches: vec![out],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let mut rng = Rng::new(47);
    let feeds: Vec<Vec<u8>> = [2 * 4 * 18, 2 * 4 * 5]
        .iter()
        .map(|&n| {
            let v: Vec<f32> = rng.vec(n, -1.0, 1.0).iter().map(|&v| v as f32).collect();
            bytes_f32(&v)
        })
        .collect();
    let refs: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
    let run = |device: &dyn Device, program: &Program| {
        let plan = program.plan();
        let at = Placement {
            persistent: 0,
            lane: plan.persistent_bytes.div_ceil(256) * 256,
        };
        device.run(program, at, &refs).unwrap().fetches
    };
    let cpu = CpuDevice::new(16 << 20).unwrap();
    let want = run(
        &cpu,
        &Program::new(graph.clone(), &Limits::default()).unwrap(),
    );
    let program = Program::for_device(graph, &Limits::default(), &*gpu).unwrap();
    let got = run(&*gpu, &program);
    assert_eq!(got, want, "the GPU's elements differ from the CPU's");
    // The element at [1, 3, k]: qkv's then mid's, scaled, in the cat's order.
    let q = |i: usize| f32::from_le_bytes(feeds[0][i * 4..i * 4 + 4].try_into().unwrap());
    let first = f32::from_le_bytes(want[0][(23 * 7) * 4..(23 * 7) * 4 + 4].try_into().unwrap());
    assert_eq!(first, 2.0 * q(18 * 7));
}

/// Scatters that start from a fill (cross-entropy's backward: zeros, then each row's
/// target; a max-scatter from -inf): the CUDA device fills their outputs instead of
/// copying the fill, and must give the CPU's elements bit for bit.
#[test]
fn scatters_into_fills_match_the_cpu_bitwise() {
    let Some(kernels) = kernels("scatters_into_fills", 64 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let tensors = vec![
        f32t("logits", &[5, 7], Role::Feed),
        Tensor {
            name: "target".into(),
            ty: TensorType::new(DType::I64, vec![5, 1]),
            role: Role::Feed,
            data: vec![],
        },
        f32t("src", &[5, 1], Role::Feed),
        f32t("zeros", &[5, 7], Role::Intermediate),
        f32t("one_hot", &[5, 7], Role::Intermediate),
        f32t("halves", &[5, 7], Role::Intermediate),
        f32t("added", &[5, 7], Role::Intermediate),
        f32t("lowest", &[5, 7], Role::Intermediate),
        f32t("largest", &[5, 7], Role::Intermediate),
    ];
    let nodes = vec![
        pointwise(Op::FullLike, &[0], 3, &[("fill_value", Attr::Float(0.0))]),
        pointwise(
            Op::ScatterValue,
            &[3, 1],
            4,
            &[("dim", Attr::Int(1)), ("value", Attr::Float(-0.25))],
        ),
        pointwise(Op::FullLike, &[0], 5, &[("fill_value", Attr::Float(1.5))]),
        pointwise(Op::ScatterAdd, &[5, 1, 2], 6, &[("dim", Attr::Int(1))]),
        pointwise(
            Op::FullLike,
            &[0],
            7,
            &[("fill_value", Attr::Float(f64::NEG_INFINITY))],
        ),
        pointwise(
            Op::ScatterReduce,
            &[7, 1, 2],
            8,
            &[("dim", Attr::Int(1)), ("reduce", Attr::Str("amax".into()))],
        ),
    ];
    let graph = Graph {
        tensors,
        nodes,
        fetches: vec![4, 6, 8],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let logits = bytes_f32(&[0.5; 35]);
    let target: Vec<u8> = [3i64, 0, 6, 6, 2]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let src = bytes_f32(&[1.0, -2.0, 0.25, 4.0, 8.0]);
    let refs: Vec<&[u8]> = vec![&logits, &target, &src];
    let run = |device: &dyn Device, program: &Program| {
        let lane = program.plan().persistent_bytes.div_ceil(256) * 256;
        let at = Placement {
            persistent: 0,
            lane,
        };
        device.run(program, at, &refs).unwrap().fetches
    };
    let cpu = CpuDevice::new(16 << 20).unwrap();
    let want = run(
        &cpu,
        &Program::new(graph.clone(), &Limits::default()).unwrap(),
    );
    let got = run(
        &*gpu,
        &Program::for_device(graph, &Limits::default(), &*gpu).unwrap(),
    );
    assert_eq!(got, want, "the GPU's elements differ from the CPU's");
    let one_hot = f32s(&want[0]);
    assert_eq!((one_hot[3], one_hot[4], one_hot[7]), (-0.25, 0.0, -0.25));
    let added = f32s(&want[1]);
    assert_eq!(
        (added[3], added[4], added[20], added[27]),
        (2.5, 1.5, 1.75, 5.5)
    );
    let largest = f32s(&want[2]);
    assert_eq!(
        (largest[3], largest[4], largest[27], largest[30]),
        (1.0, f64::NEG_INFINITY, 4.0, 8.0)
    );
}

/// The session generator's draws (`bernoulli.p`, `rand_like` in every float dtype) are
/// the CPU device's, bit for bit: a session moved between devices draws the same.
#[test]
fn random_draws_match_the_cpu_bitwise() {
    let Some(kernels) = kernels("random_draws", 64 << 20) else {
        return;
    };
    let gpu = kernels.device();
    let state = Value {
        ty: TensorType::new(DType::I64, vec![]),
        data: vec![12345.0],
    };
    let mut cases = vec![
        Case::new(Op::BernoulliP)
            .input(Value {
                ty: TensorType::new(DType::F32, vec![3000]),
                data: vec![0.0; 3000],
            })
            .input(state.clone())
            .float("p", 0.3)
            .output(DType::F32, &[3000]),
    ];
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        cases.push(
            Case::new(Op::RandLike)
                .input(Value {
                    ty: TensorType::new(dtype, vec![5, 601]),
                    data: vec![0.0; 3005],
                })
                .input(state.clone())
                .output(dtype, &[5, 601]),
        );
    }
    for case in cases {
        let want = case.try_run_on(None).unwrap();
        let got = case.try_run_on(Some(gpu.clone())).unwrap();
        assert_eq!(got, want, "{}", case.op());
    }
}
