//! Every validation rule, with a graph that breaks it and the message it gets.

#![allow(clippy::unwrap_used)]

mod common;

use common::Builder;
use salus_graph::{Attr, DType, Graph, GraphError, Limits, Op, Role, Update, check};

fn error(graph: &Graph) -> String {
    let err = check(graph, &Limits::default()).unwrap_err();
    err.to_string()
}

fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "{message:?} should mention {needle:?}"
        );
    }
}

/// A small valid training-like graph: y = relu(x @ w + b), loss = sum(y), w updated.
fn valid() -> Builder {
    let mut g = Builder::default();
    let x = g.f32("x", &[4, 8], Role::Feed);
    let w = g.f32("w", &[8, 3], Role::Parameter);
    let b = g.f32("b", &[3], Role::Parameter);
    let y = g.node(
        Op::Addmm,
        &[Some(b), Some(x), Some(w)],
        &[(DType::F32, &[4, 3])],
        &[],
    )[0];
    let r = g.node(Op::Relu, &[Some(y)], &[(DType::F32, &[4, 3])], &[])[0];
    let loss = g.node(
        Op::SumDimIntList,
        &[Some(r)],
        &[(DType::F32, &[])],
        &[("dim", Attr::Ints(vec![])), ("keepdim", Attr::Bool(false))],
    )[0];
    let w2 = g.node(
        Op::MulScalar,
        &[Some(w)],
        &[(DType::F32, &[8, 3])],
        &[("other", Attr::Float(0.5))],
    )[0];
    g.graph.fetches = vec![loss];
    g.graph.updates = vec![Update {
        target: w,
        value: w2,
    }];
    g
}

#[test]
fn a_valid_graph_passes_and_round_trips_through_protobuf() {
    let g = valid();
    let checked = check(&g.graph, &Limits::default()).unwrap();
    assert_eq!(checked.plan.persistent_bytes, 256 + 256);
    let decoded = Graph::decode(&g.graph.encode()).unwrap();
    assert_eq!(decoded, g.graph);
}

#[test]
fn shape_mismatch_names_node_op_source_and_shapes() {
    let mut g = valid();
    g.graph.tensors[1].ty.shape = vec![7, 3];
    assert_mentions(
        &error(&g.graph),
        &[
            "node 0 'n0'",
            "(addmm, from model.layer0)",
            "f32[4, 8]",
            "f32[7, 3]",
            "[n, k] and [k, m]",
        ],
    );
}

#[test]
fn declared_output_type_must_match_inference() {
    let mut g = valid();
    g.graph.tensors[4].ty.shape = vec![4, 4];
    assert_mentions(
        &error(&g.graph),
        &[
            "node 1 'n1' (relu",
            "declared f32[4, 4]",
            "op gives f32[4, 3]",
        ],
    );
    let mut g = valid();
    g.graph.tensors[4].ty.dtype = DType::I64;
    assert_mentions(&error(&g.graph), &["declared i64[4, 3]", "gives f32[4, 3]"]);
}

#[test]
fn broadcasting_errors_name_the_dimension() {
    let mut g = Builder::default();
    let a = g.f32("a", &[4, 3], Role::Feed);
    let b = g.f32("b", &[4, 2], Role::Feed);
    g.node(
        Op::AddTensor,
        &[Some(a), Some(b)],
        &[(DType::F32, &[4, 3])],
        &[],
    );
    assert_mentions(
        &error(&g.graph),
        &[
            "add.Tensor",
            "[4, 3] and [4, 2] do not broadcast",
            "dimension 1: 3 vs 2",
        ],
    );
}

#[test]
fn missing_and_wrong_attributes_are_named() {
    let mut g = Builder::default();
    let x = g.f32("x", &[2, 3], Role::Feed);
    g.node(Op::View, &[Some(x)], &[(DType::F32, &[6])], &[]);
    assert_mentions(&error(&g.graph), &["view", "attribute \"size\" is missing"]);
    let mut g = Builder::default();
    let x = g.f32("x", &[2, 3], Role::Feed);
    g.node(
        Op::View,
        &[Some(x)],
        &[(DType::F32, &[6])],
        &[("size", Attr::Float(6.0))],
    );
    assert_mentions(
        &error(&g.graph),
        &["attribute \"size\" must be a list of ints"],
    );
    let mut g = Builder::default();
    let x = g.f32("x", &[2, 3], Role::Feed);
    g.node(
        Op::View,
        &[Some(x)],
        &[(DType::F32, &[5])],
        &[("size", Attr::Ints(vec![5]))],
    );
    assert_mentions(
        &error(&g.graph),
        &["cannot view f32[2, 3] (6 elements) as [5]"],
    );
}

#[test]
fn wrong_input_counts_and_absent_required_inputs() {
    let mut g = Builder::default();
    let x = g.f32("x", &[2], Role::Feed);
    g.node(Op::Relu, &[Some(x), Some(x)], &[(DType::F32, &[2])], &[]);
    assert_mentions(&error(&g.graph), &["relu", "takes 1 tensor inputs, got 2"]);
    let mut g = Builder::default();
    let x = g.f32("x", &[2], Role::Feed);
    g.node(Op::AddTensor, &[Some(x), None], &[(DType::F32, &[2])], &[]);
    assert_mentions(&error(&g.graph), &["input 1 is required but absent"]);
}

#[test]
fn inputs_must_be_produced_before_use() {
    let mut g = Builder::default();
    let x = g.f32("x", &[2], Role::Feed);
    let later = g.f32("later", &[2], Role::Intermediate);
    g.node(
        Op::AddTensor,
        &[Some(x), Some(later)],
        &[(DType::F32, &[2])],
        &[],
    );
    assert_mentions(
        &error(&g.graph),
        &["input 1 is tensor 1 'later', which no earlier node produces"],
    );
}

#[test]
fn nodes_produce_intermediates_once() {
    let mut g = valid();
    g.graph.nodes[1].outputs[0] = Some(1); // w, a parameter
    assert_mentions(
        &error(&g.graph),
        &["output 0 is tensor 1 'w', a Parameter tensor"],
    );
    let mut g = valid();
    g.graph.nodes[1].outputs[0] = g.graph.nodes[0].outputs[0];
    assert_mentions(&error(&g.graph), &["already produced"]);
    let mut g = valid();
    g.graph.nodes[1].outputs.push(None);
    assert_mentions(&error(&g.graph), &["has 1 outputs, 2 declared"]);
}

/// An op's only result must be used: a node writing nowhere passed validation and then
/// failed every iteration on every device ("output 0 is unused").
#[test]
fn an_ops_only_result_cannot_be_unused() {
    let mut message = valid().graph.to_proto();
    message.nodes[1].outputs[0] = -1; // relu's result
    let graph = Graph::from_proto(&message).unwrap();
    assert_mentions(
        &error(&graph),
        &[
            "node 1 'n1' (relu",
            "output 0 is -1 (unused)",
            "only result",
        ],
    );
    // Ids other than -1 and those past the tensors are refused when decoding.
    for bad in [-2, -1 << 40, 11, 1 << 40] {
        let mut message = valid().graph.to_proto();
        message.nodes[1].outputs[0] = bad;
        let err = Graph::from_proto(&message).unwrap_err().to_string();
        assert_mentions(&err, &["node 1", &format!("refers to tensor {bad}")]);
    }
}

/// Node names identify nodes in errors and profiles: two nodes may not share one.
#[test]
fn node_names_are_unique() {
    let mut g = valid();
    g.graph.nodes[3].name = "n1".into();
    assert_mentions(
        &error(&g.graph),
        &["node 3 'n1'", "node 1 has the same name"],
    );
}

/// permute follows PyTorch: negative dims within range wrap, and the dims must be a
/// permutation of the input's dimensions once wrapped.
#[test]
fn permute_needs_a_true_permutation() {
    let permute = |dims: Vec<i64>| {
        let mut g = Builder::default();
        let x = g.f32("x", &[2, 3, 4], Role::Feed);
        let y = g.node(
            Op::Permute,
            &[Some(x)],
            &[(DType::F32, &[4, 2, 3])],
            &[("dims", Attr::Ints(dims))],
        )[0];
        g.graph.fetches = vec![y];
        check(&g.graph, &Limits::default()).map(|_| ())
    };
    assert_eq!(permute(vec![2, 0, 1]), Ok(()));
    assert_eq!(permute(vec![-1, -3, -2]), Ok(()), "negative dims wrap");
    for (dims, needle) in [
        (
            vec![-4, 0, 1],
            "dimension -4 out of range for a tensor of rank 3",
        ),
        (vec![3, 0, 1], "dimension 3 out of range"),
        (vec![2, -1, 0], "dimension 2 appears twice in [2, -1, 0]"),
        (vec![2, 0], "must name each of the 3 dimensions"),
    ] {
        let err = permute(dims.clone()).unwrap_err().to_string();
        assert_mentions(&err, &[needle]);
    }
}

/// An absurd input gets a short error: 100,000 permute dims made a 649 KB message, which
/// no longer fit a gRPC status.
#[test]
fn errors_about_huge_input_stay_short() {
    let mut g = valid();
    g.graph.nodes[1].attrs.insert(
        "dims".into(),
        Attr::Ints((0..100_000).map(|d| d % 2).collect()),
    );
    let err = error(&g.graph);
    assert_mentions(
        &err,
        &["node 1", "100000 values, more than the limit of 65536"],
    );
    assert!(err.len() < 300, "{} bytes: {err}", err.len());
    let mut message = valid().graph.to_proto();
    message.nodes[1].op = "x".repeat(10_000);
    let err = Graph::from_proto(&message).unwrap_err().to_string();
    assert_mentions(&err, &["unknown op \"xxxx", "(10000 characters)"]);
    assert!(err.len() < 400, "{} bytes: {err}", err.len());
    // Within the limit, a bad list is shown by its first entries.
    let mut g = Builder::default();
    let x = g.f32("x", &[2, 3], Role::Feed);
    let y = g.node(
        Op::Permute,
        &[Some(x)],
        &[(DType::F32, &[3, 2])],
        &[("dims", Attr::Ints((0..60_000).map(|d| d % 2).collect()))],
    )[0];
    g.graph.fetches = vec![y];
    let err = error(&g.graph);
    assert_mentions(
        &err,
        &["appears twice in [0, 1, 0, 1, 0, 1, 0, 1, ... (60000 values)]"],
    );
    assert!(err.len() < 300, "{} bytes: {err}", err.len());
}

#[test]
fn fetches_and_updates_are_checked() {
    let mut g = valid();
    let orphan = g.f32("orphan", &[1], Role::Intermediate);
    g.graph.fetches.push(orphan);
    assert_mentions(
        &error(&g.graph),
        &["'orphan'", "fetched but no node produces it"],
    );
    let mut g = valid();
    g.graph.updates[0].target = 0; // x, a feed
    assert_mentions(
        &error(&g.graph),
        &["tensor 0 'x'", "not a parameter or state"],
    );
    let mut g = valid();
    g.graph.updates.push(g.graph.updates[0]);
    assert_mentions(&error(&g.graph), &["'w'", "updated twice"]);
    let mut g = valid();
    g.graph.updates[0].target = 2; // b is [3], value is [8, 3]
    assert_mentions(
        &error(&g.graph),
        &["'b'", "is f32[3] but its update value", "f32[8, 3]"],
    );
}

#[test]
fn limits_stop_absurd_graphs() {
    let mut g = valid();
    g.graph.tensors[0].ty.shape = vec![1 << 40, 1 << 30];
    assert_mentions(
        &error(&g.graph),
        &["tensor 0 'x'", "needs more than the limit of"],
    );
    let mut g = valid();
    g.graph.tensors[0].ty.shape = vec![1; 9];
    assert_mentions(
        &error(&g.graph),
        &["9 dimensions, more than the limit of 8"],
    );
    let tight = Limits {
        max_nodes: 2,
        ..Limits::default()
    };
    let err = check(&valid().graph, &tight).unwrap_err();
    assert_eq!(
        err,
        GraphError::Graph("4 nodes, more than the limit of 2".into())
    );
    let tight = Limits {
        max_total_bytes: 100,
        ..Limits::default()
    };
    assert!(
        check(&valid().graph, &tight)
            .unwrap_err()
            .to_string()
            .contains("more than the limit of 100")
    );
}

#[test]
fn constants_carry_exactly_their_bytes() {
    let mut g = valid();
    g.graph.tensors[2].role = Role::Constant;
    assert_mentions(&error(&g.graph), &["'b'", "needs 12 bytes of data, got 0"]);
    let mut g = valid();
    g.graph.tensors[0].data = vec![1, 2, 3];
    assert_mentions(&error(&g.graph), &["'x'", "carries no data"]);
}

#[test]
fn protobuf_decoding_errors_are_specific() {
    let mut message = valid().graph.to_proto();
    message.version = 2;
    let err = Graph::from_proto(&message).unwrap_err().to_string();
    assert_mentions(&err, &["version 2 is not supported", "version 1"]);
    let mut message = valid().graph.to_proto();
    message.nodes[1].op = "linalg_det".into();
    let err = Graph::from_proto(&message).unwrap_err().to_string();
    assert_mentions(&err, &["node 1 'n1'", "unknown op \"linalg_det\""]);
    let mut message = valid().graph.to_proto();
    message.nodes[0].inputs[0] = 99;
    let err = Graph::from_proto(&message).unwrap_err().to_string();
    assert_mentions(
        &err,
        &["node 0", "refers to tensor 99, which does not exist"],
    );
    let mut message = valid().graph.to_proto();
    message.tensors[0].shape = vec![-4, 8];
    let err = Graph::from_proto(&message).unwrap_err().to_string();
    assert_mentions(&err, &["tensor 0 'x'", "negative dimension"]);
    let mut message = valid().graph.to_proto();
    message.tensors[0].dtype = 42;
    assert_mentions(
        &Graph::from_proto(&message).unwrap_err().to_string(),
        &["unknown dtype 42"],
    );
    assert_mentions(
        &Graph::decode(&[0xff, 0xff]).unwrap_err().to_string(),
        &["not a valid salus.v1.Graph"],
    );
}

#[test]
fn convolution_and_pooling_shapes() {
    let mut g = Builder::default();
    let x = g.f32("x", &[2, 3, 32, 32], Role::Feed);
    let w = g.f32("w", &[16, 3, 3, 3], Role::Parameter);
    let conv_attrs = [
        ("stride", Attr::Ints(vec![2, 2])),
        ("padding", Attr::Ints(vec![1, 1])),
        ("dilation", Attr::Ints(vec![1, 1])),
        ("transposed", Attr::Bool(false)),
        ("output_padding", Attr::Ints(vec![0, 0])),
        ("groups", Attr::Int(1)),
    ];
    let y = g.node(
        Op::Convolution,
        &[Some(x), Some(w), None],
        &[(DType::F32, &[2, 16, 16, 16])],
        &conv_attrs,
    )[0];
    g.node(
        Op::MaxPool2dWithIndices,
        &[Some(y)],
        &[(DType::F32, &[2, 16, 8, 8]), (DType::I64, &[2, 16, 8, 8])],
        &[
            ("kernel_size", Attr::Ints(vec![3, 3])),
            ("stride", Attr::Ints(vec![2, 2])),
            ("padding", Attr::Ints(vec![1, 1])),
        ],
    );
    check(&g.graph, &Limits::default()).unwrap();
    g.graph.tensors[1].ty.shape = vec![16, 4, 3, 3];
    assert_mentions(
        &error(&g.graph),
        &[
            "convolution",
            "input has 3 channels but weight f32[16, 4, 3, 3]",
        ],
    );
}

/// One node over feeds of the given types; the error message of validating it.
fn op_error(
    op: Op,
    inputs: &[(DType, &[u64])],
    output: (DType, &[u64]),
    attrs: &[(&str, Attr)],
) -> String {
    let mut g = Builder::default();
    let ids: Vec<Option<usize>> = inputs
        .iter()
        .enumerate()
        .map(|(i, (d, s))| Some(g.tensor(&format!("in{i}"), *d, s, Role::Feed)))
        .collect();
    g.node(op, &ids, &[output], attrs);
    error(&g.graph)
}

#[test]
fn every_op_family_rejects_bad_arguments_with_a_reason() {
    use DType::{Bool, F32, I64};
    let cases: Vec<(String, &str)> = vec![
        (
            op_error(
                Op::Bmm,
                &[(F32, &[2, 3, 4]), (F32, &[2, 5, 6])],
                (F32, &[2, 3, 6]),
                &[],
            ),
            "[b, n, k] and [b, k, m]",
        ),
        (
            op_error(
                Op::Cat,
                &[(F32, &[2, 3]), (F32, &[4, 4])],
                (F32, &[6, 3]),
                &[("tensors.len", Attr::Int(2)), ("dim", Attr::Int(0))],
            ),
            "does not match tensor 0",
        ),
        (
            op_error(Op::Cat, &[(F32, &[2, 3])], (F32, &[2, 3]), &[]),
            "\"tensors.len\"",
        ),
        (
            op_error(
                Op::SplitWithSizes,
                &[(F32, &[5, 2])],
                (F32, &[2, 2]),
                &[
                    ("split_sizes", Attr::Ints(vec![2, 2])),
                    ("dim", Attr::Int(0)),
                ],
            ),
            "add up to 4, but dimension 0",
        ),
        (
            op_error(
                Op::Permute,
                &[(F32, &[2, 3])],
                (F32, &[3, 2]),
                &[("dims", Attr::Ints(vec![0, 0]))],
            ),
            "appears twice",
        ),
        (
            op_error(
                Op::Expand,
                &[(F32, &[2, 3])],
                (F32, &[4, 3]),
                &[("size", Attr::Ints(vec![4, 3]))],
            ),
            "dimension 0 is 2",
        ),
        (
            op_error(
                Op::SliceTensor,
                &[(F32, &[8])],
                (F32, &[8]),
                &[("dim", Attr::Int(0)), ("step", Attr::Int(0))],
            ),
            "step must be positive",
        ),
        (
            op_error(
                Op::SelectInt,
                &[(F32, &[3, 2])],
                (F32, &[2]),
                &[("dim", Attr::Int(0)), ("index", Attr::Int(3))],
            ),
            "index 3 out of range",
        ),
        (
            op_error(
                Op::Unsqueeze,
                &[(F32, &[3])],
                (F32, &[3, 1]),
                &[("dim", Attr::Int(5))],
            ),
            "dimension 5 out of range",
        ),
        (
            op_error(
                Op::NativeLayerNorm,
                &[(F32, &[2, 8]), (F32, &[8]), (F32, &[8])],
                (F32, &[2, 8]),
                &[
                    ("normalized_shape", Attr::Ints(vec![4])),
                    ("eps", Attr::Float(1e-5)),
                ],
            ),
            "must equal the last dimensions",
        ),
        (
            op_error(
                Op::Embedding,
                &[(F32, &[10, 4]), (F32, &[3])],
                (F32, &[3, 4]),
                &[],
            ),
            "indices must be an i64 or i32 tensor",
        ),
        (
            op_error(
                Op::Gather,
                &[(F32, &[3, 4]), (I64, &[3])],
                (F32, &[3]),
                &[("dim", Attr::Int(1))],
            ),
            "must have the rank of input",
        ),
        (
            op_error(
                Op::WhereSelf,
                &[(F32, &[3]), (F32, &[3]), (F32, &[3])],
                (F32, &[3]),
                &[],
            ),
            "condition must be bool",
        ),
        (
            op_error(
                Op::Softmax,
                &[(I64, &[3])],
                (I64, &[3]),
                &[("dim", Attr::Int(0))],
            ),
            "must be a floating-point tensor",
        ),
        (
            op_error(Op::MeanDim, &[(I64, &[3])], (I64, &[]), &[]),
            "floating-point result",
        ),
        (
            op_error(
                Op::ArangeStartStep,
                &[],
                (I64, &[3]),
                &[
                    ("start", Attr::Int(0)),
                    ("end", Attr::Int(3)),
                    ("step", Attr::Int(-1)),
                ],
            ),
            "goes away from end",
        ),
        (
            op_error(
                Op::BernoulliP,
                &[(F32, &[3]), (I64, &[])],
                (F32, &[3]),
                &[("p", Attr::Float(1.5))],
            ),
            "p must be in [0, 1]",
        ),
        (
            op_error(
                Op::Full,
                &[],
                (F32, &[2]),
                &[
                    ("size", Attr::Ints(vec![-2])),
                    ("fill_value", Attr::Float(0.0)),
                ],
            ),
            "must be >= 0",
        ),
        (
            op_error(
                Op::IndexPut,
                &[(F32, &[4]), (I64, &[2]), (I64, &[2])],
                (F32, &[4]),
                &[
                    ("indices.len", Attr::Int(1)),
                    ("accumulate", Attr::Bool(true)),
                ],
            ),
            "values i64[2] must have the dtype of f32[4]",
        ),
        (
            op_error(Op::Clamp, &[(F32, &[3])], (F32, &[3]), &[]),
            "at least one of \"min\" and \"max\"",
        ),
        (
            op_error(
                Op::BitwiseAndTensor,
                &[(F32, &[3]), (F32, &[3])],
                (F32, &[3]),
                &[],
            ),
            "integer or bool",
        ),
        (
            op_error(
                Op::Gelu,
                &[(F32, &[3])],
                (F32, &[3]),
                &[("approximate", Attr::Str("fast".into()))],
            ),
            "\"none\" or \"tanh\"",
        ),
        (
            op_error(
                Op::LogicalAnd,
                &[(Bool, &[3]), (Bool, &[4])],
                (Bool, &[3]),
                &[],
            ),
            "do not broadcast",
        ),
        (
            op_error(
                Op::MaxPool2dWithIndices,
                &[(F32, &[1, 1, 2, 2])],
                (F32, &[1, 1, 1, 1]),
                &[
                    ("kernel_size", Attr::Ints(vec![3, 3])),
                    ("padding", Attr::Ints(vec![0, 0])),
                ],
            ),
            "smaller than the kernel extent",
        ),
        (
            op_error(
                Op::AdaptiveAvgPool2d,
                &[(F32, &[4, 4])],
                (F32, &[1, 1]),
                &[("output_size", Attr::Ints(vec![1, 1]))],
            ),
            "input must be 3-d or 4-d",
        ),
    ];
    for (message, needle) in cases {
        assert!(
            message.contains(needle),
            "{message:?} should mention {needle:?}"
        );
    }
}

#[test]
fn update_values_must_be_computed() {
    let mut g = valid();
    g.graph.updates[0].value = 2; // b, a parameter
    g.graph.updates[0].target = 2;
    assert_mentions(
        &error(&g.graph),
        &["tensor 2 'b'", "update's value but is a Parameter tensor"],
    );
}

#[test]
fn precision_flags_round_trip_and_default_to_pytorchs() {
    use salus_graph::Precision;
    let mut g = valid().graph;
    assert_eq!(
        g.precision,
        Precision {
            conv_tf32: true,
            matmul_tf32: false
        }
    );
    for precision in [
        Precision::IEEE,
        Precision {
            conv_tf32: false,
            matmul_tf32: true,
        },
    ] {
        g.precision = precision;
        assert_eq!(Graph::decode(&g.encode()).unwrap().precision, precision);
    }
    // An older client sends no flags: PyTorch's defaults.
    let mut message = g.to_proto();
    message.precision = None;
    assert_eq!(
        Graph::from_proto(&message).unwrap().precision,
        Precision::default()
    );
    // One flag given, the other left out: that one takes its default.
    let mut message = g.to_proto();
    if let Some(p) = message.precision.as_mut() {
        p.conv_allow_tf32 = Some(false);
        p.matmul_allow_tf32 = None;
    }
    assert_eq!(
        Graph::from_proto(&message).unwrap().precision,
        Precision::IEEE
    );
}
