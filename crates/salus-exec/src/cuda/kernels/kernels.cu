// salus CUDA kernels, compiled at run time with NVRTC for the device's architecture.
//
// Every kernel takes one struct by value whose fields are all 8 bytes wide (i64, u64 or
// double), so that the host builds the argument block as a list of 64-bit words in field
// order (crates/salus-exec/src/cuda/ops.rs mirrors each struct). Values are computed in
// double, as the CPU device computes them, and rounded once to the output's dtype.
// Index-taking kernels check every index and report the first bad one in the lane's error
// block instead of touching memory out of range.

typedef long long i64;
typedef unsigned long long u64;

#define MAXR 8
#define NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2
#define DT_I64 3
#define DT_I32 4
#define DT_BOOL 5

// ------------------------------------------------------------------------------------
// Loads and stores of every dtype, through double.

__device__ float h2f(unsigned short h) {
    unsigned sign = ((unsigned)h & 0x8000u) << 16;
    unsigned e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}

__device__ unsigned short f2h(float f) {
    unsigned x = __float_as_uint(f);
    unsigned sign = (x >> 16) & 0x8000u;
    unsigned ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);
    if (ax < 0x38800000u) {
        unsigned m = __float2uint_rn(__uint_as_float(ax) * 16777216.0f);
        return (unsigned short)(sign | m);
    }
    unsigned h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
    unsigned rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (unsigned short)(sign | h);
}

__device__ float bf2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }

__device__ unsigned short f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

__device__ double ld(u64 p, i64 dt, i64 i) {
    switch (dt) {
        case DT_F32: return (double)((const float*)p)[i];
        case DT_F16: return (double)h2f(((const unsigned short*)p)[i]);
        case DT_BF16: return (double)bf2f(((const unsigned short*)p)[i]);
        case DT_I64: return (double)((const i64*)p)[i];
        case DT_I32: return (double)((const int*)p)[i];
        default: return ((const unsigned char*)p)[i] != 0 ? 1.0 : 0.0;
    }
}

__device__ void st(u64 p, i64 dt, i64 i, double v) {
    switch (dt) {
        case DT_F32: ((float*)p)[i] = (float)v; break;
        case DT_F16: ((unsigned short*)p)[i] = f2h((float)v); break;
        case DT_BF16: ((unsigned short*)p)[i] = f2bf((float)v); break;
        case DT_I64: ((i64*)p)[i] = (i64)v; break;
        case DT_I32: ((int*)p)[i] = (int)v; break;
        default: ((unsigned char*)p)[i] = (v != 0.0) ? 1 : 0; break;
    }
}

__device__ int dsize(i64 dt) {
    switch (dt) {
        case DT_F32: case DT_I32: return 4;
        case DT_F16: case DT_BF16: return 2;
        case DT_I64: return 8;
        default: return 1;
    }
}

// Copies element `si` of `src` to element `di` of `dst`, both of dtype `dt`, bit for bit.
__device__ void raw(u64 dst, i64 di, u64 src, i64 si, i64 dt) {
    switch (dsize(dt)) {
        case 8: ((u64*)dst)[di] = ((const u64*)src)[si]; break;
        case 4: ((unsigned*)dst)[di] = ((const unsigned*)src)[si]; break;
        case 2: ((unsigned short*)dst)[di] = ((const unsigned short*)src)[si]; break;
        default: ((unsigned char*)dst)[di] = ((const unsigned char*)src)[si]; break;
    }
}

__device__ void atomic_addv(u64 p, i64 dt, i64 i, double v) {
    switch (dt) {
        case DT_F32: atomicAdd(((float*)p) + i, (float)v); break;
        case DT_I64: atomicAdd((u64*)(((i64*)p) + i), (u64)(i64)v); break;
        case DT_I32: atomicAdd(((int*)p) + i, (int)v); break;
        case DT_F16:
        case DT_BF16: {
            u64 a = (u64)(((unsigned short*)p) + i);
            unsigned* w = (unsigned*)(a & ~3ull);
            int shift = (a & 2ull) ? 16 : 0;
            unsigned old = *w, assumed;
            do {
                assumed = old;
                unsigned short cur = (unsigned short)((assumed >> shift) & 0xffffu);
                float f = (dt == DT_F16 ? h2f(cur) : bf2f(cur)) + (float)v;
                unsigned short nw = dt == DT_F16 ? f2h(f) : f2bf(f);
                unsigned nv = (assumed & ~(0xffffu << shift)) | ((unsigned)nw << shift);
                old = atomicCAS(w, assumed, nv);
            } while (assumed != old);
            break;
        }
        default:
            if (v != 0.0) ((unsigned char*)p)[i] = 1;
            break;
    }
}

// The error block of a lane: [flag, node, code, value, bound]. The first error wins.
__device__ void report(u64 err, i64 node, i64 code, i64 value, i64 bound) {
    u64* e = (u64*)err;
    if (atomicCAS(e, 0ull, 1ull) == 0ull) {
        e[1] = (u64)node;
        e[2] = (u64)code;
        e[3] = (u64)value;
        e[4] = (u64)bound;
        __threadfence();
    }
}

// Reads index `i` of an integer tensor and wraps a negative one; -1 with a report when it
// is out of `[-size, size)`.
__device__ i64 index_at(u64 p, i64 dt, i64 i, i64 size, u64 err, i64 node, i64 code) {
    i64 v = dt == DT_I64 ? ((const i64*)p)[i] : (i64)((const int*)p)[i];
    i64 w = v < 0 ? v + size : v;
    if (w < 0 || w >= size) {
        report(err, node, code, v, size);
        return -1;
    }
    return w;
}

#define GRID_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// ------------------------------------------------------------------------------------
// Elementwise ops and strided copies.

struct Ten {
    u64 ptr;
    i64 dt;
    i64 st[MAXR];
};

struct EwArgs {
    i64 n, rank, op, nin, contig;
    double s0, s1, s2;
    i64 shape[MAXR];
    Ten out;
    Ten in[3];
};

#define OP_COPY 0
#define OP_ADD 1
#define OP_MUL 2
#define OP_DIV 3
#define OP_ADDS 4
#define OP_MULS 5
#define OP_DIVS 6
#define OP_NEG 7
#define OP_ABS 8
#define OP_SIGN 9
#define OP_EXP 10
#define OP_LOG 11
#define OP_SQRT 12
#define OP_RSQRT 13
#define OP_SIGMOID 14
#define OP_TANH 15
#define OP_RELU 16
#define OP_LEAKY 17
#define OP_GELU_TANH 18
#define OP_GELU 19
#define OP_ERF 20
#define OP_POW_TS 21
#define OP_POW_S 22
#define OP_CLAMP 23
#define OP_EQ 24
#define OP_NE 25
#define OP_LT 26
#define OP_LE 27
#define OP_GT 28
#define OP_GE 29
#define OP_LAND 30
#define OP_LNOT 31
#define OP_BNOT 32
#define OP_BAND 33
#define OP_WHERE 34
#define OP_FILL 35
#define OP_ARANGE 36
#define OP_RECIPROCAL 37

__device__ double apply(i64 op, double a, double b, double c, double s0, double s1, i64 i) {
    switch (op) {
        case OP_COPY: return a;
        case OP_ADD: return a + s0 * b;
        case OP_MUL: return a * b;
        case OP_DIV: return a / b;
        case OP_ADDS: return a + s0;
        case OP_MULS: return a * s0;
        case OP_DIVS: return a / s0;
        case OP_NEG: return -a;
        case OP_ABS: return fabs(a);
        case OP_SIGN: return isnan(a) ? a : (a > 0.0 ? 1.0 : (a < 0.0 ? -1.0 : 0.0));
        case OP_EXP: return exp(a);
        case OP_LOG: return log(a);
        case OP_SQRT: return sqrt(a);
        case OP_RSQRT: return 1.0 / sqrt(a);
        case OP_SIGMOID: return 1.0 / (1.0 + exp(-a));
        case OP_TANH: return tanh(a);
        case OP_RELU: return isnan(a) ? a : fmax(a, 0.0);
        case OP_LEAKY: return a > 0.0 ? a : s0 * a;
        case OP_GELU_TANH:
            return 0.5 * a * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) * (a + 0.044715 * a * a * a)));
        case OP_GELU: return 0.5 * a * (1.0 + erf(a / 1.41421356237309504880));
        case OP_ERF: return erf(a);
        case OP_POW_TS: return pow(a, s0);
        case OP_POW_S: return pow(s0, a);
        case OP_CLAMP: return isnan(a) ? a : fmin(fmax(a, s0), s1);
        case OP_EQ: return a == s0 ? 1.0 : 0.0;
        case OP_NE: return a != s0 ? 1.0 : 0.0;
        case OP_LT: return a < s0 ? 1.0 : 0.0;
        case OP_LE: return a <= s0 ? 1.0 : 0.0;
        case OP_GT: return a > s0 ? 1.0 : 0.0;
        case OP_GE: return a >= s0 ? 1.0 : 0.0;
        case OP_LAND: return (a != 0.0 && b != 0.0) ? 1.0 : 0.0;
        case OP_LNOT: return a == 0.0 ? 1.0 : 0.0;
        case OP_BNOT: return (double)(~(i64)a);
        case OP_BAND: return (double)(((i64)a) & ((i64)b));
        case OP_WHERE: return a != 0.0 ? b : c;
        case OP_FILL: return s0;
        case OP_ARANGE: return s0 + s1 * (double)i;
        case OP_RECIPROCAL: return 1.0 / a;
        default: return 0.0;
    }
}

extern "C" __global__ void ew(const EwArgs a) {
    GRID_LOOP(i, a.n) {
        i64 o = i, x0 = i, x1 = i, x2 = i;
        if (!a.contig) {
            o = x0 = x1 = x2 = 0;
            i64 r = i;
            for (int d = (int)a.rank - 1; d >= 0; --d) {
                i64 c = r % a.shape[d];
                r /= a.shape[d];
                o += c * a.out.st[d];
                x0 += c * a.in[0].st[d];
                x1 += c * a.in[1].st[d];
                x2 += c * a.in[2].st[d];
            }
        }
        if (a.op == OP_COPY && a.in[0].dt == a.out.dt) {
            raw(a.out.ptr, o, a.in[0].ptr, x0, a.out.dt);
            continue;
        }
        double v0 = a.nin > 0 ? ld(a.in[0].ptr, a.in[0].dt, x0) : 0.0;
        double v1 = a.nin > 1 ? ld(a.in[1].ptr, a.in[1].dt, x1) : 0.0;
        double v2 = a.nin > 2 ? ld(a.in[2].ptr, a.in[2].dt, x2) : 0.0;
        st(a.out.ptr, a.out.dt, o, apply(a.op, v0, v1, v2, a.s0, a.s1, i));
    }
}

// The updates of an iteration: up to 128 copies of (dst, src, bytes), skipped when the
// lane's error flag is set, so that an iteration whose kernels reported an error never
// writes the persistent block. Segment blockIdx.y, grid-stride over blockIdx.x.
struct UpdArgs {
    u64 err, count;
    u64 seg[384];
};

extern "C" __global__ void guarded_copies(const UpdArgs a) {
    if (*(volatile u64*)a.err != 0ull) return;
    for (u64 s = blockIdx.y; s < a.count; s += gridDim.y) {
        u64 dst = a.seg[3 * s], src = a.seg[3 * s + 1], bytes = a.seg[3 * s + 2];
        i64 words = (i64)(bytes / 4);
        GRID_LOOP(i, words) { ((unsigned*)dst)[i] = ((const unsigned*)src)[i]; }
        GRID_LOOP(j, (i64)(bytes % 4)) {
            ((unsigned char*)dst)[words * 4 + j] = ((const unsigned char*)src)[words * 4 + j];
        }
    }
}

// ------------------------------------------------------------------------------------
// Block reductions in double.

#define BLOCK 256

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

struct RedArgs {
    i64 nout, count, op, krank, rrank;
    double correction;
    i64 kshape[MAXR];
    i64 kst[MAXR];
    i64 rshape[MAXR];
    i64 rst[MAXR];
    u64 in;
    i64 in_dt;
    u64 out;
    i64 out_dt;
};

#define RED_SUM 0
#define RED_MEAN 1
#define RED_AMAX 2
#define RED_ANY 3
#define RED_VAR 4

__device__ i64 kept_base(const RedArgs& a, i64 oi) {
    i64 base = 0, r = oi;
    for (int d = (int)a.krank - 1; d >= 0; --d) {
        i64 c = r % a.kshape[d];
        r /= a.kshape[d];
        base += c * a.kst[d];
    }
    return base;
}

__device__ i64 reduced_at(const RedArgs& a, i64 j) {
    i64 off = 0, r = j;
    for (int d = (int)a.rrank - 1; d >= 0; --d) {
        i64 c = r % a.rshape[d];
        r /= a.rshape[d];
        off += c * a.rst[d];
    }
    return off;
}

__device__ double red_finish(const RedArgs& a, double acc, double sq) {
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
extern "C" __global__ void red_thread(const RedArgs a) {
    GRID_LOOP(oi, a.nout) {
        i64 base = kept_base(a, oi);
        double acc = a.op == RED_AMAX ? NEG_INF : 0.0;
        for (i64 j = 0; j < a.count; ++j) {
            double v = ld(a.in, a.in_dt, base + reduced_at(a, j));
            if (a.op == RED_AMAX) acc = nan_max(acc, v);
            else if (a.op == RED_ANY) acc = (acc != 0.0 || v != 0.0) ? 1.0 : 0.0;
            else acc += v;
        }
        double sq = 0.0;
        if (a.op == RED_VAR) {
            double mean = acc / (double)a.count;
            for (i64 j = 0; j < a.count; ++j) {
                double d = ld(a.in, a.in_dt, base + reduced_at(a, j)) - mean;
                sq += d * d;
            }
        }
        st(a.out, a.out_dt, oi, red_finish(a, acc, sq));
    }
}

// One block per output: for long reductions.
extern "C" __global__ void red_block(const RedArgs a) {
    __shared__ double sh[BLOCK];
    for (i64 oi = blockIdx.x; oi < a.nout; oi += gridDim.x) {
        i64 base = kept_base(a, oi);
        double acc = a.op == RED_AMAX ? NEG_INF : 0.0;
        for (i64 j = threadIdx.x; j < a.count; j += blockDim.x) {
            double v = ld(a.in, a.in_dt, base + reduced_at(a, j));
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
                double d = ld(a.in, a.in_dt, base + reduced_at(a, j)) - mean;
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

struct SmArgs {
    i64 rows, len, inner, log;
    u64 x;
    i64 xdt;
    u64 y;
    i64 ydt;
    u64 g;
    i64 gdt;
};

extern "C" __global__ void softmax_fwd(const SmArgs a) {
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
extern "C" __global__ void softmax_bwd(const SmArgs a) {
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
// Layer norm over contiguous rows of `inner` elements.

struct LnArgs {
    i64 rows, inner;
    double eps;
    u64 x;
    i64 xdt;
    u64 w;
    i64 wdt;
    u64 b;
    i64 bdt;
    u64 y;
    i64 ydt;
    u64 mean;
    i64 mdt;
    u64 rstd;
    i64 rdt;
};

extern "C" __global__ void layer_norm_fwd(const LnArgs a) {
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

struct LnbArgs {
    i64 rows, inner;
    u64 g;
    i64 gdt;
    u64 x;
    i64 xdt;
    u64 mean;
    i64 mdt;
    u64 rstd;
    i64 rdt;
    u64 w;
    i64 wdt;
    u64 gi;
    i64 gidt;
    u64 gw;
    i64 gwdt;
    u64 gb;
    i64 gbdt;
};

extern "C" __global__ void layer_norm_bwd_input(const LnbArgs a) {
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

extern "C" __global__ void layer_norm_bwd_params(const LnbArgs a) {
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

// ------------------------------------------------------------------------------------
// Matrix products of any dtype (the cuBLAS path takes f32, f16 and bf16).
// c[b, i, j] = beta * bias[i * s0 + j * s1] + alpha * sum_p a[b, i, p] * b[b, p, j].

struct MmArgs {
    i64 batch, n, k, m;
    double alpha, beta;
    u64 a;
    i64 adt;
    u64 b;
    i64 bdt;
    u64 c;
    i64 cdt;
    u64 bias;
    i64 biasdt, bias_s0, bias_s1;
};

extern "C" __global__ void matmul_naive(const MmArgs a) {
    GRID_LOOP(t, a.batch * a.n * a.m) {
        i64 j = t % a.m, i = (t / a.m) % a.n, bi = t / (a.m * a.n);
        double acc = 0.0;
        for (i64 p = 0; p < a.k; ++p)
            acc += ld(a.a, a.adt, (bi * a.n + i) * a.k + p) * ld(a.b, a.bdt, (bi * a.k + p) * a.m + j);
        double v = a.bias ? a.beta * ld(a.bias, a.biasdt, i * a.bias_s0 + j * a.bias_s1) + a.alpha * acc : a.alpha * acc;
        st(a.c, a.cdt, t, v);
    }
}

// ------------------------------------------------------------------------------------
// Convolutions of 1 to 3 spatial dims (padded to 3 with size-1 dims), transposed or not,
// as direct sums. Not transposed: the input is "large", the output "small"; transposed:
// the reverse. Small position a and tap k meet large position a * stride - pad + k * dil.

struct ConvArgs {
    i64 n, groups, cin_g, cout_g, transposed;
    i64 in3[3];
    i64 out3[3];
    i64 k3[3];
    i64 stride[3];
    i64 pad[3];
    i64 dil[3];
    u64 x;
    i64 xdt;
    u64 w;
    i64 wdt;
    u64 bias;
    i64 bdt;
    u64 y;
    i64 ydt;
    u64 g;
    i64 gdt;
};

__device__ void unravel3(i64 p, const i64* s, i64* c) {
    c[2] = p % s[2];
    c[1] = (p / s[2]) % s[1];
    c[0] = p / (s[1] * s[2]);
}

__device__ i64 plane3(const i64* s) { return s[0] * s[1] * s[2]; }

// Large position of small position sc and tap kc, or -1 outside.
__device__ i64 large_of(const ConvArgs& a, const i64* sc, const i64* kc, const i64* large) {
    i64 at = 0;
    for (int d = 0; d < 3; ++d) {
        i64 b = sc[d] * a.stride[d] - a.pad[d] + kc[d] * a.dil[d];
        if (b < 0 || b >= large[d]) return -1;
        at = at * large[d] + b;
    }
    return at;
}

// Small position whose tap kc meets large position lc, or -1 when none does.
__device__ i64 small_of(const ConvArgs& a, const i64* lc, const i64* kc, const i64* small) {
    i64 at = 0;
    for (int d = 0; d < 3; ++d) {
        i64 t = lc[d] + a.pad[d] - kc[d] * a.dil[d];
        if (t < 0 || t % a.stride[d] != 0) return -1;
        t /= a.stride[d];
        if (t >= small[d]) return -1;
        at = at * small[d] + t;
    }
    return at;
}

// Weight index of (input channel c, output channel o) at tap k.
__device__ i64 w_at(const ConvArgs& a, i64 c, i64 o, i64 k) {
    i64 kp = plane3(a.k3);
    if (a.transposed) return (c * a.cout_g + (o % a.cout_g)) * kp + k;
    return (o * a.cin_g + (c % a.cin_g)) * kp + k;
}

extern "C" __global__ void conv_fwd(const ConvArgs a) {
    i64 c_in = a.cin_g * a.groups, c_out = a.cout_g * a.groups;
    i64 ip = plane3(a.in3), op = plane3(a.out3), kp = plane3(a.k3);
    GRID_LOOP(t, a.n * c_out * op) {
        i64 pos = t % op, o = (t / op) % c_out, n = t / (op * c_out), g = o / a.cout_g;
        i64 pc[3], kc[3];
        unravel3(pos, a.out3, pc);
        double acc = 0.0;
        for (i64 ci = 0; ci < a.cin_g; ++ci) {
            i64 c = g * a.cin_g + ci;
            for (i64 k = 0; k < kp; ++k) {
                unravel3(k, a.k3, kc);
                i64 xi = a.transposed ? small_of(a, pc, kc, a.in3) : large_of(a, pc, kc, a.in3);
                if (xi < 0) continue;
                acc += ld(a.x, a.xdt, (n * c_in + c) * ip + xi) * ld(a.w, a.wdt, w_at(a, c, o, k));
            }
        }
        if (a.bias) acc += ld(a.bias, a.bdt, o);
        st(a.y, a.ydt, t, acc);
    }
}

// grad_input into x from grad_output g.
extern "C" __global__ void conv_bwd_input(const ConvArgs a) {
    i64 c_in = a.cin_g * a.groups, c_out = a.cout_g * a.groups;
    i64 ip = plane3(a.in3), op = plane3(a.out3), kp = plane3(a.k3);
    GRID_LOOP(t, a.n * c_in * ip) {
        i64 pos = t % ip, c = (t / ip) % c_in, n = t / (ip * c_in), g = c / a.cin_g;
        i64 pc[3], kc[3];
        unravel3(pos, a.in3, pc);
        double acc = 0.0;
        for (i64 co = 0; co < a.cout_g; ++co) {
            i64 o = g * a.cout_g + co;
            for (i64 k = 0; k < kp; ++k) {
                unravel3(k, a.k3, kc);
                i64 yi = a.transposed ? large_of(a, pc, kc, a.out3) : small_of(a, pc, kc, a.out3);
                if (yi < 0) continue;
                acc += ld(a.g, a.gdt, (n * c_out + o) * op + yi) * ld(a.w, a.wdt, w_at(a, c, o, k));
            }
        }
        st(a.x, a.xdt, t, acc);
    }
}

// grad_weight into w from grad_output g and input x.
extern "C" __global__ void conv_bwd_weight(const ConvArgs a) {
    i64 c_in = a.cin_g * a.groups, c_out = a.cout_g * a.groups;
    i64 ip = plane3(a.in3), op = plane3(a.out3), kp = plane3(a.k3);
    i64 wn = a.transposed ? c_in * a.cout_g * kp : c_out * a.cin_g * kp;
    const i64* small = a.transposed ? a.in3 : a.out3;
    const i64* large = a.transposed ? a.out3 : a.in3;
    GRID_LOOP(t, wn) {
        i64 k = t % kp, c, o;
        if (a.transposed) {
            c = t / (a.cout_g * kp);
            o = (c / a.cin_g) * a.cout_g + (t / kp) % a.cout_g;
        } else {
            o = t / (a.cin_g * kp);
            c = (o / a.cout_g) * a.cin_g + (t / kp) % a.cin_g;
        }
        i64 kc[3], sc[3];
        unravel3(k, a.k3, kc);
        double acc = 0.0;
        for (i64 n = 0; n < a.n; ++n) {
            for (i64 s = 0; s < plane3(small); ++s) {
                unravel3(s, small, sc);
                i64 l = large_of(a, sc, kc, large);
                if (l < 0) continue;
                i64 xi = a.transposed ? s : l, yi = a.transposed ? l : s;
                acc += ld(a.g, a.gdt, (n * c_out + o) * op + yi) * ld(a.x, a.xdt, (n * c_in + c) * ip + xi);
            }
        }
        st(a.w, a.wdt, t, acc);
    }
}

// Unfolds images [n0, n0 + count) of group g of a 2-d input into col[count][K][L] (f32),
// K = cin_g * kh * kw, L = oh * ow.
struct Im2colArgs {
    i64 n0, count, g, c_in, cin_g, h, w, kh, kw, oh, ow, sh, sw, ph, pw, dh, dw;
    u64 x;
    u64 col;
};

extern "C" __global__ void im2col(const Im2colArgs a) {
    i64 K = a.cin_g * a.kh * a.kw, L = a.oh * a.ow;
    GRID_LOOP(t, a.count * K * L) {
        i64 l = t % L, kk = (t / L) % K, img = t / (K * L);
        i64 kx = kk % a.kw, ky = (kk / a.kw) % a.kh, ci = kk / (a.kw * a.kh);
        i64 ox = l % a.ow, oy = l / a.ow;
        i64 iy = oy * a.sh - a.ph + ky * a.dh, ix = ox * a.sw - a.pw + kx * a.dw;
        float v = 0.0f;
        if (iy >= 0 && iy < a.h && ix >= 0 && ix < a.w)
            v = ((const float*)a.x)[(((a.n0 + img) * a.c_in + a.g * a.cin_g + ci) * a.h + iy) * a.w + ix];
        ((float*)a.col)[t] = v;
    }
}

// Folds col[count][K][L] back into grad_input (f32), adding: the gather form, one thread per
// input element, so no atomics are needed.
extern "C" __global__ void col2im(const Im2colArgs a) {
    i64 K = a.cin_g * a.kh * a.kw, L = a.oh * a.ow;
    i64 plane = a.h * a.w;
    GRID_LOOP(t, a.count * a.cin_g * plane) {
        i64 ix = t % a.w, iy = (t / a.w) % a.h, ci = (t / plane) % a.cin_g, img = t / (plane * a.cin_g);
        float acc = 0.0f;
        for (i64 ky = 0; ky < a.kh; ++ky) {
            i64 ty = iy + a.ph - ky * a.dh;
            if (ty < 0 || ty % a.sh != 0 || ty / a.sh >= a.oh) continue;
            for (i64 kx = 0; kx < a.kw; ++kx) {
                i64 tx = ix + a.pw - kx * a.dw;
                if (tx < 0 || tx % a.sw != 0 || tx / a.sw >= a.ow) continue;
                i64 kk = (ci * a.kh + ky) * a.kw + kx, l = (ty / a.sh) * a.ow + tx / a.sw;
                acc += ((const float*)a.col)[(img * K + kk) * L + l];
            }
        }
        ((float*)a.x)[(((a.n0 + img) * a.c_in + a.g * a.cin_g + ci) * a.h + iy) * a.w + ix] = acc;
    }
}

// ------------------------------------------------------------------------------------
// Pooling over the last two dims of [planes, h, w].

struct PoolArgs {
    i64 planes, h, w, oh, ow;
    i64 k[2];
    i64 s[2];
    i64 p[2];
    i64 d[2];
    i64 count_include_pad, divisor;
    u64 x;
    i64 xdt;
    u64 y;
    i64 ydt;
    u64 idx;
    i64 idt;
    u64 g;
    i64 gdt;
    u64 err;
    i64 node;
};

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
        i64 at = index_at(a.idx, a.idt, t, a.h * a.w, a.err, a.node, 3);
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

// bernoulli.p: the CPU kernel's counter-based stream (kernels/random.rs), bit for bit.
// The generator state is read on the device, so a captured graph draws anew each replay.
struct BernoulliArgs {
    i64 n, dt;
    u64 out;
    u64 state;
    u64 key;
    double p;
};

__device__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

extern "C" __global__ void bernoulli(const BernoulliArgs a) {
    u64 key = mix64((u64)(*(const i64*)a.state) ^ a.key);
    GRID_LOOP(i, a.n) {
        u64 bits = mix64(key + (u64)i * 0x9e3779b97f4a7c15ull);
        float u = (float)(bits >> 40) / 16777216.0f;
        st(a.out, a.dt, i, ((double)u < a.p) ? 1.0 : 0.0);
    }
}
