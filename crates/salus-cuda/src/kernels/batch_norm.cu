// ------------------------------------------------------------------------------------
// Training-mode batch norm over [N, C, inner]: each channel's N * inner elements, image by
// image. Three launches each way:
//   1. bn_*_part: a block per (channel, run of whole images) sums in double into the
//      node's scratch: the forward sums x - K and (x - K)^2 about a shift K (the channel's
//      first element, so the variance does not cancel), the backward dy and dy * (x - mean);
//   2. bn_*_finish: a thread per channel combines its partials in a fixed order, writes
//      the per-channel results and the coefficients of step 3 (double) into scratch;
//   3. bn_*_apply: a pass over the elements, a block per run of (image, channel) rows.
// Scratch: partials [C][splits][2] doubles, then coefficients [C][4] doubles.
// With `vec4` (every tensor walked f32, rows a multiple of 4 long, 16-byte aligned) each
// thread moves four elements per access, so that enough bytes are in flight.

// The calling thread's place in a walk over rows of `inner` elements: `per` rows at a
// time, this thread's row `r0` among them (>= per: idle) and first element `i0`, its
// step along a row `istep`.
#define BN_WALK                                                                         \
    i64 len = a.vec4 ? a.inner / 4 : a.inner;                                           \
    i64 per = len >= BLOCK ? 1 : BLOCK / len;                                           \
    i64 r0 = len >= BLOCK ? 0 : (i64)threadIdx.x / len;                                 \
    i64 i0 = len >= BLOCK ? (i64)threadIdx.x : (i64)threadIdx.x % len;                  \
    i64 istep = len >= BLOCK ? BLOCK : len;

// The four floats at vector `i` of `p`.
__device__ float4 bn_ld4(u64 p, i64 i) { return ((const float4*)p)[i]; }

// Adds v - k and its square to the sums.
__device__ void bn_acc(double v, double k, double* s1, double* s2) {
    double d = v - k;
    *s1 += d;
    *s2 += d * d;
}

// Adds dy and dy * (x - mean) to the sums.
__device__ void bn_acc_bwd(double dy, double x, double mean, double* s1, double* s2) {
    *s1 += dy;
    *s2 += dy * (x - mean);
}

// The sum of `v` over the block, in thread 0 (fixed order).
__device__ double bn_block_sum(double v, double* sh) {
    v = warp_sum_d(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < ROW_WARPS ? sh[threadIdx.x & 31] : 0.0;
    return warp_sum_d(v);
}

// Images [n0, n1) of channel c, block (c, s) of C * splits.
#define BN_PART_RANGE                                                                   \
    i64 c = blk / a.splits, s = blk % a.splits;                                         \
    i64 n0 = s * a.chunk, n1 = n0 + a.chunk < a.batch ? n0 + a.chunk : a.batch;

extern "C" __global__ void bn_fwd_part(const BatchNormArgs a) {
    __shared__ double sh[32];
    BN_WALK
    for (i64 blk = blockIdx.x; blk < a.channels * a.splits; blk += gridDim.x) {
        BN_PART_RANGE
        double k = ld(a.x, a.xdt, c * a.inner);
        double s1 = 0.0, s2 = 0.0;
        if (r0 < per) {
            for (i64 n = n0 + r0; n < n1; n += per) {
                i64 base = (n * a.channels + c) * a.inner;
                if (a.vec4) {
                    for (i64 i = i0; i < len; i += istep) {
                        float4 v = bn_ld4(a.x, base / 4 + i);
                        bn_acc(v.x, k, &s1, &s2);
                        bn_acc(v.y, k, &s1, &s2);
                        bn_acc(v.z, k, &s1, &s2);
                        bn_acc(v.w, k, &s1, &s2);
                    }
                } else {
                    for (i64 i = i0; i < a.inner; i += istep)
                        bn_acc(ld(a.x, a.xdt, base + i), k, &s1, &s2);
                }
            }
        }
        s1 = bn_block_sum(s1, sh);
        s2 = bn_block_sum(s2, sh);
        if (threadIdx.x == 0) {
            double* part = (double*)a.part;
            part[blk * 2] = s1;
            part[blk * 2 + 1] = s2;
        }
    }
}

extern "C" __global__ void bn_fwd_finish(const BatchNormArgs a) {
    GRID_LOOP(c, a.channels) {
        const double* part = (const double*)a.part;
        double s1 = 0.0, s2 = 0.0;
        for (i64 s = 0; s < a.splits; s++) {
            s1 += part[(c * a.splits + s) * 2];
            s2 += part[(c * a.splits + s) * 2 + 1];
        }
        double n = (double)(a.batch * a.inner);
        double dm = s1 / n;
        double mean = ld(a.x, a.xdt, c * a.inner) + dm;
        double var = s2 / n - dm * dm;
        if (var < 0.0) var = 0.0;
        double rstd = 1.0 / sqrt(var + a.eps);
        double scale = a.w ? ld(a.w, a.wdt, c) : 1.0;
        double shift = a.b ? ld(a.b, a.bdt, c) : 0.0;
        double* coef = (double*)a.part + a.channels * a.splits * 2 + c * 4;
        coef[0] = mean;
        coef[1] = rstd * scale;
        coef[2] = shift;
        if (a.mean) st(a.mean, a.mdt, c, mean);
        if (a.rstd) st(a.rstd, a.rdt, c, rstd);
        double m = a.momentum;
        if (a.rmo) st(a.rmo, a.rmodt, c, (1.0 - m) * ld(a.rm, a.rmdt, c) + m * mean);
        if (a.rvo) st(a.rvo, a.rvodt, c, (1.0 - m) * ld(a.rv, a.rvdt, c) + m * var * n / (n - 1.0));
    }
}

// y = (x - mean) * (rstd * weight) + bias, a block per `per` rows (image, channel) at a time.
extern "C" __global__ void bn_fwd_apply(const BatchNormArgs a) {
    BN_WALK
    const double* coefs = (const double*)a.part + a.channels * a.splits * 2;
    i64 rows = a.batch * a.channels;
    if (r0 >= per) return;
    for (i64 r = (i64)blockIdx.x * per + r0; r < rows; r += (i64)gridDim.x * per) {
        const double* coef = coefs + (r % a.channels) * 4;
        double mean = coef[0], scale = coef[1], shift = coef[2];
        i64 base = r * a.inner;
        if (a.vec4) {
            for (i64 i = i0; i < len; i += istep) {
                float4 v = bn_ld4(a.x, base / 4 + i), o;
                o.x = (float)((v.x - mean) * scale + shift);
                o.y = (float)((v.y - mean) * scale + shift);
                o.z = (float)((v.z - mean) * scale + shift);
                o.w = (float)((v.w - mean) * scale + shift);
                ((float4*)a.y)[base / 4 + i] = o;
            }
        } else {
            for (i64 i = i0; i < a.inner; i += istep)
                st(a.y, a.ydt, base + i, (ld(a.x, a.xdt, base + i) - mean) * scale + shift);
        }
    }
}

extern "C" __global__ void bn_bwd_part(const BatchNormArgs a) {
    __shared__ double sh[32];
    BN_WALK
    for (i64 blk = blockIdx.x; blk < a.channels * a.splits; blk += gridDim.x) {
        BN_PART_RANGE
        double mean = ld(a.mean, a.mdt, c);
        double s1 = 0.0, s2 = 0.0;
        if (r0 < per) {
            for (i64 n = n0 + r0; n < n1; n += per) {
                i64 base = (n * a.channels + c) * a.inner;
                if (a.vec4) {
                    for (i64 i = i0; i < len; i += istep) {
                        float4 dy = bn_ld4(a.g, base / 4 + i), x = bn_ld4(a.x, base / 4 + i);
                        bn_acc_bwd(dy.x, x.x, mean, &s1, &s2);
                        bn_acc_bwd(dy.y, x.y, mean, &s1, &s2);
                        bn_acc_bwd(dy.z, x.z, mean, &s1, &s2);
                        bn_acc_bwd(dy.w, x.w, mean, &s1, &s2);
                    }
                } else {
                    for (i64 i = i0; i < a.inner; i += istep)
                        bn_acc_bwd(ld(a.g, a.gdt, base + i), ld(a.x, a.xdt, base + i), mean,
                                   &s1, &s2);
                }
            }
        }
        s1 = bn_block_sum(s1, sh);
        s2 = bn_block_sum(s2, sh);
        if (threadIdx.x == 0) {
            double* part = (double*)a.part;
            part[blk * 2] = s1;
            part[blk * 2 + 1] = s2;
        }
    }
}

extern "C" __global__ void bn_bwd_finish(const BatchNormArgs a) {
    GRID_LOOP(c, a.channels) {
        const double* part = (const double*)a.part;
        double sum_dy = 0.0, dot = 0.0;
        for (i64 s = 0; s < a.splits; s++) {
            sum_dy += part[(c * a.splits + s) * 2];
            dot += part[(c * a.splits + s) * 2 + 1];
        }
        double n = (double)(a.batch * a.inner);
        double rstd = ld(a.rstd, a.rdt, c);
        double scale = a.w ? ld(a.w, a.wdt, c) : 1.0;
        double* coef = (double*)a.part + a.channels * a.splits * 2 + c * 4;
        coef[0] = ld(a.mean, a.mdt, c);
        coef[1] = rstd * rstd * dot / n;
        coef[2] = sum_dy / n;
        coef[3] = rstd * scale;
        if (a.gw) st(a.gw, a.gwdt, c, dot * rstd);
        if (a.gb) st(a.gb, a.gbdt, c, sum_dy);
    }
}

// grad_input = (dy - sum_dy / n - (x - mean) * rstd^2 * dot / n) * rstd * weight.
extern "C" __global__ void bn_bwd_apply(const BatchNormArgs a) {
    BN_WALK
    const double* coefs = (const double*)a.part + a.channels * a.splits * 2;
    i64 rows = a.batch * a.channels;
    if (r0 >= per) return;
    for (i64 r = (i64)blockIdx.x * per + r0; r < rows; r += (i64)gridDim.x * per) {
        const double* coef = coefs + (r % a.channels) * 4;
        double mean = coef[0], k = coef[1], mdy = coef[2], scale = coef[3];
        i64 base = r * a.inner;
        if (a.vec4) {
            for (i64 i = i0; i < len; i += istep) {
                float4 dy = bn_ld4(a.g, base / 4 + i), x = bn_ld4(a.x, base / 4 + i), o;
                o.x = (float)((dy.x - mdy - (x.x - mean) * k) * scale);
                o.y = (float)((dy.y - mdy - (x.y - mean) * k) * scale);
                o.z = (float)((dy.z - mdy - (x.z - mean) * k) * scale);
                o.w = (float)((dy.w - mdy - (x.w - mean) * k) * scale);
                ((float4*)a.y)[base / 4 + i] = o;
            }
        } else {
            for (i64 i = i0; i < a.inner; i += istep) {
                double dy = ld(a.g, a.gdt, base + i), x = ld(a.x, a.xdt, base + i);
                st(a.y, a.ydt, base + i, (dy - mdy - (x - mean) * k) * scale);
            }
        }
    }
}
