//! Typed op parameters: what validation reads out of each node's attributes, with dims
//! normalised, defaults filled in and geometry derived, and the errors of bad attributes.

#![allow(clippy::unwrap_used)]

mod common;

use common::Builder;
use salus_graph::{
    Attr, ConvParams, DType, GeluApproximate, Limits, Op, OpParams, Role, check, wrap_dim,
};

/// An absent optional input, in the input lists below.
const ABSENT: &[u64] = &[u64::MAX];

/// One node over feeds of the given shapes (f32) producing `outputs`; its parameters.
fn params_of(
    op: Op,
    inputs: &[&[u64]],
    outputs: &[(DType, &[u64])],
    attrs: &[(&str, Attr)],
) -> OpParams {
    let mut g = Builder::default();
    let ins: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, s)| (*s != ABSENT).then(|| g.f32(&format!("x{i}"), s, Role::Feed)))
        .collect();
    g.node(op, &ins, outputs, attrs);
    let checked = check(&g.graph, &Limits::default()).unwrap();
    assert_eq!(checked.params.len(), 1);
    checked.params(0).clone()
}

/// The message of validating that node.
fn error_of(
    op: Op,
    inputs: &[&[u64]],
    outputs: &[(DType, &[u64])],
    attrs: &[(&str, Attr)],
) -> String {
    let mut g = Builder::default();
    let ins: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, s)| (*s != ABSENT).then(|| g.f32(&format!("x{i}"), s, Role::Feed)))
        .collect();
    g.node(op, &ins, outputs, attrs);
    check(&g.graph, &Limits::default()).unwrap_err().to_string()
}

fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "{message:?} should mention {needle:?}"
        );
    }
}

#[test]
fn wrap_dim_follows_pytorch() {
    assert_eq!(wrap_dim(0, 4), Ok(0));
    assert_eq!(wrap_dim(-1, 4), Ok(3));
    assert_eq!(wrap_dim(-4, 4), Ok(0));
    assert!(wrap_dim(4, 4).is_err());
    assert!(wrap_dim(-5, 4).is_err());
    // A 0-dim tensor takes 0 and -1.
    assert_eq!(wrap_dim(0, 0), Ok(0));
    assert_eq!(wrap_dim(-1, 0), Ok(0));
    assert!(wrap_dim(1, 0).is_err());
}

#[test]
fn negative_dims_are_normalised() {
    let p = params_of(
        Op::SumDimIntList,
        &[&[2, 3, 4]],
        &[(DType::F32, &[3])],
        &[("dim", Attr::Ints(vec![-1, 0]))],
    );
    let OpParams::Reduce(r) = p else {
        panic!("{p:?}")
    };
    assert_eq!(r.dims, [0, 2], "sorted and normalised");
    assert!(!r.keepdim);
    assert_eq!(r.dtype, DType::F32);

    let p = params_of(
        Op::Permute,
        &[&[2, 3, 4]],
        &[(DType::F32, &[4, 2, 3])],
        &[("dims", Attr::Ints(vec![-1, 0, 1]))],
    );
    assert_eq!(
        p,
        OpParams::Permute {
            dims: vec![2, 0, 1]
        }
    );

    let p = params_of(
        Op::Softmax,
        &[&[2, 5]],
        &[(DType::F32, &[2, 5])],
        &[("dim", Attr::Int(-1)), ("half_to_float", Attr::Bool(false))],
    );
    assert_eq!(
        p,
        OpParams::Softmax {
            dim: 1,
            half_to_float: false
        }
    );

    let p = params_of(
        Op::Unsqueeze,
        &[&[2, 5]],
        &[(DType::F32, &[2, 5, 1])],
        &[("dim", Attr::Int(-1))],
    );
    assert_eq!(p, OpParams::Unsqueeze { dim: 2 });

    let p = params_of(
        Op::SelectInt,
        &[&[2, 5]],
        &[(DType::F32, &[2])],
        &[("dim", Attr::Int(-1)), ("index", Attr::Int(-2))],
    );
    assert_eq!(p, OpParams::Select { dim: 1, index: 3 });
}

#[test]
fn slices_are_clamped_like_pytorch() {
    // x[:, -3:] of a [2, 10]: start -3 -> 7, end (i64::MAX, as torch.export gives) -> 10.
    let p = params_of(
        Op::SliceTensor,
        &[&[2, 10]],
        &[(DType::F32, &[2, 3])],
        &[
            ("dim", Attr::Int(-1)),
            ("start", Attr::Int(-3)),
            ("end", Attr::Int(i64::MAX)),
        ],
    );
    assert_eq!(
        p,
        OpParams::Slice {
            dim: 1,
            start: 7,
            end: 10,
            step: 1,
            len: 3
        }
    );
    // x[1:-20:2]: the end clamps to 0, then up to the start: nothing.
    let p = params_of(
        Op::SliceTensor,
        &[&[10]],
        &[(DType::F32, &[0])],
        &[
            ("start", Attr::Int(1)),
            ("end", Attr::Int(-20)),
            ("step", Attr::Int(2)),
        ],
    );
    assert_eq!(
        p,
        OpParams::Slice {
            dim: 0,
            start: 1,
            end: 1,
            step: 2,
            len: 0
        }
    );
    // x[2:9:3] of 10: 2, 5, 8.
    let p = params_of(
        Op::SliceTensor,
        &[&[10]],
        &[(DType::F32, &[3])],
        &[
            ("start", Attr::Int(2)),
            ("end", Attr::Int(9)),
            ("step", Attr::Int(3)),
        ],
    );
    assert!(matches!(p, OpParams::Slice { len: 3, .. }), "{p:?}");
}

#[test]
fn out_of_range_dims_are_errors_naming_the_node() {
    let message = error_of(
        Op::SumDimIntList,
        &[&[2, 3]],
        &[(DType::F32, &[2])],
        &[("dim", Attr::Ints(vec![2]))],
    );
    assert_mentions(
        &message,
        &[
            "node 0 'n0'",
            "sum.dim_IntList",
            "dimension 2 out of range for a tensor of rank 2",
        ],
    );
    let message = error_of(
        Op::Softmax,
        &[&[2, 3]],
        &[(DType::F32, &[2, 3])],
        &[("dim", Attr::Int(-3))],
    );
    assert_mentions(&message, &["_softmax", "dimension -3 out of range"]);
    let message = error_of(
        Op::SliceTensor,
        &[&[]],
        &[(DType::F32, &[])],
        &[("dim", Attr::Int(0))],
    );
    assert_mentions(&message, &["slice.Tensor", "cannot slice a 0-dim tensor"]);
}

#[test]
fn bad_attributes_are_named_in_errors() {
    let message = error_of(
        Op::AddTensor,
        &[&[4], &[4]],
        &[(DType::F32, &[4])],
        &[("alpha", Attr::Str("two".into()))],
    );
    assert_mentions(
        &message,
        &[
            "node 0 'n0'",
            "(add.Tensor",
            "\"alpha\"",
            "must be a number",
        ],
    );
    let message = error_of(
        Op::Gelu,
        &[&[4]],
        &[(DType::F32, &[4])],
        &[("approximate", Attr::Str("fast".into()))],
    );
    assert_mentions(&message, &["gelu", "\"approximate\"", "\"tanh\""]);
    let message = error_of(
        Op::NativeLayerNorm,
        &[&[2, 4], &[4], &[4]],
        &[
            (DType::F32, &[2, 4]),
            (DType::F32, &[2, 1]),
            (DType::F32, &[2, 1]),
        ],
        &[
            ("normalized_shape", Attr::Ints(vec![4])),
            ("eps", Attr::Str("small".into())),
        ],
    );
    assert_mentions(
        &message,
        &["native_layer_norm", "\"eps\"", "must be a number"],
    );
    let message = error_of(
        Op::Convolution,
        &[&[1, 3, 8, 8], &[4, 3, 3, 3], ABSENT],
        &[(DType::F32, &[1, 4, 6, 6])],
        &[
            ("stride", Attr::Float(1.0)),
            ("padding", Attr::Ints(vec![0])),
            ("dilation", Attr::Ints(vec![1])),
            ("groups", Attr::Int(1)),
        ],
    );
    assert_mentions(
        &message,
        &["convolution", "\"stride\"", "must be a list of ints"],
    );
    let message = error_of(
        Op::AvgPool2d,
        &[&[1, 3, 8, 8]],
        &[(DType::F32, &[1, 3, 4, 4])],
        &[
            ("kernel_size", Attr::Ints(vec![2])),
            ("divisor_override", Attr::Int(0)),
        ],
    );
    assert_mentions(&message, &["avg_pool2d", "divisor_override must not be 0"]);
}

#[test]
fn defaults_are_filled_in() {
    let p = params_of(Op::AddTensor, &[&[4], &[4]], &[(DType::F32, &[4])], &[]);
    assert_eq!(p, OpParams::Binary { alpha: 1.0 });
    let p = params_of(Op::LeakyRelu, &[&[4]], &[(DType::F32, &[4])], &[]);
    assert_eq!(
        p,
        OpParams::LeakyRelu {
            negative_slope: 0.01
        }
    );
    let p = params_of(
        Op::Gelu,
        &[&[4]],
        &[(DType::F32, &[4])],
        &[("approximate", Attr::Str("tanh".into()))],
    );
    assert_eq!(
        p,
        OpParams::Gelu {
            approximate: GeluApproximate::Tanh
        }
    );
    let p = params_of(
        Op::VarCorrection,
        &[&[3, 5]],
        &[(DType::F32, &[3, 1])],
        &[("dim", Attr::Ints(vec![1])), ("keepdim", Attr::Bool(true))],
    );
    let OpParams::Var {
        reduction,
        correction,
    } = p
    else {
        panic!("{p:?}")
    };
    assert_eq!(
        (reduction.dims.as_slice(), reduction.keepdim),
        (&[1][..], true)
    );
    assert_eq!(correction, 1.0);
}

fn conv(input: &[u64], weight: &[u64], output: &[u64], attrs: &[(&str, Attr)]) -> ConvParams {
    let p = params_of(
        Op::Convolution,
        &[input, weight, ABSENT],
        &[(DType::F32, output)],
        attrs,
    );
    p.conv().cloned().unwrap()
}

fn conv_attrs(
    stride: &[i64],
    padding: &[i64],
    dilation: &[i64],
    transposed: bool,
    output_padding: &[i64],
    groups: i64,
) -> Vec<(&'static str, Attr)> {
    vec![
        ("stride", Attr::Ints(stride.to_vec())),
        ("padding", Attr::Ints(padding.to_vec())),
        ("dilation", Attr::Ints(dilation.to_vec())),
        ("transposed", Attr::Bool(transposed)),
        ("output_padding", Attr::Ints(output_padding.to_vec())),
        ("groups", Attr::Int(groups)),
    ]
}

#[test]
fn convolution_geometry_matches_pytorch() {
    // torchvision resnet's stem: Conv2d(3, 64, 7, stride=2, padding=3) on 224x224 -> 112.
    let c = conv(
        &[8, 3, 224, 224],
        &[64, 3, 7, 7],
        &[8, 64, 112, 112],
        &conv_attrs(&[2, 2], &[3, 3], &[1, 1], false, &[0, 0], 1),
    );
    assert_eq!((c.batch, c.in_channels, c.out_channels), (8, 3, 64));
    assert_eq!(
        (c.input.as_slice(), c.kernel.as_slice()),
        (&[224, 224][..], &[7, 7][..])
    );
    assert_eq!(c.output, [112, 112]);
    assert_eq!(c.output_shape(), [8, 64, 112, 112]);
    assert_eq!(c.unfold_2d(), Some((3 * 7 * 7, 112 * 112, false)));

    // Single values stand for every dimension; dilation 2 with padding 2 keeps 32x32.
    let c = conv(
        &[1, 16, 32, 32],
        &[16, 16, 3, 3],
        &[1, 16, 32, 32],
        &conv_attrs(&[1], &[2], &[2], false, &[], 1),
    );
    assert_eq!(
        (c.stride.as_slice(), c.padding.as_slice()),
        (&[1, 1][..], &[2, 2][..])
    );
    assert_eq!(c.dilation, [2, 2]);
    assert_eq!(c.output_padding, [0, 0]);

    // A 1x1 convolution is pointwise: the input is its own unfolded matrix.
    let c = conv(
        &[2, 64, 56, 56],
        &[256, 64, 1, 1],
        &[2, 256, 56, 56],
        &conv_attrs(&[1, 1], &[0, 0], &[1, 1], false, &[0, 0], 1),
    );
    assert_eq!(c.unfold_2d(), Some((64, 56 * 56, true)));

    // Depthwise Conv1d(4, 8, 3, groups=4, stride=2) on length 11 -> 5.
    let c = conv(
        &[1, 4, 11],
        &[8, 1, 3],
        &[1, 8, 5],
        &conv_attrs(&[2], &[0], &[1], false, &[0], 4),
    );
    assert_eq!((c.groups, c.in_per_group(), c.out_per_group()), (4, 1, 2));
    assert_eq!(c.output, [5]);
    assert_eq!(c.unfold_2d(), None);

    // ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1) doubles 10 -> 20.
    let c = conv(
        &[2, 16, 10, 10],
        &[16, 8, 3, 3],
        &[2, 8, 20, 20],
        &conv_attrs(&[2, 2], &[1, 1], &[1, 1], true, &[1, 1], 1),
    );
    assert!(c.transposed);
    assert_eq!((c.in_channels, c.out_channels), (16, 8));
    assert_eq!(c.output, [20, 20]);
    // Its kernels unfold nothing: no scratch is planned for it.
    assert_eq!(c.unfold_2d(), None);

    // Conv3d(2, 4, (3, 3, 3), stride (1, 2, 2), padding 1) on 8x16x16 -> 8x8x8.
    let c = conv(
        &[1, 2, 8, 16, 16],
        &[4, 2, 3, 3, 3],
        &[1, 4, 8, 8, 8],
        &conv_attrs(&[1, 2, 2], &[1], &[1], false, &[], 1),
    );
    assert_eq!(c.spatial_dims(), 3);
    assert_eq!(c.output, [8, 8, 8]);
}

#[test]
fn convolution_backward_keeps_its_output_mask() {
    let mut attrs = conv_attrs(&[1, 1], &[1, 1], &[1, 1], false, &[0, 0], 1);
    attrs.push(("output_mask", Attr::Bools(vec![false, true, true])));
    let p = params_of(
        Op::ConvolutionBackward,
        &[&[2, 4, 8, 8], &[2, 3, 8, 8], &[4, 3, 3, 3]],
        &[
            (DType::F32, &[2, 3, 8, 8]),
            (DType::F32, &[4, 3, 3, 3]),
            (DType::F32, &[4]),
        ],
        &attrs,
    );
    let c = p.conv().unwrap();
    assert_eq!(c.output_mask, [false, true, true]);
    assert_eq!(c.output_shape(), [2, 4, 8, 8]);
}

#[test]
fn pooling_geometry_matches_pytorch() {
    // resnet's MaxPool2d(3, stride=2, padding=1) on 112x112 -> 56.
    let p = params_of(
        Op::MaxPool2dWithIndices,
        &[&[2, 64, 112, 112]],
        &[
            (DType::F32, &[2, 64, 56, 56]),
            (DType::I64, &[2, 64, 56, 56]),
        ],
        &[
            ("kernel_size", Attr::Ints(vec![3, 3])),
            ("stride", Attr::Ints(vec![2, 2])),
            ("padding", Attr::Ints(vec![1, 1])),
        ],
    );
    let pool = p.pool().unwrap();
    assert_eq!(pool.output, [56, 56]);
    assert_eq!(pool.planes, 2 * 64);
    assert_eq!(pool.dilation, [1, 1]);

    // MaxPool2d(2, ceil_mode=True) on 5x5 -> 3x3; the stride defaults to the kernel.
    let p = params_of(
        Op::MaxPool2dWithIndices,
        &[&[3, 5, 5]],
        &[(DType::F32, &[3, 3, 3]), (DType::I64, &[3, 3, 3])],
        &[
            ("kernel_size", Attr::Ints(vec![2])),
            ("stride", Attr::Ints(vec![])),
            ("ceil_mode", Attr::Bool(true)),
        ],
    );
    let pool = p.pool().unwrap();
    assert_eq!((pool.stride, pool.output, pool.planes), ([2, 2], [3, 3], 3));

    // AvgPool2d(3, stride=2, padding=1, count_include_pad=False) on 7x7 -> 4x4.
    let p = params_of(
        Op::AvgPool2d,
        &[&[1, 2, 7, 7]],
        &[(DType::F32, &[1, 2, 4, 4])],
        &[
            ("kernel_size", Attr::Ints(vec![3, 3])),
            ("stride", Attr::Ints(vec![2, 2])),
            ("padding", Attr::Ints(vec![1, 1])),
            ("count_include_pad", Attr::Bool(false)),
        ],
    );
    let pool = p.pool().unwrap();
    assert_eq!(pool.output, [4, 4]);
    assert!(!pool.count_include_pad);
    assert_eq!(pool.divisor_override, None);
}

#[test]
fn padding_group_norm_and_cumsum_parameters() {
    // F.pad(x, (1, 2, -1, 0), value=0.5) on [2, 3, 4]: the last dimension first.
    let p = params_of(
        Op::ConstantPadNd,
        &[&[2, 3, 4]],
        &[(DType::F32, &[2, 2, 7])],
        &[
            ("pad", Attr::Ints(vec![1, 2, -1, 0])),
            ("value", Attr::Float(0.5)),
        ],
    );
    let OpParams::ConstantPad {
        before,
        after,
        value,
    } = p
    else {
        panic!("{p:?}")
    };
    assert_eq!((before, after), (vec![0, -1, 1], vec![0, 0, 2]));
    assert_eq!(value.as_f64(), 0.5);

    // F.pad(x, (1, 2, 3, 0), mode="reflect") on [2, 3, 5, 6] -> [2, 3, 8, 9].
    let p = params_of(
        Op::ReflectionPad2d,
        &[&[2, 3, 5, 6]],
        &[(DType::F32, &[2, 3, 8, 9])],
        &[("padding", Attr::Ints(vec![1, 2, 3, 0]))],
    );
    assert_eq!(
        p,
        OpParams::ReflectionPad {
            padding: [1, 2, 3, 0],
            planes: 6,
            input: [5, 6],
            output: [8, 9],
        }
    );
    let err = error_of(
        Op::ReflectionPad2d,
        &[&[2, 3, 5, 6]],
        &[(DType::F32, &[2, 3, 5, 12])],
        &[("padding", Attr::Ints(vec![6, 0, 0, 0]))],
    );
    assert_mentions(&err, &["reflection_pad2d", "must be less than"]);

    // GroupNorm(3, 6) on [2, 6, 4, 5]: mean and rstd per (image, group).
    let p = params_of(
        Op::NativeGroupNorm,
        &[&[2, 6, 4, 5], ABSENT, ABSENT],
        &[
            (DType::F32, &[2, 6, 4, 5]),
            (DType::F32, &[2, 3]),
            (DType::F32, &[2, 3]),
        ],
        &[
            ("N", Attr::Int(2)),
            ("C", Attr::Int(6)),
            ("HxW", Attr::Int(20)),
            ("group", Attr::Int(3)),
            ("eps", Attr::Float(1e-5)),
        ],
    );
    assert!(matches!(
        p,
        OpParams::GroupNorm {
            batch: 2,
            channels: 6,
            inner: 20,
            groups: 3,
            ..
        }
    ));
    let err = error_of(
        Op::NativeGroupNorm,
        &[&[2, 6, 4, 5], ABSENT, ABSENT],
        &[
            (DType::F32, &[2, 6, 4, 5]),
            (DType::F32, &[2, 3]),
            (DType::F32, &[2, 3]),
        ],
        &[
            ("N", Attr::Int(2)),
            ("C", Attr::Int(6)),
            ("HxW", Attr::Int(21)),
            ("group", Attr::Int(3)),
            ("eps", Attr::Float(1e-5)),
        ],
    );
    assert_mentions(&err, &["native_group_norm", "N * C * HxW"]);

    // cumsum(x, -1) of f32 stays f32.
    let p = params_of(
        Op::Cumsum,
        &[&[2, 3]],
        &[(DType::F32, &[2, 3])],
        &[("dim", Attr::Int(-1))],
    );
    assert_eq!(
        p,
        OpParams::Cumsum {
            dim: 1,
            dtype: DType::F32
        }
    );
}

#[test]
fn advanced_indices_select_as_pytorch_does() {
    // x[:, :, rows, cols] with rows [H, 1] and cols [W] on [N, C, h, w]: the index shape
    // [H, W] replaces the two adjacent indexed dims; x[i, :, j] puts it in front.
    let mut g = Builder::default();
    let x = g.f32("x", &[2, 3, 4, 5], Role::Feed);
    let rows = g.tensor("rows", DType::I64, &[6, 1], Role::Feed);
    let cols = g.tensor("cols", DType::I32, &[7], Role::Feed);
    let pair = g.tensor("pair", DType::I64, &[2], Role::Feed);
    g.node(
        Op::IndexTensor,
        &[Some(x), None, None, Some(rows), Some(cols)],
        &[(DType::F32, &[2, 3, 6, 7])],
        &[("indices.len", Attr::Int(4))],
    );
    g.node(
        Op::IndexTensor,
        &[Some(x), Some(pair), None, Some(pair)],
        &[(DType::F32, &[2, 3, 5])],
        &[("indices.len", Attr::Int(3))],
    );
    let checked = check(&g.graph, &Limits::default()).unwrap();
    let OpParams::AdvancedIndex(upsample) = checked.params(0) else {
        panic!("{:?}", checked.params(0))
    };
    assert_eq!(upsample.dims, [None, None, Some(2), Some(3)]);
    assert_eq!(upsample.index_shape, [6, 7]);
    assert_eq!(upsample.index_at, 2);
    assert_eq!(upsample.whole_dims(), [Some(0), Some(1), None, None]);
    let OpParams::AdvancedIndex(apart) = checked.params(1) else {
        panic!("{:?}", checked.params(1))
    };
    assert_eq!((apart.index_at, apart.shape.clone()), (0, vec![2, 3, 5]));
    assert_eq!(apart.whole_dims(), [None, Some(1), None, Some(2)]);
}
