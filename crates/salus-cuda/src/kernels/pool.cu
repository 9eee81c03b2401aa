// ------------------------------------------------------------------------------------
// Pooling over the last two dims of [planes, h, w].

extern "C" __global__ void max_pool_fwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.oh * a.ow) {
        i64 ox = t % a.ow, oy = (t / a.ow) % a.oh, pl = t / (a.ow * a.oh);
        double best = NEG_INF;
        i64 at = -1;
        for (i64 ky = 0; ky < a.k[0]; ++ky) {
            i64 iy = oy * a.s[0] + ky * a.d[0] - a.p[0];
            for (i64 kx = 0; kx < a.k[1]; ++kx) {
                i64 ix = ox * a.s[1] + kx * a.d[1] - a.p[1];
                if (iy < 0 || ix < 0 || iy >= a.h || ix >= a.w) continue;
                i64 i = iy * a.w + ix;
                double v = ld(a.x, a.xdt, pl * a.h * a.w + i);
                if (at < 0 || (!isnan(best) && (v > best || isnan(v)))) {
                    best = v;
                    at = i;
                }
            }
        }
        if (a.y) st(a.y, a.ydt, t, best);
        if (a.idx) st(a.idx, a.idt, t, (double)(at < 0 ? 0 : at));
    }
}

// grad_input (x, zeroed first) += grad_output (g) at the recorded indices.
extern "C" __global__ void max_pool_bwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.oh * a.ow) {
        i64 pl = t / (a.oh * a.ow);
        i64 at = index_at(a.idx, a.idt, t, a.h * a.w, a.err, a.node, ERR_POOLING_INDEX);
        if (at < 0) continue;
        atomic_addv(a.x, a.xdt, pl * a.h * a.w + at, ld(a.g, a.gdt, t));
    }
}

__device__ void avg_window(const PoolArgs& a, i64 oy, i64 ox, i64* win, double* divisor) {
    i64 o[2] = {oy, ox}, size[2] = {a.h, a.w};
    i64 padded[2];
    for (int d = 0; d < 2; ++d) {
        i64 start = o[d] * a.s[d] - a.p[d];
        i64 end = start + a.k[d];
        if (end > size[d] + a.p[d]) end = size[d] + a.p[d];
        padded[d] = end - start;
        if (start < 0) start = 0;
        if (end > size[d]) end = size[d];
        if (end < start) end = start;
        win[2 * d] = start;
        win[2 * d + 1] = end;
    }
    if (a.divisor != 0) *divisor = (double)a.divisor;
    else if (a.count_include_pad) *divisor = (double)(padded[0] * padded[1]);
    else *divisor = (double)((win[1] - win[0]) * (win[3] - win[2]));
}

extern "C" __global__ void avg_pool_fwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.oh * a.ow) {
        i64 ox = t % a.ow, oy = (t / a.ow) % a.oh, pl = t / (a.ow * a.oh);
        i64 win[4];
        double divisor;
        avg_window(a, oy, ox, win, &divisor);
        double s = 0.0;
        for (i64 iy = win[0]; iy < win[1]; ++iy)
            for (i64 ix = win[2]; ix < win[3]; ++ix) s += ld(a.x, a.xdt, (pl * a.h + iy) * a.w + ix);
        st(a.y, a.ydt, t, (win[0] < win[1] && win[2] < win[3]) ? s / divisor : 0.0);
    }
}

extern "C" __global__ void avg_pool_bwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.oh * a.ow) {
        i64 ox = t % a.ow, oy = (t / a.ow) % a.oh, pl = t / (a.ow * a.oh);
        i64 win[4];
        double divisor;
        avg_window(a, oy, ox, win, &divisor);
        double share = ld(a.g, a.gdt, t) / divisor;
        for (i64 iy = win[0]; iy < win[1]; ++iy)
            for (i64 ix = win[2]; ix < win[3]; ++ix) atomic_addv(a.x, a.xdt, (pl * a.h + iy) * a.w + ix, share);
    }
}

extern "C" __global__ void adaptive_pool_fwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.oh * a.ow) {
        i64 ox = t % a.ow, oy = (t / a.ow) % a.oh, pl = t / (a.ow * a.oh);
        i64 y0 = oy * a.h / a.oh, y1 = ((oy + 1) * a.h + a.oh - 1) / a.oh;
        i64 x0 = ox * a.w / a.ow, x1 = ((ox + 1) * a.w + a.ow - 1) / a.ow;
        double s = 0.0;
        for (i64 iy = y0; iy < y1; ++iy)
            for (i64 ix = x0; ix < x1; ++ix) s += ld(a.x, a.xdt, (pl * a.h + iy) * a.w + ix);
        st(a.y, a.ydt, t, s / (double)((y1 - y0) * (x1 - x0)));
    }
}

extern "C" __global__ void adaptive_pool_bwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.oh * a.ow) {
        i64 ox = t % a.ow, oy = (t / a.ow) % a.oh, pl = t / (a.ow * a.oh);
        i64 y0 = oy * a.h / a.oh, y1 = ((oy + 1) * a.h + a.oh - 1) / a.oh;
        i64 x0 = ox * a.w / a.ow, x1 = ((ox + 1) * a.w + a.ow - 1) / a.ow;
        double share = ld(a.g, a.gdt, t) / (double)((y1 - y0) * (x1 - x0));
        for (i64 iy = y0; iy < y1; ++iy)
            for (i64 ix = x0; ix < x1; ++ix) atomic_addv(a.x, a.xdt, (pl * a.h + iy) * a.w + ix, share);
    }
}


// ------------------------------------------------------------------------------------
// Reflection padding of the last two dims of [planes, h, w] (p = (top, left); every pad
// below the dim it reflects, as validation checked).

// The input position output position j reflects, along a dim of n padded by `before`.
__device__ i64 reflect_at(i64 j, i64 before, i64 n) {
    i64 i = j - before;
    if (i < 0) return -i;
    if (i > n - 1) return 2 * (n - 1) - i;
    return i;
}

// The output positions (of `out`) that reflect input position i: itself shifted, its
// mirror in the leading pad, its mirror in the trailing pad; how many there are.
__device__ int reflections(i64 i, i64 before, i64 n, i64 out, i64* at) {
    int k = 0;
    at[k++] = i + before;
    if (i > 0 && i <= before) at[k++] = before - i;
    i64 r = 2 * (n - 1) - i + before;
    if (i < n - 1 && r >= n + before && r < out) at[k++] = r;
    return k;
}

extern "C" __global__ void reflection_pad_fwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.oh * a.ow) {
        i64 ox = t % a.ow, oy = (t / a.ow) % a.oh, pl = t / (a.ow * a.oh);
        i64 src = (pl * a.h + reflect_at(oy, a.p[0], a.h)) * a.w + reflect_at(ox, a.p[1], a.w);
        raw(a.y, t, a.x, src, a.ydt);
    }
}

// grad_input x: each input element sums the gradient g of its reflections.
extern "C" __global__ void reflection_pad_bwd(const PoolArgs a) {
    GRID_LOOP(t, a.planes * a.h * a.w) {
        i64 ix = t % a.w, iy = (t / a.w) % a.h, pl = t / (a.w * a.h);
        i64 ys[3], xs[3];
        int ny = reflections(iy, a.p[0], a.h, a.oh, ys);
        int nx = reflections(ix, a.p[1], a.w, a.ow, xs);
        double s = 0.0;
        for (int u = 0; u < ny; ++u)
            for (int v = 0; v < nx; ++v) s += ld(a.g, a.gdt, (pl * a.oh + ys[u]) * a.ow + xs[v]);
        st(a.x, a.xdt, t, s);
    }
}
