//! The argument structs of the indexing and ordering kernels (`index.cu`, `order.cu`),
//! described as every struct of the interface is (see the parent module).

use super::{CType, DeviceStruct, FieldLayout, FieldType, MAX_RANK, StructLayout};

device_struct! {
    /// `along_dim`: gather, scatter.value, scatter_add along `dim` ([`AlongDimMode`](super::AlongDimMode)).
    #[derive(Default)]
    struct AlongDimArgs {
        n: i64,
        rank: i64,
        dim: i64,
        dim_size: i64,
        mode: i64,
        value: f64,
        ishape: [i64; MAX_RANK],
        sst: [i64; MAX_RANK],
        srcst: [i64; MAX_RANK],
        input: u64,
        sdt: i64,
        index: u64,
        idt: i64,
        src: u64,
        srcdt: i64,
        out: u64,
        odt: i64,
        err: u64,
        node: i64,
    }
}

device_struct! {
    /// `take_rows`: rows of `[outer, len, inner]` picked along the middle dim; `code` is
    /// the [`IndexErrorKind`](super::IndexErrorKind) reported for a bad index.
    #[derive(Default)]
    struct TakeRowsArgs {
        outer: i64,
        len: i64,
        inner: i64,
        rows: i64,
        code: i64,
        dt: i64,
        x: u64,
        index: u64,
        idt: i64,
        out: u64,
        err: u64,
        node: i64,
    }
}

device_struct! {
    /// `embedding_bwd`: `padding` is the row left without gradient, -1 for none.
    #[derive(Default)]
    struct EmbeddingBackwardArgs {
        count: i64,
        width: i64,
        rows: i64,
        padding: i64,
        scale: i64,
        g: u64,
        gdt: i64,
        index: u64,
        idt: i64,
        out: u64,
        odt: i64,
        err: u64,
        node: i64,
    }
}

device_struct! {
    /// `index_gather` (`index.Tensor`) and `index_put`: the selection an advanced index
    /// makes of `x` (`srank` dims of sizes `size`, strides `xst`), `n` elements over
    /// `shape` (`rank` dims). Dim d of x is walked by the selection's dim `whole[d]`, or,
    /// where that is -1, by index tensor `idx[d]` (dtype `idt[d]`, strides
    /// `ist[d * MAXR + e]` over the selection's dims e). `index_gather` copies the
    /// selected elements to `out`; `index_put` writes (or with `accumulate` adds) `values`
    /// (strides `vst` over the selection) at them in `out`, already a copy of x. Both
    /// dtype `dt`; a bad index is reported as `code` ([`IndexErrorKind`](super::IndexErrorKind)).
    struct AdvancedIndexArgs {
        n: i64,
        rank: i64,
        srank: i64,
        accumulate: i64,
        code: i64,
        shape: [i64; MAX_RANK],
        size: [i64; MAX_RANK],
        xst: [i64; MAX_RANK],
        whole: [i64; MAX_RANK],
        idx: [u64; MAX_RANK],
        idt: [i64; MAX_RANK],
        ist: [i64; MAX_RANK * MAX_RANK],
        vst: [i64; MAX_RANK],
        x: u64,
        dt: i64,
        values: u64,
        out: u64,
        err: u64,
        node: i64,
    }
}

impl Default for AdvancedIndexArgs {
    /// No operands, every dim of x indexed (`whole` -1); `[T; 64]` has no derived default.
    fn default() -> Self {
        AdvancedIndexArgs {
            n: 0,
            rank: 0,
            srank: 0,
            accumulate: 0,
            code: 0,
            shape: [0; MAX_RANK],
            size: [0; MAX_RANK],
            xst: [0; MAX_RANK],
            whole: [-1; MAX_RANK],
            idx: [0; MAX_RANK],
            idt: [0; MAX_RANK],
            ist: [0; MAX_RANK * MAX_RANK],
            vst: [0; MAX_RANK],
            x: 0,
            dt: 0,
            values: 0,
            out: 0,
            err: 0,
            node: 0,
        }
    }
}

device_struct! {
    /// `arg_extreme`: the position of the largest (`largest` 1) or smallest element of
    /// each line along the middle dim of `[outer, len, inner]`, as i64 at `out`.
    #[derive(Default)]
    struct ArgReduceArgs {
        outer: i64,
        len: i64,
        inner: i64,
        largest: i64,
        x: u64,
        xdt: i64,
        out: u64,
    }
}

device_struct! {
    /// `sort_lines`: each line along the middle dim of `[outer, len, inner]` sorted
    /// (`descending` 1 or 0), stably; `values` (dtype `dt`, copied bit for bit) and the
    /// i64 `indices` each optional (0).
    #[derive(Default)]
    struct SortArgs {
        outer: i64,
        len: i64,
        inner: i64,
        descending: i64,
        x: u64,
        dt: i64,
        values: u64,
        indices: u64,
    }
}
