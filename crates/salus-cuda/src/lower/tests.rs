//! Lowering without a GPU: command lists of small programs at made-up addresses.

use std::collections::BTreeMap;

use salus_graph::{Attr, Graph, Limits, Node, Role, Tensor, samples};

use super::elementwise::{StridedView, coalesce};
use super::*;
use crate::abi::{ConvArgs, PoolArgs};

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

/// The commands of `graph`, persistent block at 1 << 20, lane at 1 << 30.
fn lower(graph: Graph) -> Vec<Command> {
    let program = Program::new(graph, &Limits::default()).expect("a valid graph");
    let mut lowering = Lowering {
        program: &program,
        persistent: 1 << 20,
        lane: 1 << 30,
        err: 1 << 40,
        dnn: None,
        index: 0,
        commands: Vec::new(),
    };
    for (index, node) in program.graph().nodes.iter().enumerate() {
        lowering.index = index;
        lowering.node(node).expect("lowered");
    }
    lowering.commands
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
        name: format!("{op}"),
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
