// ------------------------------------------------------------------------------------
// Guarded copies.

// The updates of an iteration: up to 128 copies of (dst, src, bytes), skipped when the
// lane's error flag is set, so that an iteration whose kernels reported an error never
// writes the persistent block. Segment blockIdx.y, grid-stride over blockIdx.x.
extern "C" __global__ void guarded_copies(const GuardedCopyArgs a) {
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
// Layout copies: a strided view into another, bit for bit, by element size (the dtype
// does not matter). The lowering (lower/elementwise.rs, `route_copy`) picks one of these
// for a same-dtype copy whose coalesced dims allow it, else `ew`.

// Copies vectors [v0, v1) of `V` (16, 8, 4, 2 or 1 bytes) from s to d, the tpr threads of
// a row starting at `lane`, 4 independent loads in flight before their stores.
template <typename V>
__device__ void copy_run(char* d, const char* s, i64 v0, i64 v1, int lane, int tpr) {
    V* dv = (V*)d;
    const V* sv = (const V*)s;
    i64 v = v0 + lane;
    for (; v + 3 * tpr < v1; v += 4 * tpr) {
        V x0 = sv[v], x1 = sv[v + tpr], x2 = sv[v + 2 * tpr], x3 = sv[v + 3 * tpr];
        dv[v] = x0;
        dv[v + tpr] = x1;
        dv[v + 2 * tpr] = x2;
        dv[v + 3 * tpr] = x3;
    }
    for (; v < v1; v += tpr) dv[v] = sv[v];
}

// A (row, chunk) unit per `tpr` threads; grid-stride over units. The row's offsets are
// computed once per unit, not per element.
extern "C" __global__ void copy_rows(const CopyRowsArgs a) {
    const int tpr = (int)a.tpr;
    const int slot = (int)threadIdx.x / tpr, lane = (int)threadIdx.x % tpr;
    const i64 per_block = BLOCK / tpr;
    const i64 units = a.rows * a.chunks;
    for (i64 u = (i64)blockIdx.x * per_block + slot; u < units; u += (i64)gridDim.x * per_block) {
        i64 row = u / a.chunks, ch = u - row * a.chunks;
        i64 so = 0, dof = 0, r = row;
        for (int d = (int)a.rank - 1; d >= 0; --d) {
            i64 c = r % a.shape[d];
            r /= a.shape[d];
            so += c * a.src_st[d];
            dof += c * a.dst_st[d];
        }
        const char* s = (const char*)a.src + so;
        char* dp = (char*)a.dst + dof;
        i64 v0 = ch * a.chunk, v1 = v0 + a.chunk < a.vpr ? v0 + a.chunk : a.vpr;
        switch (a.vec) {
            case 16: copy_run<uint4>(dp, s, v0, v1, lane, tpr); break;
            case 8: copy_run<u64>(dp, s, v0, v1, lane, tpr); break;
            case 4: copy_run<unsigned>(dp, s, v0, v1, lane, tpr); break;
            case 2: copy_run<unsigned short>(dp, s, v0, v1, lane, tpr); break;
            default: copy_run<unsigned char>(dp, s, v0, v1, lane, tpr); break;
        }
    }
}

#define TILE 32
#define TILE_ROWS 8

// One 32x32 tile of elements T, staged in shared memory as S (T widened to 4 bytes, or
// 8-byte words), rows padded by one S against bank conflicts. Threads are 32 x 8
// (BLOCK = 256): tx runs along i on the read (contiguous in the source) and along j on
// the write (contiguous in the destination).
template <typename T, typename S>
__device__ void transpose_tile(const TransposeArgs& a, const char* s, char* d, i64 i0, i64 j0,
                               S* tile) {
    const int tx = (int)threadIdx.x & (TILE - 1), ty = (int)threadIdx.x / TILE;
    const T* sv = (const T*)s;
    T* dv = (T*)d;
    i64 i = i0 + tx;
    if (i < a.ni) {
#pragma unroll
        for (int k = 0; k < TILE; k += TILE_ROWS) {
            i64 j = j0 + ty + k;
            if (j < a.nj) tile[(ty + k) * (TILE + 1) + tx] = (S)sv[i + j * a.src_j];
        }
    }
    __syncthreads();
    i64 j = j0 + tx;
    if (j < a.nj) {
#pragma unroll
        for (int k = 0; k < TILE; k += TILE_ROWS) {
            i64 ii = i0 + ty + k;
            if (ii < a.ni) dv[ii * a.dst_i + j] = (T)tile[tx * (TILE + 1) + ty + k];
        }
    }
    __syncthreads();
}

// A block per tile, grid-stride over (batch, tile along i, tile along j); the batch's
// offsets are computed once per tile.
extern "C" __global__ void copy_transpose(const TransposeArgs a) {
    __shared__ u64 tile[TILE * (TILE + 1)];
    const i64 ti = (a.ni + TILE - 1) / TILE, tj = (a.nj + TILE - 1) / TILE;
    const i64 tiles = a.batches * ti * tj;
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        i64 b = t / (ti * tj), rest = t - b * (ti * tj);
        i64 i0 = (rest / tj) * TILE, j0 = (rest % tj) * TILE;
        i64 so = 0, dof = 0, r = b;
        for (int d = (int)a.rank - 1; d >= 0; --d) {
            i64 c = r % a.shape[d];
            r /= a.shape[d];
            so += c * a.src_st[d];
            dof += c * a.dst_st[d];
        }
        const char* s = (const char*)a.src + so;
        char* dp = (char*)a.dst + dof;
        switch (a.esize) {
            case 8: transpose_tile<u64, u64>(a, s, dp, i0, j0, tile); break;
            case 4: transpose_tile<unsigned, unsigned>(a, s, dp, i0, j0, (unsigned*)tile); break;
            case 2:
                transpose_tile<unsigned short, unsigned>(a, s, dp, i0, j0, (unsigned*)tile);
                break;
            default:
                transpose_tile<unsigned char, unsigned>(a, s, dp, i0, j0, (unsigned*)tile);
                break;
        }
    }
}

#undef TILE
#undef TILE_ROWS
