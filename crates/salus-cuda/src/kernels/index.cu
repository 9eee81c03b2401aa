// ------------------------------------------------------------------------------------
// Indexing. A bad index is reported with its kind (ERR_*, `abi::IndexErrorKind`).

// gather / scatter.value / scatter.src / scatter_add / scatter_reduce along `dim`: index
// element t at coords c (index shape) meets self element with c[dim] replaced by the index
// value.
extern "C" __global__ void along_dim(const AlongDimArgs a) {
    GRID_LOOP(t, a.n) {
        i64 at = index_at(a.index, a.idt, t, a.dim_size, a.err, a.node, ERR_INDEX);
        if (at < 0) continue;
        i64 off = 0, soff = 0, r = t;
        for (int d = (int)a.rank - 1; d >= 0; --d) {
            i64 c = r % a.ishape[d];
            r /= a.ishape[d];
            off += (d == a.dim ? at : c) * a.sst[d];
            soff += c * a.srcst[d];
        }
        if (a.mode == ALONG_GATHER) st(a.out, a.odt, t, ld(a.input, a.sdt, off));
        else if (a.mode == ALONG_SCATTER_VALUE) st(a.out, a.odt, off, a.value);
        else if (a.mode == ALONG_SCATTER_SRC) st(a.out, a.odt, off, ld(a.src, a.srcdt, soff));
        else if (a.mode == ALONG_SCATTER_ADD) atomic_addv(a.out, a.odt, off, ld(a.src, a.srcdt, soff));
        else atomic_combine(a.out, a.odt, off, ld(a.src, a.srcdt, soff), a.mode);
    }
}

// Rows of [outer, len, inner] picked by an index along the middle dim: index_select and
// embedding (outer 1).
extern "C" __global__ void take_rows(const TakeRowsArgs a) {
    GRID_LOOP(t, a.outer * a.rows * a.inner) {
        i64 c = t % a.inner, j = (t / a.inner) % a.rows, o = t / (a.inner * a.rows);
        i64 row = index_at(a.index, a.idt, j, a.len, a.err, a.node, a.code);
        if (row < 0) continue;
        raw(a.out, t, a.x, (o * a.len + row) * a.inner + c, a.dt);
    }
}

// out (zeroed first) row r += the grad rows whose index is r.
extern "C" __global__ void embedding_bwd(const EmbeddingBackwardArgs a) {
    GRID_LOOP(t, a.count * a.width) {
        i64 j = t % a.width, i = t / a.width;
        i64 r = index_at(a.index, a.idt, i, a.rows, a.err, a.node, ERR_EMBEDDING_BACKWARD_INDEX);
        if (r < 0) continue;
        if (a.padding >= 0 && r == a.padding) continue;
        double factor = 1.0;
        if (a.scale) {
            i64 freq = 0;
            for (i64 q = 0; q < a.count; ++q) {
                i64 v = a.idt == DT_I64 ? ((const i64*)a.index)[q] : (i64)((const int*)a.index)[q];
                if (v < 0) v += a.rows;
                if (v == r) freq++;
            }
            factor = 1.0 / (double)freq;
        }
        atomic_addv(a.out, a.odt, r * a.width + j, factor * ld(a.g, a.gdt, t));
    }
}

// ------------------------------------------------------------------------------------
// Advanced indexing (index.Tensor, index_put): each thread one element of the selection.

// The element of x that selection element t picks; -1 (reported) for a bad index.
__device__ i64 selected(const AdvancedIndexArgs& a, i64 t) {
    i64 c[MAXR];
    i64 r = t;
    for (int e = (int)a.rank - 1; e >= 0; --e) {
        c[e] = r % a.shape[e];
        r /= a.shape[e];
    }
    i64 off = 0;
    for (int d = 0; d < (int)a.srank; ++d) {
        i64 at;
        if (a.whole[d] >= 0) {
            at = c[a.whole[d]];
        } else {
            i64 j = 0;
            for (int e = 0; e < (int)a.rank; ++e) j += c[e] * a.ist[d * MAXR + e];
            at = index_at(a.idx[d], a.idt[d], j, a.size[d], a.err, a.node, a.code);
            if (at < 0) return -1;
        }
        off += at * a.xst[d];
    }
    return off;
}

extern "C" __global__ void index_gather(const AdvancedIndexArgs a) {
    GRID_LOOP(t, a.n) {
        i64 at = selected(a, t);
        if (at >= 0) raw(a.out, t, a.x, at, a.dt);
    }
}

// out (already a copy of x) at each selected element takes the value broadcast to that
// selection element, or adds it (atomically: repeated places add up).
extern "C" __global__ void index_put(const AdvancedIndexArgs a) {
    GRID_LOOP(t, a.n) {
        i64 at = selected(a, t);
        if (at < 0) continue;
        i64 v = 0, r = t;
        for (int e = (int)a.rank - 1; e >= 0; --e) {
            v += (r % a.shape[e]) * a.vst[e];
            r /= a.shape[e];
        }
        if (a.accumulate) atomic_addv(a.out, a.dt, at, ld(a.values, a.dt, v));
        else raw(a.out, at, a.values, v, a.dt);
    }
}
