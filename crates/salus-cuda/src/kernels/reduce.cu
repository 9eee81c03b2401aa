// ------------------------------------------------------------------------------------
// Block reductions in double.

__device__ double block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// max that ignores NaN (f64::max), for softmax.
__device__ double block_fmax(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] = fmax(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// max where NaN wins (amax).
__device__ double nan_max(double a, double b) {
    if (isnan(a) || isnan(b)) return isnan(a) ? a : b;
    return b > a ? b : a;
}

__device__ double block_nan_max(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) sh[threadIdx.x] = nan_max(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// ------------------------------------------------------------------------------------
// Reductions over any set of dims: sum, mean, amax, any, var.

__device__ i64 kept_base(const ReduceArgs& a, i64 oi) {
    i64 base = 0, r = oi;
    for (int d = (int)a.krank - 1; d >= 0; --d) {
        i64 c = r % a.kshape[d];
        r /= a.kshape[d];
        base += c * a.kst[d];
    }
    return base;
}

__device__ i64 reduced_at(const ReduceArgs& a, i64 j) {
    i64 off = 0, r = j;
    for (int d = (int)a.rrank - 1; d >= 0; --d) {
        i64 c = r % a.rshape[d];
        r /= a.rshape[d];
        off += c * a.rst[d];
    }
    return off;
}

__device__ double red_finish(const ReduceArgs& a, double acc, double sq) {
    switch (a.op) {
        case RED_MEAN: return acc / (double)a.count;
        case RED_VAR: {
            double divisor = fmax((double)a.count - a.correction, 0.0);
            return sq / divisor;
        }
        default: return acc;
    }
}

// One thread per output: for short reductions.
extern "C" __global__ void red_thread(const ReduceArgs a) {
    GRID_LOOP(oi, a.nout) {
        i64 base = kept_base(a, oi);
        double acc = a.op == RED_AMAX ? NEG_INF : 0.0;
        for (i64 j = 0; j < a.count; ++j) {
            double v = ld(a.input, a.in_dt, base + reduced_at(a, j));
            if (a.op == RED_AMAX) acc = nan_max(acc, v);
            else if (a.op == RED_ANY) acc = (acc != 0.0 || v != 0.0) ? 1.0 : 0.0;
            else acc += v;
        }
        double sq = 0.0;
        if (a.op == RED_VAR) {
            double mean = acc / (double)a.count;
            for (i64 j = 0; j < a.count; ++j) {
                double d = ld(a.input, a.in_dt, base + reduced_at(a, j)) - mean;
                sq += d * d;
            }
        }
        st(a.out, a.out_dt, oi, red_finish(a, acc, sq));
    }
}

// One block per output: for long reductions.
extern "C" __global__ void red_block(const ReduceArgs a) {
    __shared__ double sh[BLOCK];
    for (i64 oi = blockIdx.x; oi < a.nout; oi += gridDim.x) {
        i64 base = kept_base(a, oi);
        double acc = a.op == RED_AMAX ? NEG_INF : 0.0;
        for (i64 j = threadIdx.x; j < a.count; j += blockDim.x) {
            double v = ld(a.input, a.in_dt, base + reduced_at(a, j));
            if (a.op == RED_AMAX) acc = nan_max(acc, v);
            else if (a.op == RED_ANY) acc = (acc != 0.0 || v != 0.0) ? 1.0 : 0.0;
            else acc += v;
        }
        if (a.op == RED_AMAX) acc = block_nan_max(acc, sh);
        else if (a.op == RED_ANY) acc = block_sum(acc, sh) != 0.0 ? 1.0 : 0.0;
        else acc = block_sum(acc, sh);
        double sq = 0.0;
        if (a.op == RED_VAR) {
            double mean = acc / (double)a.count;
            double part = 0.0;
            for (i64 j = threadIdx.x; j < a.count; j += blockDim.x) {
                double d = ld(a.input, a.in_dt, base + reduced_at(a, j)) - mean;
                part += d * d;
            }
            sq = block_sum(part, sh);
        }
        if (threadIdx.x == 0) st(a.out, a.out_dt, oi, red_finish(a, acc, sq));
    }
}

// ------------------------------------------------------------------------------------
// Softmax, log-softmax and their backward, along one dim: rows of `len` elements
// `inner` apart.

extern "C" __global__ void softmax_fwd(const SoftmaxArgs a) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < a.rows; r += gridDim.x) {
        i64 base = (r / a.inner) * a.len * a.inner + r % a.inner;
        double m = NEG_INF;
        for (i64 j = threadIdx.x; j < a.len; j += blockDim.x) m = fmax(m, ld(a.x, a.xdt, base + j * a.inner));
        m = block_fmax(m, sh);
        double s = 0.0;
        for (i64 j = threadIdx.x; j < a.len; j += blockDim.x) s += exp(ld(a.x, a.xdt, base + j * a.inner) - m);
        s = block_sum(s, sh);
        for (i64 j = threadIdx.x; j < a.len; j += blockDim.x) {
            double v = ld(a.x, a.xdt, base + j * a.inner) - m;
            st(a.y, a.ydt, base + j * a.inner, a.log ? v - log(s) : exp(v) / s);
        }
    }
}

// grad_input (into x) from grad_output g and output y.
extern "C" __global__ void softmax_bwd(const SoftmaxArgs a) {
    __shared__ double sh[BLOCK];
    for (i64 r = blockIdx.x; r < a.rows; r += gridDim.x) {
        i64 base = (r / a.inner) * a.len * a.inner + r % a.inner;
        double s = 0.0;
        for (i64 j = threadIdx.x; j < a.len; j += blockDim.x) {
            i64 k = base + j * a.inner;
            double gv = ld(a.g, a.gdt, k);
            s += a.log ? gv : gv * ld(a.y, a.ydt, k);
        }
        s = block_sum(s, sh);
        for (i64 j = threadIdx.x; j < a.len; j += blockDim.x) {
            i64 k = base + j * a.inner;
            double gv = ld(a.g, a.gdt, k), yv = ld(a.y, a.ydt, k);
            st(a.x, a.xdt, k, a.log ? gv - exp(yv) * s : yv * (gv - s));
        }
    }
}


// ------------------------------------------------------------------------------------
// cumsum (cumprod where `product`) along the middle dim of [rows / inner, len, inner]: a
// thread per line, accumulated in double in order, each prefix rounded once.

extern "C" __global__ void cumsum(const SoftmaxArgs a) {
    GRID_LOOP(t, a.rows) {
        i64 base = (t / a.inner) * a.len * a.inner + t % a.inner;
        double s = a.product ? 1.0 : 0.0;
        for (i64 j = 0; j < a.len; ++j) {
            double v = ld(a.x, a.xdt, base + j * a.inner);
            s = a.product ? s * v : s + v;
            st(a.y, a.ydt, base + j * a.inner, s);
        }
    }
}
