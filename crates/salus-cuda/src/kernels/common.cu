// salus CUDA kernels, compiled at run time with NVRTC for the device's architecture.
//
// The kernels are one NVRTC program: a prelude generated from the Rust description of the
// interface (crates/salus-cuda/src/abi.rs: the integer types i64 and u64, MAXR, BLOCK,
// the dtype, op, mode and error codes, and every kernel's argument struct), then the op
// families' files in the order `abi::KERNEL_FILES` gives: common.cu (this file: dtype
// loads and stores, the error block), elementwise.cu, copy.cu, reduce.cu (block
// reductions, reductions, softmax), rows.cu, batch_norm.cu, attention.cu, matmul.cu,
// conv.cu, pool.cu, index.cu, order.cu, random.cu. A file may use what an earlier one
// defines; none defines a name the prelude does.
//
// Every kernel takes one argument struct by value, all of whose fields are 8 bytes wide
// (i64, u64 or double, arrays of them, or a nested struct), so C and Rust's #[repr(C)]
// lay it out alike and the host passes the Rust struct itself. Values are computed in
// double, as the CPU device computes them, and rounded once to the output's dtype.
// Index-taking kernels check every index and report the first bad one in the lane's error
// block instead of touching memory out of range.

#define NEG_INF (-__longlong_as_double(0x7ff0000000000000LL))
#define QUIET_NAN (__longlong_as_double(0x7ff8000000000000LL))

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

// A place's value `a` combined with `v` by an `along_dim` mode: the sum, the product, or
// the larger or smaller (NaN wins, as in PyTorch's kernels).
__device__ double along_combine(double a, double v, i64 mode) {
    if (mode == ALONG_SCATTER_ADD) return a + v;
    if (mode == ALONG_SCATTER_PROD) return a * v;
    if (a != a || v != v) return a != a ? a : v;
    return mode == ALONG_SCATTER_AMAX ? (v > a ? v : a) : (v < a ? v : a);
}

// p[i] = along_combine(p[i], v, mode) atomically, by compare-and-swap on the element (a
// 16-bit one through the 32-bit word holding it). Bools: a sum or a larger value sets 1,
// a product or a smaller value clears to 0; either write is idempotent.
__device__ void atomic_combine(u64 p, i64 dt, i64 i, double v, i64 mode) {
    switch (dt) {
        case DT_F32:
        case DT_I32: {
            unsigned* w = ((unsigned*)p) + i;
            unsigned old = *w, assumed;
            do {
                assumed = old;
                double cur = dt == DT_F32 ? (double)__uint_as_float(assumed) : (double)(int)assumed;
                double nv = along_combine(cur, v, mode);
                old = atomicCAS(w, assumed,
                                dt == DT_F32 ? __float_as_uint((float)nv) : (unsigned)(int)nv);
            } while (assumed != old);
            break;
        }
        case DT_I64: {
            unsigned long long* w = ((unsigned long long*)p) + i;
            unsigned long long old = *w, assumed;
            do {
                assumed = old;
                double nv = along_combine((double)(i64)assumed, v, mode);
                old = atomicCAS(w, assumed, (unsigned long long)(i64)nv);
            } while (assumed != old);
            break;
        }
        case DT_F16:
        case DT_BF16: {
            u64 a = (u64)(((unsigned short*)p) + i);
            unsigned* w = (unsigned*)(a & ~3ull);
            int shift = (a & 2ull) ? 16 : 0;
            unsigned old = *w, assumed;
            do {
                assumed = old;
                unsigned short cur = (unsigned short)((assumed >> shift) & 0xffffu);
                float f = (float)along_combine(dt == DT_F16 ? h2f(cur) : bf2f(cur), v, mode);
                unsigned short nw = dt == DT_F16 ? f2h(f) : f2bf(f);
                unsigned nv = (assumed & ~(0xffffu << shift)) | ((unsigned)nw << shift);
                old = atomicCAS(w, assumed, nv);
            } while (assumed != old);
            break;
        }
        default: {
            bool sets = mode == ALONG_SCATTER_ADD || mode == ALONG_SCATTER_AMAX;
            if (sets ? v != 0.0 : v == 0.0) ((unsigned char*)p)[i] = sets ? 1 : 0;
            break;
        }
    }
}

// p[i] += v atomically: the hardware's add where there is one.
__device__ void atomic_addv(u64 p, i64 dt, i64 i, double v) {
    switch (dt) {
        case DT_F32: atomicAdd(((float*)p) + i, (float)v); break;
        case DT_I64: atomicAdd((u64*)(((i64*)p) + i), (u64)(i64)v); break;
        case DT_I32: atomicAdd(((int*)p) + i, (int)v); break;
        default: atomic_combine(p, dt, i, v, ALONG_SCATTER_ADD); break;
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


// SplitMix64's finalizer, the random streams' mix (random.cu, attention.cu's dropout).
__device__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
