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

