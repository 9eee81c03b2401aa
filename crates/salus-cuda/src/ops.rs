//! Lowering: every node of a [`Program`] at one placement becomes a list of device
//! commands (kernel launches with their argument words, memsets, cuBLAS products) with
//! absolute device addresses. A list is built once per (program, placement), run eagerly
//! or captured into a CUDA graph, and replayed.
//!
//! The argument words of each kernel follow the field order of its struct in
//! `src/kernels/*.cu` (`crate::KERNELS`); every field is 8 bytes.

use salus_exec::{Location, Program};
use salus_graph::{Attr, DType, Node, Op, TensorType};

use crate::driver::{Gemm, GemmType};

/// The kernels of `crate::KERNELS`, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum K {
    Ew,
    GuardedCopy,
    RedThread,
    RedBlock,
    SoftmaxFwd,
    SoftmaxBwd,
    LayerNormFwd,
    LayerNormBwdInput,
    LayerNormBwdParams,
    MatmulNaive,
    ConvFwd,
    ConvBwdInput,
    ConvBwdWeight,
    Im2col,
    Col2im,
    MaxPoolFwd,
    MaxPoolBwd,
    AvgPoolFwd,
    AvgPoolBwd,
    AdaptivePoolFwd,
    AdaptivePoolBwd,
    AlongDim,
    TakeRows,
    EmbeddingBwd,
    IndexPut,
    Bernoulli,
}

impl K {
    pub(crate) const ALL: [K; 26] = [
        K::Ew,
        K::GuardedCopy,
        K::RedThread,
        K::RedBlock,
        K::SoftmaxFwd,
        K::SoftmaxBwd,
        K::LayerNormFwd,
        K::LayerNormBwdInput,
        K::LayerNormBwdParams,
        K::MatmulNaive,
        K::ConvFwd,
        K::ConvBwdInput,
        K::ConvBwdWeight,
        K::Im2col,
        K::Col2im,
        K::MaxPoolFwd,
        K::MaxPoolBwd,
        K::AvgPoolFwd,
        K::AvgPoolBwd,
        K::AdaptivePoolFwd,
        K::AdaptivePoolBwd,
        K::AlongDim,
        K::TakeRows,
        K::EmbeddingBwd,
        K::IndexPut,
        K::Bernoulli,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            K::Ew => "ew",
            K::GuardedCopy => "guarded_copies",
            K::RedThread => "red_thread",
            K::RedBlock => "red_block",
            K::SoftmaxFwd => "softmax_fwd",
            K::SoftmaxBwd => "softmax_bwd",
            K::LayerNormFwd => "layer_norm_fwd",
            K::LayerNormBwdInput => "layer_norm_bwd_input",
            K::LayerNormBwdParams => "layer_norm_bwd_params",
            K::MatmulNaive => "matmul_naive",
            K::ConvFwd => "conv_fwd",
            K::ConvBwdInput => "conv_bwd_input",
            K::ConvBwdWeight => "conv_bwd_weight",
            K::Im2col => "im2col",
            K::Col2im => "col2im",
            K::MaxPoolFwd => "max_pool_fwd",
            K::MaxPoolBwd => "max_pool_bwd",
            K::AvgPoolFwd => "avg_pool_fwd",
            K::AvgPoolBwd => "avg_pool_bwd",
            K::AdaptivePoolFwd => "adaptive_pool_fwd",
            K::AdaptivePoolBwd => "adaptive_pool_bwd",
            K::AlongDim => "along_dim",
            K::TakeRows => "take_rows",
            K::Bernoulli => "bernoulli",
            K::EmbeddingBwd => "embedding_bwd",
            K::IndexPut => "index_put",
        }
    }
}

/// One device command.
#[derive(Debug, Clone)]
pub(crate) enum Cmd {
    Launch {
        kernel: K,
        grid: u32,
        grid_y: u32,
        block: u32,
        args: Vec<u64>,
    },
    Zero {
        ptr: u64,
        bytes: u64,
    },
    Gemm(Gemm),
}

const MAXR: usize = 8;
const BLOCK: u32 = 256;
const MAX_GRID: u64 = 65_535;

/// The error block's codes, as the kernels report them, and the CPU device's words.
pub(crate) fn index_error(code: u64, value: i64, bound: i64) -> String {
    let what = match code {
        2 => "embedding index",
        3 => "pooling index",
        4 => "index_select index",
        5 => "embedding_dense_backward index",
        6 => "index_put index",
        _ => "index",
    };
    format!("{what} {value} is out of range for a dimension of size {bound}")
}

fn dt(d: DType) -> u64 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Bf16 => 2,
        DType::I64 => 3,
        DType::I32 => 4,
        DType::Bool => 5,
    }
}

fn f(v: f64) -> u64 {
    v.to_bits()
}

fn i(v: i64) -> u64 {
    v as u64
}

fn grid_for(n: u64) -> u32 {
    n.div_ceil(u64::from(BLOCK)).clamp(1, MAX_GRID) as u32
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

fn contiguous(shape: &[u64]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1] as i64;
    }
    s
}

fn broadcast(shape: &[u64], out: &[u64]) -> Vec<i64> {
    let own = contiguous(shape);
    let lead = out.len() - shape.len().min(out.len());
    (0..out.len())
        .map(|d| {
            if d < lead || shape[d - lead] == 1 {
                0
            } else {
                own[d - lead]
            }
        })
        .collect()
}

fn wrap(d: i64, rank: usize) -> usize {
    let r = rank.max(1) as i64;
    (if d < 0 { d + r } else { d }).clamp(0, r - 1) as usize
}

fn attr_f64(node: &Node, name: &str, default: Option<f64>) -> Result<f64, String> {
    match node.attrs.get(name) {
        Some(Attr::Float(v)) => Ok(*v),
        Some(Attr::Int(v)) => Ok(*v as f64),
        Some(Attr::Bool(v)) => Ok(f64::from(u8::from(*v))),
        None => default.ok_or_else(|| format!("attribute {name:?} is missing")),
        Some(other) => Err(format!("attribute {name:?} is not a number: {other:?}")),
    }
}

fn attr_ints<'a>(node: &'a Node, name: &str) -> Option<&'a [i64]> {
    match node.attrs.get(name) {
        Some(Attr::Ints(v)) => Some(v),
        _ => None,
    }
}

fn attr_int(node: &Node, name: &str, default: i64) -> i64 {
    match node.attrs.get(name) {
        Some(Attr::Int(v)) => *v,
        _ => default,
    }
}

fn attr_bool(node: &Node, name: &str) -> bool {
    matches!(node.attrs.get(name), Some(Attr::Bool(true)))
}

/// A tensor operand: type and absolute device address.
#[derive(Debug, Clone)]
struct T {
    ty: TensorType,
    ptr: u64,
}

impl T {
    fn shape(&self) -> &[u64] {
        &self.ty.shape
    }
    fn dt(&self) -> u64 {
        dt(self.ty.dtype)
    }
    fn numel(&self) -> u64 {
        numel(&self.ty.shape)
    }
    fn size(&self) -> u64 {
        self.ty.dtype.size()
    }
}

/// An operand of a strided kernel: address (of element 0), dtype, strides in elements.
#[derive(Debug, Clone)]
struct Strided {
    ptr: u64,
    dt: u64,
    st: Vec<i64>,
}

/// Drops size-1 dims and merges dims that every operand walks contiguously.
fn coalesce(shape: &[u64], ops: &mut [Strided]) -> Vec<u64> {
    let keep: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
    let mut out_shape: Vec<u64> = Vec::new();
    let mut out_st: Vec<Vec<i64>> = vec![Vec::new(); ops.len()];
    for &d in &keep {
        let mergeable = !out_shape.is_empty()
            && ops
                .iter()
                .enumerate()
                .all(|(k, o)| out_st[k].last().copied() == Some(o.st[d] * shape[d] as i64));
        if mergeable {
            let last = out_shape.len() - 1;
            out_shape[last] *= shape[d];
            for (k, o) in ops.iter().enumerate() {
                let l = out_st[k].len() - 1;
                out_st[k][l] = o.st[d];
            }
        } else {
            out_shape.push(shape[d]);
            for (k, o) in ops.iter().enumerate() {
                out_st[k].push(o.st[d]);
            }
        }
    }
    for (o, st) in ops.iter_mut().zip(out_st) {
        o.st = st;
    }
    out_shape
}

fn padded(v: &[i64]) -> impl Iterator<Item = u64> + '_ {
    (0..MAXR).map(move |d| v.get(d).copied().unwrap_or(0) as u64)
}

/// Builds the command list of one node.
pub(crate) struct Lower<'a> {
    pub program: &'a Program,
    pub persistent: u64,
    pub lane: u64,
    pub err: u64,
    pub index: usize,
    pub cmds: Vec<Cmd>,
}

type R = Result<(), String>;

impl Lower<'_> {
    fn at(&self, id: usize) -> u64 {
        match self.program.location(id) {
            Some(Location::Persistent(off)) => self.persistent + off,
            Some(Location::Lane(off)) => self.lane + off,
            None => 0,
        }
    }

    fn input(&self, node: &Node, k: usize) -> Option<T> {
        let id = node.inputs.get(k).copied().flatten()?;
        Some(T {
            ty: self.program.graph().tensors[id].ty.clone(),
            ptr: self.at(id),
        })
    }

    fn need(&self, node: &Node, k: usize) -> Result<T, String> {
        self.input(node, k)
            .ok_or_else(|| format!("input {k} must be a tensor of its own"))
    }

    fn output(&self, node: &Node, k: usize) -> Option<T> {
        let id = node.outputs.get(k).copied().flatten()?;
        Some(T {
            ty: self.program.graph().tensors[id].ty.clone(),
            ptr: self.at(id),
        })
    }

    fn launch(&mut self, kernel: K, n: u64, args: Vec<u64>) {
        if n == 0 {
            return;
        }
        self.cmds.push(Cmd::Launch {
            kernel,
            grid: grid_for(n),
            grid_y: 1,
            block: BLOCK,
            args,
        });
    }

    fn launch_blocks(&mut self, kernel: K, blocks: u64, args: Vec<u64>) {
        if blocks == 0 {
            return;
        }
        self.cmds.push(Cmd::Launch {
            kernel,
            grid: blocks.clamp(1, MAX_GRID) as u32,
            grid_y: 1,
            block: BLOCK,
            args,
        });
    }

    fn zero(&mut self, t: &T) {
        let bytes = t.numel() * t.size();
        if bytes > 0 {
            self.cmds.push(Cmd::Zero { ptr: t.ptr, bytes });
        }
    }

    /// `out[idx] = op(ins[idx]...)` over `shape`, each operand with its own strides.
    fn strided(
        &mut self,
        op: u64,
        shape: &[u64],
        out: Strided,
        ins: Vec<Strided>,
        s: [f64; 3],
    ) -> R {
        let n = numel(shape);
        if n == 0 {
            return Ok(());
        }
        let nin = ins.len();
        let mut ops = vec![out];
        ops.extend(ins);
        let shape = coalesce(shape, &mut ops);
        if shape.len() > MAXR {
            return Err(format!(
                "the CUDA device runs elementwise ops of at most {MAXR} dims, got {}",
                shape.len()
            ));
        }
        let contig = shape.len() <= 1 && ops.iter().all(|o| o.st.iter().all(|&x| x == 1));
        let mut args = vec![
            n,
            shape.len() as u64,
            op,
            nin as u64,
            u64::from(contig),
            f(s[0]),
            f(s[1]),
            f(s[2]),
        ];
        args.extend(padded(&shape.iter().map(|&x| x as i64).collect::<Vec<_>>()));
        for k in 0..4 {
            match ops.get(k) {
                Some(o) => {
                    args.push(o.ptr);
                    args.push(o.dt);
                    args.extend(padded(&o.st));
                }
                None => args.extend(std::iter::repeat_n(0, 2 + MAXR)),
            }
        }
        self.launch(K::Ew, n, args);
        Ok(())
    }

    /// An elementwise op with broadcasting over `ins` into `out`.
    fn ew(&mut self, op: u64, out: &T, ins: &[&T], s: [f64; 3]) -> R {
        let shape = out.shape().to_vec();
        let o = Strided {
            ptr: out.ptr,
            dt: out.dt(),
            st: contiguous(&shape),
        };
        let ins = ins
            .iter()
            .map(|t| Strided {
                ptr: t.ptr,
                dt: t.dt(),
                st: broadcast(t.shape(), &shape),
            })
            .collect();
        self.strided(op, &shape, o, ins, s)
    }

    /// Copies `x` (numel of `out`) into `out` as a flat sequence, converting the dtype.
    fn copy_flat(&mut self, out: &T, x: &T) -> R {
        if out.ptr == x.ptr && out.ty.dtype == x.ty.dtype {
            return Ok(());
        }
        let shape = vec![out.numel()];
        self.strided(
            OP_COPY,
            &shape,
            Strided {
                ptr: out.ptr,
                dt: out.dt(),
                st: vec![1],
            },
            vec![Strided {
                ptr: x.ptr,
                dt: x.dt(),
                st: vec![1],
            }],
            [0.0; 3],
        )
    }

    /// Reduces `x` over `dims` into `out` (kept dims in order).
    fn reduce(&mut self, op: u64, x: &T, dims: &[usize], out: &T, correction: f64) -> R {
        let rank = x.ty.rank();
        let own = contiguous(x.shape());
        let mut kept = vec![Strided {
            ptr: 0,
            dt: 0,
            st: Vec::new(),
        }];
        let mut red = vec![Strided {
            ptr: 0,
            dt: 0,
            st: Vec::new(),
        }];
        let (mut kshape, mut rshape) = (Vec::new(), Vec::new());
        for (d, (&size, &st)) in x.shape().iter().zip(&own).enumerate().take(rank) {
            if dims.contains(&d) {
                rshape.push(size);
                red[0].st.push(st);
            } else {
                kshape.push(size);
                kept[0].st.push(st);
            }
        }
        let count = numel(&rshape);
        let nout = numel(&kshape);
        let kshape = coalesce(&kshape, &mut kept);
        let rshape = coalesce(&rshape, &mut red);
        if kshape.len() > MAXR || rshape.len() > MAXR {
            return Err("the CUDA device reduces tensors of at most 8 dims".into());
        }
        let as_i = |v: &[u64]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
        let mut args = vec![
            nout,
            count,
            op,
            kshape.len() as u64,
            rshape.len() as u64,
            f(correction),
        ];
        args.extend(padded(&as_i(&kshape)));
        args.extend(padded(&kept[0].st));
        args.extend(padded(&as_i(&rshape)));
        args.extend(padded(&red[0].st));
        args.extend([x.ptr, x.dt(), out.ptr, out.dt()]);
        if count <= 32 {
            self.launch(K::RedThread, nout, args);
        } else {
            self.launch_blocks(K::RedBlock, nout, args);
        }
        Ok(())
    }

    fn gemm_type(tys: &[&T]) -> Option<GemmType> {
        let d = tys.first()?.ty.dtype;
        if tys.iter().any(|t| t.ty.dtype != d) {
            return None;
        }
        match d {
            DType::F32 => Some(GemmType::F32),
            DType::F16 => Some(GemmType::F16),
            DType::Bf16 => Some(GemmType::Bf16),
            _ => None,
        }
    }

    /// `c[b] = alpha * a[b] (n x k) @ bm[b] (k x m) + beta * c[b]`, row-major, through
    /// cuBLAS (column-major: c^T = bm^T a^T).
    #[allow(clippy::too_many_arguments)]
    fn gemm_rm(
        &mut self,
        ty: GemmType,
        (n, k, m): (u64, u64, u64),
        a: (u64, u64, i64),
        bm: (u64, u64, i64),
        c: (u64, u64, i64),
        alpha: f64,
        beta: f64,
        batch: u64,
    ) {
        // a: (ptr, row stride (ld), batch stride); likewise bm and c.
        if n == 0 || m == 0 || batch == 0 {
            return;
        }
        self.cmds.push(Cmd::Gemm(Gemm {
            ty,
            trans_a: false,
            trans_b: false,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha: alpha as f32,
            a: bm.0,
            lda: bm.1 as i32,
            stride_a: bm.2,
            b: a.0,
            ldb: a.1 as i32,
            stride_b: a.2,
            beta: beta as f32,
            c: c.0,
            ldc: c.1 as i32,
            stride_c: c.2,
            batch: batch as i32,
        }));
    }

    /// Lowers one node.
    pub(crate) fn node(&mut self, node: &Node) -> R {
        use Op::*;
        let layout = &self.program.layouts()[self.index];
        if let Some(error) = &layout.error {
            return Err(error.clone());
        }
        if layout.skip {
            return Ok(());
        }
        match node.op {
            ConvolutionBackward => return self.convolution_backward(node),
            MaxPool2dWithIndices => return self.max_pool(node),
            NativeLayerNorm => return self.layer_norm(node),
            NativeLayerNormBackward => return self.layer_norm_backward(node),
            SplitWithSizes => return self.split(node),
            BernoulliP => return self.bernoulli(node),
            _ => {}
        }
        let o = self.output(node, 0).ok_or("output 0 is unused")?;
        let x = |me: &Self, k: usize| me.need(node, k);
        let scalar = |name: &str| attr_f64(node, name, None);
        match node.op {
            AddTensor | SubTensor => {
                let alpha = attr_f64(node, "alpha", Some(1.0))?;
                let sign = if node.op == SubTensor { -1.0 } else { 1.0 };
                let (a, b) = (x(self, 0)?, x(self, 1)?);
                self.ew(OP_ADD, &o, &[&a, &b], [sign * alpha, 0.0, 0.0])
            }
            MulTensor => self.binary(OP_MUL, node, &o),
            DivTensor => self.binary(OP_DIV, node, &o),
            LogicalAnd => self.binary(OP_LAND, node, &o),
            BitwiseAndTensor => self.binary(OP_BAND, node, &o),
            AddScalar => {
                let other = scalar("other")?;
                let alpha = attr_f64(node, "alpha", Some(1.0))?;
                self.unary(OP_ADDS, node, &o, [alpha * other, 0.0, 0.0])
            }
            MulScalar => self.unary(OP_MULS, node, &o, [scalar("other")?, 0.0, 0.0]),
            DivScalar => self.unary(OP_DIVS, node, &o, [scalar("other")?, 0.0, 0.0]),
            Neg => self.unary(OP_NEG, node, &o, [0.0; 3]),
            Abs => self.unary(OP_ABS, node, &o, [0.0; 3]),
            Sign => self.unary(OP_SIGN, node, &o, [0.0; 3]),
            Exp => self.unary(OP_EXP, node, &o, [0.0; 3]),
            Log => self.unary(OP_LOG, node, &o, [0.0; 3]),
            Sqrt => self.unary(OP_SQRT, node, &o, [0.0; 3]),
            Rsqrt => self.unary(OP_RSQRT, node, &o, [0.0; 3]),
            Reciprocal => self.unary(OP_RECIPROCAL, node, &o, [0.0; 3]),
            Sigmoid => self.unary(OP_SIGMOID, node, &o, [0.0; 3]),
            Tanh => self.unary(OP_TANH, node, &o, [0.0; 3]),
            Relu => self.unary(OP_RELU, node, &o, [0.0; 3]),
            Erf => self.unary(OP_ERF, node, &o, [0.0; 3]),
            LeakyRelu => {
                let slope = attr_f64(node, "negative_slope", Some(0.01))?;
                self.unary(OP_LEAKY, node, &o, [slope, 0.0, 0.0])
            }
            Gelu => {
                let tanh =
                    matches!(node.attrs.get("approximate"), Some(Attr::Str(s)) if s == "tanh");
                self.unary(
                    if tanh { OP_GELU_TANH } else { OP_GELU },
                    node,
                    &o,
                    [0.0; 3],
                )
            }
            PowTensorScalar => self.unary(OP_POW_TS, node, &o, [scalar("exponent")?, 0.0, 0.0]),
            PowScalar => self.unary(OP_POW_S, node, &o, [scalar("self")?, 0.0, 0.0]),
            Clamp => {
                let lo = attr_f64(node, "min", Some(f64::NEG_INFINITY))?;
                let hi = attr_f64(node, "max", Some(f64::INFINITY))?;
                self.unary(OP_CLAMP, node, &o, [lo, hi, 0.0])
            }
            EqScalar | NeScalar | LtScalar | LeScalar | GtScalar | GeScalar => {
                let code = match node.op {
                    EqScalar => OP_EQ,
                    NeScalar => OP_NE,
                    LtScalar => OP_LT,
                    LeScalar => OP_LE,
                    GtScalar => OP_GT,
                    _ => OP_GE,
                };
                self.unary(code, node, &o, [scalar("other")?, 0.0, 0.0])
            }
            LogicalNot => self.unary(OP_LNOT, node, &o, [0.0; 3]),
            BitwiseNot if o.ty.dtype == DType::Bool => self.unary(OP_LNOT, node, &o, [0.0; 3]),
            BitwiseNot => self.unary(OP_BNOT, node, &o, [0.0; 3]),
            WhereSelf => {
                let (c, a, b) = (x(self, 0)?, x(self, 1)?, x(self, 2)?);
                self.ew(OP_WHERE, &o, &[&c, &a, &b], [0.0; 3])
            }
            ToCopy | Clone => {
                let a = x(self, 0)?;
                if a.ptr == o.ptr && a.ty.dtype == o.ty.dtype {
                    return Ok(());
                }
                self.ew(OP_COPY, &o, &[&a], [0.0; 3])
            }
            Full | FullLike => self.ew(OP_FILL, &o, &[], [scalar("fill_value")?, 0.0, 0.0]),
            ScalarTensor => self.ew(OP_FILL, &o, &[], [scalar("s")?, 0.0, 0.0]),
            ArangeStartStep => {
                let start = scalar("start")?;
                let step = attr_f64(node, "step", Some(1.0))?;
                let flat = T {
                    ty: TensorType::new(o.ty.dtype, vec![o.numel()]),
                    ptr: o.ptr,
                };
                self.ew(OP_ARANGE, &flat, &[], [start, step, 0.0])
            }
            View | Unsqueeze | SqueezeDims => {
                let a = x(self, 0)?;
                self.copy_flat(&o, &a)
            }
            Permute => {
                let a = x(self, 0)?;
                let dims = attr_ints(node, "dims").ok_or("attribute \"dims\" is missing")?;
                let own = contiguous(a.shape());
                let st = dims.iter().map(|&d| own[wrap(d, a.ty.rank())]).collect();
                self.copy_strided(&o, &a, st, 0)
            }
            Expand => {
                let a = x(self, 0)?;
                let st = broadcast(a.shape(), o.shape());
                self.copy_strided(&o, &a, st, 0)
            }
            SliceTensor => self.slice(node, &o),
            SelectInt => self.select(node, &o),
            Cat => self.cat(node, &o),
            SumDimIntList | MeanDim | Amax | Mean => {
                let a = x(self, 0)?;
                let rank = a.ty.rank();
                let dims: Vec<usize> = match (node.op, attr_ints(node, "dim")) {
                    (Mean, _) | (_, None) | (_, Some([])) => (0..rank).collect(),
                    (_, Some(ds)) => ds.iter().map(|&d| wrap(d, rank)).collect(),
                };
                let op = match node.op {
                    SumDimIntList => RED_SUM,
                    Amax => RED_AMAX,
                    _ => RED_MEAN,
                };
                self.reduce(op, &a, &dims, &o, 0.0)
            }
            VarCorrection => {
                let a = x(self, 0)?;
                let rank = a.ty.rank();
                let dims: Vec<usize> = match attr_ints(node, "dim") {
                    None | Some([]) => (0..rank).collect(),
                    Some(ds) => ds.iter().map(|&d| wrap(d, rank)).collect(),
                };
                let correction = attr_f64(node, "correction", Some(1.0))?;
                self.reduce(RED_VAR, &a, &dims, &o, correction)
            }
            AnyDim => {
                let a = x(self, 0)?;
                let d = wrap(attr_int(node, "dim", 0), a.ty.rank());
                let dims: Vec<usize> = if a.ty.rank() == 0 { vec![] } else { vec![d] };
                self.reduce(RED_ANY, &a, &dims, &o, 0.0)
            }
            Softmax | LogSoftmax => {
                let a = x(self, 0)?;
                self.softmax(node, &a, None, &o, node.op == LogSoftmax, K::SoftmaxFwd)
            }
            SoftmaxBackwardData | LogSoftmaxBackwardData => {
                let (g, y) = (x(self, 0)?, x(self, 1)?);
                if g.shape() != y.shape() || o.shape() != g.shape() {
                    return Err(format!(
                        "grad_output {}, output {} and grad_input {} must have one shape",
                        g.ty, y.ty, o.ty
                    ));
                }
                let log = node.op == LogSoftmaxBackwardData;
                self.softmax(node, &y, Some(&g), &o, log, K::SoftmaxBwd)
            }
            Mm | Addmm | Bmm => self.matmul(node, &o),
            Convolution => self.convolution(node, &o),
            MaxPool2dWithIndicesBackward => self.max_pool_backward(node, &o),
            AvgPool2d | AvgPool2dBackward | AdaptiveAvgPool2d | AdaptiveAvgPool2dBackward => {
                self.avg_pool(node, &o)
            }
            Embedding => {
                let (w, idx) = (x(self, 0)?, x(self, 1)?);
                if w.ty.rank() != 2 {
                    return Err(format!("embedding weight {} must be 2-d", w.ty));
                }
                self.take_rows(&w, &idx, 1, w.shape()[0], w.shape()[1], &o, 2)
            }
            IndexSelect => {
                let (a, idx) = (x(self, 0)?, x(self, 1)?);
                if a.ty.rank() == 0 {
                    // A 0-dim self: every index must name element 0 (or -1).
                    self.copy_flat(&o, &a)?;
                    for j in 0..idx.numel() {
                        let one = T {
                            ty: TensorType::new(idx.ty.dtype, vec![1]),
                            ptr: idx.ptr + j * idx.size(),
                        };
                        self.take_rows(&a, &one, 1, 1, 1, &o, 4)?;
                    }
                    return Ok(());
                }
                let d = wrap(attr_int(node, "dim", 0), a.ty.rank());
                let outer = numel(&a.shape()[..d]);
                let inner = numel(&a.shape()[d + 1..]);
                self.take_rows(&a, &idx, outer, a.shape()[d], inner, &o, 4)
            }
            Gather | ScatterValue | ScatterAdd => self.along(node, &o),
            EmbeddingDenseBackward => self.embedding_backward(node, &o),
            IndexPut => self.index_put(node, &o),
            op => Err(format!("the CUDA device has no kernel for {op} yet")),
        }
    }

    fn unary(&mut self, op: u64, node: &Node, o: &T, s: [f64; 3]) -> R {
        let a = self.need(node, 0)?;
        self.ew(op, o, &[&a], s)
    }

    fn binary(&mut self, op: u64, node: &Node, o: &T) -> R {
        let (a, b) = (self.need(node, 0)?, self.need(node, 1)?);
        self.ew(op, o, &[&a, &b], [0.0; 3])
    }

    /// `o[idx] = a[offset + sum idx[d] * st[d]]` over o's shape.
    fn copy_strided(&mut self, o: &T, a: &T, st: Vec<i64>, offset: u64) -> R {
        let shape = o.shape().to_vec();
        self.strided(
            OP_COPY,
            &shape,
            Strided {
                ptr: o.ptr,
                dt: o.dt(),
                st: contiguous(&shape),
            },
            vec![Strided {
                ptr: a.ptr + offset * a.size(),
                dt: a.dt(),
                st,
            }],
            [0.0; 3],
        )
    }

    fn slice(&mut self, node: &Node, o: &T) -> R {
        let a = self.need(node, 0)?;
        if a.ty.rank() == 0 {
            return Err("cannot slice a 0-dim tensor".into());
        }
        let d = wrap(attr_int(node, "dim", 0), a.ty.rank());
        let n = a.shape()[d] as i64;
        let step = attr_int(node, "step", 1);
        if step <= 0 {
            return Err(format!("step must be positive, got {step}"));
        }
        let clamp = |v: i64| {
            if v < 0 {
                v.saturating_add(n).max(0)
            } else {
                v.min(n)
            }
        };
        let start = clamp(attr_int(node, "start", 0));
        let mut st = contiguous(a.shape());
        let offset = start as u64 * st[d] as u64;
        st[d] *= step;
        self.copy_strided(o, &a, st, offset)
    }

    fn select(&mut self, node: &Node, o: &T) -> R {
        let a = self.need(node, 0)?;
        if a.ty.rank() == 0 {
            return Err("cannot select from a 0-dim tensor".into());
        }
        let d = wrap(attr_int(node, "dim", 0), a.ty.rank());
        let index = attr_int(node, "index", 0);
        let n = a.shape()[d] as i64;
        let row = if index < 0 { index + n } else { index };
        if !(0..n).contains(&row) {
            return Err(format!(
                "select index {index} is out of range for dimension {d} of size {n}"
            ));
        }
        let mut st = contiguous(a.shape());
        let offset = row as u64 * st[d] as u64;
        st.remove(d);
        self.copy_strided(o, &a, st, offset)
    }

    fn cat(&mut self, node: &Node, o: &T) -> R {
        let rank = o.ty.rank();
        let d = wrap(attr_int(node, "dim", 0), rank);
        let ost = contiguous(o.shape());
        let mut at = 0u64;
        for k in 0..node.inputs.len() {
            let a = self.input(node, k).ok_or("cat inputs must be tensors")?;
            let shape = a.shape().to_vec();
            let offset = at * ost.get(d).copied().unwrap_or(1) as u64;
            self.strided(
                OP_COPY,
                &shape,
                Strided {
                    ptr: o.ptr + offset * o.size(),
                    dt: o.dt(),
                    st: ost.clone(),
                },
                vec![Strided {
                    ptr: a.ptr,
                    dt: a.dt(),
                    st: contiguous(&shape),
                }],
                [0.0; 3],
            )?;
            at += shape.get(d).copied().unwrap_or(1);
        }
        Ok(())
    }

    fn split(&mut self, node: &Node) -> R {
        let a = self.need(node, 0)?;
        let d = wrap(attr_int(node, "dim", 0), a.ty.rank());
        let sizes = attr_ints(node, "split_sizes")
            .ok_or("attribute \"split_sizes\" is missing")?
            .to_vec();
        let st = contiguous(a.shape());
        let mut at = 0u64;
        for (k, &len) in sizes.iter().enumerate() {
            if let Some(o) = self.output(node, k) {
                self.copy_strided(&o, &a, st.clone(), at * st[d] as u64)?;
            }
            at += len as u64;
        }
        Ok(())
    }

    /// Softmax forward (`g` None: y = softmax(x)) or backward (x: output y, g: grad,
    /// result into `o`).
    fn softmax(&mut self, node: &Node, a: &T, g: Option<&T>, o: &T, log: bool, k: K) -> R {
        let d = wrap(attr_int(node, "dim", -1), a.ty.rank());
        let len = a.shape().get(d).copied().unwrap_or(1);
        let inner = numel(a.shape().get(d + 1..).unwrap_or(&[]));
        let rows = a.numel() / (len * inner).max(1);
        let args = match g {
            None => vec![
                rows * inner,
                len,
                inner,
                u64::from(log),
                a.ptr,
                a.dt(),
                o.ptr,
                o.dt(),
                0,
                0,
            ],
            Some(g) => vec![
                rows * inner,
                len,
                inner,
                u64::from(log),
                o.ptr,
                o.dt(),
                a.ptr,
                a.dt(),
                g.ptr,
                g.dt(),
            ],
        };
        if len == 0 || inner == 0 {
            return Ok(());
        }
        self.launch_blocks(k, rows * inner, args);
        Ok(())
    }

    fn layer_norm(&mut self, node: &Node) -> R {
        let a = self.need(node, 0)?;
        let normalized = attr_ints(node, "normalized_shape")
            .ok_or("attribute \"normalized_shape\" is missing")?;
        let eps = attr_f64(node, "eps", Some(1e-5))?;
        let inner = normalized.iter().product::<i64>().max(0) as u64;
        let rows = a.numel() / inner.max(1);
        let opt = |t: Option<T>| t.map_or((0, 0), |t| (t.ptr, t.dt()));
        let (w, b) = (opt(self.input(node, 1)), opt(self.input(node, 2)));
        let (y, m, r) = (
            opt(self.output(node, 0)),
            opt(self.output(node, 1)),
            opt(self.output(node, 2)),
        );
        let args = vec![
            rows,
            inner,
            f(eps),
            a.ptr,
            a.dt(),
            w.0,
            w.1,
            b.0,
            b.1,
            y.0,
            y.1,
            m.0,
            m.1,
            r.0,
            r.1,
        ];
        self.launch_blocks(K::LayerNormFwd, rows, args);
        Ok(())
    }

    fn layer_norm_backward(&mut self, node: &Node) -> R {
        let (g, a, mean, rstd) = (
            self.need(node, 0)?,
            self.need(node, 1)?,
            self.need(node, 2)?,
            self.need(node, 3)?,
        );
        let normalized = attr_ints(node, "normalized_shape")
            .ok_or("attribute \"normalized_shape\" is missing")?;
        let inner = normalized.iter().product::<i64>().max(0) as u64;
        let total = a.numel();
        let rows = total.checked_div(inner).unwrap_or(0);
        if g.numel() != total || mean.numel() != rows || rstd.numel() != rows {
            return Err(format!(
                "grad_out {}, mean {} and rstd {} do not fit input {} normalized over {normalized:?}",
                g.ty, mean.ty, rstd.ty, a.ty
            ));
        }
        let w = match self.input(node, 4) {
            Some(w) if w.numel() == inner => (w.ptr, w.dt()),
            Some(w) => return Err(format!("weight {} must have {inner} elements", w.ty)),
            None => (0, 0),
        };
        let outs: Vec<Option<T>> = (0..3).map(|k| self.output(node, k)).collect();
        for (k, o) in outs.iter().enumerate() {
            if let Some(o) = o {
                let want = if k == 0 { total } else { inner };
                if o.numel() != want {
                    return Err(format!("output {k} {} must have {want} elements", o.ty));
                }
            }
        }
        let opt = |t: &Option<T>| t.as_ref().map_or((0, 0), |t| (t.ptr, t.dt()));
        let (gi, gw, gb) = (opt(&outs[0]), opt(&outs[1]), opt(&outs[2]));
        let args = vec![
            rows,
            inner,
            g.ptr,
            g.dt(),
            a.ptr,
            a.dt(),
            mean.ptr,
            mean.dt(),
            rstd.ptr,
            rstd.dt(),
            w.0,
            w.1,
            gi.0,
            gi.1,
            gw.0,
            gw.1,
            gb.0,
            gb.1,
        ];
        if gi.0 != 0 {
            self.launch_blocks(K::LayerNormBwdInput, rows, args.clone());
        }
        if gw.0 != 0 || gb.0 != 0 {
            if rows == 0 {
                for o in outs.iter().skip(1).flatten() {
                    self.zero(o);
                }
            } else {
                self.launch(K::LayerNormBwdParams, inner, args);
            }
        }
        Ok(())
    }

    fn matmul(&mut self, node: &Node, o: &T) -> R {
        let (a, b, bias) = match node.op {
            Op::Addmm => (
                self.need(node, 1)?,
                self.need(node, 2)?,
                Some(self.need(node, 0)?),
            ),
            _ => (self.need(node, 0)?, self.need(node, 1)?, None),
        };
        let batched = node.op == Op::Bmm;
        let sh = |t: &T, k: usize| -> Result<u64, String> {
            t.shape()
                .get(k)
                .copied()
                .ok_or_else(|| format!("{} has too few dims for {}", t.ty, node.op))
        };
        let (batch, n, k, m) = if batched {
            (sh(&a, 0)?, sh(&a, 1)?, sh(&a, 2)?, sh(&b, 2)?)
        } else {
            (1, sh(&a, 0)?, sh(&a, 1)?, sh(&b, 1)?)
        };
        let beta = attr_f64(node, "beta", Some(1.0))?;
        let alpha = attr_f64(node, "alpha", Some(1.0))?;
        let ty = Self::gemm_type(&[&a, &b, o]);
        if let (Some(ty), true) = (ty, k > 0) {
            let mut acc = 0.0;
            if let Some(bias) = &bias {
                self.ew(OP_MULS, o, &[bias], [beta, 0.0, 0.0])?;
                acc = 1.0;
            }
            self.gemm_rm(
                ty,
                (n, k, m),
                (a.ptr, k, (n * k) as i64),
                (b.ptr, m, (k * m) as i64),
                (o.ptr, m, (n * m) as i64),
                alpha,
                acc,
                batch,
            );
            return Ok(());
        }
        let (bptr, bdt, s0, s1) = match &bias {
            Some(t) => {
                let st = broadcast(t.shape(), o.shape());
                (
                    t.ptr,
                    t.dt(),
                    st.first().copied().unwrap_or(0),
                    st.get(1).copied().unwrap_or(0),
                )
            }
            None => (0, 0, 0, 0),
        };
        let args = vec![
            batch,
            n,
            k,
            m,
            f(alpha),
            f(beta),
            a.ptr,
            a.dt(),
            b.ptr,
            b.dt(),
            o.ptr,
            o.dt(),
            bptr,
            bdt,
            i(s0),
            i(s1),
        ];
        self.launch(K::MatmulNaive, batch * n * m, args);
        Ok(())
    }

    /// The arguments of the direct convolution kernels, or an error like the CPU's.
    fn conv_args(&self, node: &Node, x: &T, w: &T, out_shape: &[u64]) -> Result<Vec<u64>, String> {
        let rank = x.ty.rank();
        if !(3..=5).contains(&rank) || w.ty.rank() != rank || out_shape.len() != rank {
            return Err(format!(
                "convolution needs input, weight and output of one rank from 3 to 5, got {}, {} and {out_shape:?}",
                x.ty, w.ty
            ));
        }
        let dims = rank - 2;
        let triple = |name: &str, default: i64| -> Result<[i64; 3], String> {
            let values = attr_ints(node, name).unwrap_or(&[]);
            let mut out = [default; 3];
            match values.len() {
                0 => {}
                1 => out[3 - dims..].fill(values[0]),
                len if len == dims => out[3 - dims..].copy_from_slice(values),
                len => {
                    return Err(format!(
                        "attribute {name:?} has {len} values for {dims} spatial dimensions"
                    ));
                }
            }
            Ok(out)
        };
        let spatial = |s: &[u64]| -> [i64; 3] {
            let mut out = [1i64; 3];
            for (o, v) in out[3 - (s.len() - 2)..].iter_mut().zip(&s[2..]) {
                *o = *v as i64;
            }
            out
        };
        let transposed = attr_bool(node, "transposed");
        let groups = attr_int(node, "groups", 1);
        if groups <= 0 {
            return Err(format!("groups must be positive, got {groups}"));
        }
        let (c_in, c_out) = (x.shape()[1] as i64, out_shape[1] as i64);
        let (w0, w1) = (w.shape()[0] as i64, w.shape()[1] as i64);
        let (cin_g, cout_g) = if transposed {
            (w0 / groups, w1)
        } else {
            (w1, w0 / groups)
        };
        if cin_g * groups != c_in || cout_g * groups != c_out {
            return Err(format!(
                "weight {} with {groups} groups does not map {c_in} input channels to {c_out}",
                w.ty
            ));
        }
        let (stride, pad, dil) = (
            triple("stride", 1)?,
            triple("padding", 0)?,
            triple("dilation", 1)?,
        );
        if stride.iter().chain(&dil).any(|&v| v <= 0) || pad.iter().any(|&p| p < 0) {
            return Err("stride and dilation must be positive, padding >= 0".into());
        }
        let mut args = vec![
            x.shape()[0],
            groups as u64,
            cin_g as u64,
            cout_g as u64,
            u64::from(transposed),
        ];
        for v in [
            spatial(x.shape()),
            spatial(out_shape),
            spatial(w.shape()),
            stride,
            pad,
            dil,
        ] {
            args.extend(v.iter().map(|&e| e as u64));
        }
        Ok(args)
    }

    /// The 2-d f32 convolution's unfolding geometry when it takes the im2col path:
    /// (K, L, direct 1x1) and the per-image words of `Im2colArgs` after n0, count, g.
    fn conv2d_f32(
        &self,
        node: &Node,
        x: &T,
        w: &T,
        out_shape: &[u64],
    ) -> Option<(u64, u64, bool, Vec<u64>)> {
        if x.ty.rank() != 4
            || w.ty.rank() != 4
            || attr_bool(node, "transposed")
            || x.ty.dtype != DType::F32
            || w.ty.dtype != DType::F32
        {
            return None;
        }
        let pair = |name: &str, default: i64| -> [i64; 2] {
            match attr_ints(node, name) {
                Some([a]) => [*a; 2],
                Some([a, b, ..]) => [*a, *b],
                _ => [default; 2],
            }
        };
        let groups = attr_int(node, "groups", 1).max(1) as u64;
        let (stride, pad, dil) = (pair("stride", 1), pair("padding", 0), pair("dilation", 1));
        let c_in = x.shape()[1];
        let cin_g = c_in / groups;
        let (kh, kw) = (w.shape()[2], w.shape()[3]);
        let (oh, ow) = (out_shape[2], out_shape[3]);
        let k = cin_g * kh * kw;
        let l = oh * ow;
        let direct = kh == 1 && kw == 1 && stride == [1, 1] && pad == [0, 0];
        let rest = vec![
            c_in,
            cin_g,
            x.shape()[2],
            x.shape()[3],
            kh,
            kw,
            oh,
            ow,
            stride[0] as u64,
            stride[1] as u64,
            pad[0] as u64,
            pad[1] as u64,
            dil[0] as u64,
            dil[1] as u64,
        ];
        Some((k, l, direct, rest))
    }

    fn scratch(&self) -> (u64, u64) {
        self.program
            .plan()
            .scratch(self.index)
            .map_or((0, 0), |(off, len)| (self.lane + off, len))
    }

    fn convolution(&mut self, node: &Node, o: &T) -> R {
        let (x, w) = (self.need(node, 0)?, self.need(node, 1)?);
        let args = self.conv_args(node, &x, &w, o.shape())?;
        let bias = self.input(node, 2);
        if let (Some((k, l, direct, rest)), true) = (
            self.conv2d_f32(node, &x, &w, o.shape()),
            o.ty.dtype == DType::F32,
        ) {
            let (scratch, len) = self.scratch();
            let per_image = k * l * 4;
            let slots = if direct {
                x.shape()[0]
            } else {
                len / per_image.max(1)
            };
            if slots > 0 && k > 0 {
                let n = x.shape()[0];
                let groups = attr_int(node, "groups", 1).max(1) as u64;
                let (c_in, c_out) = (x.shape()[1], o.shape()[1]);
                let cout_g = c_out / groups;
                let mut n0 = 0;
                while n0 < n {
                    let count = slots.min(n - n0);
                    for g in 0..groups {
                        let (col, col_ld, col_stride) = if direct {
                            (
                                x.ptr + ((n0 * c_in + g * (c_in / groups)) * l) * 4,
                                l,
                                (c_in * l) as i64,
                            )
                        } else {
                            let mut a = vec![n0, count, g];
                            a.extend(rest.iter().copied());
                            a.extend([x.ptr, scratch]);
                            self.launch(K::Im2col, count * k * l, a);
                            (scratch, l, (k * l) as i64)
                        };
                        // y[n, g, cout_g, L] = W_g [cout_g, K] @ col [K, L], per image.
                        self.gemm_rm(
                            GemmType::F32,
                            (cout_g, k, l),
                            (w.ptr + g * cout_g * k * 4, k, 0),
                            (col, col_ld, col_stride),
                            (
                                o.ptr + ((n0 * c_out + g * cout_g) * l) * 4,
                                l,
                                (c_out * l) as i64,
                            ),
                            1.0,
                            0.0,
                            count,
                        );
                    }
                    n0 += count;
                }
                if let Some(b) = &bias {
                    let mut shape = vec![1u64; 4];
                    shape[1] = c_out;
                    let b4 = T {
                        ty: TensorType::new(b.ty.dtype, shape),
                        ptr: b.ptr,
                    };
                    self.ew(OP_ADD, o, &[o, &b4], [1.0, 0.0, 0.0])?;
                }
                return Ok(());
            }
        }
        let mut a = args;
        let (bp, bd) = bias.as_ref().map_or((0, 0), |b| (b.ptr, b.dt()));
        a.extend([x.ptr, x.dt(), w.ptr, w.dt(), bp, bd, o.ptr, o.dt(), 0, 0]);
        self.launch(K::ConvFwd, o.numel(), a);
        Ok(())
    }

    fn convolution_backward(&mut self, node: &Node) -> R {
        let (g, x, w) = (
            self.need(node, 0)?,
            self.need(node, 1)?,
            self.need(node, 2)?,
        );
        let args = self.conv_args(node, &x, &w, g.shape())?;
        let (gi, gw, gb) = (
            self.output(node, 0),
            self.output(node, 1),
            self.output(node, 2),
        );
        if let Some(gb) = &gb {
            let dims: Vec<usize> = (0..g.ty.rank()).filter(|&d| d != 1).collect();
            self.reduce(RED_SUM, &g, &dims, gb, 0.0)?;
        }
        let f32_outs = [&gi, &gw]
            .iter()
            .all(|o| o.as_ref().is_none_or(|o| o.ty.dtype == DType::F32));
        if let (Some((k, l, direct, rest)), true) = (
            self.conv2d_f32(node, &x, &w, g.shape()),
            f32_outs && g.ty.dtype == DType::F32,
        ) {
            let (scratch, len) = self.scratch();
            let per_image = 2 * k * l * 4;
            let slots = if direct {
                x.shape()[0]
            } else {
                len / per_image.max(1)
            };
            if slots > 0 && k > 0 {
                let n = x.shape()[0];
                let groups = attr_int(node, "groups", 1).max(1) as u64;
                let (c_in, c_out) = (x.shape()[1], g.shape()[1]);
                let (cin_g, cout_g) = (c_in / groups, c_out / groups);
                if let Some(gw) = &gw {
                    self.zero(gw);
                }
                let mut n0 = 0;
                while n0 < n {
                    let count = slots.min(n - n0);
                    let gcol = scratch + count * k * l * 4;
                    for grp in 0..groups {
                        let mut im = vec![n0, count, grp];
                        im.extend(rest.iter().copied());
                        let g_at = |img: u64| g.ptr + (((n0 + img) * c_out + grp * cout_g) * l) * 4;
                        let w_g = w.ptr + grp * cout_g * k * 4;
                        if let Some(gw) = &gw {
                            let (col, col_stride) = if direct {
                                (x.ptr + ((n0 * c_in + grp * cin_g) * l) * 4, c_in * l)
                            } else {
                                let mut a = im.clone();
                                a.extend([x.ptr, scratch]);
                                self.launch(K::Im2col, count * k * l, a);
                                (scratch, k * l)
                            };
                            // gw_g [cout_g, K] += G_img [cout_g, L] @ col_img^T [L, K].
                            for img in 0..count {
                                self.cmds.push(Cmd::Gemm(Gemm {
                                    ty: GemmType::F32,
                                    trans_a: true,
                                    trans_b: false,
                                    m: k as i32,
                                    n: cout_g as i32,
                                    k: l as i32,
                                    alpha: 1.0,
                                    a: col + img * col_stride * 4,
                                    lda: l as i32,
                                    stride_a: 0,
                                    b: g_at(img),
                                    ldb: l as i32,
                                    stride_b: 0,
                                    beta: 1.0,
                                    c: gw.ptr + grp * cout_g * k * 4,
                                    ldc: k as i32,
                                    stride_c: 0,
                                    batch: 1,
                                }));
                            }
                        }
                        if let Some(gi) = &gi {
                            // gcol_img [K, L] = W_g^T [K, cout_g] @ G_img [cout_g, L].
                            let (dst, dst_stride) = if direct {
                                (gi.ptr + ((n0 * c_in + grp * cin_g) * l) * 4, c_in * l)
                            } else {
                                (gcol, k * l)
                            };
                            self.cmds.push(Cmd::Gemm(Gemm {
                                ty: GemmType::F32,
                                trans_a: false,
                                trans_b: true,
                                m: l as i32,
                                n: k as i32,
                                k: cout_g as i32,
                                alpha: 1.0,
                                a: g_at(0),
                                lda: l as i32,
                                stride_a: (c_out * l) as i64,
                                b: w_g,
                                ldb: k as i32,
                                stride_b: 0,
                                beta: 0.0,
                                c: dst,
                                ldc: l as i32,
                                stride_c: dst_stride as i64,
                                batch: count as i32,
                            }));
                            if !direct {
                                let mut a = im.clone();
                                a.extend([gi.ptr, gcol]);
                                self.launch(
                                    K::Col2im,
                                    count * cin_g * x.shape()[2] * x.shape()[3],
                                    a,
                                );
                            }
                        }
                    }
                    n0 += count;
                }
                return Ok(());
            }
        }
        if let Some(gi) = &gi {
            let mut a = args.clone();
            a.extend([gi.ptr, gi.dt(), w.ptr, w.dt(), 0, 0, 0, 0, g.ptr, g.dt()]);
            self.launch(K::ConvBwdInput, gi.numel(), a);
        }
        if let Some(gw) = &gw {
            let mut a = args;
            a.extend([x.ptr, x.dt(), gw.ptr, gw.dt(), 0, 0, 0, 0, g.ptr, g.dt()]);
            self.launch(K::ConvBwdWeight, gw.numel(), a);
        }
        Ok(())
    }

    /// Planes, h, w of a pooled [.., h, w] tensor.
    fn planes(t: &T) -> Result<(u64, u64, u64), String> {
        let rank = t.ty.rank();
        if rank != 3 && rank != 4 {
            return Err(format!("pooling needs a 3-d or 4-d tensor, got {}", t.ty));
        }
        Ok((
            numel(&t.shape()[..rank - 2]),
            t.shape()[rank - 2],
            t.shape()[rank - 1],
        ))
    }

    fn pool_pair(node: &Node, name: &str, default: [i64; 2]) -> Result<[i64; 2], String> {
        match attr_ints(node, name) {
            None | Some([]) => Ok(default),
            Some([a]) => Ok([*a, *a]),
            Some([a, b]) => Ok([*a, *b]),
            Some(other) => Err(format!("attribute {name:?} has {} values", other.len())),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn pool_args(
        (planes, h, w): (u64, u64, u64),
        (oh, ow): (u64, u64),
        windows: [[i64; 2]; 4],
        include_pad: bool,
        divisor: i64,
        tensors: [(u64, u64); 4],
        err: u64,
        node: usize,
    ) -> Vec<u64> {
        let mut a = vec![planes, h, w, oh, ow];
        for pair in windows {
            a.extend(pair.iter().map(|&v| v as u64));
        }
        a.extend([u64::from(include_pad), divisor as u64]);
        for (p, d) in tensors {
            a.extend([p, d]);
        }
        a.extend([err, node as u64]);
        a
    }

    fn max_pool(&mut self, node: &Node) -> R {
        let x = self.need(node, 0)?;
        let (y, idx) = (self.output(node, 0), self.output(node, 1));
        let out = y.clone().or(idx.clone()).ok_or("both outputs are unused")?;
        let (planes, h, w) = Self::planes(&x)?;
        let (_, oh, ow) = Self::planes(&out)?;
        let kernel = Self::pool_pair(node, "kernel_size", [1, 1])?;
        let stride = Self::pool_pair(node, "stride", kernel)?;
        let padding = Self::pool_pair(node, "padding", [0, 0])?;
        let dilation = Self::pool_pair(node, "dilation", [1, 1])?;
        let opt = |t: &Option<T>| t.as_ref().map_or((0, 0), |t| (t.ptr, t.dt()));
        let a = Self::pool_args(
            (planes, h, w),
            (oh, ow),
            [kernel, stride, padding, dilation],
            false,
            0,
            [(x.ptr, x.dt()), opt(&y), opt(&idx), (0, 0)],
            self.err,
            self.index,
        );
        self.launch(K::MaxPoolFwd, planes * oh * ow, a);
        Ok(())
    }

    fn max_pool_backward(&mut self, node: &Node, o: &T) -> R {
        let (g, x, idx) = (
            self.need(node, 0)?,
            self.need(node, 1)?,
            self.need(node, 2)?,
        );
        let (planes, h, w) = Self::planes(&x)?;
        let (_, oh, ow) = Self::planes(&g)?;
        if idx.shape() != g.shape() {
            return Err(format!(
                "indices {} must have the shape of grad_output {}",
                idx.ty, g.ty
            ));
        }
        if !idx.ty.dtype.is_int() {
            return Err("pooling index must be an integer tensor".into());
        }
        self.zero(o);
        let a = Self::pool_args(
            (planes, h, w),
            (oh, ow),
            [[1, 1]; 4],
            false,
            0,
            [
                (o.ptr, o.dt()),
                (0, 0),
                (idx.ptr, idx.dt()),
                (g.ptr, g.dt()),
            ],
            self.err,
            self.index,
        );
        self.launch(K::MaxPoolBwd, planes * oh * ow, a);
        Ok(())
    }

    fn avg_pool(&mut self, node: &Node, o: &T) -> R {
        use Op::*;
        let backward = matches!(node.op, AvgPool2dBackward | AdaptiveAvgPool2dBackward);
        let (g, x) = if backward {
            (Some(self.need(node, 0)?), self.need(node, 1)?)
        } else {
            (None, self.need(node, 0)?)
        };
        let (planes, h, w) = Self::planes(&x)?;
        let pooled = g.as_ref().unwrap_or(o);
        let (_, oh, ow) = Self::planes(pooled)?;
        let (mut windows, mut include_pad, mut divisor) = ([[1, 1]; 4], true, 0);
        if matches!(node.op, AvgPool2d | AvgPool2dBackward) {
            let kernel = Self::pool_pair(node, "kernel_size", [1, 1])?;
            let stride = Self::pool_pair(node, "stride", kernel)?;
            let padding = Self::pool_pair(node, "padding", [0, 0])?;
            if kernel.iter().chain(&stride).any(|&v| v <= 0) || padding.iter().any(|&p| p < 0) {
                return Err(format!(
                    "kernel {kernel:?} and stride {stride:?} must be positive, padding {padding:?} >= 0"
                ));
            }
            windows = [kernel, stride, padding, [1, 1]];
            include_pad = match node.attrs.get("count_include_pad") {
                None => true,
                Some(_) => attr_bool(node, "count_include_pad"),
            };
            divisor = match node.attrs.get("divisor_override") {
                Some(Attr::Int(d)) if *d != 0 => *d,
                Some(Attr::Int(_)) => return Err("divisor_override must not be 0".into()),
                _ => 0,
            };
        }
        let (xt, yt, gt) = match &g {
            Some(g) => ((o.ptr, o.dt()), (0, 0), (g.ptr, g.dt())),
            None => ((x.ptr, x.dt()), (o.ptr, o.dt()), (0, 0)),
        };
        let a = Self::pool_args(
            (planes, h, w),
            (oh, ow),
            windows,
            include_pad,
            divisor,
            [xt, yt, (0, 0), gt],
            self.err,
            self.index,
        );
        if backward {
            self.zero(o);
        }
        let k = match node.op {
            AvgPool2d => K::AvgPoolFwd,
            AvgPool2dBackward => K::AvgPoolBwd,
            AdaptiveAvgPool2d => K::AdaptivePoolFwd,
            _ => K::AdaptivePoolBwd,
        };
        self.launch(k, planes * oh * ow, a);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn take_rows(
        &mut self,
        x: &T,
        idx: &T,
        outer: u64,
        len: u64,
        inner: u64,
        o: &T,
        code: u64,
    ) -> R {
        if !idx.ty.dtype.is_int() {
            return Err(format!("{} must be an integer tensor", index_what(code)));
        }
        if x.ty.dtype != o.ty.dtype {
            return Err(format!(
                "input {} and output {} differ in dtype",
                x.ty, o.ty
            ));
        }
        let rows = idx.numel();
        let a = vec![
            outer,
            len,
            inner,
            rows,
            code,
            x.dt(),
            x.ptr,
            idx.ptr,
            idx.dt(),
            o.ptr,
            self.err,
            self.index as u64,
        ];
        self.launch(K::TakeRows, outer * rows * inner, a);
        Ok(())
    }

    /// bernoulli.p from the session's generator (input 1), as salus-cpu's `kernels::random` draws.
    fn bernoulli(&mut self, node: &Node) -> R {
        let o = self.output(node, 0).ok_or("output 0 is unused")?;
        let state = self.need(node, 1)?;
        if state.ty.dtype != DType::I64 || state.numel() != 1 {
            return Err(format!(
                "the generator must be an i64 scalar, got {}",
                state.ty
            ));
        }
        let p = attr_f64(node, "p", None)?;
        let key = salus_exec::random::name_key(&node.name);
        let a = vec![o.numel(), o.dt(), o.ptr, state.ptr, key, p.to_bits()];
        self.launch(K::Bernoulli, o.numel(), a);
        Ok(())
    }

    fn along(&mut self, node: &Node, o: &T) -> R {
        let (a, idx) = (self.need(node, 0)?, self.need(node, 1)?);
        if !idx.ty.dtype.is_int() {
            return Err("index must be an integer tensor".into());
        }
        let rank = a.ty.rank();
        let dim = wrap(attr_int(node, "dim", 0), rank);
        if idx.ty.rank() > MAXR {
            return Err("the CUDA device indexes tensors of at most 8 dims".into());
        }
        if idx.numel() > 0
            && (0..idx.ty.rank())
                .any(|d| d != dim && idx.shape()[d] > a.shape().get(d).copied().unwrap_or(1))
        {
            return Err(format!(
                "index shape {:?} exceeds input shape {:?}",
                idx.shape(),
                a.shape()
            ));
        }
        let mut sst = contiguous(a.shape());
        sst.resize(idx.ty.rank(), 0);
        let dim_size = a.shape().get(dim).copied().unwrap_or(1);
        let (mode, value, src) = match node.op {
            Op::Gather => (0, 0.0, None),
            Op::ScatterValue => (1, attr_f64(node, "value", None)?, None),
            _ => {
                let src = self.need(node, 2)?;
                if idx.ty.rank() != src.ty.rank()
                    || idx.shape().iter().zip(src.shape()).any(|(i, s)| i > s)
                {
                    return Err(format!(
                        "index {} must not be larger than src {}",
                        idx.ty, src.ty
                    ));
                }
                (2, 0.0, Some(src))
            }
        };
        if mode != 0 {
            self.copy_flat(o, &a)?;
        }
        let srcst = src
            .as_ref()
            .map_or(vec![0; idx.ty.rank()], |s| contiguous(s.shape()));
        let ishape: Vec<i64> = idx.shape().iter().map(|&v| v as i64).collect();
        let mut args = vec![
            idx.numel(),
            idx.ty.rank() as u64,
            dim as u64,
            dim_size,
            mode,
            f(value),
        ];
        args.extend(padded(&ishape));
        args.extend(padded(&sst));
        args.extend(padded(&srcst));
        let (sp, sd) = src.as_ref().map_or((0, 0), |s| (s.ptr, s.dt()));
        args.extend([
            a.ptr,
            a.dt(),
            idx.ptr,
            idx.dt(),
            sp,
            sd,
            o.ptr,
            o.dt(),
            self.err,
            self.index as u64,
        ]);
        self.launch(K::AlongDim, idx.numel(), args);
        Ok(())
    }

    fn embedding_backward(&mut self, node: &Node, o: &T) -> R {
        let (g, idx) = (self.need(node, 0)?, self.need(node, 1)?);
        if !idx.ty.dtype.is_int() {
            return Err("embedding_dense_backward index must be an integer tensor".into());
        }
        let rows = o.shape().first().copied().unwrap_or(0);
        let width = g.shape().last().copied().unwrap_or(1);
        let count = idx.numel();
        if g.numel() != count * width || o.shape() != [rows, width] {
            return Err(format!(
                "grad_output {} must hold one row of the output {} per index of {}",
                g.ty, o.ty, idx.ty
            ));
        }
        self.zero(o);
        let a = vec![
            count,
            width,
            rows,
            i(attr_int(node, "padding_idx", -1)),
            u64::from(attr_bool(node, "scale_grad_by_freq")),
            g.ptr,
            g.dt(),
            idx.ptr,
            idx.dt(),
            o.ptr,
            o.dt(),
            self.err,
            self.index as u64,
        ];
        self.launch(K::EmbeddingBwd, count * width, a);
        Ok(())
    }

    fn index_put(&mut self, node: &Node, o: &T) -> R {
        let a = self.need(node, 0)?;
        let n = node.inputs.len().saturating_sub(2);
        let values = self.need(node, n + 1)?;
        let accumulate = attr_bool(node, "accumulate");
        let mut indices = Vec::new();
        for k in 0..n {
            match self.input(node, 1 + k) {
                Some(t) if t.ty.dtype.is_int() => {
                    if let Some(first) = indices.first()
                        && T::shape(first) != t.shape()
                    {
                        return Err(
                            "index_put with indices of different shapes is not supported yet"
                                .into(),
                        );
                    }
                    indices.push(t);
                }
                _ => return Err("index_put supports leading integer indices only so far".into()),
            }
        }
        if n > 4 {
            return Err("the CUDA device's index_put takes at most 4 index tensors".into());
        }
        let count = indices.first().map_or(1, |t| t.numel());
        let inner = numel(&a.shape()[n.min(a.ty.rank())..]);
        let vs = match values.numel() {
            v if v == count * inner => [inner, 1],
            v if v == inner => [0, 1],
            1 => [0, 0],
            _ => {
                return Err(format!(
                    "values {} do not fit {count} indexed rows of {inner}",
                    values.ty
                ));
            }
        };
        self.copy_flat(o, &a)?;
        let strides = contiguous(a.shape());
        let mut args = vec![count, inner, n as u64, u64::from(accumulate), vs[0], vs[1]];
        for k in 0..4 {
            args.push(indices.get(k).map_or(0, |t| t.ptr));
        }
        for k in 0..4 {
            args.push(indices.get(k).map_or(0, |t| t.dt()));
        }
        for k in 0..4 {
            args.push(if k < n { a.shape()[k] } else { 0 });
        }
        for k in 0..4 {
            args.push(strides.get(k).filter(|_| k < n).map_or(0, |&s| s as u64));
        }
        args.extend([
            values.ptr,
            values.dt(),
            o.ptr,
            o.dt(),
            self.err,
            self.index as u64,
        ]);
        self.launch(K::IndexPut, count * inner, args);
        Ok(())
    }
}

fn index_what(code: u64) -> &'static str {
    match code {
        2 => "embedding index",
        4 => "index_select index",
        _ => "index",
    }
}

/// Segments per launch of the update kernel (its struct holds 3 words each).
const UPDATE_SEGMENTS: usize = 128;

/// The updates of an iteration, `(dst, src, bytes)` each, as launches of the guarded copy
/// kernel: skipped on the device when the iteration reported an error.
pub(crate) fn guarded_copies(updates: &[(u64, u64, u64)], err: u64) -> Vec<Cmd> {
    updates
        .chunks(UPDATE_SEGMENTS)
        .map(|chunk| {
            let mut args = vec![err, chunk.len() as u64];
            for &(dst, src, bytes) in chunk {
                args.extend([dst, src, bytes]);
            }
            args.resize(2 + 3 * UPDATE_SEGMENTS, 0);
            let largest = chunk.iter().map(|u| u.2).max().unwrap_or(0);
            Cmd::Launch {
                kernel: K::GuardedCopy,
                grid: grid_for(largest / 4 + 1).min(256),
                grid_y: chunk.len() as u32,
                block: BLOCK,
                args,
            }
        })
        .collect()
}

const OP_COPY: u64 = 0;
const OP_ADD: u64 = 1;
const OP_MUL: u64 = 2;
const OP_DIV: u64 = 3;
const OP_ADDS: u64 = 4;
const OP_MULS: u64 = 5;
const OP_DIVS: u64 = 6;
const OP_NEG: u64 = 7;
const OP_ABS: u64 = 8;
const OP_SIGN: u64 = 9;
const OP_EXP: u64 = 10;
const OP_LOG: u64 = 11;
const OP_SQRT: u64 = 12;
const OP_RSQRT: u64 = 13;
const OP_SIGMOID: u64 = 14;
const OP_TANH: u64 = 15;
const OP_RELU: u64 = 16;
const OP_LEAKY: u64 = 17;
const OP_GELU_TANH: u64 = 18;
const OP_GELU: u64 = 19;
const OP_ERF: u64 = 20;
const OP_POW_TS: u64 = 21;
const OP_POW_S: u64 = 22;
const OP_CLAMP: u64 = 23;
const OP_EQ: u64 = 24;
const OP_NE: u64 = 25;
const OP_LT: u64 = 26;
const OP_LE: u64 = 27;
const OP_GT: u64 = 28;
const OP_GE: u64 = 29;
const OP_LAND: u64 = 30;
const OP_LNOT: u64 = 31;
const OP_BNOT: u64 = 32;
const OP_BAND: u64 = 33;
const OP_WHERE: u64 = 34;
const OP_FILL: u64 = 35;
const OP_ARANGE: u64 = 36;
const OP_RECIPROCAL: u64 = 37;

const RED_SUM: u64 = 0;
const RED_MEAN: u64 = 1;
const RED_AMAX: u64 = 2;
const RED_ANY: u64 = 3;
const RED_VAR: u64 = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalescing_merges_contiguous_dims_and_keeps_broadcasts() {
        let shape = [2u64, 3, 4];
        let mut ops = vec![
            Strided {
                ptr: 0,
                dt: 0,
                st: contiguous(&shape),
            },
            Strided {
                ptr: 0,
                dt: 0,
                st: contiguous(&shape),
            },
        ];
        assert_eq!(coalesce(&shape, &mut ops), vec![24]);
        assert_eq!(ops[0].st, vec![1]);
        let mut ops = vec![
            Strided {
                ptr: 0,
                dt: 0,
                st: contiguous(&shape),
            },
            Strided {
                ptr: 0,
                dt: 0,
                st: broadcast(&[4], &shape),
            },
        ];
        assert_eq!(coalesce(&shape, &mut ops), vec![6, 4]);
        assert_eq!(ops[1].st, vec![0, 1]);
        let mut ops = vec![Strided {
            ptr: 0,
            dt: 0,
            st: vec![12, 4, 1],
        }];
        assert_eq!(coalesce(&[1, 1, 1], &mut ops), Vec::<u64>::new());
    }

    #[test]
    fn every_kernel_name_is_in_the_source() {
        let source = crate::KERNELS;
        for k in K::ALL {
            assert!(
                source.contains(&format!("void {}(", k.name())),
                "the kernels' source has no kernel {}",
                k.name()
            );
        }
    }

    #[test]
    fn argument_words_match_the_structs() {
        // Counts of 8-byte fields of each struct in the kernels' source, as the lowering builds them.
        let source = crate::KERNELS;
        assert!(source.contains("struct EwArgs"));
        // EwArgs: 5 + 3 + 8 + 4 * (2 + 8).
        assert_eq!(5 + 3 + MAXR + 4 * (2 + MAXR), 56);
    }
}
