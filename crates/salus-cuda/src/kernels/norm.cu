// ------------------------------------------------------------------------------------
// Layer norm over contiguous rows of `inner` elements.

extern "C" __global__ void layer_norm_fwd(const LayerNormArgs a) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < a.rows; r += gridDim.x) {
        i64 base = r * a.inner;
        double s = 0.0;
        for (i64 j = threadIdx.x; j < a.inner; j += blockDim.x) s += ld(a.x, a.xdt, base + j);
        double mean = block_sum(s, sh) / (double)a.inner;
        double q = 0.0;
        for (i64 j = threadIdx.x; j < a.inner; j += blockDim.x) {
            double d = ld(a.x, a.xdt, base + j) - mean;
            q += d * d;
        }
        double var = block_sum(q, sh) / (double)a.inner;
        double rstd = 1.0 / sqrt(var + a.eps);
        if (a.y) {
            for (i64 j = threadIdx.x; j < a.inner; j += blockDim.x) {
                double v = (ld(a.x, a.xdt, base + j) - mean) * rstd;
                if (a.w) v *= ld(a.w, a.wdt, j);
                if (a.b) v += ld(a.b, a.bdt, j);
                st(a.y, a.ydt, base + j, v);
            }
        }
        if (threadIdx.x == 0) {
            if (a.mean) st(a.mean, a.mdt, r, mean);
            if (a.rstd) st(a.rstd, a.rdt, r, rstd);
        }
    }
}

extern "C" __global__ void layer_norm_bwd_input(const LayerNormBackwardArgs a) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < a.rows; r += gridDim.x) {
        i64 base = r * a.inner;
        double m = ld(a.mean, a.mdt, r), rs = ld(a.rstd, a.rdt, r);
        double s1 = 0.0, s2 = 0.0;
        for (i64 j = threadIdx.x; j < a.inner; j += blockDim.x) {
            double xhat = (ld(a.x, a.xdt, base + j) - m) * rs;
            double dyw = ld(a.g, a.gdt, base + j) * (a.w ? ld(a.w, a.wdt, j) : 1.0);
            s1 += dyw;
            s2 += dyw * xhat;
        }
        double mean_dyw = block_sum(s1, sh) / (double)a.inner;
        double mean_dyw_xhat = block_sum(s2, sh) / (double)a.inner;
        for (i64 j = threadIdx.x; j < a.inner; j += blockDim.x) {
            double xhat = (ld(a.x, a.xdt, base + j) - m) * rs;
            double dyw = ld(a.g, a.gdt, base + j) * (a.w ? ld(a.w, a.wdt, j) : 1.0);
            st(a.gi, a.gidt, base + j, rs * (dyw - mean_dyw - xhat * mean_dyw_xhat));
        }
    }
}

extern "C" __global__ void layer_norm_bwd_params(const LayerNormBackwardArgs a) {
    GRID_LOOP(j, a.inner) {
        double gw = 0.0, gb = 0.0;
        for (i64 r = 0; r < a.rows; ++r) {
            double dy = ld(a.g, a.gdt, r * a.inner + j);
            double xhat = (ld(a.x, a.xdt, r * a.inner + j) - ld(a.mean, a.mdt, r)) * ld(a.rstd, a.rdt, r);
            gw += dy * xhat;
            gb += dy;
        }
        if (a.gw) st(a.gw, a.gwdt, j, gw);
        if (a.gb) st(a.gb, a.gbdt, j, gb);
    }
}

