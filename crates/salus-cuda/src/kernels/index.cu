// ------------------------------------------------------------------------------------
// Indexing. A bad index is reported with its kind (ERR_*, `abi::IndexErrorKind`).

// gather / scatter.value / scatter_add along `dim`: index element t at coords c (index
// shape) meets self element with c[dim] replaced by the index value.
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
        else atomic_addv(a.out, a.odt, off, ld(a.src, a.srcdt, soff));
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

// index_put with up to 4 leading integer indices (of one shape, `count` elements each):
// out (a copy of self) at the indexed rows of `inner` elements takes (or adds) values.
extern "C" __global__ void index_put(const IndexPutArgs a) {
    GRID_LOOP(t, a.count * a.inner) {
        i64 j = t % a.inner, i = t / a.inner;
        i64 base = 0;
        bool ok = true;
        for (int k = 0; k < (int)a.nidx; ++k) {
            i64 at = index_at(a.idx[k], a.idt[k], i, a.size[k], a.err, a.node, ERR_INDEX_PUT_INDEX);
            if (at < 0) ok = false;
            else base += at * a.stride[k];
        }
        if (!ok) continue;
        double v = ld(a.values, a.vdt, i * a.vs0 + j * a.vs1);
        if (a.accumulate) atomic_addv(a.out, a.odt, base + j, v);
        else st(a.out, a.odt, base + j, v);
    }
}

