//! The interface between the lowering and the kernels, described once, in Rust.
//!
//! Everything the host and the device must agree on lives here: the kernels and the
//! argument struct each takes, the layout of those structs, the codes they carry (dtypes,
//! elementwise and reduction ops, index modes, the error block's codes) and the constants
//! both sides size things by. The CUDA side never writes these by hand: [`prelude`]
//! generates them as C (`#define`s and `struct`s) and [`kernel_source`] puts that prelude
//! before the kernel files (`src/kernels/*.cu`), which only use the names.
//!
//! An argument struct is `#[repr(C)]` and every field is 8 bytes wide (`i64`, `u64`,
//! `f64`, arrays of them, or a nested argument struct), so the C compiler lays it out with
//! no padding, exactly as Rust does; a launch hands the struct itself to the driver as the
//! kernel's one by-value parameter. The tests parse the source NVRTC compiles and check it
//! field by field against these descriptions.

use std::fmt::{Debug, Write as _};

#[macro_use]
mod layout;
mod index;
mod norm;

pub(crate) use index::{
    AdvancedIndexArgs, AlongDimArgs, ArgReduceArgs, EmbeddingBackwardArgs, SortArgs, TakeRowsArgs,
};
pub(crate) use layout::{CType, DeviceStruct, FieldLayout, FieldType, StructLayout};
pub(crate) use norm::{AttentionArgs, BatchNormArgs, LayerNormArgs, LayerNormBackwardArgs};

/// The most dimensions an elementwise, reduction or indexing kernel walks (`MAXR`).
pub(crate) const MAX_RANK: usize = 8;

/// Threads per block of every launch; the block reductions size their shared memory by it
/// (`BLOCK`).
pub(crate) const BLOCK: u32 = 256;

/// Rows of at most this many elements take a warp each in the row kernels (`rows.cu`);
/// longer ones a block each (`ROW_WARP_MAX`).
pub(crate) const ROW_WARP_MAX: u64 = 1024;

/// The longest query, key or value the fused attention kernels take (`ATT_MAXD`): their
/// shared-memory tiles are sized by it.
pub(crate) const ATTENTION_MAX_DIM: u64 = 128;

/// The longest query, key or value the register-tiled forward takes (`ATT_TD`).
pub(crate) const ATTENTION_TILED_MAX_DIM: u64 = 64;

/// Copies per launch of the guarded copy kernel (`GuardedCopyArgs::seg` holds 3 words each).
pub(crate) const UPDATE_SEGMENTS: usize = 128;

/// The kernel files, in the order they are joined after the prelude: a file may use what
/// an earlier one defines.
pub(crate) const KERNEL_FILES: [(&str, &str); 13] = [
    ("common.cu", include_str!("kernels/common.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("copy.cu", include_str!("kernels/copy.cu")),
    ("reduce.cu", include_str!("kernels/reduce.cu")),
    ("rows.cu", include_str!("kernels/rows.cu")),
    ("batch_norm.cu", include_str!("kernels/batch_norm.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("matmul.cu", include_str!("kernels/matmul.cu")),
    ("conv.cu", include_str!("kernels/conv.cu")),
    ("pool.cu", include_str!("kernels/pool.cu")),
    ("index.cu", include_str!("kernels/index.cu")),
    ("order.cu", include_str!("kernels/order.cu")),
    ("random.cu", include_str!("kernels/random.cu")),
];

/// The whole NVRTC program: the generated prelude, then the kernel files in order. The
/// compiled image is cached on disk under a hash of this text.
pub(crate) fn kernel_source() -> String {
    let mut source = prelude();
    for (_, text) in KERNEL_FILES {
        source.push_str(text);
    }
    source
}

// ------------------------------------------------------------------------------------
// Codes.

device_codes! {
    /// A tensor's element type, as the kernels' loads and stores read it (`DT_*`).
    enum DeviceDType {
        F32 = 0 => DT_F32,
        F16 = 1 => DT_F16,
        Bf16 = 2 => DT_BF16,
        I64 = 3 => DT_I64,
        I32 = 4 => DT_I32,
        Bool = 5 => DT_BOOL,
    }
}

impl DeviceDType {
    /// The code of a graph dtype.
    pub(crate) fn of(dtype: salus_graph::DType) -> DeviceDType {
        use salus_graph::DType;
        match dtype {
            DType::F32 => DeviceDType::F32,
            DType::F16 => DeviceDType::F16,
            DType::Bf16 => DeviceDType::Bf16,
            DType::I64 => DeviceDType::I64,
            DType::I32 => DeviceDType::I32,
            DType::Bool => DeviceDType::Bool,
        }
    }
}

device_codes! {
    /// What the elementwise kernel computes per element (`ElementwiseArgs::op`, `OP_*`),
    /// from inputs a, b, c and the scalars s0, s1.
    enum ElementwiseOp {
        /// a (a bit copy when the dtypes agree).
        Copy = 0 => OP_COPY,
        /// a + s0 * b.
        Add = 1 => OP_ADD,
        /// a * b.
        Mul = 2 => OP_MUL,
        /// a / b.
        Div = 3 => OP_DIV,
        /// a + s0.
        AddScalar = 4 => OP_ADDS,
        /// a * s0.
        MulScalar = 5 => OP_MULS,
        /// a / s0.
        DivScalar = 6 => OP_DIVS,
        Neg = 7 => OP_NEG,
        Abs = 8 => OP_ABS,
        Sign = 9 => OP_SIGN,
        Exp = 10 => OP_EXP,
        Log = 11 => OP_LOG,
        Sqrt = 12 => OP_SQRT,
        Rsqrt = 13 => OP_RSQRT,
        Sigmoid = 14 => OP_SIGMOID,
        Tanh = 15 => OP_TANH,
        Relu = 16 => OP_RELU,
        /// a, or s0 * a below 0.
        LeakyRelu = 17 => OP_LEAKY,
        GeluTanh = 18 => OP_GELU_TANH,
        Gelu = 19 => OP_GELU,
        Erf = 20 => OP_ERF,
        /// a ^ s0.
        PowTensorScalar = 21 => OP_POW_TS,
        /// s0 ^ a.
        PowScalar = 22 => OP_POW_S,
        /// a clamped into [s0, s1].
        Clamp = 23 => OP_CLAMP,
        /// a == s0, and so on.
        Eq = 24 => OP_EQ,
        Ne = 25 => OP_NE,
        Lt = 26 => OP_LT,
        Le = 27 => OP_LE,
        Gt = 28 => OP_GT,
        Ge = 29 => OP_GE,
        LogicalAnd = 30 => OP_LAND,
        LogicalNot = 31 => OP_LNOT,
        BitwiseNot = 32 => OP_BNOT,
        BitwiseAnd = 33 => OP_BAND,
        /// a ? b : c.
        Where = 34 => OP_WHERE,
        /// s0.
        Fill = 35 => OP_FILL,
        /// s0 + s1 * index.
        Arange = 36 => OP_ARANGE,
        Reciprocal = 37 => OP_RECIPROCAL,
        /// NaN when a or b is, else the larger (a on a tie).
        Maximum = 38 => OP_MAX,
        /// NaN when a or b is, else the smaller (a on a tie).
        Minimum = 39 => OP_MIN,
        /// a == b, a < b, a > b.
        EqTensor = 40 => OP_EQ_T,
        LtTensor = 41 => OP_LT_T,
        GtTensor = 42 => OP_GT_T,
        Log1p = 43 => OP_LOG1P,
        Expm1 = 44 => OP_EXPM1,
        Sin = 45 => OP_SIN,
        Cos = 46 => OP_COS,
        Floor = 47 => OP_FLOOR,
        Ceil = 48 => OP_CEIL,
        /// Half to even, as `round`.
        Round = 49 => OP_ROUND,
        Trunc = 50 => OP_TRUNC,
        Atan = 51 => OP_ATAN,
        Atan2 = 52 => OP_ATAN2,
        /// a - floor(a / b) * b, exactly (the sign of b; fmod, then b added to a remainder
        /// of the other sign).
        Remainder = 53 => OP_REMAINDER,
        /// a - trunc(a / b) * b, exactly (the sign of a: C's fmod).
        Fmod = 54 => OP_FMOD,
        /// a to the power b.
        PowTensorTensor = 55 => OP_POW_TT,
        /// ln |Γ(a)|.
        Lgamma = 56 => OP_LGAMMA,
        /// ψ(a), the derivative of ln Γ.
        Digamma = 57 => OP_DIGAMMA,
        /// ψ⁽ⁿ⁾(a), n = s0.
        Polygamma = 58 => OP_POLYGAMMA,
        /// 1 - erf(a), to full precision in the tail.
        Erfc = 59 => OP_ERFC,
        /// erf⁻¹(a).
        Erfinv = 60 => OP_ERFINV,
    }
}

device_codes! {
    /// What a reduction kernel computes (`ReduceArgs::op`, `RED_*`).
    enum ReduceOp {
        Sum = 0 => RED_SUM,
        Mean = 1 => RED_MEAN,
        Amax = 2 => RED_AMAX,
        Any = 3 => RED_ANY,
        /// The variance with `ReduceArgs::correction`.
        Var = 4 => RED_VAR,
    }
}

device_codes! {
    /// What `along_dim` does at each index (`AlongDimArgs::mode`, `ALONG_*`).
    enum AlongDimMode {
        Gather = 0 => ALONG_GATHER,
        ScatterValue = 1 => ALONG_SCATTER_VALUE,
        ScatterAdd = 2 => ALONG_SCATTER_ADD,
        ScatterSrc = 3 => ALONG_SCATTER_SRC,
        /// `scatter_reduce.two` (the product, the largest, the smallest).
        ScatterProd = 4 => ALONG_SCATTER_PROD,
        ScatterAmax = 5 => ALONG_SCATTER_AMAX,
        ScatterAmin = 6 => ALONG_SCATTER_AMIN,
    }
}

device_codes! {
    /// How `ew` and the fused kernels find each operand's element from the flat output
    /// index `i` (`ElementwiseArgs::mode`, `FusedArgs::mode`, `IDX_*`).
    enum IndexMode {
        /// Full N-d walk: a div and a mod per dim, each operand its strides `st`.
        Generic = 0 => IDX_GENERIC,
        /// Every operand contiguous with the output (`q` 1) or one broadcast element (`q`
        /// 0): `i` or 0, no division.
        Flat = 1 => IDX_FLAT,
        /// Every operand `(i / q) % m` (`q` 0: element 0; `m` 0: no modulo): broadcast
        /// along outer and/or inner dims of a contiguous run.
        Broadcast = 2 => IDX_BROADCAST,
        /// [`IndexMode::Flat`] with every operand f32, `n` a multiple of 4 and every
        /// contiguous operand 16-byte aligned: 4 elements a thread, as `float4` (`ew` only).
        FlatVec4 = 3 => IDX_FLAT4,
    }
}

device_codes! {
    /// Which kind of index a kernel found out of range: the code word of the lane's error
    /// block (`ERR_*`). 0 means no error.
    enum IndexErrorKind {
        Index = 1 => ERR_INDEX,
        Embedding = 2 => ERR_EMBEDDING_INDEX,
        Pooling = 3 => ERR_POOLING_INDEX,
        IndexSelect = 4 => ERR_INDEX_SELECT_INDEX,
        EmbeddingBackward = 5 => ERR_EMBEDDING_BACKWARD_INDEX,
        IndexPut = 6 => ERR_INDEX_PUT_INDEX,
        /// Not an index: an `_assert_async.msg` whose condition was false.
        Assert = 7 => ERR_ASSERT,
    }
}

impl IndexErrorKind {
    /// The kind the error block's code word names, if any.
    pub(crate) fn from_code(code: u64) -> Option<IndexErrorKind> {
        Self::ALL.iter().copied().find(|k| k.code() as u64 == code)
    }

    /// What the index is, in the CPU device's words.
    pub(crate) fn what(self) -> &'static str {
        match self {
            IndexErrorKind::Index => "index",
            IndexErrorKind::Embedding => "embedding index",
            IndexErrorKind::Pooling => "pooling index",
            IndexErrorKind::IndexSelect => "index_select index",
            IndexErrorKind::EmbeddingBackward => "embedding_dense_backward index",
            IndexErrorKind::IndexPut => "index_put index",
            IndexErrorKind::Assert => "assertion",
        }
    }
}

/// The message of an index error reported in a lane's error block (code, value, bound);
/// an assertion's is its node's own (`reported_error`).
pub(crate) fn index_error(code: u64, value: i64, bound: i64) -> String {
    let what = IndexErrorKind::from_code(code).map_or("index", IndexErrorKind::what);
    format!("{what} {value} is out of range for a dimension of size {bound}")
}

// ------------------------------------------------------------------------------------
// Argument structs.

device_struct! {
    /// One operand of the elementwise kernel: address of element 0, dtype, strides in
    /// elements (for the coalesced dims; the rest 0); for the fast [`IndexMode`]s its
    /// element of flat index `i` is `(i / q) % m` (`q` 0: element 0; `m` 0: no modulo).
    #[derive(Default)]
    struct StridedTensor {
        ptr: u64,
        dt: i64,
        q: i64,
        m: i64,
        st: [i64; MAX_RANK],
    }
}

device_struct! {
    /// `ew`: `out[i] = op(inputs[..nin][i], s0, s1, s2)` over `shape` (`rank` dims, `n`
    /// elements); `mode` how operands are indexed ([`IndexMode`]).
    #[derive(Default)]
    struct ElementwiseArgs {
        n: i64,
        rank: i64,
        op: i64,
        nin: i64,
        mode: i64,
        s0: f64,
        s1: f64,
        s2: f64,
        shape: [i64; MAX_RANK],
        out: StridedTensor,
        inputs: [StridedTensor; 3],
    }
}

device_struct! {
    /// `guarded_copies`: `count` copies of (dst, src, bytes), skipped when the error block
    /// `err` is set.
    struct GuardedCopyArgs {
        err: u64,
        count: u64,
        seg: [u64; 3 * UPDATE_SEGMENTS],
    }
}

// Layout copies (`copy.cu`): a strided view copied bit for bit into another, by element
// size, never by dtype.

device_struct! {
    /// `copy_rows`: `rows` rows of `vpr` vectors of `vec` bytes (16, 8, 4, 2 or 1), each row
    /// contiguous in both `src` and `dst`; row r sits at `sum c[d] * src_st[d]` bytes (and
    /// `dst_st`) where c is r's index over `shape` (`rank` outer dims). A row is split into
    /// `chunks` of at most `chunk` vectors; `tpr` threads (a power of two dividing BLOCK)
    /// share each (row, chunk).
    #[derive(Default)]
    struct CopyRowsArgs {
        dst: u64,
        src: u64,
        rows: i64,
        vpr: i64,
        vec: i64,
        tpr: i64,
        chunks: i64,
        chunk: i64,
        rank: i64,
        shape: [i64; MAX_RANK],
        src_st: [i64; MAX_RANK],
        dst_st: [i64; MAX_RANK],
    }
}

device_struct! {
    /// `copy_transpose`: a batched 2-D transpose of `esize`-byte elements (8, 4, 2 or 1)
    /// through 32x32 shared-memory tiles. Element (b, i, j), i < `ni`, j < `nj`, is read
    /// at `src + boff + (i + j * src_j) * esize` and written at
    /// `dst + boff' + (i * dst_i + j) * esize`: i is contiguous in the source, j in the
    /// destination. Batch b's offsets (bytes) come from its index over `shape` (`rank`
    /// dims) with `src_st` and `dst_st`.
    #[derive(Default)]
    struct TransposeArgs {
        dst: u64,
        src: u64,
        esize: i64,
        ni: i64,
        nj: i64,
        src_j: i64,
        dst_i: i64,
        batches: i64,
        rank: i64,
        shape: [i64; MAX_RANK],
        src_st: [i64; MAX_RANK],
        dst_st: [i64; MAX_RANK],
    }
}

impl KernelArgs for CopyRowsArgs {}
impl KernelArgs for TransposeArgs {}

device_struct! {
    /// `red_thread`, `red_block` (and the row kernels): `nout` outputs, each over `count`
    /// elements; kept dims (`kshape`, `kst`) and reduced dims (`rshape`, `rst`) of the
    /// input. Split reductions (`red_part_rows`, `red_part_cols`, then `red_parts`): each
    /// output's reduced range in `splits` chunks of `chunk` elements (the last shorter),
    /// their f64 partials at `part` (planned scratch; for the variance, chunk means then
    /// chunk sums of squared deviations, `nout * splits` each), output `oi`'s chunk `s`
    /// at `oi * splits + s`. `splits` 1: no partials, the result straight to `out`.
    #[derive(Default)]
    struct ReduceArgs {
        nout: i64,
        count: i64,
        op: i64,
        krank: i64,
        rrank: i64,
        correction: f64,
        kshape: [i64; MAX_RANK],
        kst: [i64; MAX_RANK],
        rshape: [i64; MAX_RANK],
        rst: [i64; MAX_RANK],
        input: u64,
        in_dt: i64,
        out: u64,
        out_dt: i64,
        splits: i64,
        chunk: i64,
        part: u64,
    }
}

device_struct! {
    /// `softmax_fwd` (x in, y out) and `softmax_bwd` (y and grad g in, x out): `rows`
    /// rows of `len` elements `inner` apart. `cumsum` (x in, y out) walks the same rows,
    /// multiplying where `product` (`cumprod`).
    #[derive(Default)]
    struct SoftmaxArgs {
        rows: i64,
        len: i64,
        inner: i64,
        log: i64,
        product: i64,
        x: u64,
        xdt: i64,
        y: u64,
        ydt: i64,
        g: u64,
        gdt: i64,
    }
}

device_struct! {
    /// `matmul_naive`: `c[b] = beta * bias + alpha * a[b] (n x k) @ b[b] (k x m)`.
    #[derive(Default)]
    struct MatmulArgs {
        batch: i64,
        n: i64,
        k: i64,
        m: i64,
        alpha: f64,
        beta: f64,
        a: u64,
        adt: i64,
        b: u64,
        bdt: i64,
        c: u64,
        cdt: i64,
        bias: u64,
        biasdt: i64,
        bias_s0: i64,
        bias_s1: i64,
    }
}

device_struct! {
    /// `conv_fwd`, `conv_bwd_input`, `conv_bwd_weight`: 1 to 3 spatial dims padded to 3
    /// with leading size-1 dims.
    #[derive(Default)]
    struct ConvArgs {
        n: i64,
        groups: i64,
        cin_g: i64,
        cout_g: i64,
        transposed: i64,
        in3: [i64; 3],
        out3: [i64; 3],
        k3: [i64; 3],
        stride: [i64; 3],
        pad: [i64; 3],
        dil: [i64; 3],
        x: u64,
        xdt: i64,
        w: u64,
        wdt: i64,
        bias: u64,
        bdt: i64,
        y: u64,
        ydt: i64,
        g: u64,
        gdt: i64,
    }
}

device_struct! {
    /// `im2col`, `col2im`: images `[n0, n0 + count)` of group `g` of a 2-d f32
    /// convolution, unfolded into (or folded from) `col`.
    #[derive(Default)]
    struct Im2colArgs {
        n0: i64,
        count: i64,
        g: i64,
        c_in: i64,
        cin_g: i64,
        h: i64,
        w: i64,
        kh: i64,
        kw: i64,
        oh: i64,
        ow: i64,
        sh: i64,
        sw: i64,
        ph: i64,
        pw: i64,
        dh: i64,
        dw: i64,
        x: u64,
        col: u64,
    }
}

device_struct! {
    /// The pooling kernels over `[planes, h, w]`: window `k`, stride `s`, padding `p`,
    /// dilation `d`, each (h, w). The reflection padding kernels read `p` as (top, left).
    #[derive(Default)]
    struct PoolArgs {
        planes: i64,
        h: i64,
        w: i64,
        oh: i64,
        ow: i64,
        k: [i64; 2],
        s: [i64; 2],
        p: [i64; 2],
        d: [i64; 2],
        count_include_pad: i64,
        divisor: i64,
        x: u64,
        xdt: i64,
        y: u64,
        ydt: i64,
        idx: u64,
        idt: i64,
        g: u64,
        gdt: i64,
        err: u64,
        node: i64,
    }
}

device_struct! {
    /// `bernoulli`: `n` draws with probability `p` from the generator at `state`.
    #[derive(Default)]
    struct BernoulliArgs {
        n: i64,
        dt: i64,
        out: u64,
        state: u64,
        key: u64,
        p: f64,
    }
}

device_struct! {
    /// `attention_seed`: the seed of attention's keep-flags, `mix64(*state ^ key)`, into
    /// the i64 at `seed`, and 0 into the i64 at `offset` (either 0: not written).
    #[derive(Default)]
    struct AttentionSeedArgs {
        state: u64,
        key: u64,
        seed: u64,
        offset: u64,
    }
}

device_struct! {
    /// `_assert_async.msg`: reports node `node` in the error block at `err` when the
    /// condition (one element at `cond`) is zero.
    #[derive(Default)]
    struct AssertArgs {
        cond: u64,
        dt: i64,
        err: u64,
        node: i64,
    }
}

device_struct! {
    /// `rand_like`: `n` uniform draws in [0, 1) of `bits` bits from the generator at
    /// `state`.
    #[derive(Default)]
    struct UniformArgs {
        n: i64,
        dt: i64,
        out: u64,
        state: u64,
        key: u64,
        bits: i64,
    }
}

// ------------------------------------------------------------------------------------
// Fused pointwise kernels (generated per region by `lower::fusion`).

/// Most operands (external inputs and written outputs) of a fused kernel.
pub(crate) const MAX_FUSED_OPERANDS: usize = 16;

/// Most nodes of a fused region; each has two scalars (`FusedArgs::s`).
pub(crate) const MAX_FUSED_NODES: usize = 16;

device_struct! {
    /// A generated fused kernel: `n` elements over `shape` (`rank` dims; `mode` how operands
    /// are indexed, [`IndexMode`]); operands `ops[..]` (the region's inputs, then the outputs it
    /// writes), two scalars per node in `s`. The ops and dtypes are in the kernel's source.
    #[derive(Default)]
    struct FusedArgs {
        n: i64,
        rank: i64,
        mode: i64,
        nops: i64,
        shape: [i64; MAX_RANK],
        s: [f64; 2 * MAX_FUSED_NODES],
        ops: [StridedTensor; MAX_FUSED_OPERANDS],
    }
}

impl KernelArgs for FusedArgs {}

/// Most launches one batched fused launch takes (`FusedBatchArgs::seg`): its argument
/// struct stays within the 4 KiB of parameters every driver takes.
pub(crate) const FUSED_BATCH: usize = 24;

device_struct! {
    /// One launch of a fused kernel inside a batched one: `n` elements, from block `first`
    /// of the grid on; operand `k` at `ptr[k]`, indexed by element where bit `k` of `full`
    /// is set and else its one element (flat indexing, `IndexMode::Flat`).
    #[derive(Default)]
    struct FusedSegment {
        n: i64,
        full: i64,
        first: i64,
        ptr: [u64; MAX_FUSED_OPERANDS],
    }
}

device_struct! {
    /// A generated fused kernel's batched form: `count` launches (`seg`) of the same kernel
    /// with the same scalars `s`, side by side in one grid of `blocks` blocks.
    #[derive(Default)]
    struct FusedBatchArgs {
        count: i64,
        blocks: i64,
        s: [f64; 2 * MAX_FUSED_NODES],
        seg: [FusedSegment; FUSED_BATCH],
    }
}

impl KernelArgs for FusedBatchArgs {}

/// The NVRTC program of generated fused kernels: the prelude, the files that define loads,
/// stores and `apply` (common.cu, elementwise.cu), then the kernels.
pub(crate) fn fused_kernel_source<'k>(kernels: impl IntoIterator<Item = &'k str>) -> String {
    let mut source = prelude();
    for (name, text) in KERNEL_FILES {
        if matches!(name, "common.cu" | "elementwise.cu") {
            source.push_str(text);
        }
    }
    for k in kernels {
        source.push_str(k);
    }
    source
}

/// Every struct of the interface, in the order the prelude defines them (a nested struct
/// before its users).
pub(crate) fn structs() -> Vec<StructLayout> {
    vec![
        StridedTensor::layout(),
        ElementwiseArgs::layout(),
        GuardedCopyArgs::layout(),
        CopyRowsArgs::layout(),
        TransposeArgs::layout(),
        ReduceArgs::layout(),
        SoftmaxArgs::layout(),
        LayerNormArgs::layout(),
        LayerNormBackwardArgs::layout(),
        BatchNormArgs::layout(),
        AttentionArgs::layout(),
        MatmulArgs::layout(),
        ConvArgs::layout(),
        Im2colArgs::layout(),
        PoolArgs::layout(),
        AlongDimArgs::layout(),
        TakeRowsArgs::layout(),
        EmbeddingBackwardArgs::layout(),
        AdvancedIndexArgs::layout(),
        ArgReduceArgs::layout(),
        SortArgs::layout(),
        BernoulliArgs::layout(),
        UniformArgs::layout(),
        AttentionSeedArgs::layout(),
        AssertArgs::layout(),
        FusedArgs::layout(),
        FusedSegment::layout(),
        FusedBatchArgs::layout(),
    ]
}

/// A struct a kernel takes as its one parameter.
pub(crate) trait KernelArgs: DeviceStruct + Debug + Send + Sync + 'static {}

impl KernelArgs for ElementwiseArgs {}
impl KernelArgs for GuardedCopyArgs {}
impl KernelArgs for ReduceArgs {}
impl KernelArgs for SoftmaxArgs {}
impl KernelArgs for LayerNormArgs {}
impl KernelArgs for LayerNormBackwardArgs {}
impl KernelArgs for BatchNormArgs {}
impl KernelArgs for AttentionArgs {}
impl KernelArgs for MatmulArgs {}
impl KernelArgs for ConvArgs {}
impl KernelArgs for Im2colArgs {}
impl KernelArgs for PoolArgs {}
impl KernelArgs for AlongDimArgs {}
impl KernelArgs for TakeRowsArgs {}
impl KernelArgs for EmbeddingBackwardArgs {}
impl KernelArgs for AdvancedIndexArgs {}
impl KernelArgs for ArgReduceArgs {}
impl KernelArgs for SortArgs {}
impl KernelArgs for BernoulliArgs {}
impl KernelArgs for UniformArgs {}
impl KernelArgs for AttentionSeedArgs {}
impl KernelArgs for AssertArgs {}

/// A kernel's argument struct behind a pointer, as a command list keeps it: the driver
/// hands its bytes to the kernel. Implemented only for the [`KernelArgs`] structs, which
/// are `#[repr(C)]` and match their C definition (checked by the tests).
pub(crate) trait LaunchArgs: Debug + Send + Sync {
    /// The struct's name, which must be the one the kernel takes.
    fn struct_name(&self) -> &'static str;

    /// The struct, for tests to read its fields.
    #[cfg(test)]
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<A: KernelArgs> LaunchArgs for A {
    fn struct_name(&self) -> &'static str {
        A::C_NAME
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

// ------------------------------------------------------------------------------------
// Kernels.

macro_rules! kernels {
    ($($(#[$meta:meta])* $variant:ident = $c_name:literal ($args:ty),)*) => {
        /// The kernels of [`kernel_source`], by what they do, and the struct each takes.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum Kernel {
            $($(#[$meta])* $variant,)*
        }

        impl Kernel {
            /// Every kernel, in declaration order (the device loads them in this order).
            pub(crate) const ALL: &[Kernel] = &[$(Kernel::$variant,)*];

            /// The kernel's name in the source.
            pub(crate) fn name(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $c_name,)*
                }
            }

            /// The argument struct it takes.
            pub(crate) fn args_struct(self) -> &'static str {
                match self {
                    $(Kernel::$variant => <$args as CType>::C_NAME,)*
                }
            }
        }
    };
}

kernels! {
    Elementwise = "ew" (ElementwiseArgs),
    GuardedCopies = "guarded_copies" (GuardedCopyArgs),
    /// Copies of contiguous rows, vectorized (`copy.cu`).
    CopyRows = "copy_rows" (CopyRowsArgs),
    /// Batched 2-D transposes through shared-memory tiles (`copy.cu`).
    CopyTranspose = "copy_transpose" (TransposeArgs),
    /// A thread per output: short reductions.
    ReduceByThread = "red_thread" (ReduceArgs),
    /// A block per output: long reductions.
    ReduceByBlock = "red_block" (ReduceArgs),
    SoftmaxForward = "softmax_fwd" (SoftmaxArgs),
    SoftmaxBackward = "softmax_bwd" (SoftmaxArgs),
    MatmulNaive = "matmul_naive" (MatmulArgs),
    ConvForward = "conv_fwd" (ConvArgs),
    ConvBackwardInput = "conv_bwd_input" (ConvArgs),
    ConvBackwardWeight = "conv_bwd_weight" (ConvArgs),
    Im2col = "im2col" (Im2colArgs),
    Col2im = "col2im" (Im2colArgs),
    MaxPoolForward = "max_pool_fwd" (PoolArgs),
    MaxPoolBackward = "max_pool_bwd" (PoolArgs),
    AvgPoolForward = "avg_pool_fwd" (PoolArgs),
    AvgPoolBackward = "avg_pool_bwd" (PoolArgs),
    AdaptivePoolForward = "adaptive_pool_fwd" (PoolArgs),
    AdaptivePoolBackward = "adaptive_pool_bwd" (PoolArgs),
    AlongDim = "along_dim" (AlongDimArgs),
    TakeRows = "take_rows" (TakeRowsArgs),
    EmbeddingBackward = "embedding_bwd" (EmbeddingBackwardArgs),
    /// `index.Tensor`: the elements an advanced index selects.
    IndexGather = "index_gather" (AdvancedIndexArgs),
    /// `index_put` over an advanced index's selection.
    IndexPut = "index_put" (AdvancedIndexArgs),
    /// `argmax` and `argmin`: a block per line (`order.cu`).
    ArgExtreme = "arg_extreme" (ArgReduceArgs),
    /// `sort.stable`: a block per line, each element placed by its rank.
    SortLines = "sort_lines" (SortArgs),
    /// `cumsum` (and `cumprod`: `product`) along the middle dim of `[rows / inner, len,
    /// inner]`, a thread per line.
    Cumsum = "cumsum" (SoftmaxArgs),
    /// `reflection_pad2d` over `[planes, h, w]`, padding `p` = (top, left).
    ReflectionPadForward = "reflection_pad_fwd" (PoolArgs),
    /// Its backward, gathering each input element's reflections: no atomics.
    ReflectionPadBackward = "reflection_pad_bwd" (PoolArgs),
    Bernoulli = "bernoulli" (BernoulliArgs),
    Uniform = "uniform" (UniformArgs),
    /// The seed and offset outputs of attention with dropout (one thread).
    AttentionSeed = "attention_seed" (AttentionSeedArgs),
    Assert = "assert_true" (AssertArgs),
    // The row kernels (`rows.cu`): a warp or a block per contiguous row.
    /// Reduced elements contiguous per output.
    ReduceRows = "red_rows" (ReduceArgs),
    /// Outputs contiguous, reduced elements strided: column sums.
    ReduceColumns = "red_cols" (ReduceArgs),
    /// Split reductions, stage 1: a block per (output, chunk), the innermost reduced dim
    /// contiguous (rows, planes, full).
    ReducePartRows = "red_part_rows" (ReduceArgs),
    /// Split reductions, stage 1: a block per (32 outputs, chunk of rows), column sums.
    ReducePartColumns = "red_part_cols" (ReduceArgs),
    /// Split reductions, stage 2: a warp per output combines its partials in a fixed order.
    ReduceParts = "red_parts" (ReduceArgs),
    SoftmaxForwardRows = "softmax_fwd_rows" (SoftmaxArgs),
    SoftmaxBackwardRows = "softmax_bwd_rows" (SoftmaxArgs),
    LayerNormForwardRows = "layer_norm_fwd_rows" (LayerNormArgs),
    LayerNormBackwardInputRows = "layer_norm_bwd_input_rows" (LayerNormBackwardArgs),
    /// Layer norm's weight and bias gradients: partial column sums of row chunks, then
    /// each column's chunks added in order.
    LayerNormBackwardParamsPart = "layer_norm_bwd_params_part" (LayerNormBackwardArgs),
    LayerNormBackwardParamsFinish = "layer_norm_bwd_params_finish" (LayerNormBackwardArgs),
    // Training-mode batch norm (`batch_norm.cu`): partial sums per (channel, run of
    // images), per-channel results, then a pass over the elements.
    BatchNormForwardPart = "bn_fwd_part" (BatchNormArgs),
    BatchNormForwardFinish = "bn_fwd_finish" (BatchNormArgs),
    BatchNormForwardApply = "bn_fwd_apply" (BatchNormArgs),
    BatchNormBackwardPart = "bn_bwd_part" (BatchNormArgs),
    BatchNormBackwardFinish = "bn_bwd_finish" (BatchNormArgs),
    BatchNormBackwardApply = "bn_bwd_apply" (BatchNormArgs),
    // Fused attention (`attention.cu`): the forward, then the backward's query gradients
    // (and the per-query D it keeps in scratch) before its key and value gradients.
    AttentionForward = "attn_fwd" (AttentionArgs),
    /// The forward in register tiles, head dims up to [`ATTENTION_TILED_MAX_DIM`].
    AttentionForwardTiled = "attn_fwd_tiled" (AttentionArgs),
    /// The backward in register tiles: the query pass, then the key and value pass.
    AttentionBackwardQueryTiled = "attn_bwd_dq_tiled" (AttentionArgs),
    AttentionBackwardKeyValueTiled = "attn_bwd_dkv_tiled" (AttentionArgs),
    AttentionBackwardQuery = "attn_bwd_dq" (AttentionArgs),
    AttentionBackwardKeyValue = "attn_bwd_dkv" (AttentionArgs),
    // Attention through cuBLAS products: the row kernels between them.
    AttentionSoftmaxRows = "attn_softmax_rows" (AttentionArgs),
    AttentionProbsRows = "attn_probs_rows" (AttentionArgs),
    AttentionDeltaRows = "attn_delta_rows" (AttentionArgs),
    AttentionScoreGradRows = "attn_dscores_rows" (AttentionArgs),
}

// ------------------------------------------------------------------------------------
// The prelude.

/// Constants both sides size things by, by their C name.
fn constants() -> [(&'static str, i64); 5] {
    [
        ("MAXR", MAX_RANK as i64),
        ("BLOCK", i64::from(BLOCK)),
        ("ROW_WARP_MAX", ROW_WARP_MAX as i64),
        ("ATT_MAXD", ATTENTION_MAX_DIM as i64),
        ("ATT_TD", ATTENTION_TILED_MAX_DIM as i64),
    ]
}

/// Every code's `#define`, by family.
fn codes() -> Vec<(&'static str, Vec<(&'static str, i64)>)> {
    vec![
        ("dtypes", DeviceDType::defines().collect()),
        ("elementwise ops", ElementwiseOp::defines().collect()),
        ("reductions", ReduceOp::defines().collect()),
        ("along_dim modes", AlongDimMode::defines().collect()),
        ("index modes", IndexMode::defines().collect()),
        ("index error codes", IndexErrorKind::defines().collect()),
    ]
}

/// The C text before the kernel files: the integer types, the constants, the codes and
/// the argument structs, all from this module.
pub(crate) fn prelude() -> String {
    let mut out = String::from(
        "// Generated from crates/salus-cuda/src/abi.rs (the Rust/CUDA interface): do not\n\
         // define these names in the kernel files.\n\n\
         typedef long long i64;\n\
         typedef unsigned long long u64;\n\n",
    );
    for (name, value) in constants() {
        let _ = writeln!(out, "#define {name} {value}");
    }
    for (family, defines) in codes() {
        let _ = writeln!(out, "\n// {family}");
        for (name, value) in defines {
            let _ = writeln!(out, "#define {name} {value}");
        }
    }
    for s in structs() {
        out.push('\n');
        out.push_str(&s.declaration());
    }
    out.push('\n');
    out
}

#[cfg(test)]
pub(crate) mod tests;
