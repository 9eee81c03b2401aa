//! The salus graph IR: what a session runs, checked and planned before it runs.
//!
//! Owns the framework-neutral graph (tensors with dtype, static shape and role; nodes of
//! Core ATen ops in topological order; fetches; updates), its protobuf form
//! (`proto/salus/v1/graph.proto`), validation with shape and dtype inference, limits that
//! keep a graph from asking for absurd memory, and the static memory plan that gives P and
//! E exactly before the first iteration. It executes nothing (that is `salus-exec`) and
//! decides nothing about lanes (that is `salus-core`, which takes P and E from here).
//!
//! ```
//! use salus_graph::{DType, Graph, Limits, Role, Tensor, TensorType, Node, Op};
//!
//! let t = |name: &str, role| Tensor {
//!     name: name.into(),
//!     ty: TensorType::new(DType::F32, vec![4, 8]),
//!     role,
//!     data: vec![],
//! };
//! let graph = Graph {
//!     tensors: vec![t("x", Role::Feed), t("y", Role::Intermediate)],
//!     nodes: vec![Node {
//!         name: "relu".into(),
//!         op: Op::Relu,
//!         inputs: vec![Some(0)],
//!         outputs: vec![Some(1)],
//!         attrs: Default::default(),
//!         source: String::new(),
//!     }],
//!     fetches: vec![1],
//!     updates: vec![],
//!     precision: Default::default(),
//! };
//! let checked = salus_graph::check(&graph, &Limits::default()).unwrap();
//! assert_eq!(checked.plan.ephemeral_bytes, 256); // relu runs in place over x
//! ```

mod convert;
mod error;
mod infer;
mod ir;
mod op;
pub mod params;
pub mod plan;
pub mod samples;
mod validate;

pub use error::GraphError;
pub use ir::{Attr, DType, Graph, Node, Precision, Role, Tensor, TensorId, TensorType, Update};
pub use op::Op;
pub use params::{
    AdvancedIndex, AttentionParams, ConvParams, GeluApproximate, OpParams, PoolParams, Reduction,
    Scalar, ScatterReduction, wrap_dim, wrap_dims,
};
pub use plan::{Buffer, MemoryPlan, PortableScratch, ScratchSizer};
pub use validate::{Limits, Producer, validate};

/// A graph that passed validation, with its nodes' parameters and its memory plan.
#[derive(Debug, Clone)]
pub struct CheckedGraph {
    /// Where each tensor comes from.
    pub producers: Vec<Producer>,
    /// Per node, in node order: its attributes as typed, checked parameters. Backends read
    /// these, never [`Node::attrs`].
    pub params: Vec<OpParams>,
    /// Where each tensor lives.
    pub plan: MemoryPlan,
}

impl CheckedGraph {
    /// The parameters of node `node` (its index in [`Graph::nodes`]).
    ///
    /// # Panics
    /// If the graph has no such node.
    pub fn params(&self, node: usize) -> &OpParams {
        &self.params[node]
    }
}

/// Validates `graph`, reads every node's attributes into its [`OpParams`] and plans its
/// memory.
pub fn check(graph: &Graph, limits: &Limits) -> Result<CheckedGraph, GraphError> {
    check_with(graph, limits, &plan::PortableScratch)
}

/// [`check`] with each node's scratch sized by `sizer` (a device's own kernels).
pub fn check_with(
    graph: &Graph,
    limits: &Limits,
    sizer: &dyn plan::ScratchSizer,
) -> Result<CheckedGraph, GraphError> {
    let (producers, params) = validate::validate_with_params(graph, limits)?;
    let plan = plan::plan_with(graph, &producers, &params, sizer);
    Ok(CheckedGraph {
        producers,
        params,
        plan,
    })
}
