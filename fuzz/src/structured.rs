//! Graphs built from structured input: real op names, small shapes, attribute names the
//! validator reads, so that most inputs get past conversion and into shape inference and
//! planning (random protobuf bytes rarely do).

use arbitrary::Arbitrary;
use salus_graph::Op;
use salus_proto::v1 as pb;

/// Every attribute name the validator reads, and the string values it knows.
const NAMES: &[&str] = &[
    "accumulate",
    "alpha",
    "approximate",
    "beta",
    "ceil_mode",
    "correction",
    "count_include_pad",
    "dilation",
    "dim",
    "dimension",
    "dims",
    "divisor_override",
    "dtype",
    "end",
    "eps",
    "exponent",
    "fill_value",
    "groups",
    "half_to_float",
    "index",
    "indices",
    "input_dtype",
    "keepdim",
    "kernel_size",
    "max",
    "min",
    "negative_slope",
    "none",
    "normalized_shape",
    "num_weights",
    "other",
    "output_mask",
    "output_padding",
    "output_size",
    "p",
    "pad",
    "padding",
    "padding_idx",
    "scale_grad_by_freq",
    "size",
    "split_sizes",
    "start",
    "step",
    "stride",
    "sum",
    "mean",
    "tanh",
    "transposed",
    "value",
];

/// A graph, described so that most descriptions are nearly valid.
#[derive(Arbitrary, Debug)]
pub struct GraphSpec {
    tensors: Vec<TensorSpec>,
    nodes: Vec<NodeSpec>,
    fetches: Vec<u8>,
    updates: Vec<(u8, u8)>,
    precision: Option<(Option<bool>, Option<bool>)>,
}

#[derive(Arbitrary, Debug)]
struct TensorSpec {
    dtype: u8,
    shape: Vec<Dim>,
    role: u8,
    data: Data,
}

#[derive(Arbitrary, Debug)]
enum Dim {
    Small(u8),
    Any(i64),
}

#[derive(Arbitrary, Debug)]
enum Data {
    None,
    /// As many bytes as the tensor has (small tensors only), from this seed.
    Exact(u8),
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct NodeSpec {
    op: u16,
    inputs: Vec<Ref>,
    outputs: Vec<Ref>,
    attrs: Vec<(u8, AttrSpec)>,
}

#[derive(Arbitrary, Debug)]
enum Ref {
    Tensor(u8),
    Absent,
    Any(i64),
}

#[derive(Arbitrary, Debug)]
enum AttrSpec {
    Small(i8),
    Int(i64),
    Float(f64),
    Bool(bool),
    Name(u8),
    Str(String),
    Ints(Vec<i8>),
    AnyInts(Vec<i64>),
    Floats(Vec<f64>),
    Bools(Vec<bool>),
    DType(u8),
    Empty,
}

fn dtype_size(dtype: i32) -> u64 {
    match dtype {
        1 | 5 => 4,
        2 | 3 => 2,
        4 => 8,
        _ => 1,
    }
}

impl GraphSpec {
    /// The graph as a client would send it.
    pub fn to_proto(&self) -> pb::Graph {
        let n = self.tensors.len().max(1);
        let tensor_ref = |r: &Ref| match r {
            Ref::Tensor(t) => (*t as usize % n) as i64,
            Ref::Absent => -1,
            Ref::Any(v) => *v,
        };
        let tensors = self
            .tensors
            .iter()
            .enumerate()
            .map(|(id, t)| {
                let dtype = i32::from(t.dtype % 8);
                let shape: Vec<i64> = t
                    .shape
                    .iter()
                    .take(9)
                    .map(|d| match d {
                        Dim::Small(v) => i64::from(v % 9),
                        Dim::Any(v) => *v,
                    })
                    .collect();
                let elements = shape.iter().try_fold(1u64, |acc, &d| {
                    u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
                });
                let data = match &t.data {
                    Data::None => Vec::new(),
                    Data::Exact(seed) => {
                        match elements.and_then(|e| e.checked_mul(dtype_size(dtype))) {
                            Some(bytes) if bytes <= 4096 => (0..bytes)
                                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(*seed))
                                .collect(),
                            _ => Vec::new(),
                        }
                    }
                    Data::Raw(bytes) => bytes.clone(),
                };
                pb::Tensor {
                    id: id as u32,
                    name: format!("t{id}"),
                    dtype,
                    shape,
                    role: i32::from(t.role % 6),
                    data,
                }
            })
            .collect();
        let nodes = self
            .nodes
            .iter()
            .enumerate()
            .map(|(index, node)| {
                let op = Op::ALL[node.op as usize % Op::ALL.len()];
                pb::Node {
                    name: format!("n{index}"),
                    op: op.name().to_string(),
                    inputs: node.inputs.iter().take(8).map(tensor_ref).collect(),
                    outputs: node.outputs.iter().take(4).map(tensor_ref).collect(),
                    attributes: node
                        .attrs
                        .iter()
                        .take(8)
                        .map(|(name, value)| {
                            (
                                NAMES[*name as usize % NAMES.len()].to_string(),
                                attribute(value),
                            )
                        })
                        .collect(),
                    source: String::new(),
                }
            })
            .collect();
        pb::Graph {
            version: salus_graph::Graph::VERSION,
            tensors,
            nodes,
            fetches: self
                .fetches
                .iter()
                .map(|&f| u32::from(f) % n as u32)
                .collect(),
            updates: self
                .updates
                .iter()
                .map(|&(target, value)| pb::Update {
                    target: u32::from(target) % n as u32,
                    value: u32::from(value) % n as u32,
                })
                .collect(),
            precision: self.precision.map(|(conv, matmul)| pb::Precision {
                conv_allow_tf32: conv,
                matmul_allow_tf32: matmul,
            }),
        }
    }
}

fn attribute(spec: &AttrSpec) -> pb::Attribute {
    use pb::attribute::Value;
    let value = match spec {
        AttrSpec::Small(v) => Some(Value::Int(i64::from(*v))),
        AttrSpec::Int(v) => Some(Value::Int(*v)),
        AttrSpec::Float(v) => Some(Value::Float(*v)),
        AttrSpec::Bool(v) => Some(Value::Bool(*v)),
        AttrSpec::Name(v) => Some(Value::String(NAMES[*v as usize % NAMES.len()].into())),
        AttrSpec::Str(v) => Some(Value::String(v.clone())),
        AttrSpec::Ints(v) => Some(Value::Ints(pb::IntList {
            values: v.iter().map(|&x| i64::from(x)).collect(),
        })),
        AttrSpec::AnyInts(v) => Some(Value::Ints(pb::IntList { values: v.clone() })),
        AttrSpec::Floats(v) => Some(Value::Floats(pb::FloatList { values: v.clone() })),
        AttrSpec::Bools(v) => Some(Value::Bools(pb::BoolList { values: v.clone() })),
        AttrSpec::DType(v) => Some(Value::Dtype(i32::from(v % 8))),
        AttrSpec::Empty => None,
    };
    pb::Attribute { value }
}
