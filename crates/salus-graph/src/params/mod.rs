//! Typed op parameters: every node's attributes, read and checked once by validation.
//!
//! A node's non-tensor arguments arrive as [`crate::Attr`] values by schema name. Validation
//! turns them into one [`OpParams`] per node, with defaults filled in, dimensions
//! normalised by [`wrap_dim`] and the geometry backends need (a convolution's output
//! size, a slice's clamped bounds) derived from the input shapes. Nothing after validation
//! reads an attribute by name: shape inference, the memory planner and the backends read
//! [`crate::CheckedGraph::params`].
//!
//! ```
//! use salus_graph::{Attr, DType, Graph, Limits, Node, Op, OpParams, Role, Tensor, TensorType};
//!
//! let t = |name: &str, shape: Vec<u64>, role| Tensor {
//!     name: name.into(),
//!     ty: TensorType::new(DType::F32, shape),
//!     role,
//!     data: vec![],
//! };
//! let graph = Graph {
//!     tensors: vec![t("x", vec![4, 8], Role::Feed), t("y", vec![4], Role::Intermediate)],
//!     nodes: vec![Node {
//!         name: "sum".into(),
//!         op: Op::SumDimIntList,
//!         inputs: vec![Some(0)],
//!         outputs: vec![Some(1)],
//!         attrs: [("dim".to_string(), Attr::Ints(vec![-1]))].into(),
//!         source: String::new(),
//!     }],
//!     fetches: vec![1],
//!     updates: vec![],
//!     precision: Default::default(),
//! };
//! let checked = salus_graph::check(&graph, &Limits::default()).unwrap();
//! let OpParams::Reduce(r) = checked.params(0) else { unreachable!() };
//! assert_eq!(r.dims, [1]); // -1 normalised against rank 2
//! assert!(!r.keepdim);
//! ```

mod attrs;
mod extract;
mod geometry;
mod indexing;

pub(crate) use attrs::Inputs;
pub(crate) use extract::extract;
pub use geometry::{ConvParams, PoolParams};
pub use indexing::AdvancedIndex;

use crate::ir::DType;

/// A number argument (ATen `Scalar`): int, float or bool, as the graph gave it. The kind
/// matters for type promotion (a float number lifts an integer tensor to f32).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    /// An integer (`Attr::Int`).
    Int(i64),
    /// A float (`Attr::Float`).
    Float(f64),
    /// A boolean (`Attr::Bool`).
    Bool(bool),
}

impl Scalar {
    /// The value as f64 (a bool is 0 or 1).
    pub fn as_f64(self) -> f64 {
        match self {
            Scalar::Int(v) => v as f64,
            Scalar::Float(v) => v,
            Scalar::Bool(v) => f64::from(u8::from(v)),
        }
    }
}

/// How `gelu` computes Φ (`approximate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluApproximate {
    /// `"none"` (the default): the exact `erf` form.
    None,
    /// `"tanh"`: the tanh approximation.
    Tanh,
}

/// How `scatter_reduce.two` combines the values that meet at a place (`reduce`). The IR
/// takes these, starting from `self` (`include_self` true); the adaptors write `sum` and
/// `mean` as `scatter_add`, and `include_self=False` as a `scatter.value` of the identity
/// first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScatterReduction {
    /// `"prod"`: the product.
    Prod,
    /// `"amax"`: the largest; NaN wins.
    Amax,
    /// `"amin"`: the smallest; NaN wins.
    Amin,
}

/// A reduction's dimensions and result, shared by `sum.dim_IntList`, `mean`, `mean.dim`,
/// `var.correction`, `any.dim`, `amax`, `argmax` and `argmin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reduction {
    /// Reduced dimensions of the input: from `dim` (an int for `any.dim`, a list
    /// otherwise), normalised by [`wrap_dim`] and sorted; every dimension when `dim` is
    /// absent or empty (and always for `mean`). Repeated dimensions are an error. Empty
    /// for a 0-dim input.
    pub dims: Vec<usize>,
    /// `keepdim` (default false): reduced dimensions stay as size 1.
    pub keepdim: bool,
    /// The result's dtype: `dtype` when given, else the op's default (`sum`: i64 for
    /// integer and bool inputs; `any.dim`: bool; otherwise the input's).
    pub dtype: DType,
}

impl Reduction {
    /// True when dimension `d` of the input is reduced.
    pub fn reduces(&self, d: usize) -> bool {
        self.dims.binary_search(&d).is_ok()
    }
}

/// The typed, checked non-tensor arguments of one node: one variant per family of ops.
/// Each field says which ATen attribute it comes from and its default.
#[derive(Debug, Clone, PartialEq)]
pub enum OpParams {
    /// Ops without attributes: `mul.Tensor`, `div.Tensor`, `neg`, `abs`, `sign`, `exp`,
    /// `log`, `sqrt`, `rsqrt`, `reciprocal`, `erf`, `relu`, `sigmoid`, `tanh`,
    /// `logical_and`, `logical_not`, `bitwise_and.Tensor`, `bitwise_not`, `where.self`,
    /// `eq/lt/gt.Tensor`, `maximum`, `minimum`, `clone`, `mm`, `bmm`,
    /// `_adaptive_avg_pool2d_backward`, `rand_like`.
    None,
    /// `add.Tensor`, `sub.Tensor`: `self ± alpha * other`.
    Binary {
        /// `alpha` (Scalar, default 1).
        alpha: f64,
    },
    /// A tensor and a number: `add.Scalar`, `mul.Scalar`, `div.Scalar` and the
    /// comparisons `eq/ne/lt/le/gt/ge.Scalar` (`other`), `pow.Tensor_Scalar` (`exponent`),
    /// `pow.Scalar` (`self`, the base; the tensor input is the exponent).
    WithScalar {
        /// `other`, `exponent` or `self` (Scalar, required).
        scalar: Scalar,
        /// `alpha` of `add.Scalar` (default 1); 1 for every other op.
        alpha: f64,
    },
    /// `clamp`: at least one bound.
    Clamp {
        /// `min` (Scalar, optional).
        min: Option<Scalar>,
        /// `max` (Scalar, optional).
        max: Option<Scalar>,
    },
    /// `polygamma`.
    Polygamma {
        /// `n` (int, at least 0): the order of the derivative of digamma.
        n: u64,
    },
    /// `leaky_relu`.
    LeakyRelu {
        /// `negative_slope` (Scalar, default 0.01).
        negative_slope: f64,
    },
    /// `gelu`.
    Gelu {
        /// `approximate` (`"none"` or `"tanh"`, default `"none"`).
        approximate: GeluApproximate,
    },
    /// `_to_copy`.
    ToCopy {
        /// `dtype` (default: the input's).
        dtype: DType,
    },
    /// `sum.dim_IntList`, `mean`, `mean.dim`, `any.dim`, `amax`; `argmax` and `argmin`
    /// (one `dim`, or every dim when it is absent: the index is then into the flattened
    /// input; dtype i64).
    Reduce(Reduction),
    /// `var.correction`.
    Var {
        /// `dim`, `keepdim` (the dtype is the input's).
        reduction: Reduction,
        /// `correction` (Scalar, default 1): the divisor is N - correction.
        correction: f64,
    },
    /// `_softmax`, `_log_softmax`.
    Softmax {
        /// `dim`, normalised.
        dim: usize,
        /// `half_to_float` (default false): the result is f32.
        half_to_float: bool,
    },
    /// `_softmax_backward_data`, `_log_softmax_backward_data`.
    SoftmaxBackward {
        /// `dim`, normalised.
        dim: usize,
        /// `input_dtype` (default: grad_output's): the result's dtype.
        input_dtype: DType,
    },
    /// `cumsum`, `cumprod`.
    Cumsum {
        /// `dim`, normalised (0 for a 0-dim input).
        dim: usize,
        /// `dtype` (default: i64 for integer and bool inputs, else the input's).
        dtype: DType,
    },
    /// `sort.stable`: every line along `dim` in order, equal elements (and NaNs, which
    /// sort after every number) in their input order whether or not `stable` is set.
    Sort {
        /// `dim` (default -1), normalised (0 for a 0-dim input).
        dim: usize,
        /// `descending` (default false): largest first, NaNs first.
        descending: bool,
    },
    /// `addmm`: `beta * self + alpha * mat1 @ mat2`.
    Addmm {
        /// `beta` (Scalar, default 1).
        beta: f64,
        /// `alpha` (Scalar, default 1).
        alpha: f64,
    },
    /// `convolution`, `convolution_backward`: attributes and derived geometry.
    Conv(ConvParams),
    /// `view` (`size`, its -1 resolved) and `expand` (`size`, its -1s resolved): the
    /// result's shape.
    Reshape {
        /// The result's shape.
        shape: Vec<u64>,
    },
    /// `permute`.
    Permute {
        /// `dims`, normalised: result dimension i is input dimension `dims[i]`.
        dims: Vec<usize>,
    },
    /// `unsqueeze`.
    Unsqueeze {
        /// `dim`, normalised against rank + 1: where the size-1 dimension goes.
        dim: usize,
    },
    /// `squeeze.dims`.
    Squeeze {
        /// `dim` (a list), normalised and sorted; only those of size 1 are removed.
        dims: Vec<usize>,
    },
    /// `split_with_sizes`.
    Split {
        /// `dim` (default 0), normalised.
        dim: usize,
        /// `split_sizes`, each >= 0, adding up to the dimension.
        sizes: Vec<u64>,
    },
    /// `cat`.
    Cat {
        /// `dim` (default 0), normalised.
        dim: usize,
        /// `tensors.len`: how many inputs.
        count: usize,
    },
    /// `slice.Tensor`, bounds clamped as PyTorch does: `start, start + step, ... < end`.
    Slice {
        /// `dim` (default 0), normalised.
        dim: usize,
        /// `start` (default 0; negative counts from the end), clamped into `[0, size]`.
        start: u64,
        /// `end` (default the size; negative counts from the end), clamped into
        /// `[start, size]`.
        end: u64,
        /// `step` (default 1, > 0).
        step: u64,
        /// Elements taken: `ceil((end - start) / step)`.
        len: u64,
    },
    /// `select.int`.
    Select {
        /// `dim`, normalised.
        dim: usize,
        /// `index`, normalised (negative counts from the end) and in range.
        index: u64,
    },
    /// `flip`.
    Flip {
        /// `dims`, normalised and sorted (none for a 0-dim input).
        dims: Vec<usize>,
    },
    /// `constant_pad_nd`: per dimension of the input, elements added before and after
    /// (negative: removed), from `pad`'s pairs (the last dimension first).
    ConstantPad {
        /// Elements added before each dimension's first (0 where `pad` says nothing).
        before: Vec<i64>,
        /// Elements added after each dimension's last.
        after: Vec<i64>,
        /// `value` (Scalar, default 0): what the added elements hold.
        value: Scalar,
    },
    /// `native_layer_norm`, `native_layer_norm_backward`.
    LayerNorm {
        /// `normalized_shape`: the input's last dimensions.
        normalized_shape: Vec<u64>,
        /// The first normalised dimension: `rank - normalized_shape.len()`.
        axis: usize,
        /// `eps` (float, default 1e-5).
        eps: f64,
    },
    /// `native_group_norm`: each image's channels in `groups` groups of
    /// `channels / groups` channels, normalised over each group's elements.
    GroupNorm {
        /// `N`: the input's first dimension.
        batch: u64,
        /// `C`: its second.
        channels: u64,
        /// `HxW`: elements of one channel of one image (the product of the other dims).
        inner: u64,
        /// `group` (> 0, dividing C).
        groups: u64,
        /// `eps` (float).
        eps: f64,
    },
    /// `_native_batch_norm_legit_functional` (training), `native_batch_norm_backward`
    /// (`train`): each channel normalised over its `batch * inner` elements.
    BatchNorm {
        /// `N`: the input's first dimension.
        batch: u64,
        /// `C`: its second.
        channels: u64,
        /// Elements of one channel of one image (the product of the dims after C).
        inner: u64,
        /// `momentum` (float): the running statistics move this far to the batch's
        /// (the forward only; 0 for the backward).
        momentum: f64,
        /// `eps` (float).
        eps: f64,
    },
    /// `_scaled_dot_product_flash_attention_for_cpu` and its backward: softmax attention
    /// of `q_len` queries over `kv_len` keys in each of `batch * heads` heads.
    Attention(AttentionParams),
    /// `max_pool2d_with_indices(_backward)`, `avg_pool2d(_backward)`.
    Pool(PoolParams),
    /// `_adaptive_avg_pool2d`.
    AdaptivePool {
        /// `output_size` (one value for both, or two), each >= 0.
        output_size: [u64; 2],
    },
    /// `reflection_pad2d`, `reflection_pad2d_backward`: the last two dimensions padded by
    /// their own reflection (the edge element not repeated).
    ReflectionPad {
        /// `padding`: (left, right, top, bottom), each >= 0 and less than the dimension it
        /// reflects.
        padding: [u64; 4],
        /// Planes: the product of the input's leading dimensions.
        planes: u64,
        /// The input's last two dimensions.
        input: [u64; 2],
        /// The output's: `input + (top + bottom, left + right)`.
        output: [u64; 2],
    },
    /// `embedding`, `embedding_dense_backward`.
    Embedding {
        /// `padding_idx` (default -1): the row that gets no gradient; `None` when negative.
        padding_idx: Option<u64>,
        /// `scale_grad_by_freq` (default false).
        scale_grad_by_freq: bool,
        /// `num_weights` of the backward: the gradient's rows; 0 for the forward.
        num_weights: u64,
    },
    /// `gather`, `scatter_add`, `scatter.src`, `index_select`.
    Index {
        /// `dim`, normalised.
        dim: usize,
    },
    /// `scatter.value`.
    Scatter {
        /// `dim`, normalised.
        dim: usize,
        /// `value` (Scalar).
        value: Scalar,
    },
    /// `scatter_reduce.two` (`include_self` true).
    ScatterReduce {
        /// `dim`, normalised.
        dim: usize,
        /// `reduce`.
        reduce: ScatterReduction,
    },
    /// `index.Tensor`: what the index tensors (inputs 1.. with absent entries) select.
    AdvancedIndex(AdvancedIndex),
    /// `index_put`.
    IndexPut {
        /// `indices.len`: the index tensors are inputs 1..=count.
        count: usize,
        /// `accumulate` (default false).
        accumulate: bool,
        /// What the indices select; `None` when one is a bool mask (devices refuse those:
        /// what a mask selects depends on its values).
        index: Option<AdvancedIndex>,
    },
    /// `full`, `full_like`, `scalar_tensor`.
    Fill {
        /// `fill_value`, or `s` of `scalar_tensor`.
        value: Scalar,
        /// `dtype` (default: `full` from the number's kind, `full_like` the input's,
        /// `scalar_tensor` f32).
        dtype: DType,
        /// `size` of `full`; the input's shape for `full_like`; empty for `scalar_tensor`.
        shape: Vec<u64>,
    },
    /// `arange.start_step`.
    Arange {
        /// `start` (Scalar).
        start: Scalar,
        /// `end` (Scalar).
        end: Scalar,
        /// `step` (Scalar, default 1, non-zero).
        step: Scalar,
        /// Values: `ceil((end - start) / step)`.
        len: u64,
        /// `dtype` (default i64 when all three numbers are integers, else f32).
        dtype: DType,
    },
    /// `_assert_async.msg`: the iteration fails with `message` when the condition is
    /// false.
    Assert {
        /// `assert_msg`.
        message: String,
    },
    /// `bernoulli.p`.
    Bernoulli {
        /// `p` (float in [0, 1]).
        p: f64,
    },
}

impl OpParams {
    /// The convolution's parameters, for `convolution` and `convolution_backward`.
    pub fn conv(&self) -> Option<&ConvParams> {
        match self {
            OpParams::Conv(c) => Some(c),
            _ => None,
        }
    }

    /// The pooling window, for the max and average pooling ops.
    pub fn pool(&self) -> Option<&PoolParams> {
        match self {
            OpParams::Pool(p) => Some(p),
            _ => None,
        }
    }

    /// The reduction, for the reduction ops (`var.correction` included).
    pub fn reduction(&self) -> Option<&Reduction> {
        match self {
            OpParams::Reduce(r) | OpParams::Var { reduction: r, .. } => Some(r),
            _ => None,
        }
    }
}

/// A dimension index for a tensor of rank `rank`, negative counting from the end, as
/// PyTorch's `maybe_wrap_dim`: valid in `[-rank, rank)`, where a 0-dim tensor counts as
/// rank 1 (so 0 and -1 name its one "dimension"). Out of range is an error, never clamped.
///
/// ```
/// use salus_graph::wrap_dim;
/// assert_eq!(wrap_dim(-1, 3), Ok(2));
/// assert_eq!(wrap_dim(2, 3), Ok(2));
/// assert_eq!(wrap_dim(-1, 0), Ok(0));
/// assert!(wrap_dim(3, 3).unwrap_err().contains("out of range"));
/// assert!(wrap_dim(-4, 3).is_err());
/// ```
pub fn wrap_dim(d: i64, rank: usize) -> Result<usize, String> {
    let r = rank.max(1) as i64;
    let wrapped = if d < 0 { d + r } else { d };
    if !(0..r).contains(&wrapped) {
        return Err(format!(
            "dimension {d} out of range for a tensor of rank {rank}"
        ));
    }
    Ok(wrapped as usize)
}

/// [`wrap_dim`] for each of `ds`; a dimension named twice is an error. In the given order.
pub fn wrap_dims(ds: &[i64], rank: usize) -> Result<Vec<usize>, String> {
    let mut out = Vec::with_capacity(ds.len());
    for &d in ds {
        let d = wrap_dim(d, rank)?;
        if out.contains(&d) {
            return Err(format!(
                "dimension {d} appears twice in {}",
                crate::error::preview(ds)
            ));
        }
        out.push(d);
    }
    Ok(out)
}

/// The geometry of fused scaled-dot-product attention: query `[batch, heads, q_len,
/// head_dim]`, key `[batch, heads, kv_len, head_dim]`, value `[batch, heads, kv_len,
/// v_dim]`; output `[batch, heads, q_len, v_dim]` and the f32 log-sum-exp of each query's
/// scores `[batch, heads, q_len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionParams {
    /// `B`.
    pub batch: u64,
    /// `H`.
    pub heads: u64,
    /// `L`: queries per head.
    pub q_len: u64,
    /// `S`: keys (and values) per head.
    pub kv_len: u64,
    /// `E`: the length of a query and a key.
    pub head_dim: u64,
    /// `Ev`: the length of a value.
    pub v_dim: u64,
    /// `is_causal`: query i attends to keys 0..=i.
    pub causal: bool,
    /// `scale` (default `1 / sqrt(head_dim)`): scores are `scale * q . k`.
    pub scale: f64,
    /// `attn_mask`'s element strides over (batch, heads, query, key), 0 along the dims it
    /// broadcasts over; `None` without a mask. A bool mask keeps the scores where it is
    /// true; a float mask is added to them.
    pub mask_strides: Option<[u64; 4]>,
    /// `dropout_p`: each probability is dropped with this chance and the kept ones scaled
    /// by `1 / (1 - dropout)` (0 for the flash op). The keep-flags are the session's
    /// counter-based stream under the forward's seed (`docs/ops.md`), the same on every
    /// device, so the backward draws them again instead of keeping them.
    pub dropout: f64,
    /// Elements between two heads' log-sum-exps: `q_len` for the flash op, `q_len`
    /// rounded up to 32 for the efficient op (PyTorch's layout; the entries past the
    /// queries are 0), 0 where no log-sum-exp is computed.
    pub lse_stride: u64,
}
