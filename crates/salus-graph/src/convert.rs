//! Conversion between the IR and its protobuf form (`salus.v1.Graph`), both ways.

use prost::Message;
use salus_proto::v1 as pb;
use salus_proto::v1::attribute::Value;

use crate::error::GraphError;
use crate::ir::{Attr, DType, Graph, Node, Precision, Role, Tensor, TensorType, Update};

fn dtype_from(v: i32) -> Option<DType> {
    Some(match pb::DType::try_from(v).ok()? {
        pb::DType::DtypeF32 => DType::F32,
        pb::DType::DtypeF16 => DType::F16,
        pb::DType::DtypeBf16 => DType::Bf16,
        pb::DType::DtypeI64 => DType::I64,
        pb::DType::DtypeI32 => DType::I32,
        pb::DType::DtypeBool => DType::Bool,
        pb::DType::DtypeUnspecified => return None,
    })
}

fn dtype_to(d: DType) -> pb::DType {
    match d {
        DType::F32 => pb::DType::DtypeF32,
        DType::F16 => pb::DType::DtypeF16,
        DType::Bf16 => pb::DType::DtypeBf16,
        DType::I64 => pb::DType::DtypeI64,
        DType::I32 => pb::DType::DtypeI32,
        DType::Bool => pb::DType::DtypeBool,
    }
}

fn role_from(v: i32) -> Option<Role> {
    Some(match pb::TensorRole::try_from(v).ok()? {
        pb::TensorRole::Parameter => Role::Parameter,
        pb::TensorRole::State => Role::State,
        pb::TensorRole::Constant => Role::Constant,
        pb::TensorRole::Feed => Role::Feed,
        pb::TensorRole::Intermediate => Role::Intermediate,
        pb::TensorRole::Unspecified => return None,
    })
}

fn role_to(r: Role) -> pb::TensorRole {
    match r {
        Role::Parameter => pb::TensorRole::Parameter,
        Role::State => pb::TensorRole::State,
        Role::Constant => pb::TensorRole::Constant,
        Role::Feed => pb::TensorRole::Feed,
        Role::Intermediate => pb::TensorRole::Intermediate,
    }
}

impl Graph {
    /// Decodes a serialized `salus.v1.Graph`.
    pub fn decode(bytes: &[u8]) -> Result<Graph, GraphError> {
        let message = pb::Graph::decode(bytes)
            .map_err(|e| GraphError::Graph(format!("not a valid salus.v1.Graph message: {e}")))?;
        Graph::from_proto(&message)
    }

    /// Serializes to a `salus.v1.Graph` message.
    pub fn encode(&self) -> Vec<u8> {
        self.to_proto().encode_to_vec()
    }

    /// Converts from the protobuf form. Checks what the conversion needs (version, enum
    /// values, ids, op names); everything else is for [`crate::validate`].
    pub fn from_proto(message: &pb::Graph) -> Result<Graph, GraphError> {
        if message.version != Graph::VERSION {
            return Err(GraphError::Graph(format!(
                "graph version {} is not supported; this daemon reads version {}",
                message.version,
                Graph::VERSION
            )));
        }
        let n = message.tensors.len();
        let mut tensors = Vec::with_capacity(n);
        for (i, t) in message.tensors.iter().enumerate() {
            let fail = |m: String| GraphError::Tensor {
                id: i,
                name: t.name.clone(),
                message: m,
            };
            if t.id as usize != i {
                return Err(fail(format!(
                    "has id {} at position {i}; ids must equal positions",
                    t.id
                )));
            }
            let dtype =
                dtype_from(t.dtype).ok_or_else(|| fail(format!("unknown dtype {}", t.dtype)))?;
            let role = role_from(t.role).ok_or_else(|| fail(format!("unknown role {}", t.role)))?;
            let shape = t
                .shape
                .iter()
                .map(|&d| {
                    u64::try_from(d)
                        .map_err(|_| fail(format!("negative dimension in shape {:?}", t.shape)))
                })
                .collect::<Result<Vec<u64>, _>>()?;
            tensors.push(Tensor {
                name: t.name.clone(),
                ty: TensorType::new(dtype, shape),
                role,
                data: t.data.clone(),
            });
        }
        let id = |v: i64| -> Result<Option<usize>, String> {
            match v {
                -1 => Ok(None),
                v if v >= 0 && (v as usize) < n => Ok(Some(v as usize)),
                v => Err(format!(
                    "refers to tensor {v}, which does not exist ({n} tensors)"
                )),
            }
        };
        let mut nodes = Vec::with_capacity(message.nodes.len());
        for (index, node) in message.nodes.iter().enumerate() {
            let fail = |m: String| GraphError::Node {
                index,
                name: node.name.clone(),
                op: node.op.clone(),
                origin: node.source.clone(),
                message: m,
            };
            let op = node.op.parse().map_err(&fail)?;
            let inputs = node
                .inputs
                .iter()
                .map(|&v| id(v))
                .collect::<Result<_, _>>()
                .map_err(&fail)?;
            let outputs = node
                .outputs
                .iter()
                .map(|&v| id(v))
                .collect::<Result<_, _>>()
                .map_err(&fail)?;
            let mut attrs = std::collections::BTreeMap::new();
            for (name, a) in &node.attributes {
                let value =
                    match &a.value {
                        Some(Value::Int(v)) => Attr::Int(*v),
                        Some(Value::Float(v)) => Attr::Float(*v),
                        Some(Value::Bool(v)) => Attr::Bool(*v),
                        Some(Value::String(v)) => Attr::Str(v.clone()),
                        Some(Value::Ints(v)) => Attr::Ints(v.values.clone()),
                        Some(Value::Floats(v)) => Attr::Floats(v.values.clone()),
                        Some(Value::Bools(v)) => Attr::Bools(v.values.clone()),
                        Some(Value::Dtype(v)) => Attr::DType(dtype_from(*v).ok_or_else(|| {
                            fail(format!("attribute {name:?}: unknown dtype {v}"))
                        })?),
                        None => return Err(fail(format!("attribute {name:?} has no value"))),
                    };
                attrs.insert(name.clone(), value);
            }
            nodes.push(Node {
                name: node.name.clone(),
                op,
                inputs,
                outputs,
                attrs,
                source: node.source.clone(),
            });
        }
        let check = |v: u32, what: &str| -> Result<usize, GraphError> {
            let v = v as usize;
            if v < n {
                Ok(v)
            } else {
                Err(GraphError::Graph(format!(
                    "{what} refers to tensor {v}, which does not exist"
                )))
            }
        };
        let fetches = message
            .fetches
            .iter()
            .map(|&f| check(f, "a fetch"))
            .collect::<Result<_, _>>()?;
        let updates = message
            .updates
            .iter()
            .map(|u| {
                Ok(Update {
                    target: check(u.target, "an update")?,
                    value: check(u.value, "an update")?,
                })
            })
            .collect::<Result<_, GraphError>>()?;
        let defaults = Precision::default();
        let precision = message.precision.map_or(defaults, |p| Precision {
            conv_tf32: p.conv_allow_tf32.unwrap_or(defaults.conv_tf32),
            matmul_tf32: p.matmul_allow_tf32.unwrap_or(defaults.matmul_tf32),
        });
        Ok(Graph {
            tensors,
            nodes,
            fetches,
            updates,
            precision,
        })
    }

    /// Converts to the protobuf form.
    pub fn to_proto(&self) -> pb::Graph {
        let id = |v: Option<usize>| v.map_or(-1, |v| v as i64);
        pb::Graph {
            version: Graph::VERSION,
            tensors: self
                .tensors
                .iter()
                .enumerate()
                .map(|(i, t)| pb::Tensor {
                    id: i as u32,
                    name: t.name.clone(),
                    dtype: dtype_to(t.ty.dtype) as i32,
                    shape: t.ty.shape.iter().map(|&d| d as i64).collect(),
                    role: role_to(t.role) as i32,
                    data: t.data.clone(),
                })
                .collect(),
            nodes: self
                .nodes
                .iter()
                .map(|node| pb::Node {
                    name: node.name.clone(),
                    op: node.op.name().to_string(),
                    inputs: node.inputs.iter().map(|&v| id(v)).collect(),
                    outputs: node.outputs.iter().map(|&v| id(v)).collect(),
                    attributes: node
                        .attrs
                        .iter()
                        .map(|(k, a)| {
                            let value = match a {
                                Attr::Int(v) => Value::Int(*v),
                                Attr::Float(v) => Value::Float(*v),
                                Attr::Bool(v) => Value::Bool(*v),
                                Attr::Str(v) => Value::String(v.clone()),
                                Attr::Ints(v) => Value::Ints(pb::IntList { values: v.clone() }),
                                Attr::Floats(v) => {
                                    Value::Floats(pb::FloatList { values: v.clone() })
                                }
                                Attr::Bools(v) => Value::Bools(pb::BoolList { values: v.clone() }),
                                Attr::DType(d) => Value::Dtype(dtype_to(*d) as i32),
                            };
                            (k.clone(), pb::Attribute { value: Some(value) })
                        })
                        .collect(),
                    source: node.source.clone(),
                })
                .collect(),
            fetches: self.fetches.iter().map(|&f| f as u32).collect(),
            updates: self
                .updates
                .iter()
                .map(|u| pb::Update {
                    target: u.target as u32,
                    value: u.value as u32,
                })
                .collect(),
            precision: Some(pb::Precision {
                conv_allow_tf32: Some(self.precision.conv_tf32),
                matmul_allow_tf32: Some(self.precision.matmul_tf32),
            }),
        }
    }
}
