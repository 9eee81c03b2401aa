//! The static memory planner: no two live tensors overlap, offsets are aligned, memory is
//! reused, and E stays close to the lower bound.

#![allow(clippy::unwrap_used)]

mod common;

use common::Builder;
use proptest::prelude::*;
use salus_graph::plan::{ALIGNMENT, Buffer, place};
use salus_graph::{Attr, DType, Graph, Limits, MemoryPlan, Op, Role, check};

/// Checks the plan against the graph: every pair of tensors whose lifetimes overlap and
/// that do not share a buffer occupy disjoint bytes; everything is aligned and inside E.
fn assert_sound(graph: &Graph, plan: &MemoryPlan) {
    for b in &plan.buffers {
        assert_eq!(b.offset % ALIGNMENT, 0, "{b:?}");
        assert_eq!(b.size % ALIGNMENT, 0, "{b:?}");
        assert!(b.offset + b.size <= plan.ephemeral_bytes);
    }
    for (i, a) in plan.buffers.iter().enumerate() {
        for b in &plan.buffers[i + 1..] {
            let live_together = a.first <= b.last && b.first <= a.last;
            let overlap = a.offset < b.offset + b.size && b.offset < a.offset + a.size;
            assert!(!(live_together && overlap), "{a:?} and {b:?} collide");
        }
    }
    assert!(plan.ephemeral_bytes >= plan.lower_bound);
    for (id, t) in graph.tensors.iter().enumerate() {
        assert_eq!(
            t.role.is_persistent(),
            plan.persistent_offsets[id].is_some()
        );
    }
}

#[test]
fn a_chain_reuses_memory() {
    // x -> mm -> mm -> mm ...: only two activations are ever live at once.
    let mut g = Builder::default();
    let mut x = g.f32("x", &[64, 64], Role::Feed);
    for i in 0..8 {
        let w = g.f32(&format!("w{i}"), &[64, 64], Role::Parameter);
        x = g.node(Op::Mm, &[Some(x), Some(w)], &[(DType::F32, &[64, 64])], &[])[0];
    }
    g.graph.fetches = vec![x];
    let plan = check(&g.graph, &Limits::default()).unwrap().plan;
    assert_sound(&g.graph, &plan);
    let act = 64 * 64 * 4;
    assert_eq!(plan.persistent_bytes, 8 * act);
    assert_eq!(plan.lower_bound, 2 * act);
    assert_eq!(plan.ephemeral_bytes, 2 * act);
}

#[test]
fn views_share_their_input_and_elementwise_ops_run_in_place() {
    let mut g = Builder::default();
    let x = g.f32("x", &[8, 32], Role::Feed);
    let v = g.node(
        Op::View,
        &[Some(x)],
        &[(DType::F32, &[256])],
        &[("size", Attr::Ints(vec![256]))],
    )[0];
    let r = g.node(Op::Relu, &[Some(v)], &[(DType::F32, &[256])], &[])[0];
    let e = g.node(Op::Exp, &[Some(r)], &[(DType::F32, &[256])], &[])[0];
    g.graph.fetches = vec![e];
    let plan = check(&g.graph, &Limits::default()).unwrap().plan;
    assert_sound(&g.graph, &plan);
    assert_eq!(plan.buffers.len(), 1, "{:?}", plan.buffers);
    assert_eq!(plan.ephemeral_bytes, 1024);
    assert_eq!(plan.lane_offset(x), plan.lane_offset(e));
}

#[test]
fn no_in_place_write_over_a_tensor_still_needed() {
    let mut g = Builder::default();
    let x = g.f32("x", &[256], Role::Feed);
    let r = g.node(Op::Relu, &[Some(x)], &[(DType::F32, &[256])], &[])[0];
    let s = g.node(
        Op::AddTensor,
        &[Some(r), Some(x)],
        &[(DType::F32, &[256])],
        &[],
    )[0];
    g.graph.fetches = vec![s];
    let plan = check(&g.graph, &Limits::default()).unwrap().plan;
    assert_sound(&g.graph, &plan);
    assert_ne!(
        plan.lane_offset(x),
        plan.lane_offset(r),
        "x is read again by the add"
    );
    // The add is the last reader of both: it may overwrite one of them.
    assert_eq!(plan.buffers.len(), 2);
}

#[test]
fn a_view_keeps_its_input_alive() {
    let mut g = Builder::default();
    let x = g.f32("x", &[4, 64], Role::Feed);
    let v = g.node(
        Op::View,
        &[Some(x)],
        &[(DType::F32, &[256])],
        &[("size", Attr::Ints(vec![256]))],
    )[0];
    let a = g.node(Op::Exp, &[Some(x)], &[(DType::F32, &[4, 64])], &[])[0];
    let b = g.node(Op::Neg, &[Some(v)], &[(DType::F32, &[256])], &[])[0];
    g.graph.fetches = vec![a, b];
    let plan = check(&g.graph, &Limits::default()).unwrap().plan;
    assert_sound(&g.graph, &plan);
    // exp must not write over x: the view v of x is read afterwards.
    assert_ne!(plan.lane_offset(a), plan.lane_offset(x));
}

#[test]
fn fetches_and_update_values_live_to_the_end() {
    let mut g = Builder::default();
    let x = g.f32("x", &[256], Role::Feed);
    let w = g.f32("w", &[256], Role::Parameter);
    let w2 = g.node(
        Op::MulTensor,
        &[Some(w), Some(x)],
        &[(DType::F32, &[256])],
        &[],
    )[0];
    let y = g.node(Op::Exp, &[Some(x)], &[(DType::F32, &[256])], &[])[0];
    g.graph.updates = vec![salus_graph::Update {
        target: w,
        value: w2,
    }];
    g.graph.fetches = vec![y];
    let plan = check(&g.graph, &Limits::default()).unwrap().plan;
    assert_sound(&g.graph, &plan);
    assert_ne!(plan.lane_offset(w2), plan.lane_offset(y));
}

proptest! {
    /// Random interval sets: the placement never overlaps two live buffers.
    #[test]
    fn placement_never_overlaps(spec in prop::collection::vec((1u64..5000, 0usize..60, 0usize..20), 1..200)) {
        let mut buffers: Vec<Buffer> = spec
            .iter()
            .map(|&(size, first, len)| Buffer {
                offset: 0,
                size: size.div_ceil(ALIGNMENT) * ALIGNMENT,
                first,
                last: first + len,
            })
            .collect();
        let top = place(&mut buffers);
        for (i, a) in buffers.iter().enumerate() {
            prop_assert!(a.offset + a.size <= top);
            for b in &buffers[i + 1..] {
                let live = a.first <= b.last && b.first <= a.last;
                let overlap = a.offset < b.offset + b.size && b.offset < a.offset + a.size;
                prop_assert!(!(live && overlap), "{:?} {:?}", a, b);
            }
        }
    }

    /// Random graphs of elementwise ops, views and matrix products over random earlier
    /// tensors: valid, and their plans sound.
    #[test]
    fn random_graphs_plan_soundly(steps in prop::collection::vec((0u8..5, any::<usize>(), any::<usize>()), 1..60)) {
        let mut g = Builder::default();
        let mut live = vec![g.f32("x0", &[16, 16], Role::Feed), g.f32("x1", &[16, 16], Role::Feed)];
        let w = g.f32("w", &[16, 16], Role::Parameter);
        for (kind, a, b) in steps {
            let (a, b) = (live[a % live.len()], live[b % live.len()]);
            let out = match kind {
                0 => g.node(Op::Relu, &[Some(a)], &[(DType::F32, &[16, 16])], &[]),
                1 => g.node(Op::AddTensor, &[Some(a), Some(b)], &[(DType::F32, &[16, 16])], &[]),
                2 => g.node(Op::Mm, &[Some(a), Some(w)], &[(DType::F32, &[16, 16])], &[]),
                3 => g.node(Op::View, &[Some(a)], &[(DType::F32, &[16, 16])], &[("size", Attr::Ints(vec![16, -1]))]),
                _ => g.node(Op::MulScalar, &[Some(a)], &[(DType::F32, &[16, 16])], &[("other", Attr::Float(2.0))]),
            };
            live.push(out[0]);
        }
        let n = live.len();
        g.graph.fetches = vec![live[n - 1], live[n / 2]];
        let checked = check(&g.graph, &Limits::default()).unwrap();
        assert_sound(&g.graph, &checked.plan);
        // Tensors that share a buffer never hold different values at once: a tensor
        // written into a buffer must come after the last read of what it replaces, unless
        // it is a view of it.
        let plan = &checked.plan;
        for (i, node) in g.graph.nodes.iter().enumerate() {
            for &out in node.outputs.iter().flatten() {
                let buf = plan.buffer_of[out];
                for (id, _) in g.graph.tensors.iter().enumerate() {
                    if id == out || plan.buffer_of[id] != buf || buf.is_none() {
                        continue;
                    }
                    let is_input = node.inputs.contains(&Some(id));
                    let read_later = g.graph.nodes[i + 1..].iter().any(|n| n.inputs.contains(&Some(id)))
                        || g.graph.fetches.contains(&id);
                    let view = matches!(node.op, Op::View);
                    prop_assert!(view || !read_later || !is_input || id == out,
                        "node {} writes over tensor {} that is read later", i, id);
                }
            }
        }
    }
}

/// A 2-d f32 convolution (3x3 kernel, not pointwise) and its backward.
fn conv_net() -> Graph {
    conv_net_of(DType::F32)
}

/// [`conv_net`] over `dtype`.
fn conv_net_of(dtype: DType) -> Graph {
    conv_net_sized(dtype, 16)
}

/// [`conv_net`] over `dtype`, on `hw x hw` images.
fn conv_net_sized(dtype: DType, hw: u64) -> Graph {
    let mut g = Builder::default();
    let x = g.tensor("x", dtype, &[8, 3, hw, hw], Role::Feed);
    let w = g.tensor("w", dtype, &[4, 3, 3, 3], Role::Parameter);
    let attrs = [
        ("stride", Attr::Ints(vec![1, 1])),
        ("padding", Attr::Ints(vec![1, 1])),
        ("dilation", Attr::Ints(vec![1, 1])),
        ("transposed", Attr::Bool(false)),
        ("output_padding", Attr::Ints(vec![0, 0])),
        ("groups", Attr::Int(1)),
    ];
    let y = g.node(
        Op::Convolution,
        &[Some(x), Some(w), None],
        &[(dtype, &[8, 4, hw, hw])],
        &attrs,
    )[0];
    let mut back = attrs.to_vec();
    back.push(("bias_sizes", Attr::Ints(vec![4])));
    back.push(("output_mask", Attr::Bools(vec![true, true, false])));
    let grads = g.node(
        Op::ConvolutionBackward,
        &[Some(y), Some(x), Some(w)],
        &[(dtype, &[8, 3, hw, hw]), (dtype, &[4, 3, 3, 3])],
        &back,
    );
    g.graph.nodes[1].outputs.push(None); // no bias gradient
    g.graph.fetches = grads;
    g.graph
}

#[test]
fn the_portable_scratch_is_what_plain_planning_gives() {
    use salus_graph::{PortableScratch, check_with};
    let graph = conv_net();
    let plain = check(&graph, &Limits::default()).unwrap().plan;
    let portable = check_with(&graph, &Limits::default(), &PortableScratch)
        .unwrap()
        .plan;
    assert_eq!(plain, portable);
    // The CPU's im2col scratch, as before device-aware sizing: 4 images unfolded, k = 27,
    // l = 256 (forward); twice that plus the weight's gradient per slot (backward).
    let (k, l) = (27u64, 256u64);
    assert_eq!(
        plain.scratch(0).unwrap().1,
        (4 * k * l * 4).div_ceil(256) * 256
    );
    let backward = 4 * (2 * k * l + 4 * k) * 4;
    assert_eq!(plain.scratch(1).unwrap().1, backward.div_ceil(256) * 256);
    assert_eq!(plain.scratch_bytes, backward.div_ceil(256) * 256);
}

#[test]
fn small_planes_plan_their_images_side_by_side() {
    // 4x4 output planes (l = 16): the 8 images go into one product (256 columns wanted,
    // 128 there are) in one slot, with room for the product's result before it is spread
    // over the images (4 channels x 128 columns).
    let plan = check(&conv_net_sized(DType::F32, 4), &Limits::default())
        .unwrap()
        .plan;
    let (k, cols, c_out) = (27u64, 8 * 16u64, 4u64);
    let forward = (k * cols + c_out * cols) * 4;
    assert_eq!(plan.scratch(0).unwrap().1, forward.div_ceil(256) * 256);
    let backward = (2 * k * cols + c_out * cols + c_out * k) * 4;
    assert_eq!(plan.scratch(1).unwrap().1, backward.div_ceil(256) * 256);
}

#[test]
fn a_transposed_convolution_plans_its_adjoints_backward() {
    // [2, 4, 3, 3] up to [2, 3, 6, 6] (stride 2, padding 1, output padding 1): its
    // adjoint maps 6x6 planes of 3 channels to 3x3 planes of 4 (k = 27, l = 9), both
    // images in one product (18 columns), one slot: the unfolded input and its gradient,
    // the gathered output gradient and a partial weight gradient.
    let mut g = Builder::default();
    let x = g.tensor("x", DType::F32, &[2, 4, 3, 3], Role::Feed);
    let w = g.tensor("w", DType::F32, &[4, 3, 3, 3], Role::Parameter);
    let attrs = [
        ("stride", Attr::Ints(vec![2, 2])),
        ("padding", Attr::Ints(vec![1, 1])),
        ("dilation", Attr::Ints(vec![1, 1])),
        ("transposed", Attr::Bool(true)),
        ("output_padding", Attr::Ints(vec![1, 1])),
        ("groups", Attr::Int(1)),
    ];
    let y = g.node(
        Op::Convolution,
        &[Some(x), Some(w), None],
        &[(DType::F32, &[2, 3, 6, 6])],
        &attrs,
    );
    g.graph.fetches = y;
    let plan = check(&g.graph, &Limits::default()).unwrap().plan;
    let (k, cols, c_out_adjoint) = (27u64, 18u64, 4u64);
    let bytes = (2 * k * cols + c_out_adjoint * cols + c_out_adjoint * k) * 4;
    assert_eq!(plan.scratch(0).unwrap().1, bytes.div_ceil(256) * 256);
}

#[test]
fn a_16_bit_convolution_plans_its_operands_widened_to_f32() {
    // The CPU runs it with the f32 kernel: each input and used output in f32, then the
    // f32 kernel's own scratch (as in `the_portable_scratch_is_what_plain_planning_gives`).
    let (k, l) = (27u64, 256u64);
    let (x, w, y) = (8 * 3 * 16 * 16u64, 4 * 27u64, 8 * 4 * 16 * 16u64);
    let round = |b: u64| b.div_ceil(256) * 256;
    for dtype in [DType::F16, DType::Bf16] {
        let plan = check(&conv_net_of(dtype), &Limits::default()).unwrap().plan;
        let forward = 4 * (x + w + y) + 4 * k * l * 4;
        assert_eq!(plan.scratch(0).unwrap().1, round(forward), "{dtype}");
        // Inputs (gradient, x, w), then the two gradients asked for.
        let backward = 4 * (y + x + w + x + w) + 4 * (2 * k * l + 4 * k) * 4;
        assert_eq!(plan.scratch(1).unwrap().1, round(backward), "{dtype}");
    }
}

#[test]
fn a_device_sizer_sets_each_nodes_scratch_and_e_follows() {
    use salus_graph::{OpParams, ScratchSizer, check_with};
    /// A device whose convolutions want 1000 bytes and whose backward wants none.
    struct Device;
    impl ScratchSizer for Device {
        fn scratch_bytes(&self, graph: &Graph, node: usize, _: &OpParams) -> u64 {
            if graph.nodes[node].op == Op::Convolution {
                1000
            } else {
                0
            }
        }
    }
    let graph = conv_net();
    let plan = check_with(&graph, &Limits::default(), &Device)
        .unwrap()
        .plan;
    assert_sound(&graph, &plan);
    assert_eq!(plan.scratch(0).unwrap().1, 1024);
    assert_eq!(plan.scratch(1), None);
    assert_eq!(plan.scratch_bytes, 1024);
    let plain = check(&graph, &Limits::default()).unwrap().plan;
    assert!(plan.ephemeral_bytes < plain.ephemeral_bytes);
    assert!(plan.ephemeral_bytes >= plan.lower_bound);
}
