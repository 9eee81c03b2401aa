//! The argument structs of the normalisation and attention kernels (`rows.cu`,
//! `batch_norm.cu`, `attention.cu`), described as every struct of the interface is
//! (see the parent module).

use super::{CType, DeviceStruct, FieldLayout, FieldType, StructLayout};

device_struct! {
    /// `layer_norm_fwd`: `rows` contiguous rows of `inner`; every output optional (0).
    #[derive(Default)]
    struct LayerNormArgs {
        rows: i64,
        inner: i64,
        eps: f64,
        x: u64,
        xdt: i64,
        w: u64,
        wdt: i64,
        b: u64,
        bdt: i64,
        y: u64,
        ydt: i64,
        mean: u64,
        mdt: i64,
        rstd: u64,
        rdt: i64,
    }
}

device_struct! {
    /// Layer norm's backward (`rows.cu`): `layer_norm_bwd_input_rows` writes `gi`;
    /// `layer_norm_bwd_params_part` sums `per` rows a chunk (`chunks` of them) into `part`
    /// (the node's scratch: `chunks` rows of `inner` doubles for the weight, then as many
    /// for the bias), `layer_norm_bwd_params_finish` adds them into `gw` and `gb`; `res`
    /// (when not 0) is added into `gi` element by element (a folded residual add).
    #[derive(Default)]
    struct LayerNormBackwardArgs {
        rows: i64,
        inner: i64,
        g: u64,
        gdt: i64,
        x: u64,
        xdt: i64,
        mean: u64,
        mdt: i64,
        rstd: u64,
        rdt: i64,
        w: u64,
        wdt: i64,
        gi: u64,
        gidt: i64,
        gw: u64,
        gwdt: i64,
        gb: u64,
        gbdt: i64,
        part: u64,
        chunks: i64,
        per: i64,
        res: u64,
        resdt: i64,
    }
}

device_struct! {
    /// The batch-norm kernels (`batch_norm.cu`) over `[batch, channels, inner]`: `x` the
    /// input, `g` the gradient (backward), `y` the output or grad_input; `mean` and `rstd`
    /// the saved statistics (written forward, read backward); `rm`/`rv` the running
    /// statistics read and `rmo`/`rvo` written; `gw`/`gb` the parameter gradients; `part`
    /// the node's scratch (partials of `splits` runs of `chunk` images per channel, then
    /// four coefficients per channel); `vec4`: 1 when every tensor the element walks touch
    /// is f32, 16-byte aligned, and `inner` a multiple of 4. Absent tensors are 0.
    #[derive(Default)]
    struct BatchNormArgs {
        batch: i64,
        channels: i64,
        inner: i64,
        splits: i64,
        chunk: i64,
        vec4: i64,
        momentum: f64,
        eps: f64,
        x: u64,
        xdt: i64,
        g: u64,
        gdt: i64,
        w: u64,
        wdt: i64,
        b: u64,
        bdt: i64,
        mean: u64,
        mdt: i64,
        rstd: u64,
        rdt: i64,
        rm: u64,
        rmdt: i64,
        rv: u64,
        rvdt: i64,
        rmo: u64,
        rmodt: i64,
        rvo: u64,
        rvodt: i64,
        y: u64,
        ydt: i64,
        gw: u64,
        gwdt: i64,
        gb: u64,
        gbdt: i64,
        part: u64,
    }
}

device_struct! {
    /// The fused attention kernels (`attention.cu`) over `batch * heads` heads of `lq`
    /// queries and `lk` keys, of `e` (query and key) and `ev` (value) elements: `q`, `k`,
    /// `v` the inputs, `o` and `lse` the forward's results (read by the backward), `go` the
    /// gradient of `o`, `dq`/`dk`/`dv` the backward's results; `mask` (0: none, `mdt`
    /// bool or float) with element strides `ms` over (batch, head, query, key); scratch:
    /// `delta` (an f32 per query), `s` and `dp` (f32 `[batch * heads * lq, lk]` scores,
    /// probabilities and their gradients, on the cuBLAS path); `lses` the elements between
    /// two heads' log-sum-exps. Dropout (`dropout` > 0) drops probability `at` (its flat
    /// index over `[batch, heads, lq, lk]`) by the keep-flag drawn from the i64 at `seed`,
    /// mixed with `key` first when `keyed` is 1 (the forward, from the generator state) or
    /// as it is (the backward, from the forward's seed). Absent tensors are 0.
    #[derive(Default)]
    struct AttentionArgs {
        batch: i64,
        heads: i64,
        lq: i64,
        lk: i64,
        e: i64,
        ev: i64,
        causal: i64,
        scale: f64,
        dropout: f64,
        seed: u64,
        key: u64,
        keyed: i64,
        mask: u64,
        mdt: i64,
        ms: [i64; 4],
        q: u64,
        qdt: i64,
        k: u64,
        kdt: i64,
        v: u64,
        vdt: i64,
        o: u64,
        odt: i64,
        lse: u64,
        lsedt: i64,
        lses: i64,
        go: u64,
        godt: i64,
        dq: u64,
        dqdt: i64,
        dk: u64,
        dkdt: i64,
        dv: u64,
        dvdt: i64,
        delta: u64,
        s: u64,
        dp: u64,
    }
}
