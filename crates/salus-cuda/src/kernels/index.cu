// ------------------------------------------------------------------------------------
// Indexing. Error codes: 1 index, 2 embedding index, 3 pooling index, 4 index_select
// index, 5 embedding_dense_backward index, 6 index_put index.

// gather / scatter.value / scatter_add along `dim`: index element t at coords c (index
// shape) meets self element with c[dim] replaced by the index value.
struct AlongArgs {
    i64 n, rank, dim, dim_size, mode;
    double value;
    i64 ishape[MAXR];
    i64 sst[MAXR];
    i64 srcst[MAXR];
    u64 self;
    i64 sdt;
    u64 index;
    i64 idt;
    u64 src;
    i64 srcdt;
    u64 out;
    i64 odt;
    u64 err;
    i64 node;
};

#define ALONG_GATHER 0
#define ALONG_SCATTER_VALUE 1
#define ALONG_SCATTER_ADD 2

extern "C" __global__ void along_dim(const AlongArgs a) {
    GRID_LOOP(t, a.n) {
        i64 at = index_at(a.index, a.idt, t, a.dim_size, a.err, a.node, 1);
        if (at < 0) continue;
        i64 off = 0, soff = 0, r = t;
        for (int d = (int)a.rank - 1; d >= 0; --d) {
            i64 c = r % a.ishape[d];
            r /= a.ishape[d];
            off += (d == a.dim ? at : c) * a.sst[d];
            soff += c * a.srcst[d];
        }
        if (a.mode == ALONG_GATHER) st(a.out, a.odt, t, ld(a.self, a.sdt, off));
        else if (a.mode == ALONG_SCATTER_VALUE) st(a.out, a.odt, off, a.value);
        else atomic_addv(a.out, a.odt, off, ld(a.src, a.srcdt, soff));
    }
}

// Rows of [outer, len, inner] picked by an index along the middle dim: index_select and
// embedding (outer 1).
struct RowsArgs {
    i64 outer, len, inner, rows, code, dt;
    u64 x;
    u64 index;
    i64 idt;
    u64 out;
    u64 err;
    i64 node;
};

extern "C" __global__ void take_rows(const RowsArgs a) {
    GRID_LOOP(t, a.outer * a.rows * a.inner) {
        i64 c = t % a.inner, j = (t / a.inner) % a.rows, o = t / (a.inner * a.rows);
        i64 row = index_at(a.index, a.idt, j, a.len, a.err, a.node, a.code);
        if (row < 0) continue;
        raw(a.out, t, a.x, (o * a.len + row) * a.inner + c, a.dt);
    }
}

struct EmbBwdArgs {
    i64 count, width, rows, padding, scale;
    u64 g;
    i64 gdt;
    u64 index;
    i64 idt;
    u64 out;
    i64 odt;
    u64 err;
    i64 node;
};

// out (zeroed first) row r += the grad rows whose index is r.
extern "C" __global__ void embedding_bwd(const EmbBwdArgs a) {
    GRID_LOOP(t, a.count * a.width) {
        i64 j = t % a.width, i = t / a.width;
        i64 r = index_at(a.index, a.idt, i, a.rows, a.err, a.node, 5);
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
struct IndexPutArgs {
    i64 count, inner, nidx, accumulate, vs0, vs1;
    u64 idx[4];
    i64 idt[4];
    i64 size[4];
    i64 stride[4];
    u64 values;
    i64 vdt;
    u64 out;
    i64 odt;
    u64 err;
    i64 node;
};

extern "C" __global__ void index_put(const IndexPutArgs a) {
    GRID_LOOP(t, a.count * a.inner) {
        i64 j = t % a.inner, i = t / a.inner;
        i64 base = 0;
        bool ok = true;
        for (int k = 0; k < (int)a.nidx; ++k) {
            i64 at = index_at(a.idx[k], a.idt[k], i, a.size[k], a.err, a.node, 6);
            if (at < 0) ok = false;
            else base += at * a.stride[k];
        }
        if (!ok) continue;
        double v = ld(a.values, a.vdt, i * a.vs0 + j * a.vs1);
        if (a.accumulate) atomic_addv(a.out, a.odt, base + j, v);
        else st(a.out, a.odt, base + j, v);
    }
}

