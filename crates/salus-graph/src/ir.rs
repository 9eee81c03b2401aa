//! The IR's types: tensors with dtype, shape and role; nodes; updates; the graph.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::op::Op;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit float (IEEE half); computed in f32.
    F16,
    /// bfloat16; computed in f32.
    Bf16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// Boolean, one byte each.
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::Bf16 => 2,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::Bf16)
    }

    /// True for the integer types (not bool).
    pub fn is_int(self) -> bool {
        matches!(self, DType::I64 | DType::I32)
    }

    /// The lower-case name used in messages and docs.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a tensor is to the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Persistent, trained; rewritten by an update each iteration.
    Parameter,
    /// Persistent; rewritten by updates (optimizer moments, running statistics).
    State,
    /// Persistent, read-only, its value in the graph.
    Constant,
    /// Given by the client each iteration.
    Feed,
    /// Produced by a node; lives in the lane during the iteration.
    Intermediate,
}

impl Role {
    /// True for tensors that live in the persistent region.
    pub fn is_persistent(self) -> bool {
        matches!(self, Role::Parameter | Role::State | Role::Constant)
    }
}

/// Index of a tensor in [`Graph::tensors`].
pub type TensorId = usize;

/// Dtype and static shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Dimensions; empty for a 0-dim scalar.
    pub shape: Vec<u64>,
}

impl TensorType {
    /// A type from a dtype and a shape.
    pub fn new(dtype: DType, shape: Vec<u64>) -> Self {
        TensorType { dtype, shape }
    }

    /// Number of elements (1 for a scalar); `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
    }

    /// Bytes of the tensor; `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.numel()?.checked_mul(self.dtype.size())
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:?}", self.dtype, self.shape)
    }
}

/// One tensor of the graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    /// A name people recognise.
    pub name: String,
    /// Dtype and shape.
    pub ty: TensorType,
    /// What it is to the session.
    pub role: Role,
    /// Value of a constant (little-endian, row-major); empty otherwise.
    pub data: Vec<u8>,
}

/// A non-tensor argument of an op.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Attr {
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// Integers.
    Ints(Vec<i64>),
    /// Floats.
    Floats(Vec<f64>),
    /// Booleans.
    Bools(Vec<bool>),
    /// An element type.
    DType(DType),
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// Unique name.
    pub name: String,
    /// The operation.
    pub op: Op,
    /// Tensor arguments in schema order; `None` for an absent optional tensor.
    pub inputs: Vec<Option<TensorId>>,
    /// Tensor results in schema order; `None` for a result nothing uses.
    pub outputs: Vec<Option<TensorId>>,
    /// Non-tensor arguments by schema name.
    pub attrs: BTreeMap<String, Attr>,
    /// Where it came from (module path, source line), for messages.
    pub source: String,
}

/// At the end of an iteration, `value` is written into the persistent tensor `target`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Update {
    /// A parameter or state tensor.
    pub target: TensorId,
    /// The tensor whose value it takes.
    pub value: TensorId,
}

/// A session's whole computation.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Graph {
    /// Every tensor, indexed by [`TensorId`].
    pub tensors: Vec<Tensor>,
    /// Nodes in execution (topological) order.
    pub nodes: Vec<Node>,
    /// Tensors returned to the client each iteration.
    pub fetches: Vec<TensorId>,
    /// Write-backs into persistent tensors at the end of each iteration.
    pub updates: Vec<Update>,
    /// The f32 precision the job allowed (TF32 or not), as its framework was set.
    #[serde(default)]
    pub precision: Precision,
}

/// Whether a device may compute f32 work with TF32 tensor cores (products of 10-bit
/// mantissas, f32 sums), as the job's PyTorch allowed when it was traced. Devices without
/// TF32 ignore it. The default is PyTorch's: convolutions may, matrix products may not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Precision {
    /// f32 convolutions may use TF32 (`torch.backends.cudnn.allow_tf32`).
    pub conv_tf32: bool,
    /// f32 matrix products may use TF32 (`torch.backends.cuda.matmul.allow_tf32`).
    pub matmul_tf32: bool,
}

impl Precision {
    /// Full f32 everywhere: what comparisons against the CPU device ask for.
    pub const IEEE: Precision = Precision {
        conv_tf32: false,
        matmul_tf32: false,
    };
}

impl Default for Precision {
    fn default() -> Precision {
        Precision {
            conv_tf32: true,
            matmul_tf32: false,
        }
    }
}

impl Graph {
    /// The version of the IR this crate reads and writes.
    pub const VERSION: u32 = 1;
}
