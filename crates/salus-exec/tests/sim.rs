//! The sim device: modeled time, accounted memory, the same exclusivity and feed checks
//! as the real devices.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use salus_exec::{CostModel, Device, ExecError, Placement, Program, SimDevice};
use salus_graph::Limits;
use salus_graph::samples::regression;

fn program(n: u64, d: u64, k: u64) -> Program {
    Program::new(regression(n, d, k, 0.1), &Limits::default()).unwrap()
}

fn feeds(p: &Program) -> Vec<Vec<u8>> {
    p.feeds()
        .iter()
        .map(|&id| vec![0; p.bytes(id) as usize])
        .collect()
}

fn run(device: &SimDevice, p: &Program, at: Placement) -> Result<salus_exec::Outcome, ExecError> {
    let feeds = feeds(p);
    let views: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
    device.run(p, at, &views)
}

#[test]
fn an_iteration_takes_the_clients_expected_time() {
    let device = SimDevice::new(1 << 30, CostModel::default());
    let p = program(8, 4, 2).with_expected_iteration(Some(Duration::from_millis(30)));
    let at = Placement {
        persistent: 0,
        lane: 1 << 20,
    };
    let start = Instant::now();
    let out = run(&device, &p, at).unwrap();
    assert_eq!(out.duration, Duration::from_millis(30));
    assert!(start.elapsed() >= Duration::from_millis(30));
    assert_eq!(out.fetches, vec![vec![0u8; 4]], "a zero-filled loss");
}

#[test]
fn without_a_hint_the_cost_model_scales_with_the_work() {
    let model = CostModel {
        flops_per_s: 1e9,
        bytes_per_s: 1e12,
        per_node: Duration::ZERO,
    };
    // Two products of n x d x k multiply-adds dominate: 2 * 2 * n * d * k flops.
    let small = model.iteration(&program(64, 64, 64));
    let large = model.iteration(&program(128, 128, 128));
    let expected_small = 4.0 * 64f64.powi(3) / 1e9;
    assert!(
        (small.as_secs_f64() - expected_small).abs() < 0.1 * expected_small,
        "{small:?} vs {expected_small} s"
    );
    let ratio = large.as_secs_f64() / small.as_secs_f64();
    assert!(
        (7.0..9.0).contains(&ratio),
        "8x the flops, {ratio}x the time"
    );
}

#[test]
fn memory_is_accounted_not_kept() {
    let device = SimDevice::new(1 << 20, CostModel::default());
    device.write(0, &[7; 64]).unwrap();
    assert_eq!(device.read(0, 64).unwrap(), vec![0; 64]);
    let out_of_range = device.read((1 << 20) - 8, 64).unwrap_err();
    assert!(
        out_of_range.to_string().contains("outside the arena"),
        "{out_of_range}"
    );
}

#[test]
fn feeds_and_overlapping_lanes_are_refused() {
    let device = std::sync::Arc::new(SimDevice::new(1 << 30, CostModel::default()));
    let p = std::sync::Arc::new(
        program(8, 4, 2).with_expected_iteration(Some(Duration::from_millis(200))),
    );
    let err = device
        .run(
            &p,
            Placement {
                persistent: 0,
                lane: 4096,
            },
            &[&[0u8; 3]],
        )
        .unwrap_err();
    assert!(err.to_string().contains("takes 2 feeds, 1 given"), "{err}");
    // A second iteration in the lane of one still running is refused.
    let running = {
        let (device, p) = (device.clone(), p.clone());
        std::thread::spawn(move || {
            run(
                &device,
                &p,
                Placement {
                    persistent: 0,
                    lane: 4096,
                },
            )
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let clash = run(
        &device,
        &p,
        Placement {
            persistent: 1024,
            lane: 4096,
        },
    )
    .unwrap_err();
    assert!(clash.to_string().contains("in use"), "{clash}");
    running.join().unwrap().unwrap();
}

/// One `convolution` (or `convolution_backward` with `output_mask`) of a 3x3 kernel,
/// stride 1, padding 1, on `[2, 8, 32, 32]` to 16 channels in `groups` groups.
fn convolution(groups: u64, output_mask: Option<[bool; 3]>) -> Program {
    use salus_graph::{Attr, DType, Graph, Node, Op, Role, Tensor, TensorType};
    let t = |name: &str, shape: &[u64]| Tensor {
        name: name.into(),
        ty: TensorType::new(DType::F32, shape.to_vec()),
        role: Role::Feed,
        data: vec![],
    };
    let mut attrs: std::collections::BTreeMap<String, Attr> = [
        ("stride", Attr::Ints(vec![1])),
        ("padding", Attr::Ints(vec![1])),
        ("dilation", Attr::Ints(vec![1])),
        ("groups", Attr::Int(groups as i64)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let (x, w, y) = ([2, 8, 32, 32], [16, 8 / groups, 3, 3], [2, 16, 32, 32]);
    let intermediate = |mut t: Tensor| {
        t.role = Role::Intermediate;
        t
    };
    let (tensors, node) = match output_mask {
        None => (
            vec![t("x", &x), t("w", &w), intermediate(t("y", &y))],
            Node {
                name: "conv".into(),
                op: Op::Convolution,
                inputs: vec![Some(0), Some(1), None],
                outputs: vec![Some(2)],
                attrs,
                source: String::new(),
            },
        ),
        Some(mask) => {
            attrs.insert("output_mask".into(), Attr::Bools(mask.to_vec()));
            let outputs = (0..3).map(|i| mask[i].then_some(3 + i)).collect();
            (
                vec![
                    t("gy", &y),
                    t("x", &x),
                    t("w", &w),
                    intermediate(t("gx", &x)),
                    intermediate(t("gw", &w)),
                    intermediate(t("gb", &[16])),
                ],
                Node {
                    name: "conv_backward".into(),
                    op: Op::ConvolutionBackward,
                    inputs: vec![Some(0), Some(1), Some(2)],
                    outputs,
                    attrs,
                    source: String::new(),
                },
            )
        }
    };
    let fetches = node.outputs.iter().flatten().copied().collect();
    let graph = Graph {
        tensors,
        nodes: vec![node],
        fetches,
        updates: vec![],
        precision: Default::default(),
    };
    Program::new(graph, &Limits::default()).unwrap()
}

#[test]
fn a_convolution_costs_its_multiply_adds() {
    let model = CostModel {
        flops_per_s: 1e9,
        bytes_per_s: 1e15,
        per_node: Duration::ZERO,
    };
    // Each of the 2 x 16 x 32 x 32 outputs sums 8/groups x 3 x 3 products.
    let seconds = |p: &Program| model.iteration(p).as_secs_f64();
    let products = |groups: f64| 2.0 * 16.0 * 32.0 * 32.0 * (8.0 / groups) * 9.0;
    for groups in [1, 4] {
        let expected = 2.0 * products(groups as f64) / 1e9;
        let forward = seconds(&convolution(groups, None));
        assert!(
            (forward - expected).abs() < 1e-3 * expected,
            "groups {groups}: {forward} s vs {expected} s"
        );
    }
    // The backward makes one such product per gradient of the input and the weight.
    let both = seconds(&convolution(1, Some([true, true, true])));
    let weight_only = seconds(&convolution(1, Some([false, true, true])));
    let expected = 2.0 * 2.0 * products(1.0) / 1e9;
    assert!(
        (both - expected).abs() < 1e-3 * expected,
        "{both} s vs {expected} s"
    );
    assert!(
        (weight_only - expected / 2.0).abs() < 1e-3 * expected,
        "{weight_only} s vs {} s",
        expected / 2.0
    );
}
