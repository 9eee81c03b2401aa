//! Shape and dtype inference: for each op, the types of its outputs from the types of its
//! inputs and its typed parameters ([`OpParams`]), following the ATen op's semantics.
//! Errors are plain messages; validation adds which node they are about.
//!
//! Elementwise ops and reductions are here; products, convolution, shape, neural-network,
//! indexing and creation ops in [`tensor`].

mod tensor;

use crate::ir::{DType, TensorType};
use crate::op::Op;
use crate::params::{Inputs, OpParams, Scalar};

type Result<T> = std::result::Result<T, String>;

/// The error for parameters of another op's family, which validation never produces.
fn mismatch(op: Op, params: &OpParams) -> String {
    format!("parameters {params:?} do not belong to {op}")
}

fn category(d: DType) -> u8 {
    if d.is_float() {
        2
    } else if d.is_int() {
        1
    } else {
        0
    }
}

/// Promotion of two dtypes of equal standing.
fn promote_types(a: DType, b: DType) -> DType {
    if a == b {
        return a;
    }
    match category(a).cmp(&category(b)) {
        std::cmp::Ordering::Greater => a,
        std::cmp::Ordering::Less => b,
        std::cmp::Ordering::Equal if a.is_float() => DType::F32,
        std::cmp::Ordering::Equal => DType::I64,
    }
}

/// PyTorch's result type of two tensors: tensors with dimensions outrank 0-dim tensors,
/// unless the 0-dim one is of a higher category (bool < integer < float).
fn result_type(a: &TensorType, b: &TensorType) -> DType {
    match (a.rank() == 0, b.rank() == 0) {
        (false, true) if category(b.dtype) > category(a.dtype) => b.dtype,
        (false, true) => a.dtype,
        (true, false) if category(a.dtype) > category(b.dtype) => a.dtype,
        (true, false) => b.dtype,
        _ => promote_types(a.dtype, b.dtype),
    }
}

/// Result type of a tensor and a Python number, which ranks below any tensor.
fn result_type_scalar(t: DType, s: Scalar) -> DType {
    let s_category = match s {
        Scalar::Float(_) => 2,
        Scalar::Int(_) => 1,
        Scalar::Bool(_) => 0,
    };
    if s_category > category(t) {
        if s_category == 2 {
            DType::F32
        } else {
            DType::I64
        }
    } else {
        t
    }
}

/// Floating result of a unary float function: integers and bools become f32.
fn float_of(d: DType) -> DType {
    if d.is_float() { d } else { DType::F32 }
}

pub(crate) fn broadcast(a: &[u64], b: &[u64]) -> Result<Vec<u64>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let x = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let y = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(format!(
                    "shapes {a:?} and {b:?} do not broadcast (dimension {i}: {x} vs {y})"
                ));
            }
        };
    }
    Ok(out)
}

fn same(t: &TensorType) -> Vec<TensorType> {
    vec![t.clone()]
}

fn require_float(t: &TensorType, what: &str) -> Result<()> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!("{what} must be a floating-point tensor, got {t}"))
    }
}

fn require_index(t: &TensorType, what: &str) -> Result<()> {
    if t.dtype.is_int() {
        Ok(())
    } else {
        Err(format!("{what} must be an i64 or i32 tensor, got {t}"))
    }
}

fn binary(ins: &Inputs<'_>) -> Result<Vec<TensorType>> {
    ins.count(2)?;
    let (a, b) = (ins.input(0)?, ins.input(1)?);
    Ok(vec![TensorType::new(
        result_type(a, b),
        broadcast(&a.shape, &b.shape)?,
    )])
}

fn unary_float(ins: &Inputs<'_>) -> Result<Vec<TensorType>> {
    ins.count(1)?;
    let t = ins.input(0)?;
    Ok(vec![TensorType::new(float_of(t.dtype), t.shape.clone())])
}

fn unary_same(ins: &Inputs<'_>) -> Result<Vec<TensorType>> {
    ins.count(1)?;
    Ok(same(ins.input(0)?))
}

/// The shape of `shape` reduced over `dims` (sorted), reduced dimensions kept as 1 when
/// `keepdim`.
fn reduced(shape: &[u64], r: &crate::params::Reduction) -> Vec<u64> {
    shape
        .iter()
        .enumerate()
        .filter_map(|(i, &n)| match (r.reduces(i), r.keepdim) {
            (true, true) => Some(1),
            (true, false) => None,
            (false, _) => Some(n),
        })
        .collect()
}

/// The types of a node's outputs, in schema order, given its inputs' types and its
/// parameters (which [`crate::params::extract`] made for this op).
pub(crate) fn infer(op: Op, p: &OpParams, ins: &Inputs<'_>) -> Result<Vec<TensorType>> {
    use Op::*;
    match (op, p) {
        (AddTensor | SubTensor | MulTensor, _) => binary(ins),
        (DivTensor, _) => {
            let mut out = binary(ins)?;
            out[0].dtype = float_of(out[0].dtype);
            Ok(out)
        }
        (
            AddScalar | MulScalar | DivScalar | PowTensorScalar,
            OpParams::WithScalar { scalar, .. },
        ) => {
            let t = ins.input(0)?;
            let mut dtype = result_type_scalar(t.dtype, *scalar);
            if op == DivScalar {
                dtype = float_of(dtype);
            }
            Ok(vec![TensorType::new(dtype, t.shape.clone())])
        }
        (PowScalar, OpParams::WithScalar { scalar, .. }) => {
            // self is a number, exponent a tensor.
            let exponent = ins.input(0)?;
            Ok(vec![TensorType::new(
                result_type_scalar(exponent.dtype, *scalar),
                exponent.shape.clone(),
            )])
        }
        (
            NeScalar | EqScalar | LeScalar | LtScalar | GeScalar | GtScalar,
            OpParams::WithScalar { .. },
        ) => Ok(vec![TensorType::new(
            DType::Bool,
            ins.input(0)?.shape.clone(),
        )]),
        (Neg | Abs | Sign | Relu | Clone | BitwiseNot | Floor | Ceil | Round | Trunc, _) => {
            unary_same(ins)
        }
        (
            Exp | Log | Sqrt | Rsqrt | Reciprocal | Erf | Erfc | Erfinv | Lgamma | Digamma
            | Polygamma | Log1p | Expm1 | Sin | Cos | Atan | Sigmoid | Tanh | Gelu,
            _,
        ) => unary_float(ins),
        (LeakyRelu, _) => {
            ins.count(1)?;
            let t = ins.input(0)?;
            require_float(t, "input")?;
            Ok(same(t))
        }
        (Clamp, OpParams::Clamp { min, max }) => {
            let t = ins.input(0)?;
            let dtype = [*min, *max]
                .into_iter()
                .flatten()
                .fold(t.dtype, result_type_scalar);
            Ok(vec![TensorType::new(dtype, t.shape.clone())])
        }
        (LogicalAnd | EqTensor | LtTensor | GtTensor, _) => {
            let mut out = binary(ins)?;
            out[0].dtype = DType::Bool;
            Ok(out)
        }
        (Maximum | Minimum, _) => binary(ins),
        (Atan2, _) => {
            let mut out = binary(ins)?;
            out[0].dtype = float_of(out[0].dtype);
            Ok(out)
        }
        (PowTensorTensor, _) => {
            let out = binary(ins)?;
            if !out[0].dtype.is_float() {
                return Err(format!(
                    "{op} takes floating-point tensors, not {} (PyTorch refuses an integer \
                     to a negative integer power, which the IR cannot check)",
                    out[0].dtype
                ));
            }
            Ok(out)
        }
        (RemainderTensor | FmodTensor, _) => {
            let out = binary(ins)?;
            if out[0].dtype == DType::Bool {
                return Err(format!("{op} takes numbers, not two bool tensors"));
            }
            Ok(out)
        }
        (Sort, OpParams::Sort { .. }) => {
            let t = ins.input(0)?;
            Ok(vec![
                t.clone(),
                TensorType::new(DType::I64, t.shape.clone()),
            ])
        }
        (Cumsum | Cumprod, &OpParams::Cumsum { dtype, .. }) => {
            ins.count(1)?;
            Ok(vec![TensorType::new(dtype, ins.input(0)?.shape.clone())])
        }
        (LogicalNot, _) => {
            ins.count(1)?;
            Ok(vec![TensorType::new(
                DType::Bool,
                ins.input(0)?.shape.clone(),
            )])
        }
        (BitwiseAndTensor, _) => {
            let out = binary(ins)?;
            if out[0].dtype.is_float() {
                return Err(format!(
                    "needs integer or bool tensors, got {}",
                    out[0].dtype
                ));
            }
            Ok(out)
        }
        (WhereSelf, _) => {
            ins.count(3)?;
            let (cond, a, b) = (ins.input(0)?, ins.input(1)?, ins.input(2)?);
            if cond.dtype != DType::Bool {
                return Err(format!("condition must be bool, got {cond}"));
            }
            let shape = broadcast(&broadcast(&cond.shape, &a.shape)?, &b.shape)?;
            Ok(vec![TensorType::new(result_type(a, b), shape)])
        }
        (ToCopy, OpParams::ToCopy { dtype }) => {
            Ok(vec![TensorType::new(*dtype, ins.input(0)?.shape.clone())])
        }
        (SumDimIntList | Mean | MeanDim | AnyDim | Amax | Argmax | Argmin, OpParams::Reduce(r)) => {
            let t = ins.input(0)?;
            Ok(vec![TensorType::new(r.dtype, reduced(&t.shape, r))])
        }
        (VarCorrection, OpParams::Var { reduction, .. }) => {
            let t = ins.input(0)?;
            require_float(t, "input")?;
            Ok(vec![TensorType::new(
                reduction.dtype,
                reduced(&t.shape, reduction),
            )])
        }
        (Softmax | LogSoftmax, OpParams::Softmax { half_to_float, .. }) => {
            let t = ins.input(0)?;
            require_float(t, "input")?;
            let dtype = if *half_to_float { DType::F32 } else { t.dtype };
            Ok(vec![TensorType::new(dtype, t.shape.clone())])
        }
        (
            SoftmaxBackwardData | LogSoftmaxBackwardData,
            OpParams::SoftmaxBackward { input_dtype, .. },
        ) => {
            let (grad, out) = (ins.input(0)?, ins.input(1)?);
            if grad.shape != out.shape {
                return Err(format!(
                    "grad_output {grad} and output {out} must have one shape"
                ));
            }
            Ok(vec![TensorType::new(*input_dtype, grad.shape.clone())])
        }
        _ => tensor::infer(op, p, ins),
    }
}
