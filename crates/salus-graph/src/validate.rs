//! Validation: structure, limits, and shape and dtype inference for every node.

use std::collections::HashMap;

use crate::error::GraphError;
use crate::infer::infer;
use crate::ir::{Attr, Graph, Role, TensorType};
use crate::params::{Inputs, OpParams, extract};

/// Bounds a graph must stay within, so no client can ask for absurd memory or counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most tensors in one graph.
    pub max_tensors: usize,
    /// Most nodes in one graph.
    pub max_nodes: usize,
    /// Most dimensions of one tensor.
    pub max_rank: usize,
    /// Largest single tensor, in bytes.
    pub max_tensor_bytes: u64,
    /// Largest sum of all tensors, in bytes.
    pub max_total_bytes: u64,
    /// Most values in one list attribute (`dims`, `sizes`, ...).
    pub max_attribute_values: usize,
}

impl Default for Limits {
    /// Generous for real models (resnet152 training has about 10^4 tensors), far below
    /// what could exhaust the daemon.
    fn default() -> Self {
        Limits {
            max_tensors: 1 << 20,
            max_nodes: 1 << 20,
            max_rank: 8,
            max_tensor_bytes: 64 << 30,
            max_total_bytes: 1 << 40,
            // Lists name dimensions or split sizes: a few, or a few thousand at most.
            max_attribute_values: 1 << 16,
        }
    }
}

/// Where each tensor comes from, found by validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Producer {
    /// Persistent or fed: present before the first node runs.
    Input,
    /// Output `output` of node `node`.
    Node {
        /// The producing node.
        node: usize,
        /// Which of its outputs.
        output: usize,
    },
    /// An intermediate no node produces (only valid if nothing reads it).
    Unused,
}

fn tensor_err(graph: &Graph, id: usize, message: String) -> GraphError {
    GraphError::Tensor {
        id,
        name: graph
            .tensors
            .get(id)
            .map(|t| t.name.clone())
            .unwrap_or_default(),
        message,
    }
}

/// How many values an attribute holds (a string counts its bytes).
fn attribute_values(attr: &Attr) -> usize {
    match attr {
        Attr::Ints(v) => v.len(),
        Attr::Floats(v) => v.len(),
        Attr::Bools(v) => v.len(),
        Attr::Str(s) => s.len(),
        Attr::Int(_) | Attr::Float(_) | Attr::Bool(_) | Attr::DType(_) => 1,
    }
}

/// Checks `graph` against `limits` and infers every node's output types, which must equal
/// the declared types of its output tensors. Returns each tensor's producer.
pub fn validate(graph: &Graph, limits: &Limits) -> Result<Vec<Producer>, GraphError> {
    validate_with_params(graph, limits).map(|(producers, _)| producers)
}

/// [`validate`], also returning each node's parameters, read from its attributes.
pub(crate) fn validate_with_params(
    graph: &Graph,
    limits: &Limits,
) -> Result<(Vec<Producer>, Vec<OpParams>), GraphError> {
    if graph.tensors.len() > limits.max_tensors {
        return Err(GraphError::Graph(format!(
            "{} tensors, more than the limit of {}",
            graph.tensors.len(),
            limits.max_tensors
        )));
    }
    if graph.nodes.len() > limits.max_nodes {
        return Err(GraphError::Graph(format!(
            "{} nodes, more than the limit of {}",
            graph.nodes.len(),
            limits.max_nodes
        )));
    }
    let mut total = 0u64;
    for (id, t) in graph.tensors.iter().enumerate() {
        if t.ty.rank() > limits.max_rank {
            return Err(tensor_err(
                graph,
                id,
                format!(
                    "{} dimensions, more than the limit of {}",
                    t.ty.rank(),
                    limits.max_rank
                ),
            ));
        }
        let bytes =
            t.ty.bytes()
                .filter(|&b| b <= limits.max_tensor_bytes)
                .ok_or_else(|| {
                    tensor_err(
                        graph,
                        id,
                        format!(
                            "shape {} needs more than the limit of {} bytes",
                            t.ty, limits.max_tensor_bytes
                        ),
                    )
                })?;
        total = total.saturating_add(bytes);
        let constant = t.role == Role::Constant;
        if constant && t.data.len() as u64 != bytes {
            return Err(tensor_err(
                graph,
                id,
                format!(
                    "constant {} needs {bytes} bytes of data, got {}",
                    t.ty,
                    t.data.len()
                ),
            ));
        }
        if !constant && !t.data.is_empty() {
            return Err(tensor_err(
                graph,
                id,
                format!("a {:?} tensor carries no data", t.role),
            ));
        }
    }
    if total > limits.max_total_bytes {
        return Err(GraphError::Graph(format!(
            "tensors total {total} bytes, more than the limit of {}",
            limits.max_total_bytes
        )));
    }

    let mut producer: Vec<Producer> = graph
        .tensors
        .iter()
        .map(|t| {
            if t.role == Role::Intermediate {
                Producer::Unused
            } else {
                Producer::Input
            }
        })
        .collect();
    let mut inputs: Vec<Option<TensorType>> = Vec::new();
    let mut params = Vec::with_capacity(graph.nodes.len());
    let mut names: HashMap<&str, usize> = HashMap::with_capacity(graph.nodes.len());
    for (index, node) in graph.nodes.iter().enumerate() {
        let fail = |message: String| GraphError::Node {
            index,
            name: node.name.clone(),
            op: node.op.name().to_string(),
            origin: node.source.clone(),
            message,
        };
        // Errors and profiles name nodes: two of one name would point at the wrong one.
        if let Some(first) = names.insert(node.name.as_str(), index) {
            return Err(fail(format!(
                "node {first} has the same name; node names are unique within a graph"
            )));
        }
        for (name, attr) in &node.attrs {
            let values = attribute_values(attr);
            if values > limits.max_attribute_values {
                return Err(fail(format!(
                    "attribute {} has {values} values, more than the limit of {}",
                    crate::error::preview_str(name),
                    limits.max_attribute_values
                )));
            }
        }
        inputs.clear();
        for (i, input) in node.inputs.iter().enumerate() {
            match input {
                None => inputs.push(None),
                Some(id) => {
                    let t = graph.tensors.get(*id).ok_or_else(|| {
                        fail(format!("input {i} is tensor {id}, which does not exist"))
                    })?;
                    if producer[*id] == Producer::Unused {
                        return Err(fail(format!(
                            "input {i} is tensor {id} '{}', which no earlier node produces",
                            t.name
                        )));
                    }
                    inputs.push(Some(t.ty.clone()));
                }
            }
        }
        let ins = Inputs::new(&inputs);
        let p = extract(node.op, &node.attrs, &ins).map_err(&fail)?;
        let inferred = infer(node.op, &p, &ins).map_err(&fail)?;
        params.push(p);
        if node.outputs.len() != inferred.len() {
            return Err(fail(format!(
                "has {} outputs, {} declared",
                inferred.len(),
                node.outputs.len()
            )));
        }
        for (o, (out, ty)) in node.outputs.iter().zip(&inferred).enumerate() {
            let Some(id) = *out else {
                // Ops with several results fill only those a graph uses; an op's only
                // result is what the node is for, and every backend writes it.
                if inferred.len() == 1 {
                    return Err(fail(
                        "output 0 is -1 (unused), but it is the op's only result; name the \
                         tensor it produces"
                            .into(),
                    ));
                }
                continue;
            };
            let t = graph
                .tensors
                .get(id)
                .ok_or_else(|| fail(format!("output {o} is tensor {id}, which does not exist")))?;
            if t.role != Role::Intermediate {
                return Err(fail(format!(
                    "output {o} is tensor {id} '{}', a {:?} tensor; nodes produce intermediates only",
                    t.name, t.role
                )));
            }
            if producer[id] != Producer::Unused {
                return Err(fail(format!(
                    "output {o} is tensor {id} '{}', which is already produced",
                    t.name
                )));
            }
            if ty.rank() > limits.max_rank {
                return Err(fail(format!(
                    "output {o} would have {} dimensions, more than the limit of {}",
                    ty.rank(),
                    limits.max_rank
                )));
            }
            if &t.ty != ty {
                return Err(fail(format!(
                    "output {o} '{}' is declared {} but the op gives {ty}",
                    t.name, t.ty
                )));
            }
            producer[id] = Producer::Node {
                node: index,
                output: o,
            };
        }
    }
    for &f in &graph.fetches {
        match producer.get(f) {
            None => {
                return Err(GraphError::Graph(format!(
                    "fetch of tensor {f}, which does not exist"
                )));
            }
            Some(Producer::Unused) => {
                return Err(tensor_err(
                    graph,
                    f,
                    "is fetched but no node produces it".into(),
                ));
            }
            Some(_) => {}
        }
    }
    let mut updated = vec![false; graph.tensors.len()];
    for u in &graph.updates {
        let (Some(target), Some(value)) = (graph.tensors.get(u.target), graph.tensors.get(u.value))
        else {
            return Err(GraphError::Graph(format!(
                "update of tensor {} from tensor {}: no such tensor",
                u.target, u.value
            )));
        };
        if !matches!(target.role, Role::Parameter | Role::State) {
            return Err(tensor_err(
                graph,
                u.target,
                format!(
                    "is updated but is a {:?} tensor, not a parameter or state",
                    target.role
                ),
            ));
        }
        if std::mem::replace(&mut updated[u.target], true) {
            return Err(tensor_err(graph, u.target, "is updated twice".into()));
        }
        if value.role.is_persistent() {
            // Updates are applied one after another at the end of the iteration; reading a
            // persistent tensor there could see another update's result.
            return Err(tensor_err(
                graph,
                u.value,
                format!(
                    "is an update's value but is a {:?} tensor; values must be computed",
                    value.role
                ),
            ));
        }
        if producer[u.value] == Producer::Unused {
            return Err(tensor_err(
                graph,
                u.value,
                "is an update's value but no node produces it".into(),
            ));
        }
        if target.ty != value.ty {
            return Err(tensor_err(
                graph,
                u.target,
                format!(
                    "is {} but its update value '{}' is {}",
                    target.ty, value.name, value.ty
                ),
            ));
        }
    }
    Ok((producer, params))
}
