//! Lowering without a GPU: command lists of small programs at made-up addresses.

use std::collections::BTreeMap;

use salus_graph::{Attr, Graph, Limits, Node, Role, Tensor, samples};

use super::elementwise::{StridedView, coalesce, fast_index, index_mode};
use super::*;
use crate::abi::{AttentionArgs, AttentionSeedArgs, ConvArgs, PoolArgs};

fn view(st: Vec<i64>) -> StridedView {
    StridedView { ptr: 0, dt: 0, st }
}

#[test]
fn coalescing_merges_contiguous_dims_and_keeps_broadcasts() {
    let shape = [2u64, 3, 4];
    let mut ops = vec![view(contiguous(&shape)), view(contiguous(&shape))];
    assert_eq!(coalesce(&shape, &mut ops), vec![24]);
    assert_eq!(ops[0].st, vec![1]);
    let mut ops = vec![view(contiguous(&shape)), view(broadcast(&[4], &shape))];
    assert_eq!(coalesce(&shape, &mut ops), vec![6, 4]);
    assert_eq!(ops[1].st, vec![0, 1]);
    let mut ops = vec![view(vec![12, 4, 1])];
    assert_eq!(coalesce(&[1, 1, 1], &mut ops), Vec::<u64>::new());
}

/// The index mode and fast indices of `out = op(ins...)` over `shape`, after coalescing
/// (the output dense, each input broadcast from its own shape).
fn mode_of(shape: &[u64], ins: &[&[u64]]) -> (crate::abi::IndexMode, Vec<(i64, i64)>, Vec<u64>) {
    let mut ops = vec![view(contiguous(shape))];
    ops.extend(ins.iter().map(|s| view(broadcast(s, shape))));
    let coalesced = coalesce(shape, &mut ops);
    let (mode, fast) = index_mode(&coalesced, &ops, 0..1);
    (mode, fast, coalesced)
}

#[test]
fn index_mode_is_flat_for_contiguous_operands_and_scalars() {
    use crate::abi::IndexMode;
    let (mode, fast, _) = mode_of(&[32, 512, 768], &[&[32, 512, 768], &[32, 512, 768]]);
    assert_eq!(mode, IndexMode::Flat);
    assert_eq!(fast, vec![(1, 0), (1, 0), (1, 0)]);
    // A numel-1 operand of any rank, and a 0-d one.
    let (mode, fast, _) = mode_of(&[7, 13], &[&[7, 13], &[1, 1], &[]]);
    assert_eq!(mode, IndexMode::Flat);
    assert_eq!(fast, vec![(1, 0), (1, 0), (0, 0), (0, 0)]);
    // Everything numel 1: rank 0 after coalescing.
    let (mode, fast, shape) = mode_of(&[1, 1], &[&[1], &[]]);
    assert_eq!((mode, shape.len()), (IndexMode::Flat, 0));
    assert_eq!(fast, vec![(1, 0), (0, 0), (0, 0)]);
}

#[test]
fn index_mode_broadcasts_along_outer_inner_and_both() {
    use crate::abi::IndexMode;
    // Outer: a bias [C] or [1, C] against [N, C]: i % C.
    for b in [&[768u64][..], &[1, 768]] {
        let (mode, fast, _) = mode_of(&[4096, 768], &[&[4096, 768], b]);
        assert_eq!(mode, IndexMode::Broadcast);
        assert_eq!(fast, vec![(1, 0), (1, 0), (1, 768)]);
    }
    // Inner: [N, C, 1, 1] against [N, C, H, W]: i / (H W).
    let (mode, fast, _) = mode_of(&[32, 64, 7, 9], &[&[32, 64, 7, 9], &[32, 64, 1, 1]]);
    assert_eq!(mode, IndexMode::Broadcast);
    assert_eq!(fast, vec![(1, 0), (1, 0), (63, 0)]);
    // Both: [1, C, 1, 1] against [N, C, H, W]: (i / (H W)) % C.
    let (mode, fast, _) = mode_of(&[32, 64, 7, 9], &[&[32, 64, 7, 9], &[1, 64, 1, 1]]);
    assert_eq!(mode, IndexMode::Broadcast);
    assert_eq!(fast, vec![(1, 0), (1, 0), (63, 64)]);
    // Mixed: a where with a [S, S] mask, a scalar and a full operand.
    let (mode, fast, _) = mode_of(&[8, 12, 5, 5], &[&[5, 5], &[], &[8, 12, 5, 5]]);
    assert_eq!(mode, IndexMode::Broadcast);
    assert_eq!(fast, vec![(1, 0), (1, 25), (0, 0), (1, 0)]);
}

#[test]
fn index_mode_is_generic_otherwise() {
    use crate::abi::IndexMode;
    // Two walked runs with a broadcast between: [N, 1, W] against [N, C, W].
    let (mode, fast, _) = mode_of(&[4, 3, 5], &[&[4, 1, 5]]);
    assert_eq!(mode, IndexMode::Generic);
    assert_eq!(fast, vec![(0, 0), (0, 0)]);
    // Both broadcast against each other: [N, 1] x [1, C].
    let (mode, _, _) = mode_of(&[6, 10], &[&[6, 1], &[1, 10]]);
    assert_eq!(
        mode,
        IndexMode::Broadcast,
        "each one run: [6,1] -> i/10, [1,10] -> i%10"
    );
    // A transposed operand (strides not row-major).
    let shape = [6u64, 10];
    let ops = vec![view(contiguous(&shape)), view(vec![1, 6])];
    assert_eq!(index_mode(&shape, &ops, 0..1).0, IndexMode::Generic);
    // A strided output (a cat into a slice of a wider tensor).
    let ops = vec![view(vec![20, 1]), view(contiguous(&shape))];
    assert_eq!(index_mode(&shape, &ops, 0..1).0, IndexMode::Generic);
    // A step-2 slice: stride 2 innermost.
    assert_eq!(fast_index(&[6, 10], &[20, 2]), None);
    assert_eq!(fast_index(&[6, 10], &[10, 1]), Some((1, 0)));
    assert_eq!(fast_index(&[6, 10], &[0, 0]), Some((0, 0)));
}

/// The commands of `graph`, persistent block at 1 << 20, lane at 1 << 30.
fn lower(graph: Graph) -> Vec<Command> {
    let program = Program::new(graph, &Limits::default()).expect("a valid graph");
    lower_fused(&program, &fusion::FusionPlan::none()).0
}

fn launches(commands: &[Command]) -> Vec<&Launch> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Launch(l) => Some(l),
            _ => None,
        })
        .collect()
}

fn tensor(name: &str, dtype: DType, shape: &[u64], role: Role) -> Tensor {
    Tensor {
        name: name.into(),
        ty: TensorType::new(dtype, shape.to_vec()),
        role,
        data: vec![],
    }
}

fn node(op: Op, inputs: &[usize], outputs: &[usize], attrs: &[(&str, Attr)]) -> Node {
    Node {
        // Unique within a graph: named for the tensors it produces.
        name: format!("{op}{outputs:?}"),
        op,
        inputs: inputs.iter().map(|&i| Some(i)).collect(),
        outputs: outputs.iter().map(|&i| Some(i)).collect(),
        attrs: attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect::<BTreeMap<_, _>>(),
        source: String::new(),
    }
}

/// A 2-d convolution (stride 2, padding 1, no bias) then a 3x3 max pool, in `dtype`.
fn conv_then_pool(dtype: DType) -> Graph {
    let ints = |v: &[i64]| Attr::Ints(v.to_vec());
    Graph {
        tensors: vec![
            tensor("x", dtype, &[2, 3, 9, 9], Role::Feed),
            tensor("w", dtype, &[4, 3, 3, 3], Role::Parameter),
            tensor("y", dtype, &[2, 4, 5, 5], Role::Intermediate),
            tensor("p", dtype, &[2, 4, 2, 2], Role::Intermediate),
            tensor("i", DType::I64, &[2, 4, 2, 2], Role::Intermediate),
        ],
        nodes: vec![
            Node {
                inputs: vec![Some(0), Some(1), None],
                ..node(
                    Op::Convolution,
                    &[],
                    &[2],
                    &[
                        ("stride", ints(&[2])),
                        ("padding", ints(&[1])),
                        ("dilation", ints(&[1])),
                        ("transposed", Attr::Bool(false)),
                        ("output_padding", ints(&[0, 0])),
                        ("groups", Attr::Int(1)),
                    ],
                )
            },
            node(
                Op::MaxPool2dWithIndices,
                &[2],
                &[3, 4],
                &[("kernel_size", ints(&[3])), ("stride", ints(&[2]))],
            ),
        ],
        fetches: vec![3],
        updates: vec![],
        precision: Default::default(),
    }
}

#[test]
fn every_launch_passes_the_struct_its_kernel_takes() {
    for graph in [
        samples::regression(4, 3, 2, 0.1),
        samples::embedding_sum(),
        conv_then_pool(DType::F32),
        conv_then_pool(DType::F16),
    ] {
        let commands = lower(graph);
        assert!(!commands.is_empty());
        for l in launches(&commands) {
            assert_eq!(l.args.struct_name(), l.kernel.args_struct(), "{l:?}");
        }
    }
}

#[test]
fn convolution_and_pooling_take_their_geometry_from_the_params() {
    let commands = lower(conv_then_pool(DType::F16));
    let launches = launches(&commands);
    let conv = launches
        .iter()
        .find(|l| l.kernel == Kernel::ConvForward)
        .expect("f16 takes the direct kernel");
    let conv: &ConvArgs = conv.args.as_any().downcast_ref().unwrap();
    assert_eq!((conv.n, conv.groups, conv.cin_g, conv.cout_g), (2, 1, 3, 4));
    assert_eq!(conv.in3, [1, 9, 9]);
    assert_eq!(conv.out3, [1, 5, 5]);
    assert_eq!(conv.k3, [1, 3, 3]);
    assert_eq!(
        (conv.stride, conv.pad, conv.dil),
        ([1, 2, 2], [0, 1, 1], [1, 1, 1])
    );
    assert_eq!(conv.bias, 0);
    let pool = launches
        .iter()
        .find(|l| l.kernel == Kernel::MaxPoolForward)
        .unwrap();
    let pool: &PoolArgs = pool.args.as_any().downcast_ref().unwrap();
    assert_eq!(
        (pool.planes, pool.h, pool.w, pool.oh, pool.ow),
        (8, 5, 5, 2, 2)
    );
    assert_eq!(
        (pool.k, pool.s, pool.p, pool.d),
        ([3, 3], [2, 2], [0, 0], [1, 1])
    );
    assert_eq!(pool.err, 1 << 40);
    assert_eq!(pool.node, 1);
    assert!(pool.y != 0 && pool.idx != 0);
}

#[test]
fn updates_become_guarded_copies_of_up_to_128_segments() {
    let updates: Vec<(u64, u64, u64)> = (0..130).map(|k| (k * 64, k * 64 + 8, 64)).collect();
    let commands = guarded_copies(&updates, 77);
    let launches = launches(&commands);
    assert_eq!(launches.len(), 2);
    let first: &GuardedCopyArgs = launches[0].args.as_any().downcast_ref().unwrap();
    assert_eq!((first.err, first.count), (77, 128));
    assert_eq!(&first.seg[3..6], &[64, 72, 64]);
    assert_eq!(launches[0].grid.1, 128);
    let second: &GuardedCopyArgs = launches[1].args.as_any().downcast_ref().unwrap();
    assert_eq!(second.count, 2);
    assert_eq!(
        &second.seg[..6],
        &[128 * 64, 128 * 64 + 8, 64, 129 * 64, 129 * 64 + 8, 64]
    );
    assert!(second.seg[6..].iter().all(|&w| w == 0));
}

// ---------------------------------------------------------------------------------------
// Fusion.

use salus_graph::{Precision, Update};

use super::fusion::{FusionPlan, plan};
use crate::abi::{ElementwiseArgs, FusedArgs, IndexMode};

fn f32t(name: &str, shape: &[u64], role: Role) -> Tensor {
    tensor(name, DType::F32, shape, role)
}

fn program(graph: Graph) -> Program {
    Program::new(graph, &Limits::default()).expect("a valid graph")
}

/// A lowered program: its commands, each node's commands, the generated kernels.
pub(super) struct LoweredProgram(
    pub Vec<Command>,
    pub Vec<std::ops::Range<usize>>,
    pub Vec<(String, String)>,
);

/// `program` lowered node by node with `fusion` and `folds` (persistent block at 1 << 20,
/// lane at 1 << 30).
pub(super) fn lower_all(
    program: &Program,
    fusion: &FusionPlan,
    folds: &super::folds::Folds,
) -> LoweredProgram {
    let mut lowering = Lowering {
        program,
        persistent: 1 << 20,
        lane: 1 << 30,
        err: 1 << 40,
        dnn: None,
        index: 0,
        commands: Vec::new(),
        fusion,
        folds,
        epilogues: &super::epilogues::Epilogues::none(),
        kernels: Vec::new(),
        tiled_attention: false,
    };
    let mut spans = Vec::new();
    for (index, node) in program.graph().nodes.iter().enumerate() {
        lowering.index = index;
        let start = lowering.commands.len();
        lowering.node(node).expect("lowered");
        spans.push(start..lowering.commands.len());
    }
    LoweredProgram(lowering.commands, spans, lowering.kernels)
}

/// The commands of `program` lowered with `fusion`, and the generated kernels.
fn lower_fused(program: &Program, fusion: &FusionPlan) -> (Vec<Command>, Vec<(String, String)>) {
    let LoweredProgram(commands, _, kernels) =
        lower_all(program, fusion, &super::folds::Folds::none());
    (commands, kernels)
}

/// x [4, 8] + b [8], * 2, relu (fetched), - x, tanh (fetched): five pointwise ops with a
/// broadcast and a fetched middle value.
fn chain_with_fetched_middle() -> Graph {
    Graph {
        tensors: vec![
            f32t("x", &[4, 8], Role::Feed),
            f32t("b", &[8], Role::Parameter),
            f32t("t0", &[4, 8], Role::Intermediate),
            f32t("t1", &[4, 8], Role::Intermediate),
            f32t("t2", &[4, 8], Role::Intermediate),
            f32t("t3", &[4, 8], Role::Intermediate),
            f32t("t4", &[4, 8], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::AddTensor, &[0, 1], &[2], &[]),
            node(Op::MulScalar, &[2], &[3], &[("other", Attr::Float(2.0))]),
            node(Op::Relu, &[3], &[4], &[]),
            node(Op::SubTensor, &[4, 0], &[5], &[]),
            node(Op::Tanh, &[5], &[6], &[]),
        ],
        fetches: vec![4, 6],
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[test]
fn a_chain_fuses_into_one_region_writing_only_what_is_needed() {
    let program = program(chain_with_fetched_middle());
    let fusion = plan(&program);
    assert_eq!(fusion.regions.len(), 1, "{fusion:?}");
    let r = &fusion.regions[0];
    assert_eq!(r.nodes, vec![0, 1, 2, 3, 4]);
    assert_eq!(r.shape, vec![4, 8]);
    assert_eq!(r.inputs, vec![0, 1], "x and b are read");
    assert_eq!(r.outputs, vec![4, 6], "the fetched t2 and t4 are written");
    let (commands, kernels) = lower_fused(&program, &fusion);
    assert_eq!(commands.len(), 1, "{commands:?}");
    let Command::Fused(f) = &commands[0] else {
        panic!("{commands:?}")
    };
    assert_eq!(kernels.len(), 1);
    assert_eq!(kernels[0].0, f.name);
    let a: &FusedArgs = &f.args;
    assert_eq!((a.n, a.nops, a.mode), (32, 4, IndexMode::Broadcast.code()));
    assert_eq!(&a.shape[..2], &[4, 8]);
    assert_eq!(&a.ops[1].st[..2], &[0, 1], "b broadcast over the rows");
    assert_eq!(&a.s[..4], &[1.0, 0.0, 2.0, 0.0]);
    assert_eq!(&a.s[6..8], &[-1.0, 0.0], "sub is add with alpha -1");
    // Without fusion: five launches of `ew`.
    let (unfused, none) = lower_fused(&program, &FusionPlan::none());
    assert_eq!(launches(&unfused).len(), 5);
    assert!(none.is_empty());
}

#[test]
fn an_intermediate_read_outside_the_region_is_written_and_bounds_it() {
    // t0 = exp(x); t1 = neg(t0); s = sum(t0, 1) reads t0; t2 = t1 + 1 after the sum.
    let graph = Graph {
        tensors: vec![
            f32t("x", &[4, 8], Role::Feed),
            f32t("t0", &[4, 8], Role::Intermediate),
            f32t("t1", &[4, 8], Role::Intermediate),
            f32t("s", &[4], Role::Intermediate),
            f32t("t2", &[4, 8], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::Exp, &[0], &[1], &[]),
            node(Op::Neg, &[1], &[2], &[]),
            node(
                Op::SumDimIntList,
                &[1],
                &[3],
                &[("dim", Attr::Ints(vec![1]))],
            ),
            node(Op::AddScalar, &[2], &[4], &[("other", Attr::Float(1.0))]),
        ],
        fetches: vec![3, 4],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let program = program(graph);
    let fusion = plan(&program);
    assert_eq!(fusion.regions.len(), 1, "{fusion:?}");
    let r = &fusion.regions[0];
    assert_eq!(
        r.nodes,
        vec![0, 1],
        "the add runs after the sum that reads t0"
    );
    assert_eq!(
        r.outputs,
        vec![1, 2],
        "t0 (read by the sum) and t1 (by the add)"
    );
    assert!(fusion.region(3).is_none());
}

#[test]
fn different_shapes_do_not_fuse_and_updates_are_written() {
    // a = exp(r) [4, 1]; c = x * a [4, 8]; d = -c [4, 8]; w2 = w - 0.1 * g, w updated.
    let graph = Graph {
        tensors: vec![
            f32t("x", &[4, 8], Role::Feed),
            f32t("r", &[4, 1], Role::Feed),
            f32t("a", &[4, 1], Role::Intermediate),
            f32t("c", &[4, 8], Role::Intermediate),
            f32t("d", &[4, 8], Role::Intermediate),
            f32t("w", &[8], Role::Parameter),
            f32t("g", &[8], Role::Feed),
            f32t("t", &[8], Role::Intermediate),
            f32t("w2", &[8], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::Exp, &[1], &[2], &[]),
            node(Op::MulTensor, &[0, 2], &[3], &[]),
            node(Op::Neg, &[3], &[4], &[]),
            node(Op::MulScalar, &[6], &[7], &[("other", Attr::Float(0.1))]),
            node(Op::SubTensor, &[5, 7], &[8], &[]),
        ],
        fetches: vec![4],
        updates: vec![Update {
            target: 5,
            value: 8,
        }],
        precision: Precision::IEEE,
    };
    let program = program(graph);
    let fusion = plan(&program);
    let regions: Vec<(Vec<usize>, Vec<usize>, Vec<usize>)> = fusion
        .regions
        .iter()
        .map(|r| (r.nodes.clone(), r.inputs.clone(), r.outputs.clone()))
        .collect();
    assert_eq!(
        regions,
        vec![
            (vec![1, 2], vec![0, 2], vec![4]),
            (vec![3, 4], vec![6, 5], vec![8]),
        ]
    );
    assert!(fusion.region(0).is_none(), "exp over [4, 1] runs alone");
}

#[test]
fn non_adjacent_nodes_fuse_when_nothing_between_overwrites_their_inputs() {
    // Two interleaved chains (as traced optimizers lay them out): a0 = x * 2, b0 = y * 2,
    // a1 = a0 + 1, b1 = b0 + 1; each chain is a region running at its last node.
    let graph = Graph {
        tensors: vec![
            f32t("x", &[16], Role::Feed),
            f32t("y", &[16], Role::Feed),
            f32t("a0", &[16], Role::Intermediate),
            f32t("b0", &[16], Role::Intermediate),
            f32t("a1", &[16], Role::Intermediate),
            f32t("b1", &[16], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::MulScalar, &[0], &[2], &[("other", Attr::Float(2.0))]),
            node(Op::MulScalar, &[1], &[3], &[("other", Attr::Float(2.0))]),
            node(Op::AddScalar, &[2], &[4], &[("other", Attr::Float(1.0))]),
            node(Op::AddScalar, &[3], &[5], &[("other", Attr::Float(1.0))]),
        ],
        fetches: vec![4, 5],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let program = program(graph);
    let fusion = plan(&program);
    let nodes: Vec<Vec<usize>> = fusion.regions.iter().map(|r| r.nodes.clone()).collect();
    assert_eq!(nodes, vec![vec![0, 2], vec![1, 3]]);
    let (commands, kernels) = lower_fused(&program, &fusion);
    assert_eq!(commands.len(), 2);
    assert_eq!(kernels.len(), 1, "both regions are the same kernel");
}

#[test]
fn a_node_joining_two_regions_merges_them() {
    // An optimizer-like update: m = g * 0.1 + m0 * 0.9 and v = g * g * 0.001 + v0 * 0.999
    // (two chains), then p = p0 - m / (sqrt(v) + eps), which reads both: one region, one
    // launch, writing only m, v and p.
    let t = |name: &str, role| f32t(name, &[64], role);
    let graph = Graph {
        tensors: vec![
            t("g", Role::Feed),
            t("m0", Role::Feed),
            t("v0", Role::Feed),
            t("p0", Role::Feed),
            t("gm", Role::Intermediate),
            t("mm", Role::Intermediate),
            t("m", Role::Intermediate),
            t("gg", Role::Intermediate),
            t("gv", Role::Intermediate),
            t("vv", Role::Intermediate),
            t("v", Role::Intermediate),
            t("sv", Role::Intermediate),
            t("den", Role::Intermediate),
            t("step", Role::Intermediate),
            t("p", Role::Intermediate),
        ],
        nodes: vec![
            node(Op::MulScalar, &[0], &[4], &[("other", Attr::Float(0.1))]),
            node(Op::MulScalar, &[1], &[5], &[("other", Attr::Float(0.9))]),
            node(Op::AddTensor, &[4, 5], &[6], &[]),
            node(Op::MulTensor, &[0, 0], &[7], &[]),
            node(Op::MulScalar, &[7], &[8], &[("other", Attr::Float(0.001))]),
            node(Op::MulScalar, &[2], &[9], &[("other", Attr::Float(0.999))]),
            node(Op::AddTensor, &[8, 9], &[10], &[]),
            node(Op::Sqrt, &[10], &[11], &[]),
            node(Op::AddScalar, &[11], &[12], &[("other", Attr::Float(1e-8))]),
            node(Op::DivTensor, &[6, 12], &[13], &[]),
            node(Op::SubTensor, &[3, 13], &[14], &[]),
        ],
        fetches: vec![6, 10, 14],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let program = program(graph);
    let fusion = plan(&program);
    assert_eq!(fusion.regions.len(), 1, "{fusion:?}");
    let r = &fusion.regions[0];
    assert_eq!(r.nodes, (0..11).collect::<Vec<_>>());
    assert_eq!(r.inputs, vec![0, 1, 2, 3]);
    assert_eq!(r.outputs, vec![6, 10, 14]);
    let (commands, kernels) = lower_fused(&program, &fusion);
    assert_eq!(commands.len(), 1);
    let source = crate::abi::fused_kernel_source(kernels.iter().map(|(_, t)| t.as_str()));
    if let Some(r) = crate::abi::tests::host_compiles(&source) {
        r.unwrap_or_else(|log| panic!("host C++ rejects\n{source}\n{log}"));
    }
}

#[test]
fn regions_that_cannot_run_together_stay_apart() {
    // a = x * 3 + 1 is read by a sum before c = a + b2 reads it, so a's region must run
    // before the sum: c cannot merge it with b2's region and joins b2's alone.
    let graph = Graph {
        tensors: vec![
            f32t("x", &[4, 8], Role::Feed),
            f32t("a0", &[4, 8], Role::Intermediate),
            f32t("a", &[4, 8], Role::Intermediate),
            f32t("s", &[4], Role::Intermediate),
            f32t("b", &[4, 8], Role::Intermediate),
            f32t("b2", &[4, 8], Role::Intermediate),
            f32t("c", &[4, 8], Role::Intermediate),
        ],
        nodes: vec![
            node(Op::MulScalar, &[0], &[1], &[("other", Attr::Float(3.0))]),
            node(Op::AddScalar, &[1], &[2], &[("other", Attr::Float(1.0))]),
            node(
                Op::SumDimIntList,
                &[2],
                &[3],
                &[("dim", Attr::Ints(vec![1]))],
            ),
            node(Op::MulScalar, &[0], &[4], &[("other", Attr::Float(2.0))]),
            node(Op::AddScalar, &[4], &[5], &[("other", Attr::Float(5.0))]),
            node(Op::AddTensor, &[2, 5], &[6], &[]),
        ],
        fetches: vec![3, 6],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let program = program(graph);
    let fusion = plan(&program);
    let nodes: Vec<Vec<usize>> = fusion.regions.iter().map(|r| r.nodes.clone()).collect();
    assert_eq!(nodes, vec![vec![0, 1], vec![3, 4, 5]]);
    assert_eq!(
        fusion.regions[0].outputs,
        vec![2],
        "a, read by the sum and by c"
    );
}

#[test]
fn fused_ops_and_scalars_are_the_unfused_lowering_s() {
    // Each single node lowered unfused (one `ew` launch) against `pointwise`.
    type Case = (Op, Vec<(&'static str, Attr)>, usize);
    let cases: Vec<Case> = vec![
        (Op::AddTensor, vec![("alpha", Attr::Float(0.5))], 2),
        (Op::SubTensor, vec![("alpha", Attr::Float(3.0))], 2),
        (Op::MulTensor, vec![], 2),
        (Op::DivTensor, vec![], 2),
        (
            Op::AddScalar,
            vec![("other", Attr::Float(2.0)), ("alpha", Attr::Float(3.0))],
            1,
        ),
        (Op::DivScalar, vec![("other", Attr::Float(4.0))], 1),
        (Op::PowTensorScalar, vec![("exponent", Attr::Float(3.0))], 1),
        (Op::Sigmoid, vec![], 1),
        (Op::Rsqrt, vec![], 1),
        (Op::Gelu, vec![("approximate", Attr::Str("tanh".into()))], 1),
        (Op::Gelu, vec![], 1),
        (Op::LeakyRelu, vec![("negative_slope", Attr::Float(0.2))], 1),
        (
            Op::Clamp,
            vec![("min", Attr::Float(-1.0)), ("max", Attr::Float(2.0))],
            1,
        ),
    ];
    for (op, attrs, inputs) in cases {
        let mut tensors: Vec<Tensor> = (0..inputs)
            .map(|k| f32t(&format!("in{k}"), &[3, 5], Role::Feed))
            .collect();
        tensors.push(f32t("out", &[3, 5], Role::Intermediate));
        let ins: Vec<usize> = (0..inputs).collect();
        let graph = Graph {
            tensors,
            nodes: vec![node(op, &ins, &[inputs], &attrs)],
            fetches: vec![inputs],
            updates: vec![],
            precision: Precision::IEEE,
        };
        let program = program(graph);
        let (commands, _) = lower_fused(&program, &FusionPlan::none());
        let launches = launches(&commands);
        let ew: &ElementwiseArgs = launches[0].args.as_any().downcast_ref().unwrap();
        let p = fusion::pointwise(op, program.params(0), DType::F32, DType::F32)
            .unwrap_or_else(|| panic!("{op} fuses"));
        assert_eq!(
            (p.op.code(), p.inputs as i64, p.s),
            (ew.op, ew.nin, [ew.s0, ew.s1]),
            "{op} {attrs:?}"
        );
    }
}

/// The `ew` launch of `out = a * b` (f32, or `b` of `bdt`), unfused.
fn mul_launch(a: &[u64], b: &[u64], bdt: DType, out: &[u64]) -> (ElementwiseArgs, u32) {
    let graph = Graph {
        tensors: vec![
            f32t("a", a, Role::Feed),
            tensor("b", bdt, b, Role::Feed),
            f32t("out", out, Role::Intermediate),
        ],
        nodes: vec![node(Op::MulTensor, &[0, 1], &[2], &[])],
        fetches: vec![2],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let program = program(graph);
    let (commands, _) = lower_fused(&program, &FusionPlan::none());
    let launches = launches(&commands);
    assert_eq!(launches.len(), 1, "{commands:?}");
    let ew: &ElementwiseArgs = launches[0].args.as_any().downcast_ref().unwrap();
    (*ew, launches[0].grid.0)
}

#[test]
fn ew_launches_take_the_index_mode_of_their_shapes() {
    // f32, contiguous, n a multiple of 4 (planned addresses 16-byte aligned): float4, a
    // thread per 4 elements.
    let (a, grid) = mul_launch(&[512, 1024], &[512, 1024], DType::F32, &[512, 1024]);
    assert_eq!(a.mode, IndexMode::FlatVec4.code());
    assert_eq!(grid, 512 * 1024 / 4 / BLOCK);
    let (a, _) = mul_launch(&[64, 16], &[], DType::F32, &[64, 16]);
    assert_eq!(a.mode, IndexMode::FlatVec4.code());
    assert_eq!(
        (a.inputs[0].q, a.inputs[1].q),
        (1, 0),
        "the scalar read once"
    );
    // An odd size, or another dtype: flat, one element a thread.
    let (a, grid) = mul_launch(&[3, 5], &[3, 5], DType::F32, &[3, 5]);
    assert_eq!((a.mode, grid), (IndexMode::Flat.code(), 1));
    let (a, _) = mul_launch(&[8, 16], &[8, 16], DType::I64, &[8, 16]);
    assert_eq!(a.mode, IndexMode::Flat.code());
    // A bias along the rows; a per-channel NCHW scale.
    let (a, _) = mul_launch(&[8, 16], &[16], DType::F32, &[8, 16]);
    assert_eq!(a.mode, IndexMode::Broadcast.code());
    assert_eq!((a.inputs[1].q, a.inputs[1].m), (1, 16));
    let (a, _) = mul_launch(&[2, 3, 4, 5], &[1, 3, 1, 1], DType::F32, &[2, 3, 4, 5]);
    assert_eq!(a.mode, IndexMode::Broadcast.code());
    assert_eq!((a.inputs[1].q, a.inputs[1].m), (20, 3));
    // Two runs: generic.
    let (a, _) = mul_launch(&[2, 1, 5], &[2, 3, 5], DType::F32, &[2, 3, 5]);
    assert_eq!((a.mode, a.rank), (IndexMode::Generic.code(), 3));
}

#[test]
fn generated_kernels_compile() {
    let program = program(chain_with_fetched_middle());
    let (_, kernels) = lower_fused(&program, &plan(&program));
    let text = &kernels[0].1;
    assert!(text.contains(&format!("void {}(const FusedArgs a)", kernels[0].0)));
    for name in ["OP_ADD", "OP_MULS", "OP_RELU", "OP_TANH", "DT_F32"] {
        assert!(text.contains(name), "{name} in\n{text}");
    }
    let source = crate::abi::fused_kernel_source(kernels.iter().map(|(_, t)| t.as_str()));
    match crate::abi::tests::host_compiles(&source) {
        None => eprintln!("host C++ check skipped: no C++ compiler"),
        Some(r) => r.unwrap_or_else(|log| panic!("host C++ rejects\n{text}\n{log}")),
    }
    match crate::abi::tests::nvrtc_compiles(&source) {
        None => eprintln!("NVRTC check skipped: no NVRTC library"),
        Some(r) => r.unwrap_or_else(|log| panic!("NVRTC rejects\n{text}\n{log}")),
    }
}

// ------------------------------------------------------------------------------------
// Copy routing.

use super::elementwise::{CopyRoute, route_copy};

/// The route of a copy of a dense `shape` permuted by `dims` into a dense output, f32 at
/// 16-byte aligned addresses.
fn permute_route(shape: &[u64], dims: &[usize], esize: i64) -> (Vec<u64>, CopyRoute) {
    let own = contiguous(shape);
    let out_shape: Vec<u64> = dims.iter().map(|&d| shape[d]).collect();
    let mut ops = vec![
        StridedView {
            ptr: 1 << 20,
            dt: 0,
            st: contiguous(&out_shape),
        },
        StridedView {
            ptr: 1 << 24,
            dt: 0,
            st: dims.iter().map(|&d| own[d]).collect(),
        },
    ];
    let shape = coalesce(&out_shape, &mut ops);
    let route = route_copy(&shape, &ops[0], &ops[1], esize);
    (shape, route)
}

#[test]
fn heads_split_permute_copies_rows() {
    // [B, S, H, D] -> [B, H, S, D]: D stays innermost.
    let (shape, route) = permute_route(&[32, 128, 8, 64], &[0, 2, 1, 3], 4);
    assert_eq!(shape, vec![32, 8, 128, 64]);
    let CopyRoute::Rows(a) = route else {
        panic!("{route:?}")
    };
    assert_eq!(
        (a.rows, a.vec, a.vpr, a.tpr, a.chunks, a.rank),
        (32 * 8 * 128, 16, 16, 4, 1, 3)
    );
    assert_eq!(&a.shape[..3], &[32, 8, 128]);
    assert_eq!(&a.src_st[..3], &[128 * 8 * 64 * 4, 64 * 4, 8 * 64 * 4]);
    assert_eq!(&a.dst_st[..3], &[8 * 128 * 64 * 4, 128 * 64 * 4, 64 * 4]);
    // An odd row of f16 falls to 2-byte accesses.
    let (_, route) = permute_route(&[3, 5, 7], &[1, 0, 2], 2);
    let CopyRoute::Rows(a) = route else {
        panic!("{route:?}")
    };
    assert_eq!((a.vec, a.vpr, a.rows), (2, 7, 15));
}

#[test]
fn last_two_dims_swapped_is_a_batched_transpose() {
    let (shape, route) = permute_route(&[32, 128, 8, 64], &[0, 1, 3, 2], 4);
    assert_eq!(shape, vec![32 * 128, 64, 8]);
    let CopyRoute::Transpose(a) = route else {
        panic!("{route:?}")
    };
    assert_eq!(
        (a.ni, a.nj, a.src_j, a.dst_i, a.batches, a.rank),
        (64, 8, 64, 8, 4096, 1)
    );
    assert_eq!((a.src_st[0], a.dst_st[0], a.esize), (512 * 4, 512 * 4, 4));
    // The innermost dim moved outward past a batch dim: [a, b, c] -> [c, a, b].
    let (shape, route) = permute_route(&[3, 33, 17], &[2, 0, 1], 8);
    assert_eq!(shape, vec![17, 99]);
    let CopyRoute::Transpose(a) = route else {
        panic!("{route:?}")
    };
    assert_eq!(
        (a.ni, a.nj, a.src_j, a.dst_i, a.batches, a.rank),
        (17, 99, 17, 99, 1, 0)
    );
    // [a, b, c] -> [b, c, a] keeps a batch dim between.
    let (shape, route) = permute_route(&[4, 5, 6], &[1, 0, 2], 1);
    assert_eq!(shape, vec![5, 4, 6]);
    assert!(matches!(route, CopyRoute::Rows(_)));
    let (shape, route) = permute_route(&[2, 3, 4, 5], &[3, 1, 0, 2], 4);
    assert_eq!(shape, vec![5, 3, 2, 4]);
    let CopyRoute::Transpose(a) = route else {
        panic!("{route:?}")
    };
    assert_eq!(
        (a.ni, a.nj, a.src_j, a.dst_i, a.batches, a.rank),
        (5, 4, 5, 24, 6, 2)
    );
    assert_eq!(&a.shape[..2], &[3, 2]);
    assert_eq!(&a.src_st[..2], &[20 * 4, 60 * 4]);
    assert_eq!(&a.dst_st[..2], &[8 * 4, 4 * 4]);
}

#[test]
fn broadcast_innermost_and_misaligned_copies() {
    // expand [4, 1, 64] -> [4, 16, 64]: rows, the source row read 16 times.
    let shape = [4u64, 16, 64];
    let mut ops = vec![
        StridedView {
            ptr: 4096,
            dt: 0,
            st: contiguous(&shape),
        },
        StridedView {
            ptr: 8192,
            dt: 0,
            st: broadcast(&[4, 1, 64], &shape),
        },
    ];
    let shape = coalesce(&shape, &mut ops);
    let CopyRoute::Rows(a) = route_copy(&shape, &ops[0], &ops[1], 4) else {
        panic!()
    };
    assert_eq!((a.rows, a.vec, &a.src_st[..2]), (64, 16, &[256i64, 0][..]));
    // expand [8, 1] -> [8, 32]: innermost broadcast, read along the other dim's run.
    let shape = [8u64, 32];
    let mut ops = vec![
        StridedView {
            ptr: 4096,
            dt: 0,
            st: contiguous(&shape),
        },
        StridedView {
            ptr: 8192,
            dt: 0,
            st: broadcast(&[8, 1], &shape),
        },
    ];
    let shape = coalesce(&shape, &mut ops);
    let CopyRoute::Transpose(a) = route_copy(&shape, &ops[0], &ops[1], 4) else {
        panic!()
    };
    assert_eq!((a.ni, a.nj, a.src_j, a.dst_i), (8, 32, 0, 32));
    // Every second element of the innermost dim: nothing contiguous in the source.
    let dst = StridedView {
        ptr: 4096,
        dt: 0,
        st: vec![16, 1],
    };
    let src = StridedView {
        ptr: 8192,
        dt: 0,
        st: vec![32, 2],
    };
    assert_eq!(route_copy(&[8, 16], &dst, &src, 4), CopyRoute::Generic);
    // A slice starting one f32 in: 4-byte accesses; a flat copy is one row in chunks.
    let src = StridedView {
        ptr: 8196,
        dt: 0,
        st: vec![1],
    };
    let dst = StridedView {
        ptr: 4096,
        dt: 0,
        st: vec![1],
    };
    let CopyRoute::Rows(a) = route_copy(&[1 << 20], &dst, &src, 4) else {
        panic!()
    };
    assert_eq!(
        (a.rows, a.vec, a.vpr, a.tpr, a.chunk, a.chunks),
        (1, 4, 1 << 20, 256, 1024, 1024)
    );
}

#[test]
fn permute_and_dtype_changing_copies_launch_their_kernels() {
    let t = |n: &str, d: DType, s: &[u64], r: Role| tensor(n, d, s, r);
    let graph = Graph {
        tensors: vec![
            t("x", DType::F32, &[4, 6, 8], Role::Feed),
            t("p", DType::F32, &[4, 8, 6], Role::Intermediate),
            t("q", DType::F16, &[4, 8, 6], Role::Intermediate),
        ],
        nodes: vec![
            node(
                Op::Permute,
                &[0],
                &[1],
                &[("dims", Attr::Ints(vec![0, 2, 1]))],
            ),
            node(
                Op::ToCopy,
                &[1],
                &[2],
                &[("dtype", Attr::DType(DType::F16))],
            ),
        ],
        fetches: vec![2],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let commands = lower(graph);
    let kernels: Vec<Kernel> = launches(&commands).iter().map(|l| l.kernel).collect();
    assert_eq!(kernels, vec![Kernel::CopyTranspose, Kernel::Elementwise]);
}

/// A U-Net's new ops and cumsum, flip and maximum over `x` [2, 4, 3, 5].
fn unet_ops() -> Graph {
    let t = |n: &str, d: DType, s: &[u64], r: Role| tensor(n, d, s, r);
    let ints = |v: &[i64]| Attr::Ints(v.to_vec());
    let f32i = |n: &str, s: &[u64]| t(n, DType::F32, s, Role::Intermediate);
    Graph {
        tensors: vec![
            t("x", DType::F32, &[2, 4, 3, 5], Role::Feed),
            t("rows", DType::I64, &[6, 1], Role::Feed),
            t("cols", DType::I32, &[10], Role::Feed),
            f32i("flipped", &[2, 4, 3, 5]),
            f32i("padded", &[2, 4, 4, 3]),
            f32i("reflected", &[2, 4, 6, 8]),
            f32i("reflected_grad", &[2, 4, 3, 5]),
            f32i("normed", &[2, 4, 3, 5]),
            f32i("mean", &[2, 2]),
            f32i("up", &[2, 4, 6, 10]),
            f32i("down", &[2, 4, 3, 5]),
            f32i("sums", &[2, 4, 3, 5]),
            f32i("larger", &[2, 4, 3, 5]),
        ],
        nodes: vec![
            node(Op::Flip, &[0], &[3], &[("dims", ints(&[1, 3]))]),
            node(
                Op::ConstantPadNd,
                &[0],
                &[4],
                &[("pad", ints(&[-1, -1, 1, 0])), ("value", Attr::Float(2.0))],
            ),
            node(
                Op::ReflectionPad2d,
                &[0],
                &[5],
                &[("padding", ints(&[1, 2, 2, 1]))],
            ),
            node(
                Op::ReflectionPad2dBackward,
                &[5, 0],
                &[6],
                &[("padding", ints(&[1, 2, 2, 1]))],
            ),
            Node {
                inputs: vec![Some(0), None, None],
                outputs: vec![Some(7), Some(8), None],
                ..node(
                    Op::NativeGroupNorm,
                    &[],
                    &[],
                    &[
                        ("N", Attr::Int(2)),
                        ("C", Attr::Int(4)),
                        ("HxW", Attr::Int(15)),
                        ("group", Attr::Int(2)),
                        ("eps", Attr::Float(1e-5)),
                    ],
                )
            },
            Node {
                inputs: vec![Some(0), None, None, Some(1), Some(2)],
                ..node(Op::IndexTensor, &[], &[9], &[("indices.len", Attr::Int(4))])
            },
            Node {
                inputs: vec![Some(0), None, None, Some(1), Some(2), Some(9)],
                ..node(
                    Op::IndexPut,
                    &[],
                    &[10],
                    &[
                        ("indices.len", Attr::Int(4)),
                        ("accumulate", Attr::Bool(true)),
                    ],
                )
            },
            node(Op::Cumsum, &[0], &[11], &[("dim", Attr::Int(2))]),
            node(Op::Maximum, &[0], &[12], &[]),
        ],
        fetches: vec![3, 4, 6, 7, 8, 10, 11, 12],
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[test]
fn unet_ops_lower_to_their_kernels() {
    let mut graph = unet_ops();
    // maximum(x, x): both inputs the feed.
    graph.nodes[8].inputs = vec![Some(0), Some(0)];
    let commands = lower(graph);
    let launches = launches(&commands);
    let kernels: Vec<Kernel> = launches.iter().map(|l| l.kernel).collect();
    assert_eq!(
        kernels,
        vec![
            // flip: a copy reading backwards; constant_pad_nd: a fill, then the kept part
            // (rows contiguous in both).
            Kernel::Elementwise,
            Kernel::Elementwise,
            Kernel::CopyRows,
            Kernel::ReflectionPadForward,
            Kernel::ReflectionPadBackward,
            // group norm without weight and bias: the layer norm rows alone.
            Kernel::LayerNormForwardRows,
            Kernel::IndexGather,
            // index_put: a copy of self, then the accumulation.
            Kernel::CopyRows,
            Kernel::IndexPut,
            Kernel::Cumsum,
            Kernel::Elementwise,
        ]
    );
    for l in &launches {
        assert_eq!(l.args.struct_name(), l.kernel.args_struct(), "{l:?}");
    }
    let flip: &ElementwiseArgs = launches[0].args.as_any().downcast_ref().unwrap();
    let walked: Vec<i64> = flip.inputs[0].st[..flip.rank as usize].to_vec();
    // [2, 4, 3, 5] flipped along dims 1 and 3: nothing coalesces.
    assert_eq!(walked, vec![60, -15, 5, -1]);
    // Read from the last element of dims 1 and 3 (x's address as reflection padding has it).
    let reflect: &PoolArgs = launches[3].args.as_any().downcast_ref().unwrap();
    assert_eq!(flip.inputs[0].ptr, reflect.x + 4 * (3 * 15 + 4));
    let gather: &crate::abi::AdvancedIndexArgs = launches[6].args.as_any().downcast_ref().unwrap();
    assert_eq!(
        (gather.n, gather.rank, gather.srank),
        (2 * 4 * 6 * 10, 4, 4)
    );
    assert_eq!(gather.whole[..4], [0, 1, -1, -1]);
    // rows [6, 1] walks selection dim 2; cols [10] selection dim 3.
    assert_eq!(
        gather.ist[2 * crate::abi::MAX_RANK..2 * crate::abi::MAX_RANK + 4],
        [0, 0, 1, 0]
    );
    assert_eq!(
        gather.ist[3 * crate::abi::MAX_RANK..3 * crate::abi::MAX_RANK + 4],
        [0, 0, 0, 1]
    );
    assert_eq!(gather.xst[..4], [60, 15, 5, 1]);
    assert_eq!(reflect.p, [2, 1]);
    assert_eq!((reflect.oh, reflect.ow), (6, 8));
}

/// Plans attention nodes' scratch as the CUDA device does (the rest portably).
struct AttentionSizer;

impl salus_graph::ScratchSizer for AttentionSizer {
    fn scratch_bytes(&self, graph: &Graph, node: usize, params: &salus_graph::OpParams) -> u64 {
        attention::attention_scratch_bytes(graph, node, params)
    }
}

/// A command as the checks below read it: a kernel by name, or a product as cuBLAS is
/// called (transposes of its first and second operand, m, n, k, and the three leading
/// dimensions).
#[derive(Debug, PartialEq)]
enum Step {
    Kernel(&'static str),
    Gemm([bool; 2], [i32; 3], [i32; 3]),
}

/// f32 attention and its backward go through cuBLAS: each product reads q, k, v, grad_out,
/// the probabilities and the score gradients in the layout and orientation the formulas
/// ask for (row-major operands handed to column-major cuBLAS, the second factor first).
#[test]
fn f32_attention_lowers_to_products_around_row_kernels() {
    let (b, h, l, s, e, ev) = (2u64, 3u64, 5u64, 7u64, 8u64, 4u64);
    let absent_mask = |inputs: &[usize]| {
        let mut all: Vec<Option<usize>> = inputs.iter().map(|&i| Some(i)).collect();
        all.push(None);
        all
    };
    let flags = [
        ("dropout_p", Attr::Float(0.0)),
        ("is_causal", Attr::Bool(false)),
    ];
    let mut forward = node(Op::ScaledDotProductAttention, &[], &[3, 4], &flags);
    forward.inputs = absent_mask(&[0, 1, 2]);
    let mut backward = node(
        Op::ScaledDotProductAttentionBackward,
        &[],
        &[6, 7, 8],
        &flags,
    );
    backward.inputs = absent_mask(&[5, 0, 1, 2, 3, 4]);
    let graph = Graph {
        tensors: vec![
            f32t("q", &[b, h, l, e], Role::Feed),
            f32t("k", &[b, h, s, e], Role::Feed),
            f32t("v", &[b, h, s, ev], Role::Feed),
            f32t("out", &[b, h, l, ev], Role::Intermediate),
            f32t("lse", &[b, h, l], Role::Intermediate),
            f32t("grad_out", &[b, h, l, ev], Role::Feed),
            f32t("dq", &[b, h, l, e], Role::Intermediate),
            f32t("dk", &[b, h, s, e], Role::Intermediate),
            f32t("dv", &[b, h, s, ev], Role::Intermediate),
        ],
        nodes: vec![forward, backward],
        fetches: vec![3, 6, 7, 8],
        updates: vec![],
        precision: Precision::IEEE,
    };
    let program =
        Program::with_scratch(graph, &Limits::default(), &AttentionSizer).expect("a valid graph");
    let (commands, _) = lower_fused(&program, &FusionPlan::none());
    let steps: Vec<Step> = commands
        .iter()
        .filter_map(|c| match c {
            Command::Launch(launch) => Some(Step::Kernel(launch.kernel.name())),
            Command::Gemm(g) => {
                assert_eq!(g.batch, (b * h) as i32, "one call for every head");
                Some(Step::Gemm(
                    [g.trans_a, g.trans_b],
                    [g.m, g.n, g.k],
                    [g.lda, g.ldb, g.ldc],
                ))
            }
            _ => None,
        })
        .collect();
    let (l, s, e, ev) = (l as i32, s as i32, e as i32, ev as i32);
    // The scores q k^T: [l, s] per head from q [l, e] and k [s, e] read transposed.
    let scores = Step::Gemm([true, false], [s, l, e], [e, e, s]);
    assert_eq!(
        steps,
        vec![
            scores,
            Step::Kernel("attn_softmax_rows"),
            // out = P v: [l, ev] from P [l, s] and v [s, ev].
            Step::Gemm([false, false], [ev, l, s], [ev, s, ev]),
            Step::Kernel("attn_delta_rows"),
            Step::Gemm([true, false], [s, l, e], [e, e, s]),
            Step::Kernel("attn_probs_rows"),
            // dP = grad_out v^T: [l, s] from v [s, ev] read transposed.
            Step::Gemm([true, false], [s, l, ev], [ev, ev, s]),
            Step::Kernel("attn_dscores_rows"),
            // grad_value = P^T grad_out: [s, ev] from P [l, s] read transposed (after the
            // row kernel, which applies dropout to P).
            Step::Gemm([false, true], [ev, s, l], [ev, s, ev]),
            // grad_query = dS k: [l, e] from dS [l, s] and k [s, e].
            Step::Gemm([false, false], [e, l, s], [e, s, e]),
            // grad_key = dS^T q: [s, e] from dS [l, s] read transposed and q [l, e].
            Step::Gemm([false, true], [e, s, l], [e, s, e]),
        ]
    );
}

/// The efficient ops (attention with dropout) in `dtype`, forward then backward, with no
/// bias: the forward's seed and offset feed the backward.
fn efficient_attention(dtype: DType, dropout: f64) -> Graph {
    let (b, h, l, s, e, ev) = (2u64, 3u64, 37u64, 45u64, 16u64, 8u64);
    let flags = |backward: bool| {
        let mut flags = vec![
            ("dropout_p", Attr::Float(dropout)),
            ("is_causal", Attr::Bool(true)),
        ];
        if backward {
            flags.push((
                "grad_input_mask",
                Attr::Bools(vec![true, true, true, false]),
            ));
        }
        flags
    };
    let mut forward = node(Op::EfficientAttention, &[], &[5, 6, 7, 8], &flags(false));
    forward.inputs = vec![Some(0), Some(1), Some(2), None, Some(3)];
    let mut backward = node(
        Op::EfficientAttentionBackward,
        &[],
        &[9, 10, 11],
        &flags(true),
    );
    backward.inputs = [4, 0, 1, 2]
        .map(Some)
        .into_iter()
        .chain([None])
        .chain([5, 6, 7, 8].map(Some))
        .collect();
    backward.outputs.push(None);
    let t = |name: &str, shape: &[u64], role: Role| tensor(name, dtype, shape, role);
    Graph {
        tensors: vec![
            t("q", &[b, h, l, e], Role::Feed),
            t("k", &[b, h, s, e], Role::Feed),
            t("v", &[b, h, s, ev], Role::Feed),
            tensor("state", DType::I64, &[], Role::Feed),
            t("grad_out", &[b, h, l, ev], Role::Feed),
            t("out", &[b, h, l, ev], Role::Intermediate),
            f32t("lse", &[b, h, 64], Role::Intermediate),
            tensor("seed", DType::I64, &[], Role::Intermediate),
            tensor("offset", DType::I64, &[], Role::Intermediate),
            t("dq", &[b, h, l, e], Role::Intermediate),
            t("dk", &[b, h, s, e], Role::Intermediate),
            t("dv", &[b, h, s, ev], Role::Intermediate),
        ],
        nodes: vec![forward, backward],
        fetches: vec![5, 6, 7, 8, 9, 10, 11],
        updates: vec![],
        precision: Precision::IEEE,
    }
}

/// The efficient ops run the flash ops' kernels: the forward writes its seed first (and
/// zeroes the log-sum-exp's padding), draws from the generator state with the node's key;
/// the backward draws from the forward's seed; both read the log-sum-exps 64 apart.
#[test]
fn efficient_attention_lowers_to_the_flash_kernels_with_its_seed() {
    let program = Program::with_scratch(
        efficient_attention(DType::F32, 0.3),
        &Limits::default(),
        &AttentionSizer,
    )
    .expect("a valid graph");
    let LoweredProgram(commands, spans, _) =
        lower_all(&program, &FusionPlan::none(), &super::folds::Folds::none());
    let at = |id: usize| match program.location(id) {
        Some(salus_exec::Location::Lane(off)) => (1 << 30) + off,
        other => panic!("tensor {id} at {other:?}"),
    };
    let forward = &commands[spans[0].clone()];
    let Command::Launch(seed) = &forward[0] else {
        panic!("the seed kernel first, got {:?}", forward[0]);
    };
    assert_eq!(seed.kernel, Kernel::AttentionSeed);
    let seed: &AttentionSeedArgs = seed.args.as_any().downcast_ref().unwrap();
    let key = salus_exec::random::name_key(&program.graph().nodes[0].name);
    assert_eq!(
        (seed.state, seed.key, seed.seed, seed.offset),
        (at(3), key, at(7), at(8))
    );
    assert!(
        matches!(forward[1], Command::Zero { ptr, bytes } if ptr == at(6) && bytes == 2 * 3 * 64 * 4),
        "{:?}",
        forward[1]
    );
    let attention: Vec<&AttentionArgs> = launches(&commands)
        .iter()
        .filter(|l| l.kernel.args_struct() == "AttentionArgs")
        .map(|l| l.args.as_any().downcast_ref().unwrap())
        .collect();
    assert!(!attention.is_empty());
    for a in &attention {
        assert_eq!((a.dropout, a.lses, a.lq), (0.3, 64, 37));
    }
    // The forward's draw from the state and key; the backward's from the seed as it is.
    let first_backward = attention
        .iter()
        .position(|a| a.delta != 0)
        .expect("a backward launch");
    for (k, a) in attention.iter().enumerate() {
        let want = if k < first_backward {
            (at(3), key, 1)
        } else {
            (at(7), 0, 0)
        };
        assert_eq!((a.seed, a.key, a.keyed), want, "launch {k}");
    }
    // Without dropout nothing draws (the seed is still written).
    let program = Program::with_scratch(
        efficient_attention(DType::F16, 0.0),
        &Limits::default(),
        &AttentionSizer,
    )
    .expect("a valid graph");
    let LoweredProgram(commands, _, _) =
        lower_all(&program, &FusionPlan::none(), &super::folds::Folds::none());
    let kernels: Vec<Kernel> = launches(&commands).iter().map(|l| l.kernel).collect();
    assert_eq!(
        kernels,
        vec![
            Kernel::AttentionSeed,
            Kernel::AttentionForwardTiled,
            Kernel::AttentionDeltaRows,
            Kernel::AttentionBackwardQueryTiled,
            Kernel::AttentionBackwardKeyValueTiled,
        ]
    );
    for l in launches(&commands).iter().skip(1) {
        let a: &AttentionArgs = l.args.as_any().downcast_ref().unwrap();
        assert_eq!((a.dropout, a.seed, a.keyed), (0.0, 0, 0));
    }
}

/// The efficient ops plan the scratch the flash ops plan at the same geometry.
#[test]
fn efficient_attention_plans_the_flash_ops_scratch() {
    for dtype in [DType::F32, DType::F16] {
        let graph = efficient_attention(dtype, 0.3);
        let program = Program::new(graph.clone(), &Limits::default()).expect("a valid graph");
        let mut flash = graph.clone();
        flash.nodes[0].op = Op::ScaledDotProductAttention;
        flash.nodes[1].op = Op::ScaledDotProductAttentionBackward;
        for node in 0..2 {
            let params = program.params(node);
            let bytes = attention::attention_scratch_bytes(&graph, node, params);
            assert_eq!(
                bytes,
                attention::attention_scratch_bytes(&flash, node, params),
                "{dtype} node {node}"
            );
            assert_eq!(
                bytes > 0,
                node == 1 || dtype == DType::F32,
                "{dtype} {node}"
            );
        }
    }
}

// ------------------------------------------------------------------------------------
// Batched fused launches.

use std::ops::Range;

use super::batch::batch_fused;
use crate::abi::{FUSED_BATCH, FusedBatchArgs};

/// SGD-like updates of parameters of `sizes` elements, laid out as a traced optimizer
/// lays them out: every `g * lr` first, then every `p - that`; with `feed_back` the k-th
/// update also reads the (k-1)-th's result. `lrs` gives each parameter's rate.
fn updates(sizes: &[u64], lrs: &[f64], feed_back: bool) -> Graph {
    let k = sizes.len();
    let mut tensors = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        tensors.push(f32t(&format!("p{i}"), &[n], Role::Feed));
        tensors.push(f32t(&format!("g{i}"), &[n], Role::Feed));
    }
    for (i, &n) in sizes.iter().enumerate() {
        tensors.push(f32t(&format!("step{i}"), &[n], Role::Intermediate));
    }
    for (i, &n) in sizes.iter().enumerate() {
        tensors.push(f32t(&format!("new{i}"), &[n], Role::Intermediate));
    }
    let mut nodes = Vec::new();
    for (i, &lr) in lrs.iter().enumerate() {
        let lr = Attr::Float(lr);
        nodes.push(node(
            Op::MulScalar,
            &[2 * i + 1],
            &[2 * k + i],
            &[("other", lr)],
        ));
    }
    for i in 0..k {
        let p = if feed_back && i > 0 {
            3 * k + i - 1
        } else {
            2 * i
        };
        nodes.push(node(Op::SubTensor, &[p, 2 * k + i], &[3 * k + i], &[]));
    }
    Graph {
        tensors,
        nodes,
        fetches: (3 * k..4 * k).collect(),
        updates: vec![],
        precision: Precision::IEEE,
    }
}

/// The commands and each node's span, lowered with fusion, then batched; and the fused
/// launches before batching.
fn lower_batched(graph: Graph) -> (Vec<Command>, Vec<Range<usize>>, Vec<fusion::FusedLaunch>) {
    let program = program(graph);
    let fusion = plan(&program);
    let LoweredProgram(commands, mut spans, singles_kernels) =
        lower_all(&program, &fusion, &super::folds::Folds::none());
    let singles = commands
        .iter()
        .filter_map(|c| match c {
            Command::Fused(f) => Some(f.clone()),
            _ => None,
        })
        .collect();
    let (commands, kernels) = batch_fused(commands, &mut spans);
    let source = crate::abi::fused_kernel_source(
        singles_kernels
            .iter()
            .chain(&kernels)
            .map(|(_, t)| t.as_str()),
    );
    if let Some(r) = crate::abi::tests::host_compiles(&source) {
        r.unwrap_or_else(|log| panic!("host C++ rejects\n{source}\n{log}"));
    }
    if let Some(r) = crate::abi::tests::nvrtc_compiles(&source) {
        r.unwrap_or_else(|log| panic!("NVRTC rejects\n{source}\n{log}"));
    }
    (commands, spans, singles)
}

fn batch_args(c: &Command) -> &FusedBatchArgs {
    match c {
        Command::FusedBatch(b) => &b.args,
        other => panic!("not a batch: {other:?}"),
    }
}

#[test]
fn a_run_of_one_fused_kernel_over_flat_operands_becomes_one_launch() {
    let sizes = [1000, 3, 262_144, 512, 1];
    let (commands, spans, singles) = lower_batched(updates(&sizes, &[0.1; 5], false));
    assert_eq!(singles.len(), 5, "one region per parameter");
    assert_eq!(commands.len(), 1, "{commands:?}");
    let a = batch_args(&commands[0]);
    assert_eq!((a.count, a.s), (5, singles[0].args.s));
    let mut block = 0;
    for (seg, f) in a.seg.iter().zip(&singles) {
        assert_eq!((seg.n, seg.first), (f.args.n, block));
        for k in 0..3 {
            assert_eq!(seg.ptr[k], f.args.ops[k].ptr);
            assert_eq!(seg.full >> k & 1, i64::from(f.args.ops[k].q != 0));
        }
        if seg.n > 1 {
            assert_eq!(seg.full, 0b111, "p, g in, the new value out: all full");
        }
        block += i64::from(f.grid);
    }
    assert_eq!(a.blocks, block);
    let Command::FusedBatch(b) = &commands[0] else {
        unreachable!()
    };
    assert_eq!(
        (b.grid as i64, b.name.clone()),
        (block, format!("{}_batch", singles[0].name))
    );
    // The first update's node holds the batch; every other node none.
    let held: Vec<usize> = (0..spans.len()).filter(|&i| !spans[i].is_empty()).collect();
    assert_eq!(held, vec![5]);
    assert_eq!(spans[5], 0..1);
}

#[test]
fn launches_batch_only_when_running_them_side_by_side_changes_nothing() {
    // Each update reads the one before it: run in order, never batched.
    let (commands, _, singles) = lower_batched(updates(&[64, 64, 64], &[0.1; 3], true));
    assert_eq!(commands.len(), singles.len(), "{commands:?}");
    assert!(commands.iter().all(|c| matches!(c, Command::Fused(_))));
    // Other scalars (another learning rate) end a run.
    let (commands, _, _) = lower_batched(updates(&[8, 8, 8, 8], &[0.1, 0.1, 0.2, 0.2], false));
    let counts: Vec<i64> = commands.iter().map(|c| batch_args(c).count).collect();
    assert_eq!(counts, vec![2, 2]);
    // A run longer than a batch takes is cut.
    let many = vec![16; FUSED_BATCH + 3];
    let (commands, spans, _) = lower_batched(updates(&many, &vec![0.1; many.len()], false));
    let counts: Vec<i64> = commands.iter().map(|c| batch_args(c).count).collect();
    assert_eq!(counts, vec![FUSED_BATCH as i64, 3]);
    let held = spans.iter().filter(|s| !s.is_empty()).count();
    assert_eq!(held, 2);
    assert_eq!(spans.last().unwrap().end, 2);
}
// ------------------------------------------------------------------------------------
// Transposes folded into products.

use super::folds;

/// `program` lowered with its folds (no fusion).
fn lower_folding(program: &Program) -> (Vec<Command>, folds::Folds) {
    let folds = folds::plan(program, &super::epilogues::Epilogues::none());
    let LoweredProgram(commands, _, _) = lower_all(program, &FusionPlan::none(), &folds);
    (commands, folds)
}

fn gemms(commands: &[Command]) -> Vec<&crate::driver::Gemm> {
    commands
        .iter()
        .filter_map(|c| match c {
            Command::Gemm(g) => Some(g),
            _ => None,
        })
        .collect()
}

/// A linear layer's step: y = x @ w.t() (forward), dx = g @ w.t().t() (backward), with
/// `extra` also reading w.t() elementwise.
fn linear(extra: bool) -> Graph {
    let mut tensors = vec![
        f32t("x", &[4, 3], Role::Feed),
        f32t("w", &[5, 3], Role::Parameter),
        f32t("g", &[4, 5], Role::Feed),
        f32t("wt", &[3, 5], Role::Intermediate),
        f32t("y", &[4, 5], Role::Intermediate),
        f32t("wtt", &[5, 3], Role::Intermediate),
        f32t("dx", &[4, 3], Role::Intermediate),
    ];
    let perm = || ("dims", Attr::Ints(vec![1, 0]));
    let mut nodes = vec![
        node(Op::Permute, &[1], &[3], &[perm()]),
        node(Op::Mm, &[0, 3], &[4], &[]),
        node(Op::Permute, &[3], &[5], &[perm()]),
        node(Op::Mm, &[2, 5], &[6], &[]),
    ];
    let mut fetches = vec![4, 6];
    if extra {
        tensors.push(f32t("wt2", &[3, 5], Role::Intermediate));
        nodes.push(node(
            Op::MulScalar,
            &[3],
            &[7],
            &[("other", Attr::Float(2.0))],
        ));
        fetches.push(7);
    }
    Graph {
        tensors,
        nodes,
        fetches,
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[test]
fn a_weights_transposes_fold_into_the_products_that_read_them() {
    let program = program(linear(false));
    let (commands, folds) = lower_folding(&program);
    assert!(folds.skips(0) && folds.skips(2), "{folds:?}");
    assert_eq!(folds.source(3), Some((1, true)), "w.t() reads w transposed");
    assert_eq!(
        folds.source(5),
        Some((1, false)),
        "w.t().t() reads w as stored"
    );
    assert_eq!(commands.len(), 2, "two products, no copies: {commands:?}");
    let w = 1 << 20; // the persistent block: w is its only tensor
    let g = gemms(&commands);
    // y = x @ w^T: cuBLAS's first operand is the right factor, w (3 per row) transposed.
    assert_eq!((g[0].a, g[0].lda, g[0].trans_a), (w, 3, true));
    assert_eq!((g[0].m, g[0].n, g[0].k), (5, 4, 3));
    // dx = g @ w: w as stored.
    assert_eq!((g[1].a, g[1].lda, g[1].trans_a), (w, 3, false));
    assert_eq!((g[1].m, g[1].n, g[1].k), (3, 4, 5));
    // Unfolded, the same products read the copies.
    let LoweredProgram(unfolded, _, _) =
        lower_all(&program, &FusionPlan::none(), &folds::Folds::none());
    assert_eq!(unfolded.len(), 4);
    assert!(gemms(&unfolded).iter().all(|g| !g.trans_a && !g.trans_b));
}

#[test]
fn a_transpose_something_else_reads_is_copied_and_a_transpose_of_it_copies_straight() {
    let program = program(linear(true));
    let (commands, folds) = lower_folding(&program);
    assert!(!folds.skips(0), "w.t() is also read elementwise: copied");
    assert_eq!(folds.source(3), None);
    assert!(folds.skips(2), "w.t().t() still reads w");
    assert_eq!(folds.source(5), Some((1, false)));
    let g = gemms(&commands);
    assert_eq!(g.len(), 2);
    assert_eq!(
        (g[1].a, g[1].trans_a),
        (1 << 20, false),
        "dx reads w itself"
    );
    // w.t() copied once (the first product reads the copy), then the elementwise op.
    assert_eq!(commands.len(), 4, "{commands:?}");
}

// ------------------------------------------------------------------------------------
// Adds folded into their producers.

/// y = b + x @ w (addmm), z = r + y (fetched); with `fetch_y` y is fetched too.
fn residual(fetch_y: bool) -> Graph {
    let tensors = vec![
        f32t("x", &[4, 3], Role::Feed),
        f32t("w", &[3, 5], Role::Parameter),
        f32t("b", &[5], Role::Parameter),
        f32t("r", &[4, 5], Role::Feed),
        f32t("y", &[4, 5], Role::Intermediate),
        f32t("z", &[4, 5], Role::Intermediate),
    ];
    let nodes = vec![
        node(Op::Addmm, &[2, 0, 1], &[4], &[]),
        node(Op::AddTensor, &[3, 4], &[5], &[]),
    ];
    Graph {
        tensors,
        nodes,
        fetches: if fetch_y { vec![5, 4] } else { vec![5] },
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[test]
fn a_residual_add_folds_into_the_product_that_makes_its_operand() {
    let program = program(residual(false));
    let epilogues = super::epilogues::plan(&program, &FusionPlan::none());
    let e = epilogues.of(0).expect("the add folds into the product");
    assert_eq!((e.out, e.residual), (5, 3));
    assert!(epilogues.skips(1));
    let list = lower_program(
        &program,
        (1 << 20, 1 << 30, 1 << 40),
        None,
        &FusionPlan::none(),
        false,
    )
    .expect("lowered");
    let z = match program.location(5) {
        Some(salus_exec::Location::Lane(off)) => (1 << 30) + off,
        other => panic!("z at {other:?}"),
    };
    // z = r + b first (one elementwise launch), then the product accumulates into z.
    assert_eq!(list.commands.len(), 2, "{:?}", list.commands);
    assert_eq!(list.spans[1], 2..2, "the add issues nothing");
    let g = gemms(&list.commands);
    assert_eq!((g[0].c, g[0].beta), (z, 1.0));
}

#[test]
fn an_add_whose_operand_is_read_elsewhere_runs_as_itself() {
    let program = program(residual(true));
    let epilogues = super::epilogues::plan(&program, &FusionPlan::none());
    assert_eq!(
        epilogues.of(0),
        None,
        "y is fetched: the product must write it"
    );
    assert!(!epilogues.skips(1));
}

#[test]
fn views_of_strided_tensors_get_their_strides_or_none() {
    use super::folds::view_strides;
    // One of three [2, 4, 6] slices of a [2, 4, 18] tensor, as [2, 4, 2, 3] heads.
    assert_eq!(
        view_strides(&[2, 4, 6], &[72, 18, 1], &[2, 4, 2, 3]),
        Some(vec![72, 18, 3, 1])
    );
    // Merging the batch and row dims of that slice: evenly spaced, one stride.
    assert_eq!(
        view_strides(&[2, 4, 6], &[72, 18, 1], &[8, 6]),
        Some(vec![18, 1])
    );
    // Merging rows with the cut dim is not one strided view.
    assert_eq!(view_strides(&[2, 4, 6], &[72, 18, 1], &[2, 24]), None);
    // A contiguous tensor takes any shape; size-1 dims anywhere.
    assert_eq!(
        view_strides(&[6, 4], &[4, 1], &[3, 1, 8]),
        Some(vec![8, 8, 1])
    );
    assert_eq!(view_strides(&[6, 0], &[0, 1], &[0]), None);
}

// ------------------------------------------------------------------------------------
// Permutes folded into the cat that reads them.

/// The backward of attention's heads-first split: `a` and `b` [2, 3, 4, 5] ([B, H, S, D])
/// each permuted to [B, S, H, D] and viewed as [2, 4, 15], cat along the last dim with a
/// feed `c` [2, 4, 6] between them (fetched). With `read_permute`, the first permute's
/// output is also fetched.
fn heads_back_into_rows(read_permute: bool) -> Graph {
    let perm = || ("dims", Attr::Ints(vec![0, 2, 1, 3]));
    let size = || ("size", Attr::Ints(vec![2, 4, 15]));
    let tensors = vec![
        f32t("a", &[2, 3, 4, 5], Role::Feed),
        f32t("b", &[2, 3, 4, 5], Role::Feed),
        f32t("c", &[2, 4, 6], Role::Feed),
        f32t("pa", &[2, 4, 3, 5], Role::Intermediate),
        f32t("va", &[2, 4, 15], Role::Intermediate),
        f32t("pb", &[2, 4, 3, 5], Role::Intermediate),
        f32t("vb", &[2, 4, 15], Role::Intermediate),
        f32t("rows", &[2, 4, 36], Role::Intermediate),
    ];
    let nodes = vec![
        node(Op::Permute, &[0], &[3], &[perm()]),
        node(Op::View, &[3], &[4], &[size()]),
        node(Op::Permute, &[1], &[5], &[perm()]),
        node(Op::View, &[5], &[6], &[size()]),
        node(
            Op::Cat,
            &[4, 2, 6],
            &[7],
            &[("tensors.len", Attr::Int(3)), ("dim", Attr::Int(-1))],
        ),
    ];
    Graph {
        tensors,
        nodes,
        fetches: if read_permute { vec![7, 3] } else { vec![7] },
        updates: vec![],
        precision: Precision::IEEE,
    }
}

/// Plans as the CUDA device does: its kernels' scratch, and its folded copies' reads.
struct CudaPlan;

impl salus_graph::ScratchSizer for CudaPlan {
    fn scratch_bytes(&self, graph: &Graph, node: usize, params: &salus_graph::OpParams) -> u64 {
        crate::kernel_scratch_bytes(graph, node, params)
    }

    fn extra_reads(&self, graph: &Graph, params: &[salus_graph::OpParams]) -> Vec<(usize, usize)> {
        folds::extra_reads(graph, params)
    }
}

#[test]
fn permutes_read_only_by_a_cat_are_copied_by_the_cat_from_their_source() {
    let cuda_plan = |graph| Program::with_scratch(graph, &Limits::default(), &CudaPlan).unwrap();
    // Planned without the folded reads, the cat's output takes the bytes of the permutes'
    // sources (read for the last time by the permutes): no fold.
    let (commands, folds) = lower_folding(&program(heads_back_into_rows(false)));
    assert!(
        !folds.skips(0) && !folds.skips(2) && commands.len() == 5,
        "{folds:?}"
    );
    let program = cuda_plan(heads_back_into_rows(false));
    let (commands, folds) = lower_folding(&program);
    assert!(folds.skips(0) && folds.skips(2), "{folds:?}");
    let a = folds.strided_source(4).expect("va reads from a");
    assert_eq!((a.root, a.offset), (0, 0));
    // [B, S, H, D] walking a [B, H, S, D]: strides 60, 5, 20, 1.
    assert_eq!(
        (a.shape.clone(), a.strides.clone()),
        (vec![2, 4, 3, 5], vec![60, 5, 20, 1])
    );
    assert_eq!(folds.strided_source(6).map(|s| s.root), Some(1));
    assert_eq!(
        commands.len(),
        3,
        "the cat's three copies, no permute: {commands:?}"
    );
    // The slot of a view of [B, S, H*D] in [2, 4, 36], viewed as [B, S, H, D].
    assert_eq!(
        folds::cat_slot(&[2, 4, 36], &[2, 4, 15], &[2, 4, 3, 5]),
        Some(vec![144, 36, 5, 1])
    );
    // A permute something else reads is copied, and the cat reads its copy.
    let program = cuda_plan(heads_back_into_rows(true));
    let (commands, folds) = lower_folding(&program);
    assert!(!folds.skips(0) && folds.skips(2));
    assert!(folds.strided_source(4).is_none());
    assert_eq!(commands.len(), 4, "{commands:?}");
}

// ------------------------------------------------------------------------------------
// Fills folded into the scatter that starts from them.

/// Cross-entropy's backward as traced: `zeros = full_like(logits, 0)`, then
/// `scatter.value(zeros, 1, target, -1)` (fetched); with `read_zeros` the zeros are also
/// fetched.
fn one_hot(read_zeros: bool) -> Graph {
    let tensors = vec![
        f32t("logits", &[4, 6], Role::Feed),
        tensor("target", DType::I64, &[4, 1], Role::Feed),
        f32t("zeros", &[4, 6], Role::Intermediate),
        f32t("grad", &[4, 6], Role::Intermediate),
    ];
    let nodes = vec![
        node(
            Op::FullLike,
            &[0],
            &[2],
            &[("fill_value", Attr::Float(0.0))],
        ),
        node(
            Op::ScatterValue,
            &[2, 1],
            &[3],
            &[("dim", Attr::Int(1)), ("value", Attr::Float(-1.0))],
        ),
    ];
    Graph {
        tensors,
        nodes,
        fetches: if read_zeros { vec![3, 2] } else { vec![3] },
        updates: vec![],
        precision: Precision::IEEE,
    }
}

#[test]
fn a_fill_read_only_by_a_scatter_is_written_by_the_scatter() {
    let (commands, folds) = lower_folding(&program(one_hot(false)));
    assert!(folds.skips(0), "{folds:?}");
    assert_eq!(folds.constant(2), Some(0.0));
    // The scatter fills its output, then writes the indexed places: no copy of the zeros.
    assert_eq!(commands.len(), 2, "{commands:?}");
    let (commands, folds) = lower_folding(&program(one_hot(true)));
    assert!(!folds.skips(0) && folds.constant(2).is_none());
    assert_eq!(commands.len(), 3, "fill, copy, scatter: {commands:?}");
}
