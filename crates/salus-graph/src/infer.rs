//! Shape and dtype inference: for each op, the types of its outputs from the types of its
//! inputs and its attributes, following the ATen op's semantics. Errors are plain messages;
//! validation adds which node they are about.

use crate::ir::{Attr, DType, Node, TensorType};
use crate::op::Op;

type Result<T> = std::result::Result<T, String>;

/// A node's arguments, as inference reads them.
pub(crate) struct Args<'a> {
    node: &'a Node,
    inputs: &'a [Option<TensorType>],
}

impl<'a> Args<'a> {
    pub(crate) fn new(node: &'a Node, inputs: &'a [Option<TensorType>]) -> Self {
        Args { node, inputs }
    }

    fn count(&self, n: usize) -> Result<()> {
        if self.inputs.len() != n {
            return Err(format!(
                "takes {n} tensor inputs, got {}",
                self.inputs.len()
            ));
        }
        Ok(())
    }

    fn input(&self, i: usize) -> Result<&'a TensorType> {
        match self.inputs.get(i) {
            Some(Some(t)) => Ok(t),
            Some(None) => Err(format!("input {i} is required but absent")),
            None => Err(format!(
                "input {i} is missing ({} given)",
                self.inputs.len()
            )),
        }
    }

    fn optional(&self, i: usize) -> Option<&'a TensorType> {
        self.inputs.get(i).and_then(Option::as_ref)
    }

    fn attr(&self, name: &str) -> Option<&'a Attr> {
        self.node.attrs.get(name)
    }

    fn int(&self, name: &str) -> Result<i64> {
        match self.attr(name) {
            Some(Attr::Int(v)) => Ok(*v),
            Some(other) => Err(format!("attribute {name:?} must be an int, got {other:?}")),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    fn int_or(&self, name: &str, default: i64) -> Result<i64> {
        match self.attr(name) {
            None => Ok(default),
            Some(_) => self.int(name),
        }
    }

    fn ints(&self, name: &str) -> Result<&'a [i64]> {
        match self.attr(name) {
            Some(Attr::Ints(v)) => Ok(v),
            Some(other) => Err(format!(
                "attribute {name:?} must be a list of ints, got {other:?}"
            )),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    fn ints_opt(&self, name: &str) -> Result<Option<&'a [i64]>> {
        match self.attr(name) {
            None => Ok(None),
            Some(_) => self.ints(name).map(Some),
        }
    }

    fn bool_or(&self, name: &str, default: bool) -> Result<bool> {
        match self.attr(name) {
            None => Ok(default),
            Some(Attr::Bool(v)) => Ok(*v),
            Some(other) => Err(format!("attribute {name:?} must be a bool, got {other:?}")),
        }
    }

    fn bools(&self, name: &str) -> Result<&'a [bool]> {
        match self.attr(name) {
            Some(Attr::Bools(v)) => Ok(v),
            Some(other) => Err(format!(
                "attribute {name:?} must be a list of bools, got {other:?}"
            )),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    /// A number argument (ATen `Scalar`): int, float or bool.
    fn scalar(&self, name: &str) -> Result<Scalar> {
        match self.attr(name) {
            Some(Attr::Int(v)) => Ok(Scalar::Int(*v)),
            Some(Attr::Float(v)) => Ok(Scalar::Float(*v)),
            Some(Attr::Bool(v)) => Ok(Scalar::Bool(*v)),
            Some(other) => Err(format!(
                "attribute {name:?} must be a number, got {other:?}"
            )),
            None => Err(format!("attribute {name:?} is missing")),
        }
    }

    fn scalar_opt(&self, name: &str) -> Result<Option<Scalar>> {
        match self.attr(name) {
            None => Ok(None),
            Some(_) => self.scalar(name).map(Some),
        }
    }

    fn dtype_opt(&self, name: &str) -> Result<Option<DType>> {
        match self.attr(name) {
            None => Ok(None),
            Some(Attr::DType(d)) => Ok(Some(*d)),
            Some(other) => Err(format!("attribute {name:?} must be a dtype, got {other:?}")),
        }
    }

    fn list_len(&self, name: &str) -> Result<usize> {
        let key = format!("{name}.len");
        match self.attr(&key) {
            Some(Attr::Int(n)) if *n >= 0 => Ok(*n as usize),
            Some(other) => Err(format!("attribute {key:?} must be a count, got {other:?}")),
            None => Err(format!(
                "attribute {key:?} (length of tensor list {name}) is missing"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Scalar {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl Scalar {
    fn as_f64(self) -> f64 {
        match self {
            Scalar::Int(v) => v as f64,
            Scalar::Float(v) => v,
            Scalar::Bool(v) => f64::from(u8::from(v)),
        }
    }
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

fn broadcast(a: &[u64], b: &[u64]) -> Result<Vec<u64>> {
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

/// A dimension index, negative counting from the end, checked against `rank`.
fn dim(d: i64, rank: usize) -> Result<usize> {
    let r = rank.max(1) as i64;
    let wrapped = if d < 0 { d + r } else { d };
    if !(0..r).contains(&wrapped) {
        return Err(format!(
            "dimension {d} out of range for a tensor of rank {rank}"
        ));
    }
    Ok(wrapped as usize)
}

fn dims(ds: &[i64], rank: usize) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(ds.len());
    for &d in ds {
        let d = dim(d, rank)?;
        if out.contains(&d) {
            return Err(format!("dimension {d} appears twice in {ds:?}"));
        }
        out.push(d);
    }
    Ok(out)
}

fn reduce(shape: &[u64], reduced: Option<&[i64]>, keepdim: bool) -> Result<Vec<u64>> {
    let all: Vec<usize> = (0..shape.len()).collect();
    let reduced = match reduced {
        Some(ds) if !ds.is_empty() => dims(ds, shape.len())?,
        _ => all,
    };
    Ok(shape
        .iter()
        .enumerate()
        .filter_map(|(i, &n)| match (reduced.contains(&i), keepdim) {
            (true, true) => Some(1),
            (true, false) => None,
            (false, _) => Some(n),
        })
        .collect())
}

/// Shape of a reduction over the `dim` attribute (all dimensions when absent or empty),
/// keeping reduced dimensions as 1 when `keepdim`.
fn reduce_dims(args: &Args<'_>, t: &TensorType) -> Result<Vec<u64>> {
    reduce(
        &t.shape,
        args.ints_opt("dim")?,
        args.bool_or("keepdim", false)?,
    )
}

fn nonneg(v: i64, what: &str) -> Result<u64> {
    u64::try_from(v).map_err(|_| format!("{what} must be >= 0, got {v}"))
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

/// Pairs of (kernel, stride, padding, dilation) for the spatial dims of a pooling or
/// convolution, expanding single values to every dimension.
fn spatial(values: &[i64], n: usize, what: &str, default: Option<i64>) -> Result<Vec<i64>> {
    match values.len() {
        0 => default
            .map(|d| vec![d; n])
            .ok_or_else(|| format!("{what} is empty")),
        1 => Ok(vec![values[0]; n]),
        len if len == n => Ok(values.to_vec()),
        len => Err(format!(
            "{what} has {len} values for {n} spatial dimensions"
        )),
    }
}

fn pooled(size: u64, kernel: i64, stride: i64, pad: i64, dilation: i64, ceil: bool) -> Result<u64> {
    if kernel <= 0 || stride <= 0 || dilation <= 0 || pad < 0 {
        return Err(format!(
            "kernel {kernel}, stride {stride}, dilation {dilation} must be positive and padding {pad} >= 0"
        ));
    }
    if pad * 2 > kernel {
        return Err(format!(
            "padding {pad} must be at most half the kernel {kernel}"
        ));
    }
    let span = size as i64 + 2 * pad - dilation * (kernel - 1) - 1;
    if span < 0 {
        return Err(format!(
            "input size {size} with padding {pad} is smaller than the kernel extent {}",
            dilation * (kernel - 1) + 1
        ));
    }
    let mut out = if ceil {
        (span + stride - 1) / stride + 1
    } else {
        span / stride + 1
    };
    // A last window that starts inside the right padding is dropped (ATen's rule).
    if ceil && (out - 1) * stride >= size as i64 + pad {
        out -= 1;
    }
    Ok(out as u64)
}

fn pool2d_shape(input: &TensorType, args: &Args<'_>, with_dilation: bool) -> Result<Vec<u64>> {
    let rank = input.rank();
    if rank != 3 && rank != 4 {
        return Err(format!("input must be 3-d or 4-d, got {input}"));
    }
    let kernel = spatial(args.ints("kernel_size")?, 2, "kernel_size", None)?;
    let stride = spatial(args.ints_opt("stride")?.unwrap_or(&[]), 2, "stride", None)
        .unwrap_or_else(|_| kernel.clone());
    let padding = spatial(
        args.ints_opt("padding")?.unwrap_or(&[]),
        2,
        "padding",
        Some(0),
    )?;
    let dilation = if with_dilation {
        spatial(
            args.ints_opt("dilation")?.unwrap_or(&[]),
            2,
            "dilation",
            Some(1),
        )?
    } else {
        vec![1, 1]
    };
    let ceil = args.bool_or("ceil_mode", false)?;
    let mut shape = input.shape.clone();
    for i in 0..2 {
        let at = rank - 2 + i;
        shape[at] = pooled(
            shape[at],
            kernel[i],
            stride[i],
            padding[i],
            dilation[i],
            ceil,
        )?;
    }
    Ok(shape)
}

fn conv_shape(args: &Args<'_>, input: &TensorType, weight: &TensorType) -> Result<Vec<u64>> {
    let rank = input.rank();
    if rank < 3 || weight.rank() != rank {
        return Err(format!(
            "input {input} and weight {weight} must both be 3-d to 5-d and of equal rank"
        ));
    }
    let n = rank - 2;
    let stride = spatial(args.ints("stride")?, n, "stride", None)?;
    let padding = spatial(args.ints("padding")?, n, "padding", Some(0))?;
    let dilation = spatial(args.ints("dilation")?, n, "dilation", Some(1))?;
    let transposed = args.bool_or("transposed", false)?;
    let output_padding = spatial(
        args.ints_opt("output_padding")?.unwrap_or(&[]),
        n,
        "output_padding",
        Some(0),
    )?;
    let groups = args.int("groups")?;
    if groups <= 0 {
        return Err(format!("groups must be positive, got {groups}"));
    }
    let groups = groups as u64;
    let (c_in, c_out) = if transposed {
        (weight.shape[0], weight.shape[1] * groups)
    } else {
        (weight.shape[1] * groups, weight.shape[0])
    };
    if input.shape[1] != c_in {
        return Err(format!(
            "input has {} channels but weight {weight} with groups {groups} expects {c_in}",
            input.shape[1]
        ));
    }
    if !transposed && c_out % groups != 0 {
        return Err(format!(
            "{c_out} output channels do not split into {groups} groups"
        ));
    }
    let mut shape = vec![input.shape[0], c_out];
    for i in 0..n {
        let size = input.shape[2 + i] as i64;
        let k = weight.shape[2 + i] as i64;
        let (s, p, d, op) = (stride[i], padding[i], dilation[i], output_padding[i]);
        if s <= 0 || d <= 0 || p < 0 || op < 0 {
            return Err(format!(
                "stride {s} and dilation {d} must be positive, padding {p} and output_padding {op} >= 0"
            ));
        }
        let out = if transposed {
            (size - 1) * s - 2 * p + d * (k - 1) + op + 1
        } else {
            (size + 2 * p - d * (k - 1) - 1) / s + 1
        };
        if out <= 0 || (!transposed && size + 2 * p < d * (k - 1) + 1) {
            return Err(format!(
                "spatial dimension {i}: input {size} with padding {p} is smaller than the kernel extent {}",
                d * (k - 1) + 1
            ));
        }
        shape.push(out as u64);
    }
    Ok(shape)
}

fn view_shape(input: &TensorType, size: &[i64]) -> Result<Vec<u64>> {
    let numel = input.numel().unwrap_or(u64::MAX);
    let mut inferred = None;
    let mut known = 1u64;
    let mut out = Vec::with_capacity(size.len());
    for (i, &s) in size.iter().enumerate() {
        if s == -1 {
            if inferred.replace(i).is_some() {
                return Err(format!("size {size:?} has more than one -1"));
            }
            out.push(0);
        } else {
            let s = nonneg(s, "a view dimension")?;
            known = known.saturating_mul(s);
            out.push(s);
        }
    }
    if let Some(i) = inferred {
        if known == 0 || !numel.is_multiple_of(known) {
            return Err(format!("cannot view {input} as {size:?}"));
        }
        out[i] = numel / known;
    } else if known != numel {
        return Err(format!(
            "cannot view {input} ({numel} elements) as {size:?}"
        ));
    }
    Ok(out)
}

fn elementwise_scalar(args: &Args<'_>, name: &str) -> Result<Vec<TensorType>> {
    args.count(1)?;
    let t = args.input(0)?;
    let s = args.scalar(name)?;
    Ok(vec![TensorType::new(
        result_type_scalar(t.dtype, s),
        t.shape.clone(),
    )])
}

fn binary(args: &Args<'_>) -> Result<Vec<TensorType>> {
    args.count(2)?;
    let (a, b) = (args.input(0)?, args.input(1)?);
    Ok(vec![TensorType::new(
        result_type(a, b),
        broadcast(&a.shape, &b.shape)?,
    )])
}

fn compare_scalar(args: &Args<'_>) -> Result<Vec<TensorType>> {
    args.count(1)?;
    args.scalar("other")?;
    Ok(vec![TensorType::new(
        DType::Bool,
        args.input(0)?.shape.clone(),
    )])
}

fn unary_float(args: &Args<'_>) -> Result<Vec<TensorType>> {
    args.count(1)?;
    let t = args.input(0)?;
    Ok(vec![TensorType::new(float_of(t.dtype), t.shape.clone())])
}

fn unary_same(args: &Args<'_>) -> Result<Vec<TensorType>> {
    args.count(1)?;
    Ok(same(args.input(0)?))
}

/// The types of `node`'s outputs, in schema order, given its inputs' types.
pub(crate) fn infer(op: Op, args: &Args<'_>) -> Result<Vec<TensorType>> {
    use Op::*;
    match op {
        AddTensor | SubTensor | MulTensor => binary(args),
        DivTensor => {
            let mut out = binary(args)?;
            out[0].dtype = float_of(out[0].dtype);
            Ok(out)
        }
        AddScalar | MulScalar => elementwise_scalar(args, "other"),
        DivScalar => {
            let mut out = elementwise_scalar(args, "other")?;
            out[0].dtype = float_of(out[0].dtype);
            Ok(out)
        }
        Neg | Abs | Sign | Relu | Clone | BitwiseNot => unary_same(args),
        Exp | Log | Sqrt | Rsqrt | Reciprocal | Erf | Sigmoid | Tanh => unary_float(args),
        LeakyRelu => {
            args.count(1)?;
            let t = args.input(0)?;
            require_float(t, "input")?;
            args.scalar_opt("negative_slope")?;
            Ok(same(t))
        }
        Gelu => {
            let out = unary_float(args)?;
            match args.attr("approximate") {
                None => {}
                Some(Attr::Str(s)) if s == "none" || s == "tanh" => {}
                Some(other) => {
                    return Err(format!(
                        "attribute \"approximate\" must be \"none\" or \"tanh\", got {other:?}"
                    ));
                }
            }
            Ok(out)
        }
        PowScalar => {
            // self is a number, exponent a tensor.
            args.count(1)?;
            let exponent = args.input(0)?;
            let base = args.scalar("self")?;
            Ok(vec![TensorType::new(
                result_type_scalar(exponent.dtype, base),
                exponent.shape.clone(),
            )])
        }
        PowTensorScalar => elementwise_scalar(args, "exponent"),
        Clamp => {
            args.count(1)?;
            let t = args.input(0)?;
            let (lo, hi) = (args.scalar_opt("min")?, args.scalar_opt("max")?);
            if lo.is_none() && hi.is_none() {
                return Err("needs at least one of \"min\" and \"max\"".into());
            }
            let dtype = [lo, hi]
                .into_iter()
                .flatten()
                .fold(t.dtype, result_type_scalar);
            Ok(vec![TensorType::new(dtype, t.shape.clone())])
        }
        NeScalar | EqScalar | LeScalar | LtScalar | GeScalar | GtScalar => compare_scalar(args),
        LogicalAnd => {
            let mut out = binary(args)?;
            out[0].dtype = DType::Bool;
            Ok(out)
        }
        LogicalNot => {
            args.count(1)?;
            Ok(vec![TensorType::new(
                DType::Bool,
                args.input(0)?.shape.clone(),
            )])
        }
        BitwiseAndTensor => {
            let out = binary(args)?;
            if out[0].dtype.is_float() {
                return Err(format!(
                    "needs integer or bool tensors, got {}",
                    out[0].dtype
                ));
            }
            Ok(out)
        }
        WhereSelf => {
            args.count(3)?;
            let (cond, a, b) = (args.input(0)?, args.input(1)?, args.input(2)?);
            if cond.dtype != DType::Bool {
                return Err(format!("condition must be bool, got {cond}"));
            }
            let shape = broadcast(&broadcast(&cond.shape, &a.shape)?, &b.shape)?;
            Ok(vec![TensorType::new(result_type(a, b), shape)])
        }
        ToCopy => {
            args.count(1)?;
            let t = args.input(0)?;
            let dtype = args.dtype_opt("dtype")?.unwrap_or(t.dtype);
            Ok(vec![TensorType::new(dtype, t.shape.clone())])
        }
        SumDimIntList => {
            args.count(1)?;
            let t = args.input(0)?;
            let shape = reduce_dims(args, t)?;
            let default = if t.dtype.is_float() {
                t.dtype
            } else {
                DType::I64
            };
            Ok(vec![TensorType::new(
                args.dtype_opt("dtype")?.unwrap_or(default),
                shape,
            )])
        }
        Mean => {
            args.count(1)?;
            let t = args.input(0)?;
            let dtype = args.dtype_opt("dtype")?.unwrap_or(t.dtype);
            if !dtype.is_float() {
                return Err(format!("mean needs a floating-point result, got {dtype}"));
            }
            Ok(vec![TensorType::new(dtype, vec![])])
        }
        MeanDim => {
            args.count(1)?;
            let t = args.input(0)?;
            let dtype = args.dtype_opt("dtype")?.unwrap_or(t.dtype);
            if !dtype.is_float() {
                return Err(format!("mean needs a floating-point result, got {dtype}"));
            }
            let shape = reduce_dims(args, t)?;
            Ok(vec![TensorType::new(dtype, shape)])
        }
        VarCorrection => {
            args.count(1)?;
            let t = args.input(0)?;
            require_float(t, "input")?;
            args.scalar_opt("correction")?;
            let shape = reduce_dims(args, t)?;
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        AnyDim => {
            args.count(1)?;
            let t = args.input(0)?;
            let d = args.int("dim")?;
            let shape = reduce(&t.shape, Some(&[d]), args.bool_or("keepdim", false)?)?;
            Ok(vec![TensorType::new(DType::Bool, shape)])
        }
        Amax => {
            args.count(1)?;
            let t = args.input(0)?;
            let shape = reduce_dims(args, t)?;
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        Softmax | LogSoftmax => {
            args.count(1)?;
            let t = args.input(0)?;
            require_float(t, "input")?;
            dim(args.int("dim")?, t.rank())?;
            let dtype = if args.bool_or("half_to_float", false)? {
                DType::F32
            } else {
                t.dtype
            };
            Ok(vec![TensorType::new(dtype, t.shape.clone())])
        }
        SoftmaxBackwardData | LogSoftmaxBackwardData => {
            args.count(2)?;
            let (grad, out) = (args.input(0)?, args.input(1)?);
            if grad.shape != out.shape {
                return Err(format!(
                    "grad_output {grad} and output {out} must have one shape"
                ));
            }
            dim(args.int("dim")?, grad.rank())?;
            let dtype = args.dtype_opt("input_dtype")?.unwrap_or(grad.dtype);
            Ok(vec![TensorType::new(dtype, grad.shape.clone())])
        }
        Mm => {
            args.count(2)?;
            let (a, b) = (args.input(0)?, args.input(1)?);
            matmul_2d(a, b).map(|t| vec![t])
        }
        Addmm => {
            args.count(3)?;
            let (bias, a, b) = (args.input(0)?, args.input(1)?, args.input(2)?);
            let out = matmul_2d(a, b)?;
            if broadcast(&bias.shape, &out.shape)? != out.shape {
                return Err(format!(
                    "bias {bias} does not broadcast to the product's {out}"
                ));
            }
            args.scalar_opt("beta")?;
            args.scalar_opt("alpha")?;
            Ok(vec![out])
        }
        Bmm => {
            args.count(2)?;
            let (a, b) = (args.input(0)?, args.input(1)?);
            if a.rank() != 3
                || b.rank() != 3
                || a.shape[0] != b.shape[0]
                || a.shape[2] != b.shape[1]
            {
                return Err(format!(
                    "bmm needs [b, n, k] and [b, k, m], got {a} and {b}"
                ));
            }
            if a.dtype != b.dtype {
                return Err(format!("operands differ in dtype: {a} and {b}"));
            }
            Ok(vec![TensorType::new(
                a.dtype,
                vec![a.shape[0], a.shape[1], b.shape[2]],
            )])
        }
        Convolution => {
            args.count(3)?;
            let (input, weight) = (args.input(0)?, args.input(1)?);
            require_float(input, "input")?;
            let shape = conv_shape(args, input, weight)?;
            if let Some(bias) = args.optional(2)
                && bias.shape != [shape[1]]
            {
                return Err(format!("bias {bias} must be [{}]", shape[1]));
            }
            Ok(vec![TensorType::new(input.dtype, shape)])
        }
        ConvolutionBackward => {
            args.count(3)?;
            let (grad, input, weight) = (args.input(0)?, args.input(1)?, args.input(2)?);
            let expected = conv_shape(args, input, weight)?;
            if grad.shape != expected {
                return Err(format!(
                    "grad_output {grad} does not match the convolution's output {expected:?}"
                ));
            }
            let mask = args.bools("output_mask")?;
            if mask.len() != 3 {
                return Err(format!("output_mask must have 3 entries, got {mask:?}"));
            }
            Ok(vec![
                input.clone(),
                weight.clone(),
                TensorType::new(grad.dtype, vec![expected[1]]),
            ])
        }
        View => {
            args.count(1)?;
            let t = args.input(0)?;
            Ok(vec![TensorType::new(
                t.dtype,
                view_shape(t, args.ints("size")?)?,
            )])
        }
        Permute => {
            args.count(1)?;
            let t = args.input(0)?;
            let order = dims(args.ints("dims")?, t.rank())?;
            if order.len() != t.rank() {
                return Err(format!(
                    "dims {order:?} must name each of the {} dimensions",
                    t.rank()
                ));
            }
            Ok(vec![TensorType::new(
                t.dtype,
                order.iter().map(|&d| t.shape[d]).collect(),
            )])
        }
        Expand => {
            args.count(1)?;
            let t = args.input(0)?;
            let size = args.ints("size")?;
            if size.len() < t.rank() {
                return Err(format!("cannot expand {t} to fewer dimensions {size:?}"));
            }
            let lead = size.len() - t.rank();
            let mut shape = Vec::with_capacity(size.len());
            for (i, &s) in size.iter().enumerate() {
                let current = (i >= lead).then(|| t.shape[i - lead]);
                let target = match (s, current) {
                    (-1, Some(c)) => c,
                    (-1, None) => return Err(format!("-1 in a new leading dimension of {size:?}")),
                    (s, _) => nonneg(s, "an expanded dimension")?,
                };
                if let Some(c) = current
                    && c != target
                    && c != 1
                {
                    return Err(format!(
                        "cannot expand {t} to {size:?}: dimension {i} is {c}"
                    ));
                }
                shape.push(target);
            }
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        Unsqueeze => {
            args.count(1)?;
            let t = args.input(0)?;
            let d = dim(args.int("dim")?, t.rank() + 1)?;
            let mut shape = t.shape.clone();
            shape.insert(d, 1);
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        SqueezeDims => {
            args.count(1)?;
            let t = args.input(0)?;
            let ds = dims(args.ints("dim")?, t.rank())?;
            let shape = t
                .shape
                .iter()
                .enumerate()
                .filter(|&(i, &n)| !(ds.contains(&i) && n == 1))
                .map(|(_, &n)| n)
                .collect();
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        SplitWithSizes => {
            args.count(1)?;
            let t = args.input(0)?;
            let d = dim(args.int_or("dim", 0)?, t.rank())?;
            let sizes = args.ints("split_sizes")?;
            let mut total = 0u64;
            let mut out = Vec::with_capacity(sizes.len());
            for &s in sizes {
                let s = nonneg(s, "a split size")?;
                total += s;
                let mut shape = t.shape.clone();
                shape[d] = s;
                out.push(TensorType::new(t.dtype, shape));
            }
            if total != t.shape[d] {
                return Err(format!(
                    "split sizes {sizes:?} add up to {total}, but dimension {d} of {t} is {}",
                    t.shape[d]
                ));
            }
            Ok(out)
        }
        Cat => {
            let n = args.list_len("tensors")?;
            args.count(n)?;
            if n == 0 {
                return Err("needs at least one tensor".into());
            }
            let first = args.input(0)?;
            let d = dim(args.int_or("dim", 0)?, first.rank())?;
            let mut shape = first.shape.clone();
            let mut dtype = first.dtype;
            for i in 1..n {
                let t = args.input(i)?;
                if t.rank() != first.rank()
                    || t.shape
                        .iter()
                        .enumerate()
                        .any(|(j, &s)| j != d && s != first.shape[j])
                {
                    return Err(format!(
                        "tensor {i} {t} does not match tensor 0 {first} outside dimension {d}"
                    ));
                }
                shape[d] += t.shape[d];
                dtype = promote_types(dtype, t.dtype);
            }
            Ok(vec![TensorType::new(dtype, shape)])
        }
        SliceTensor => {
            args.count(1)?;
            let t = args.input(0)?;
            let d = dim(args.int_or("dim", 0)?, t.rank())?;
            let n = t.shape[d] as i64;
            let step = args.int_or("step", 1)?;
            if step <= 0 {
                return Err(format!("step must be positive, got {step}"));
            }
            let clampi = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
            let start = clampi(args.int_or("start", 0)?);
            let end = clampi(args.int_or("end", n)?).max(start);
            let mut shape = t.shape.clone();
            shape[d] = ((end - start + step - 1) / step) as u64;
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        SelectInt => {
            args.count(1)?;
            let t = args.input(0)?;
            if t.rank() == 0 {
                return Err("cannot select from a 0-dim tensor".into());
            }
            let d = dim(args.int("dim")?, t.rank())?;
            let index = args.int("index")?;
            let n = t.shape[d] as i64;
            if index < -n || index >= n {
                return Err(format!(
                    "index {index} out of range for dimension {d} of size {n}"
                ));
            }
            let mut shape = t.shape.clone();
            shape.remove(d);
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        NativeLayerNorm => {
            args.count(3)?;
            let t = args.input(0)?;
            require_float(t, "input")?;
            let normalized = args.ints("normalized_shape")?;
            let axis = layer_norm_axis(t, normalized)?;
            for (i, what) in [(1, "weight"), (2, "bias")] {
                if let Some(p) = args.optional(i)
                    && p.shape != t.shape[axis..]
                {
                    return Err(format!(
                        "{what} {p} must have the normalized shape {normalized:?}"
                    ));
                }
            }
            let mut stats = t.shape[..axis].to_vec();
            stats.extend(std::iter::repeat_n(1, t.rank() - axis));
            Ok(vec![
                t.clone(),
                TensorType::new(t.dtype, stats.clone()),
                TensorType::new(t.dtype, stats),
            ])
        }
        NativeLayerNormBackward => {
            // grad_out, input, mean, rstd, weight?, bias?
            args.count(6)?;
            let (grad, t) = (args.input(0)?, args.input(1)?);
            if grad.shape != t.shape {
                return Err(format!("grad_out {grad} and input {t} must have one shape"));
            }
            let normalized = args.ints("normalized_shape")?;
            let axis = layer_norm_axis(t, normalized)?;
            let param = TensorType::new(t.dtype, t.shape[axis..].to_vec());
            Ok(vec![t.clone(), param.clone(), param])
        }
        MaxPool2dWithIndices => {
            args.count(1)?;
            let t = args.input(0)?;
            let shape = pool2d_shape(t, args, true)?;
            Ok(vec![
                TensorType::new(t.dtype, shape.clone()),
                TensorType::new(DType::I64, shape),
            ])
        }
        MaxPool2dWithIndicesBackward => {
            args.count(3)?;
            let (grad, t, indices) = (args.input(0)?, args.input(1)?, args.input(2)?);
            let shape = pool2d_shape(t, args, true)?;
            if grad.shape != shape || indices.shape != shape {
                return Err(format!(
                    "grad_output {grad} and indices {indices} must match the pooled shape {shape:?}"
                ));
            }
            require_index(indices, "indices")?;
            Ok(same(t))
        }
        AvgPool2d => {
            args.count(1)?;
            let t = args.input(0)?;
            Ok(vec![TensorType::new(
                t.dtype,
                pool2d_shape(t, args, false)?,
            )])
        }
        AvgPool2dBackward => {
            args.count(2)?;
            let (grad, t) = (args.input(0)?, args.input(1)?);
            let shape = pool2d_shape(t, args, false)?;
            if grad.shape != shape {
                return Err(format!(
                    "grad_output {grad} must match the pooled shape {shape:?}"
                ));
            }
            Ok(same(t))
        }
        AdaptiveAvgPool2d => {
            args.count(1)?;
            let t = args.input(0)?;
            if t.rank() != 3 && t.rank() != 4 {
                return Err(format!("input must be 3-d or 4-d, got {t}"));
            }
            let size = spatial(args.ints("output_size")?, 2, "output_size", None)?;
            let mut shape = t.shape.clone();
            let rank = shape.len();
            shape[rank - 2] = nonneg(size[0], "output_size")?;
            shape[rank - 1] = nonneg(size[1], "output_size")?;
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        AdaptiveAvgPool2dBackward => {
            args.count(2)?;
            let (grad, t) = (args.input(0)?, args.input(1)?);
            if grad.rank() != t.rank() || grad.shape[..t.rank() - 2] != t.shape[..t.rank() - 2] {
                return Err(format!("grad_output {grad} does not fit input {t}"));
            }
            Ok(same(t))
        }
        Embedding => {
            args.count(2)?;
            let (weight, indices) = (args.input(0)?, args.input(1)?);
            if weight.rank() != 2 {
                return Err(format!("weight must be 2-d, got {weight}"));
            }
            require_index(indices, "indices")?;
            let mut shape = indices.shape.clone();
            shape.push(weight.shape[1]);
            Ok(vec![TensorType::new(weight.dtype, shape)])
        }
        EmbeddingDenseBackward => {
            args.count(2)?;
            let (grad, indices) = (args.input(0)?, args.input(1)?);
            require_index(indices, "indices")?;
            let rows = nonneg(args.int("num_weights")?, "num_weights")?;
            let width = *grad
                .shape
                .last()
                .ok_or("grad_output must have a dimension")?;
            Ok(vec![TensorType::new(grad.dtype, vec![rows, width])])
        }
        Gather => {
            args.count(2)?;
            let (t, index) = (args.input(0)?, args.input(1)?);
            require_index(index, "index")?;
            dim(args.int("dim")?, t.rank())?;
            if index.rank() != t.rank() {
                return Err(format!("index {index} must have the rank of input {t}"));
            }
            Ok(vec![TensorType::new(t.dtype, index.shape.clone())])
        }
        ScatterValue => {
            args.count(2)?;
            let (t, index) = (args.input(0)?, args.input(1)?);
            require_index(index, "index")?;
            dim(args.int("dim")?, t.rank())?;
            args.scalar("value")?;
            Ok(same(t))
        }
        ScatterAdd => {
            args.count(3)?;
            let (t, index, src) = (args.input(0)?, args.input(1)?, args.input(2)?);
            require_index(index, "index")?;
            dim(args.int("dim")?, t.rank())?;
            if index.rank() != t.rank() || src.rank() != t.rank() {
                return Err(format!(
                    "index {index} and src {src} must have the rank of {t}"
                ));
            }
            Ok(same(t))
        }
        IndexPut => {
            let n = args.list_len("indices")?;
            args.count(n + 2)?;
            let t = args.input(0)?;
            let mut index_shape: Option<Vec<u64>> = None;
            for i in 1..=n {
                if let Some(index) = args.optional(i) {
                    if !(index.dtype.is_int() || index.dtype == DType::Bool) {
                        return Err(format!(
                            "index {} must be integer or bool, got {index}",
                            i - 1
                        ));
                    }
                    index_shape = Some(match index_shape {
                        None => index.shape.clone(),
                        Some(s) => broadcast(&s, &index.shape)?,
                    });
                }
            }
            if n > t.rank() {
                return Err(format!("{n} indices for a tensor of rank {}", t.rank()));
            }
            let values = args.input(n + 1)?;
            args.bool_or("accumulate", false)?;
            if values.dtype != t.dtype {
                return Err(format!("values {values} must have the dtype of {t}"));
            }
            Ok(same(t))
        }
        IndexSelect => {
            args.count(2)?;
            let (t, index) = (args.input(0)?, args.input(1)?);
            require_index(index, "index")?;
            if index.rank() > 1 {
                return Err(format!("index must be 0-d or 1-d, got {index}"));
            }
            let d = dim(args.int("dim")?, t.rank())?;
            let mut shape = t.shape.clone();
            if !shape.is_empty() {
                shape[d] = index.numel().unwrap_or(0);
            }
            Ok(vec![TensorType::new(t.dtype, shape)])
        }
        Full => {
            args.count(0)?;
            let size: Vec<u64> = args
                .ints("size")?
                .iter()
                .map(|&s| nonneg(s, "a dimension"))
                .collect::<Result<_>>()?;
            let fill = args.scalar("fill_value")?;
            let dtype = args.dtype_opt("dtype")?.unwrap_or(match fill {
                Scalar::Float(_) => DType::F32,
                Scalar::Int(_) => DType::I64,
                Scalar::Bool(_) => DType::Bool,
            });
            Ok(vec![TensorType::new(dtype, size)])
        }
        FullLike => {
            args.count(1)?;
            let t = args.input(0)?;
            args.scalar("fill_value")?;
            let dtype = args.dtype_opt("dtype")?.unwrap_or(t.dtype);
            Ok(vec![TensorType::new(dtype, t.shape.clone())])
        }
        ScalarTensor => {
            args.count(0)?;
            args.scalar("s")?;
            Ok(vec![TensorType::new(
                args.dtype_opt("dtype")?.unwrap_or(DType::F32),
                vec![],
            )])
        }
        ArangeStartStep => {
            args.count(0)?;
            let (start, end) = (args.scalar("start")?, args.scalar("end")?);
            let step = args.scalar_opt("step")?.unwrap_or(Scalar::Int(1));
            let (a, b, s) = (start.as_f64(), end.as_f64(), step.as_f64());
            if s == 0.0 || !a.is_finite() || !b.is_finite() || !s.is_finite() {
                return Err(format!(
                    "start {a}, end {b} and step {s} must be finite, step non-zero"
                ));
            }
            if (b - a) / s < 0.0 {
                return Err(format!("step {s} goes away from end {b} starting at {a}"));
            }
            let len = ((b - a) / s).ceil() as u64;
            let all_int = [start, end, step]
                .iter()
                .all(|v| matches!(v, Scalar::Int(_)));
            let default = if all_int { DType::I64 } else { DType::F32 };
            Ok(vec![TensorType::new(
                args.dtype_opt("dtype")?.unwrap_or(default),
                vec![len],
            )])
        }
        BernoulliP => {
            // self, then the session's generator: an i64 scalar STATE tensor that the
            // graph advances every iteration, so each iteration draws new values.
            args.count(2)?;
            let t = args.input(0)?;
            let generator = args.input(1)?;
            if generator.dtype != DType::I64 || !generator.shape.is_empty() {
                return Err(format!(
                    "the generator (input 1) must be an i64 scalar, got {generator}"
                ));
            }
            let p = args.scalar("p")?.as_f64();
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("p must be in [0, 1], got {p}"));
            }
            Ok(same(t))
        }
    }
}

fn matmul_2d(a: &TensorType, b: &TensorType) -> Result<TensorType> {
    if a.rank() != 2 || b.rank() != 2 || a.shape[1] != b.shape[0] {
        return Err(format!("needs [n, k] and [k, m], got {a} and {b}"));
    }
    if a.dtype != b.dtype {
        return Err(format!("operands differ in dtype: {a} and {b}"));
    }
    Ok(TensorType::new(a.dtype, vec![a.shape[0], b.shape[1]]))
}

fn layer_norm_axis(t: &TensorType, normalized: &[i64]) -> Result<usize> {
    if normalized.is_empty() || normalized.len() > t.rank() {
        return Err(format!(
            "normalized_shape {normalized:?} does not fit input {t}"
        ));
    }
    let axis = t.rank() - normalized.len();
    let tail: Vec<i64> = t.shape[axis..].iter().map(|&d| d as i64).collect();
    if tail != normalized {
        return Err(format!(
            "normalized_shape {normalized:?} must equal the last dimensions of input {t}"
        ));
    }
    Ok(axis)
}
