//! Where an iteration's device time goes: the per-node times that
//! [`CudaDevice::profile_iteration`](crate::CudaDevice::profile_iteration) measures, their
//! sums by op and by op [`Family`], and the one mapping from op names to families.
//!
//! The mapping takes ATen names, so it serves the IR's ops (`add.Tensor`, `convolution`)
//! and the ops PyTorch's profiler reports (`aten::cudnn_convolution`, `aten::add_`,
//! `aten::_foreach_mul_`) alike: `salus-bench profile` puts both sides' times in the same
//! rows with it. Nothing here touches the GPU.

use std::collections::BTreeMap;

/// A coarse group of ops whose time is compared as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// Convolutions and their gradients.
    Conv,
    /// Matrix products (mm, bmm, addmm, linear).
    Matmul,
    /// Fused attention (PyTorch's scaled-dot-product kernels; salus runs attention as
    /// matmul and reduce/norm nodes).
    Attention,
    /// Elementwise math, comparisons, activations and their gradients.
    Pointwise,
    /// Reductions, softmax, batch and layer norm, losses' reductions.
    ReduceNorm,
    /// Max and average pooling and their gradients.
    Pooling,
    /// Embedding, gather, scatter, index_put, index_select, NLL loss, random draws.
    Index,
    /// Copies, views that move data, concatenation, fills, creation.
    CopyLayout,
    /// Anything the optimizer's update runs, whatever the op.
    Optimizer,
    /// Not in the mapping.
    Other,
}

impl Family {
    /// Every family, in table order.
    pub const ALL: [Family; 10] = [
        Family::Conv,
        Family::Matmul,
        Family::Attention,
        Family::Pointwise,
        Family::ReduceNorm,
        Family::Pooling,
        Family::Index,
        Family::CopyLayout,
        Family::Optimizer,
        Family::Other,
    ];

    /// Its name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Family::Conv => "conv",
            Family::Matmul => "matmul",
            Family::Attention => "attention",
            Family::Pointwise => "pointwise",
            Family::ReduceNorm => "reduce/norm",
            Family::Pooling => "pooling",
            Family::Index => "index",
            Family::CopyLayout => "copy/layout",
            Family::Optimizer => "optimizer",
            Family::Other => "other",
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The bare ATen name of an op: without the `aten::` namespace, the overload
/// (`add.Tensor` -> `add`) and the in-place underscore (`add_` -> `add`).
pub fn base_name(op: &str) -> &str {
    let op = op.strip_prefix("aten::").unwrap_or(op);
    let op = op.split('.').next().unwrap_or(op);
    match op.strip_suffix('_') {
        Some(base) if !base.is_empty() => base,
        _ => op,
    }
}

/// The family of an op by its ATen name (an IR op or an op PyTorch's profiler reports).
/// Context decides [`Family::Optimizer`]: see [`node_family`].
pub fn op_family(op: &str) -> Family {
    let op = base_name(op);
    if op.starts_with("_foreach_") || op.starts_with("_fused_adam") || op.starts_with("_fused_sgd")
    {
        return Family::Optimizer;
    }
    if op.contains("convolution") || op.starts_with("conv") || op.starts_with("cudnn_conv") {
        return Family::Conv;
    }
    if op.contains("attention") || op.contains("scaled_dot_product") {
        return Family::Attention;
    }
    if op.contains("pool") {
        return Family::Pooling;
    }
    if (op.contains("norm") && op != "normal") || op.contains("softmax") {
        return Family::ReduceNorm;
    }
    if op.starts_with("nll_loss") || op.starts_with("embedding") || op.contains("dropout") {
        return Family::Index;
    }
    match op {
        "mm" | "bmm" | "addmm" | "baddbmm" | "addbmm" | "matmul" | "linear"
        | "_addmm_activation" | "addmv" | "mv" | "dot" => Family::Matmul,
        "sum" | "mean" | "amax" | "amin" | "max" | "min" | "var" | "var_mean" | "std"
        | "std_mean" | "any" | "all" | "argmax" | "argmin" | "prod" | "cumsum" | "cumprod"
        | "logsumexp" | "mse_loss" | "cross_entropy_loss" => Family::ReduceNorm,
        "gather" | "scatter" | "scatter_add" | "scatter_reduce" | "index_put"
        | "_index_put_impl" | "index" | "index_select" | "index_add" | "bernoulli"
        | "rand_like" | "uniform" | "normal" | "_assert_async" | "randperm" | "masked_fill"
        | "masked_select" | "take" | "sort" | "topk" | "argsort" => Family::Index,
        "view"
        | "_unsafe_view"
        | "reshape"
        | "permute"
        | "transpose"
        | "t"
        | "expand"
        | "unsqueeze"
        | "squeeze"
        | "slice"
        | "select"
        | "split"
        | "split_with_sizes"
        | "chunk"
        | "cat"
        | "stack"
        | "clone"
        | "_to_copy"
        | "to"
        | "copy"
        | "contiguous"
        | "flatten"
        | "full"
        | "full_like"
        | "scalar_tensor"
        | "arange"
        | "zero"
        | "zeros"
        | "zeros_like"
        | "ones"
        | "ones_like"
        | "fill"
        | "empty"
        | "empty_like"
        | "empty_strided"
        | "new_zeros"
        | "new_empty"
        | "as_strided"
        | "unbind"
        | "narrow"
        | "memcpy"
        | "memset"
        | "flip"
        | "constant_pad_nd"
        | "reflection_pad2d"
        | "reflection_pad2d_backward" => Family::CopyLayout,
        "add"
        | "sub"
        | "rsub"
        | "mul"
        | "div"
        | "neg"
        | "abs"
        | "sign"
        | "exp"
        | "log"
        | "log1p"
        | "expm1"
        | "sin"
        | "cos"
        | "floor"
        | "ceil"
        | "round"
        | "trunc"
        | "atan"
        | "atan2"
        | "remainder"
        | "fmod"
        | "sqrt"
        | "rsqrt"
        | "reciprocal"
        | "erf"
        | "erfc"
        | "erfinv"
        | "lgamma"
        | "digamma"
        | "polygamma"
        | "pow"
        | "clamp"
        | "clamp_min"
        | "clamp_max"
        | "relu"
        | "threshold"
        | "threshold_backward"
        | "leaky_relu"
        | "leaky_relu_backward"
        | "gelu"
        | "gelu_backward"
        | "silu"
        | "silu_backward"
        | "sigmoid"
        | "sigmoid_backward"
        | "tanh"
        | "tanh_backward"
        | "ne"
        | "eq"
        | "le"
        | "lt"
        | "ge"
        | "gt"
        | "logical_and"
        | "logical_or"
        | "logical_not"
        | "bitwise_and"
        | "bitwise_or"
        | "bitwise_not"
        | "where"
        | "addcmul"
        | "addcdiv"
        | "lerp"
        | "maximum"
        | "minimum"
        | "square"
        | "hardtanh"
        | "hardtanh_backward" => Family::Pointwise,
        _ => Family::Other,
    }
}

/// The family of an IR node: [`Family::Optimizer`] for a node the tracer attributed to the
/// optimizer (its `source` starts with `optimizer`), else its op's family.
pub fn node_family(op: &str, source: &str) -> Family {
    if source.starts_with("optimizer") {
        Family::Optimizer
    } else {
        op_family(op)
    }
}

/// One node of a profiled iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeTime {
    /// Its position in the graph's node list.
    pub index: usize,
    /// Its name.
    pub name: String,
    /// Its op (the IR's ATen overload name).
    pub op: String,
    /// Its family.
    pub family: Family,
    /// Device commands it issued: kernel launches, cuBLAS products and memsets (a view
    /// that moves no data issues none).
    pub launches: u32,
    /// Device time from just before its first command to just after its last, in ms
    /// (0 for a node without commands).
    pub ms: f64,
}

/// Time and launches of a group of nodes (an op or a family).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupTime {
    /// Summed device time, ms.
    pub ms: f64,
    /// Device commands issued.
    pub launches: u64,
    /// Nodes in the group.
    pub nodes: u64,
}

impl GroupTime {
    fn add(&mut self, n: &NodeTime) {
        self.ms += n.ms;
        self.launches += u64::from(n.launches);
        self.nodes += 1;
    }
}

/// One eagerly run, node-by-node timed iteration.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Profile {
    /// Every node of the graph, in order.
    pub nodes: Vec<NodeTime>,
    /// Commands of the update writes (not run by the profile, so the session's state is
    /// unchanged).
    pub update_launches: u32,
    /// True when the gate that holds the stream while a batch of commands is issued gave
    /// up waiting: the times of that batch may include host launch gaps.
    pub gate_timed_out: bool,
}

impl Profile {
    /// Summed device time of every node, ms.
    pub fn total_ms(&self) -> f64 {
        self.nodes.iter().map(|n| n.ms).sum()
    }

    /// Commands issued by every node.
    pub fn launches(&self) -> u64 {
        self.nodes.iter().map(|n| u64::from(n.launches)).sum()
    }

    /// Time by family.
    pub fn by_family(&self) -> BTreeMap<Family, GroupTime> {
        let mut out = BTreeMap::new();
        for n in &self.nodes {
            out.entry(n.family)
                .or_insert_with(GroupTime::default)
                .add(n);
        }
        out
    }

    /// Time by IR op, with each op's family (an op's nodes may span families when some
    /// belong to the optimizer: keyed by both).
    pub fn by_op(&self) -> BTreeMap<(String, Family), GroupTime> {
        let mut out = BTreeMap::new();
        for n in &self.nodes {
            out.entry((n.op.clone(), n.family))
                .or_insert_with(GroupTime::default)
                .add(n);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_names_drop_namespace_overload_and_inplace() {
        assert_eq!(base_name("aten::add_"), "add");
        assert_eq!(base_name("add.Tensor"), "add");
        assert_eq!(base_name("squeeze.dims"), "squeeze");
        assert_eq!(base_name("_to_copy"), "_to_copy");
        assert_eq!(base_name("aten::_foreach_mul_.Scalar"), "_foreach_mul");
        assert_eq!(base_name("_"), "_");
    }

    #[test]
    fn every_ir_op_has_a_family() {
        for op in salus_graph::Op::ALL {
            assert_ne!(op_family(op.name()), Family::Other, "{}", op.name());
        }
    }

    #[test]
    fn ir_and_torch_names_meet_in_one_family() {
        let same = [
            ("convolution", "aten::cudnn_convolution"),
            ("convolution_backward", "aten::convolution_backward"),
            ("addmm", "aten::addmm"),
            ("mm", "aten::mm"),
            ("bmm", "aten::bmm"),
            ("native_layer_norm", "aten::native_layer_norm"),
            (
                "native_layer_norm_backward",
                "aten::native_layer_norm_backward",
            ),
            ("var.correction", "aten::cudnn_batch_norm"),
            ("_log_softmax", "aten::_log_softmax"),
            ("max_pool2d_with_indices", "aten::max_pool2d_with_indices"),
            (
                "_adaptive_avg_pool2d_backward",
                "aten::_adaptive_avg_pool2d_backward",
            ),
            ("embedding_dense_backward", "aten::embedding_dense_backward"),
            ("gather", "aten::nll_loss_forward"),
            ("bernoulli.p", "aten::native_dropout"),
            ("relu", "aten::threshold_backward"),
            ("mul.Tensor", "aten::mul_"),
            ("_to_copy", "aten::copy_"),
            ("full", "aten::zero_"),
            ("cat", "aten::cat"),
        ];
        for (ir, torch) in same {
            assert_eq!(op_family(ir), op_family(torch), "{ir} / {torch}");
        }
        assert_eq!(op_family("convolution"), Family::Conv);
        assert_eq!(op_family("aten::_foreach_addcdiv_"), Family::Optimizer);
        assert_eq!(op_family("aten::_fused_adamw_"), Family::Optimizer);
        assert_eq!(
            op_family("aten::_scaled_dot_product_flash_attention"),
            Family::Attention
        );
        assert_eq!(
            op_family("aten::_efficient_attention_backward"),
            Family::Attention
        );
        assert_eq!(op_family("something_new"), Family::Other);
    }

    #[test]
    fn the_optimizer_claims_its_nodes() {
        assert_eq!(
            node_family("mul.Tensor", "optimizer (AdamW)"),
            Family::Optimizer
        );
        assert_eq!(
            node_family("mul.Tensor", "layer1.0.bn1 (BatchNorm2d)"),
            Family::Pointwise
        );
        assert_eq!(node_family("mul.Tensor", ""), Family::Pointwise);
    }

    fn node(index: usize, op: &str, family: Family, launches: u32, ms: f64) -> NodeTime {
        NodeTime {
            index,
            name: format!("n{index}"),
            op: op.into(),
            family,
            launches,
            ms,
        }
    }

    #[test]
    fn groups_sum_time_launches_and_nodes() {
        let p = Profile {
            nodes: vec![
                node(0, "convolution", Family::Conv, 3, 1.5),
                node(1, "relu", Family::Pointwise, 1, 0.25),
                node(2, "convolution", Family::Conv, 2, 0.5),
                node(3, "view", Family::CopyLayout, 0, 0.0),
                node(4, "mul.Tensor", Family::Optimizer, 1, 0.125),
                node(5, "mul.Tensor", Family::Pointwise, 1, 0.125),
            ],
            update_launches: 1,
            gate_timed_out: false,
        };
        assert_eq!(p.total_ms(), 2.5);
        assert_eq!(p.launches(), 8);
        let f = p.by_family();
        assert_eq!(
            f[&Family::Conv],
            GroupTime {
                ms: 2.0,
                launches: 5,
                nodes: 2
            }
        );
        assert_eq!(f[&Family::Pointwise].nodes, 2);
        assert_eq!(f[&Family::CopyLayout].launches, 0);
        let o = p.by_op();
        assert_eq!(o[&("mul.Tensor".to_string(), Family::Optimizer)].nodes, 1);
        assert_eq!(o[&("convolution".to_string(), Family::Conv)].launches, 5);
    }
}
