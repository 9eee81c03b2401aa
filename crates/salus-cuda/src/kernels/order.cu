// ------------------------------------------------------------------------------------
// Ordering: argmax and argmin, and sort, along the middle dim of [outer, len, inner], a
// block per line. Values compare in double (integers beyond 2^53 may tie); NaN counts as
// larger than every number, and equal elements keep their input order, as on the CPU
// device: the first of several maxima wins and sorts are stable.

// Whether element (w, k) comes before (v, j) in ascending order (`desc` 0) or descending.
__device__ bool sorts_before(double w, i64 k, double v, i64 j, i64 desc) {
    bool wn = isnan(w), vn = isnan(v);
    if (wn || vn) {
        if (wn && vn) return k < j;
        return desc ? wn : vn;
    }
    if (w == v) return k < j;
    return desc ? w > v : w < v;
}

// Whether (w, k) is a better extreme than (v, j): a NaN before every number (max and min
// both propagate it), then the larger (`largest`) or smaller value, then the lower position.
__device__ bool extreme_before(double w, i64 k, double v, i64 j, i64 largest) {
    bool wn = isnan(w), vn = isnan(v);
    if (wn || vn) return wn && vn ? k < j : wn;
    if (w == v) return k < j;
    return largest ? w > v : w < v;
}

// The position of each line's largest (`largest` 1) or smallest element, a NaN first of
// all: the block's threads stride over the line, then halve their candidates in shared
// memory, ties to the lower position.
extern "C" __global__ void arg_extreme(const ArgReduceArgs a) {
    __shared__ double sv[BLOCK];
    __shared__ i64 sj[BLOCK];
    const int tid = threadIdx.x;
    for (i64 line = blockIdx.x; line < a.outer * a.inner; line += gridDim.x) {
        i64 base = (line / a.inner) * a.len * a.inner + line % a.inner;
        double bv = 0.0;
        i64 bj = -1;
        for (i64 j = tid; j < a.len; j += blockDim.x) {
            double v = ld(a.x, a.xdt, base + j * a.inner);
            if (bj < 0 || extreme_before(v, j, bv, bj, a.largest)) {
                bv = v;
                bj = j;
            }
        }
        sv[tid] = bv;
        sj[tid] = bj;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (tid < s && sj[tid + s] >= 0 &&
                (sj[tid] < 0 ||
                 extreme_before(sv[tid + s], sj[tid + s], sv[tid], sj[tid], a.largest))) {
                sv[tid] = sv[tid + s];
                sj[tid] = sj[tid + s];
            }
            __syncthreads();
        }
        if (tid == 0) ((i64*)a.out)[line] = sj[0];
        __syncthreads();
    }
}

// A stable sort of each line by rank: element j goes to the number of elements that sort
// before it, counted against the line in tiles of BLOCK held in shared memory. Quadratic
// in the line's length: meant for the lines training steps sort (experts, patches,
// classes), not for millions of elements. `values` and `indices` are optional (0).
extern "C" __global__ void sort_lines(const SortArgs a) {
    __shared__ double tile[BLOCK];
    const int tid = threadIdx.x;
    for (i64 line = blockIdx.x; line < a.outer * a.inner; line += gridDim.x) {
        i64 base = (line / a.inner) * a.len * a.inner + line % a.inner;
        for (i64 j0 = 0; j0 < a.len; j0 += blockDim.x) {
            i64 j = j0 + tid;
            double v = j < a.len ? ld(a.x, a.dt, base + j * a.inner) : 0.0;
            i64 rank = 0;
            for (i64 k0 = 0; k0 < a.len; k0 += blockDim.x) {
                i64 k = k0 + tid;
                __syncthreads();
                tile[tid] = k < a.len ? ld(a.x, a.dt, base + k * a.inner) : 0.0;
                __syncthreads();
                i64 m = a.len - k0 < (i64)blockDim.x ? a.len - k0 : (i64)blockDim.x;
                if (j < a.len) {
                    for (i64 q = 0; q < m; ++q) rank += sorts_before(tile[q], k0 + q, v, j, a.descending);
                }
            }
            if (j < a.len) {
                i64 at = base + rank * a.inner;
                if (a.values) raw(a.values, at, a.x, base + j * a.inner, a.dt);
                if (a.indices) ((i64*)a.indices)[at] = j;
            }
        }
    }
}
