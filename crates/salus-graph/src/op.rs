//! The op set: every Core ATen overload the IR has, by name.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

macro_rules! ops {
    ($($variant:ident = $name:literal,)*) => {
        /// An operation of the IR: a Core ATen overload. `docs/ops.md` defines each.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[allow(missing_docs)]
        pub enum Op {
            $($variant,)*
        }

        impl Op {
            /// Every op, in the order of `proto/salus/v1/ops.txt`.
            pub const ALL: &'static [Op] = &[$(Op::$variant,)*];

            /// The ATen overload name without the `aten.` prefix.
            pub fn name(self) -> &'static str {
                match self {
                    $(Op::$variant => $name,)*
                }
            }
        }
    };
}

ops! {
    AddTensor = "add.Tensor",
    AddScalar = "add.Scalar",
    SubTensor = "sub.Tensor",
    MulTensor = "mul.Tensor",
    MulScalar = "mul.Scalar",
    DivTensor = "div.Tensor",
    DivScalar = "div.Scalar",
    Neg = "neg",
    Abs = "abs",
    Sign = "sign",
    Exp = "exp",
    Log = "log",
    Sqrt = "sqrt",
    Rsqrt = "rsqrt",
    Reciprocal = "reciprocal",
    Erf = "erf",
    Erfc = "erfc",
    Erfinv = "erfinv",
    Lgamma = "lgamma",
    Digamma = "digamma",
    Polygamma = "polygamma",
    Log1p = "log1p",
    Expm1 = "expm1",
    Sin = "sin",
    Cos = "cos",
    Atan = "atan",
    Atan2 = "atan2",
    RemainderTensor = "remainder.Tensor",
    FmodTensor = "fmod.Tensor",
    Floor = "floor",
    Ceil = "ceil",
    Round = "round",
    Trunc = "trunc",
    PowScalar = "pow.Scalar",
    PowTensorScalar = "pow.Tensor_Scalar",
    PowTensorTensor = "pow.Tensor_Tensor",
    Clamp = "clamp",
    Relu = "relu",
    LeakyRelu = "leaky_relu",
    Gelu = "gelu",
    Sigmoid = "sigmoid",
    Tanh = "tanh",
    NeScalar = "ne.Scalar",
    EqScalar = "eq.Scalar",
    LeScalar = "le.Scalar",
    LtScalar = "lt.Scalar",
    GeScalar = "ge.Scalar",
    GtScalar = "gt.Scalar",
    EqTensor = "eq.Tensor",
    LtTensor = "lt.Tensor",
    GtTensor = "gt.Tensor",
    Maximum = "maximum",
    Minimum = "minimum",
    LogicalAnd = "logical_and",
    LogicalNot = "logical_not",
    BitwiseAndTensor = "bitwise_and.Tensor",
    BitwiseNot = "bitwise_not",
    WhereSelf = "where.self",
    ToCopy = "_to_copy",
    Clone = "clone",
    SumDimIntList = "sum.dim_IntList",
    Mean = "mean",
    MeanDim = "mean.dim",
    VarCorrection = "var.correction",
    AnyDim = "any.dim",
    Amax = "amax",
    Argmax = "argmax",
    Argmin = "argmin",
    Softmax = "_softmax",
    LogSoftmax = "_log_softmax",
    SoftmaxBackwardData = "_softmax_backward_data",
    LogSoftmaxBackwardData = "_log_softmax_backward_data",
    Cumsum = "cumsum",
    Cumprod = "cumprod",
    Sort = "sort.stable",
    Mm = "mm",
    Addmm = "addmm",
    Bmm = "bmm",
    Convolution = "convolution",
    ConvolutionBackward = "convolution_backward",
    View = "view",
    Permute = "permute",
    Expand = "expand",
    Unsqueeze = "unsqueeze",
    SqueezeDims = "squeeze.dims",
    SplitWithSizes = "split_with_sizes",
    Cat = "cat",
    SliceTensor = "slice.Tensor",
    SelectInt = "select.int",
    Flip = "flip",
    ConstantPadNd = "constant_pad_nd",
    NativeLayerNorm = "native_layer_norm",
    NativeLayerNormBackward = "native_layer_norm_backward",
    NativeGroupNorm = "native_group_norm",
    NativeBatchNorm = "_native_batch_norm_legit_functional",
    NativeBatchNormBackward = "native_batch_norm_backward",
    ScaledDotProductAttention = "_scaled_dot_product_flash_attention_for_cpu",
    ScaledDotProductAttentionBackward = "_scaled_dot_product_flash_attention_for_cpu_backward",
    EfficientAttention = "_scaled_dot_product_efficient_attention",
    EfficientAttentionBackward = "_scaled_dot_product_efficient_attention_backward",
    MaxPool2dWithIndices = "max_pool2d_with_indices",
    MaxPool2dWithIndicesBackward = "max_pool2d_with_indices_backward",
    AvgPool2d = "avg_pool2d",
    AvgPool2dBackward = "avg_pool2d_backward",
    AdaptiveAvgPool2d = "_adaptive_avg_pool2d",
    AdaptiveAvgPool2dBackward = "_adaptive_avg_pool2d_backward",
    ReflectionPad2d = "reflection_pad2d",
    ReflectionPad2dBackward = "reflection_pad2d_backward",
    Embedding = "embedding",
    EmbeddingDenseBackward = "embedding_dense_backward",
    Gather = "gather",
    ScatterValue = "scatter.value",
    ScatterAdd = "scatter_add",
    ScatterSrc = "scatter.src",
    ScatterReduce = "scatter_reduce.two",
    IndexPut = "index_put",
    IndexSelect = "index_select",
    IndexTensor = "index.Tensor",
    Full = "full",
    FullLike = "full_like",
    ScalarTensor = "scalar_tensor",
    ArangeStartStep = "arange.start_step",
    BernoulliP = "bernoulli.p",
    RandLike = "rand_like",
    AssertAsyncMsg = "_assert_async.msg",
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Op {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let name = s.strip_prefix("aten.").unwrap_or(s);
        Op::ALL
            .iter()
            .copied()
            .find(|op| op.name() == name)
            .ok_or_else(|| {
                format!(
                    "unknown op {}: salus has no such operation (see docs/ops.md)",
                    crate::error::preview_str(s)
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_set_matches_ops_txt() {
        let listed: Vec<&str> = include_str!("../../../proto/salus/v1/ops.txt")
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        let ours: Vec<&str> = Op::ALL.iter().map(|op| op.name()).collect();
        assert_eq!(ours, listed);
    }

    #[test]
    fn names_parse_with_or_without_prefix() {
        assert_eq!("aten.add.Tensor".parse::<Op>(), Ok(Op::AddTensor));
        assert_eq!("convolution".parse::<Op>(), Ok(Op::Convolution));
        let err = "linalg_det".parse::<Op>().unwrap_err();
        assert!(err.contains("linalg_det"), "{err}");
    }
}
