// ------------------------------------------------------------------------------------
// Row kernels: reductions, softmax and layer norm over contiguous rows (the innermost dims),
// a warp per row when a row has at most ROW_WARP_MAX elements (BLOCK / 32 rows per block),
// else a block per row. Lanes read consecutive elements (coalesced); partial results are
// combined with warp shuffles, and across the block's warps through shared memory.
// Softmax and layer norm compute in f32 (loads widened to f32, f32 sums); reductions sum
// in double as the general kernels do (exact integer sums). The general kernels of
// reduce.cu remain for other layouts.

#define ROW_WARPS (BLOCK / 32)

// The rows of a launch, for the calling thread: a warp or a block per row.
#define ROW_LOOP(r, rows, per_warp)                                                    \
    for (i64 r = (per_warp) ? (i64)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5)       \
                            : (i64)blockIdx.x;                                         \
         r < (rows); r += (per_warp) ? (i64)gridDim.x * ROW_WARPS : (i64)gridDim.x)

__device__ float warp_sum_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// max that ignores NaN (fmaxf), as softmax's block_fmax.
__device__ float warp_max_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ double warp_nan_max_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The whole row's sum (max) in every thread of the row's warp (per_warp) or block.
__device__ float row_sum_f(float v, bool per_warp, float* sh) {
    v = warp_sum_f(v);
    if (per_warp) return v;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < ROW_WARPS ? sh[threadIdx.x & 31] : 0.0f;
    return warp_sum_f(v);
}

__device__ float row_max_f(float v, bool per_warp, float* sh) {
    v = warp_max_f(v);
    if (per_warp) return v;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < ROW_WARPS ? sh[threadIdx.x & 31] : -__int_as_float(0x7f800000);
    return warp_max_f(v);
}

__device__ double row_sum_d(double v, bool per_warp, double* sh) {
    v = warp_sum_d(v);
    if (per_warp) return v;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < ROW_WARPS ? sh[threadIdx.x & 31] : 0.0;
    return warp_sum_d(v);
}

__device__ double row_nan_max_d(double v, bool per_warp, double* sh) {
    v = warp_nan_max_d(v);
    if (per_warp) return v;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < ROW_WARPS ? sh[threadIdx.x & 31] : NEG_INF;
    return warp_nan_max_d(v);
}

__device__ float ldf(u64 p, i64 dt, i64 i) {
    if (dt == DT_F32) return ((const float*)p)[i];
    return (float)ld(p, dt, i);
}

__device__ void stf(u64 p, i64 dt, i64 i, float v) {
    if (dt == DT_F32) ((float*)p)[i] = v;
    else st(p, dt, i, (double)v);
}

// Reductions whose reduced elements are one contiguous run per output (`rrank` 1 with
// stride 1): output `oi` reads `count` elements from `kept_base(oi)`.
extern "C" __global__ void red_rows(const ReduceArgs a) {
    __shared__ double sh[32];
    bool pw = a.count <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    ROW_LOOP(oi, a.nout, pw) {
        i64 base = kept_base(a, oi);
        double acc = a.op == RED_AMAX ? NEG_INF : 0.0;
        for (i64 j = t; j < a.count; j += nt) {
            double v = ld(a.input, a.in_dt, base + j);
            if (a.op == RED_AMAX) acc = nan_max(acc, v);
            else if (a.op == RED_ANY) acc = (acc != 0.0 || v != 0.0) ? 1.0 : 0.0;
            else acc += v;
        }
        if (a.op == RED_AMAX) acc = row_nan_max_d(acc, pw, sh);
        else if (a.op == RED_ANY) acc = row_sum_d(acc, pw, sh) != 0.0 ? 1.0 : 0.0;
        else acc = row_sum_d(acc, pw, sh);
        double sq = 0.0;
        if (a.op == RED_VAR) {
            double mean = acc / (double)a.count;
            double part = 0.0;
            for (i64 j = t; j < a.count; j += nt) {
                double d = ld(a.input, a.in_dt, base + j) - mean;
                part += d * d;
            }
            sq = row_sum_d(part, pw, sh);
        }
        if (t == 0) st(a.out, a.out_dt, oi, red_finish(a, acc, sq));
    }
}

// Reductions whose outputs are one contiguous run (`krank` 1, stride 1) and whose reduced
// elements are `rst[0]` apart (`rrank` 1): the sum of a [count, nout] matrix's columns, as a
// bias gradient. A block takes 32 adjacent outputs (a lane each, coalesced) and splits the
// reduced elements among its ROW_WARPS warps, combined through shared memory.
extern "C" __global__ void red_cols(const ReduceArgs a) {
    __shared__ double sh[ROW_WARPS][33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    i64 stride = a.rst[0];
    for (i64 c0 = (i64)blockIdx.x * 32; c0 < a.nout; c0 += (i64)gridDim.x * 32) {
        i64 oi = c0 + lane;
        bool on = oi < a.nout;
        double acc = a.op == RED_AMAX ? NEG_INF : 0.0;
        if (on) {
            for (i64 j = w; j < a.count; j += ROW_WARPS) {
                double v = ld(a.input, a.in_dt, oi + j * stride);
                if (a.op == RED_AMAX) acc = nan_max(acc, v);
                else if (a.op == RED_ANY) acc = (acc != 0.0 || v != 0.0) ? 1.0 : 0.0;
                else acc += v;
            }
        }
        __syncthreads();
        sh[w][lane] = acc;
        __syncthreads();
        double total = a.op == RED_AMAX ? NEG_INF : 0.0;
        for (int k = 0; k < ROW_WARPS; ++k) {
            double v = sh[k][lane];
            if (a.op == RED_AMAX) total = nan_max(total, v);
            else if (a.op == RED_ANY) total = (total != 0.0 || v != 0.0) ? 1.0 : 0.0;
            else total += v;
        }
        double sq = 0.0;
        if (a.op == RED_VAR) {
            double mean = total / (double)a.count;
            double part = 0.0;
            if (on) {
                for (i64 j = w; j < a.count; j += ROW_WARPS) {
                    double d = ld(a.input, a.in_dt, oi + j * stride) - mean;
                    part += d * d;
                }
            }
            __syncthreads();
            sh[w][lane] = part;
            __syncthreads();
            for (int k = 0; k < ROW_WARPS; ++k) sq += sh[k][lane];
        }
        if (w == 0 && on) st(a.out, a.out_dt, oi, red_finish(a, total, sq));
    }
}

// ------------------------------------------------------------------------------------
// Split reductions: for few outputs over many elements, each output's reduced range is cut
// into `a.splits` chunks of `a.chunk` elements, a block per (output or 32 outputs, chunk).
// Each block writes its chunk's partial (f64) to `a.part`; `red_parts` then combines each
// output's partials in a fixed order. Every sum has a fixed shape (no atomics): the same
// inputs give the same bits. With `a.splits` 1 the stage-1 kernels write the result.
// The variance is two-pass within a chunk (its mean, then its sum of squared deviations
// about it); chunks merge as (n, mean, m2) pairs.

// One element into an accumulator: `dev` sums squared deviations from `mean`.
__device__ double red_step(const ReduceArgs& a, double acc, double v, bool dev, double mean) {
    if (dev) {
        double d = v - mean;
        return acc + d * d;
    }
    if (a.op == RED_AMAX) return nan_max(acc, v);
    if (a.op == RED_ANY) return (acc != 0.0 || v != 0.0) ? 1.0 : 0.0;
    return acc + v;
}

// Two accumulators of the same kind into one.
__device__ double red_merge(const ReduceArgs& a, double x, double y, bool dev) {
    if (!dev && a.op == RED_AMAX) return nan_max(x, y);
    if (!dev && a.op == RED_ANY) return (x != 0.0 || y != 0.0) ? 1.0 : 0.0;
    return x + y;
}

__device__ double red_init(const ReduceArgs& a, bool dev) {
    return (!dev && a.op == RED_AMAX) ? NEG_INF : 0.0;
}

// A thread's walk through its chunk without a division per element: the flattened
// reduced index j as digits in rshape (the last innermost) and its offset, advanced by a
// fixed step. The outermost digit is not wrapped (the walk stops at the chunk's end).
// Fully unrolled over MAXR, so that the digits stay in registers.
#define WALK_START(a, dig, stp, off, j, step)                                           \
    {                                                                                    \
        i64 jj_ = (j), ss_ = (step);                                                     \
        off = 0;                                                                         \
        _Pragma("unroll") for (int d = MAXR - 1; d >= 0; --d) {                          \
            dig[d] = 0;                                                                  \
            stp[d] = 0;                                                                  \
            if (d < (a).rrank) {                                                         \
                if (d > 0) {                                                             \
                    dig[d] = jj_ % (a).rshape[d];                                        \
                    jj_ /= (a).rshape[d];                                                \
                    stp[d] = ss_ % (a).rshape[d];                                        \
                    ss_ /= (a).rshape[d];                                                \
                } else {                                                                 \
                    dig[d] = jj_;                                                        \
                    stp[d] = ss_;                                                        \
                }                                                                        \
                off += dig[d] * (a).rst[d];                                              \
            }                                                                            \
        }                                                                                \
    }

#define WALK_NEXT(a, dig, stp, off)                                                     \
    {                                                                                    \
        i64 carry_ = 0;                                                                  \
        _Pragma("unroll") for (int d = MAXR - 1; d >= 0; --d) {                          \
            if (d < (a).rrank) {                                                         \
                i64 add_ = stp[d] + carry_;                                              \
                dig[d] += add_;                                                          \
                off += add_ * (a).rst[d];                                                \
                carry_ = 0;                                                              \
                if (d > 0 && dig[d] >= (a).rshape[d]) {                                  \
                    dig[d] -= (a).rshape[d];                                             \
                    off -= (a).rshape[d] * (a).rst[d];                                   \
                    carry_ = 1;                                                          \
                }                                                                        \
            }                                                                            \
        }                                                                                \
    }

// This thread's share of reduced elements [j0, j1) of the output at `base`, the block's
// threads interleaved (coalesced along the contiguous innermost reduced dim).
__device__ double red_chunk(const ReduceArgs& a, i64 base, i64 j0, i64 j1, bool dev, double mean) {
    double acc = red_init(a, dev);
    i64 nt = (i64)blockDim.x;
    i64 j = j0 + (i64)threadIdx.x;
    if (a.rrank == 1) {
        i64 s = a.rst[0];
        for (; j < j1; j += nt) acc = red_step(a, acc, ld(a.input, a.in_dt, base + j * s), dev, mean);
    } else if (j < j1) {
        i64 dig[MAXR], stp[MAXR], off;
        WALK_START(a, dig, stp, off, j, nt);
        for (; j < j1; j += nt) {
            acc = red_step(a, acc, ld(a.input, a.in_dt, base + off), dev, mean);
            WALK_NEXT(a, dig, stp, off);
        }
    }
    return acc;
}

// The block's accumulators combined, in every thread (a fixed shuffle tree).
__device__ double red_block_all(const ReduceArgs& a, double acc, bool dev, double* sh) {
    if (!dev && a.op == RED_AMAX) return row_nan_max_d(acc, false, sh);
    if (!dev && a.op == RED_ANY) return row_sum_d(acc, false, sh) != 0.0 ? 1.0 : 0.0;
    return row_sum_d(acc, false, sh);
}

// Elements in chunk `s`.
__device__ i64 chunk_len(const ReduceArgs& a, i64 s) {
    i64 rest = a.count - s * a.chunk;
    return rest < a.chunk ? rest : a.chunk;
}

// A chunk's result: the output (one chunk) or its partial(s).
__device__ void red_put(const ReduceArgs& a, i64 oi, i64 s, double acc, double sq) {
    if (a.splits == 1) {
        st(a.out, a.out_dt, oi, red_finish(a, acc, sq));
        return;
    }
    double* part = (double*)a.part;
    i64 k = oi * a.splits + s;
    if (a.op == RED_VAR) {
        part[k] = acc / (double)chunk_len(a, s);
        part[a.nout * a.splits + k] = sq;
    } else {
        part[k] = acc;
    }
}

// Stage 1 where the innermost reduced dim is contiguous (rows, planes, full): a block per
// (output, chunk).
extern "C" __global__ void red_part_rows(const ReduceArgs a) {
    __shared__ double sh[32];
    i64 blocks = a.nout * a.splits;
    for (i64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        i64 oi = b / a.splits, s = b % a.splits;
        i64 j0 = s * a.chunk, j1 = j0 + chunk_len(a, s);
        i64 base = kept_base(a, oi);
        double acc = red_block_all(a, red_chunk(a, base, j0, j1, false, 0.0), false, sh);
        double sq = 0.0;
        if (a.op == RED_VAR) {
            double mean = acc / (double)(j1 - j0);
            sq = red_block_all(a, red_chunk(a, base, j0, j1, true, mean), true, sh);
        }
        if (threadIdx.x == 0) red_put(a, oi, s, acc, sq);
    }
}

// This lane's column `oi`, rows [j0, j1) stepping by the block's warps from warp `w`.
__device__ double col_chunk(const ReduceArgs& a, i64 oi, int w, i64 j0, i64 j1, bool dev, double mean) {
    double acc = red_init(a, dev);
    i64 stride = a.rst[0];
    for (i64 j = j0 + w; j < j1; j += ROW_WARPS) acc = red_step(a, acc, ld(a.input, a.in_dt, oi + j * stride), dev, mean);
    return acc;
}

// The warps' accumulators of each lane's column, combined in warp order.
__device__ double col_merge(const ReduceArgs& a, double acc, bool dev, double (*sh)[33]) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    sh[w][lane] = acc;
    __syncthreads();
    double total = red_init(a, dev);
    for (int k = 0; k < ROW_WARPS; ++k) total = red_merge(a, total, sh[k][lane], dev);
    return total;
}

// Stage 1 for column sums (outputs contiguous, `rrank` 1): a block per (32 adjacent
// outputs, chunk of rows), a lane per output, the block's warps over the chunk's rows.
extern "C" __global__ void red_part_cols(const ReduceArgs a) {
    __shared__ double sh[ROW_WARPS][33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    i64 groups = (a.nout + 31) / 32;
    i64 blocks = groups * a.splits;
    for (i64 b = blockIdx.x; b < blocks; b += gridDim.x) {
        i64 g = b / a.splits, s = b % a.splits;
        i64 oi = g * 32 + lane;
        bool on = oi < a.nout;
        i64 j0 = s * a.chunk, j1 = j0 + chunk_len(a, s);
        double acc = col_merge(a, on ? col_chunk(a, oi, w, j0, j1, false, 0.0) : red_init(a, false), false, sh);
        double sq = 0.0;
        if (a.op == RED_VAR) {
            double mean = acc / (double)(j1 - j0);
            sq = col_merge(a, on ? col_chunk(a, oi, w, j0, j1, true, mean) : 0.0, true, sh);
        }
        if (w == 0 && on) red_put(a, oi, s, acc, sq);
    }
}

// (n, mean, m2) of two disjoint sets: symmetric in its arguments, bit for bit.
__device__ void var_merge(double& n, double& mean, double& m2, double nb, double mb, double m2b) {
    if (nb == 0.0) return;
    if (n == 0.0) {
        n = nb;
        mean = mb;
        m2 = m2b;
        return;
    }
    double nt = n + nb;
    double d = mean - mb;
    double m = (n * mean + nb * mb) / nt;
    m2 = (m2 + m2b) + d * d * ((n * nb) / nt);
    mean = m;
    n = nt;
}

// Stage 2: a warp per output; lane l combines chunks l, l + 32, ... in order, then the
// lanes combine through a fixed shuffle tree; lane 0 writes.
extern "C" __global__ void red_parts(const ReduceArgs a) {
    const double* part = (const double*)a.part;
    int lane = threadIdx.x & 31;
    i64 total = a.nout * a.splits;
    for (i64 oi = (i64)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5); oi < a.nout;
         oi += (i64)gridDim.x * ROW_WARPS) {
        const double* q = part + oi * a.splits;
        double r;
        if (a.op == RED_VAR) {
            double n = 0.0, mean = 0.0, m2 = 0.0;
            for (i64 s = lane; s < a.splits; s += 32) var_merge(n, mean, m2, (double)chunk_len(a, s), q[s], q[total + s]);
            for (int o = 16; o > 0; o >>= 1) {
                double nb = __shfl_xor_sync(0xffffffffu, n, o);
                double mb = __shfl_xor_sync(0xffffffffu, mean, o);
                double m2b = __shfl_xor_sync(0xffffffffu, m2, o);
                var_merge(n, mean, m2, nb, mb, m2b);
            }
            r = m2 / fmax((double)a.count - a.correction, 0.0);
        } else {
            double acc = red_init(a, false);
            for (i64 s = lane; s < a.splits; s += 32) acc = red_merge(a, acc, q[s], false);
            for (int o = 16; o > 0; o >>= 1) acc = red_merge(a, acc, __shfl_xor_sync(0xffffffffu, acc, o), false);
            r = a.op == RED_MEAN ? acc / (double)a.count : acc;
        }
        if (lane == 0) st(a.out, a.out_dt, oi, r);
    }
}

// Softmax and log-softmax over the last dim (`inner` 1): rows of `len` contiguous elements.
extern "C" __global__ void softmax_fwd_rows(const SoftmaxArgs a) {
    __shared__ float sh[32];
    bool pw = a.len <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    ROW_LOOP(r, a.rows, pw) {
        i64 base = r * a.len;
        float m = -__int_as_float(0x7f800000);
        for (i64 j = t; j < a.len; j += nt) m = fmaxf(m, ldf(a.x, a.xdt, base + j));
        m = row_max_f(m, pw, sh);
        float s = 0.0f;
        for (i64 j = t; j < a.len; j += nt) s += expf(ldf(a.x, a.xdt, base + j) - m);
        s = row_sum_f(s, pw, sh);
        float ls = logf(s);
        for (i64 j = t; j < a.len; j += nt) {
            float v = ldf(a.x, a.xdt, base + j) - m;
            stf(a.y, a.ydt, base + j, a.log ? v - ls : expf(v) / s);
        }
    }
}

// Their backward over the last dim: grad_input (into x) from grad_output g and output y.
// Each element is read and written by one thread, after the row's sum: in place over g
// is safe.
extern "C" __global__ void softmax_bwd_rows(const SoftmaxArgs a) {
    __shared__ float sh[32];
    bool pw = a.len <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    ROW_LOOP(r, a.rows, pw) {
        i64 base = r * a.len;
        float s = 0.0f;
        for (i64 j = t; j < a.len; j += nt) {
            float gv = ldf(a.g, a.gdt, base + j);
            s += a.log ? gv : gv * ldf(a.y, a.ydt, base + j);
        }
        s = row_sum_f(s, pw, sh);
        for (i64 j = t; j < a.len; j += nt) {
            float gv = ldf(a.g, a.gdt, base + j), yv = ldf(a.y, a.ydt, base + j);
            stf(a.x, a.xdt, base + j, a.log ? gv - expf(yv) * s : yv * (gv - s));
        }
    }
}

// Layer norm over rows of `inner` contiguous elements: mean, then the variance about it
// (two passes, f32).
extern "C" __global__ void layer_norm_fwd_rows(const LayerNormArgs a) {
    __shared__ float sh[32];
    bool pw = a.inner <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    float n = (float)a.inner;
    ROW_LOOP(r, a.rows, pw) {
        i64 base = r * a.inner;
        float s = 0.0f;
        for (i64 j = t; j < a.inner; j += nt) s += ldf(a.x, a.xdt, base + j);
        float mean = row_sum_f(s, pw, sh) / n;
        float q = 0.0f;
        for (i64 j = t; j < a.inner; j += nt) {
            float d = ldf(a.x, a.xdt, base + j) - mean;
            q += d * d;
        }
        float var = row_sum_f(q, pw, sh) / n;
        float rstd = 1.0f / sqrtf(var + (float)a.eps);
        if (a.y) {
            for (i64 j = t; j < a.inner; j += nt) {
                float v = (ldf(a.x, a.xdt, base + j) - mean) * rstd;
                if (a.w) v *= ldf(a.w, a.wdt, j);
                if (a.b) v += ldf(a.b, a.bdt, j);
                stf(a.y, a.ydt, base + j, v);
            }
        }
        if (t == 0) {
            if (a.mean) stf(a.mean, a.mdt, r, mean);
            if (a.rstd) stf(a.rstd, a.rdt, r, rstd);
        }
    }
}

extern "C" __global__ void layer_norm_bwd_input_rows(const LayerNormBackwardArgs a) {
    __shared__ float sh[32];
    bool pw = a.inner <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    float n = (float)a.inner;
    ROW_LOOP(r, a.rows, pw) {
        i64 base = r * a.inner;
        float m = ldf(a.mean, a.mdt, r), rs = ldf(a.rstd, a.rdt, r);
        float s1 = 0.0f, s2 = 0.0f;
        for (i64 j = t; j < a.inner; j += nt) {
            float xhat = (ldf(a.x, a.xdt, base + j) - m) * rs;
            float dyw = ldf(a.g, a.gdt, base + j) * (a.w ? ldf(a.w, a.wdt, j) : 1.0f);
            s1 += dyw;
            s2 += dyw * xhat;
        }
        float mean_dyw = row_sum_f(s1, pw, sh) / n;
        float mean_dyw_xhat = row_sum_f(s2, pw, sh) / n;
        for (i64 j = t; j < a.inner; j += nt) {
            float xhat = (ldf(a.x, a.xdt, base + j) - m) * rs;
            float dyw = ldf(a.g, a.gdt, base + j) * (a.w ? ldf(a.w, a.wdt, j) : 1.0f);
            float v = rs * (dyw - mean_dyw - xhat * mean_dyw_xhat);
            if (a.res) v += ldf(a.res, a.resdt, base + j);
            stf(a.gi, a.gidt, base + j, v);
        }
    }
}

// The weight and bias gradients in two steps, in double and in a fixed order (the same
// result every run). `layer_norm_bwd_params_part`: chunk blockIdx.y of `per` rows, 32
// adjacent columns a block (a lane each, coalesced), the chunk's rows split among its
// warps and combined through shared memory, into part[y][j] (weight) and
// part[chunks + y][j] (bias). `layer_norm_bwd_params_finish`: each column's chunks added.
extern "C" __global__ void layer_norm_bwd_params_part(const LayerNormBackwardArgs a) {
    __shared__ double shw[ROW_WARPS][33];
    __shared__ double shb[ROW_WARPS][33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    double* part = (double*)a.part;
    for (i64 y = blockIdx.y; y < a.chunks; y += gridDim.y) {
        i64 r0 = y * a.per, r1 = r0 + a.per < a.rows ? r0 + a.per : a.rows;
        for (i64 c0 = (i64)blockIdx.x * 32; c0 < a.inner; c0 += (i64)gridDim.x * 32) {
            i64 j = c0 + lane;
            double gw = 0.0, gb = 0.0;
            if (j < a.inner) {
                for (i64 r = r0 + w; r < r1; r += ROW_WARPS) {
                    double dy = ld(a.g, a.gdt, r * a.inner + j);
                    double xhat = (ld(a.x, a.xdt, r * a.inner + j) - ld(a.mean, a.mdt, r)) * ld(a.rstd, a.rdt, r);
                    gw += dy * xhat;
                    gb += dy;
                }
            }
            __syncthreads();
            shw[w][lane] = gw;
            shb[w][lane] = gb;
            __syncthreads();
            if (w == 0 && j < a.inner) {
                double tw = 0.0, tb = 0.0;
                for (int k = 0; k < ROW_WARPS; ++k) {
                    tw += shw[k][lane];
                    tb += shb[k][lane];
                }
                part[y * a.inner + j] = tw;
                part[(a.chunks + y) * a.inner + j] = tb;
            }
        }
    }
}

extern "C" __global__ void layer_norm_bwd_params_finish(const LayerNormBackwardArgs a) {
    const double* part = (const double*)a.part;
    GRID_LOOP(j, a.inner) {
        double tw = 0.0, tb = 0.0;
        for (i64 y = 0; y < a.chunks; ++y) {
            tw += part[y * a.inner + j];
            tb += part[(a.chunks + y) * a.inner + j];
        }
        if (a.gw) st(a.gw, a.gwdt, j, tw);
        if (a.gb) st(a.gb, a.gbdt, j, tb);
    }
}
