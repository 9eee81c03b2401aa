// ------------------------------------------------------------------------------------
// Fused scaled-dot-product attention over heads of [L, E] queries, [S, E] keys and
// [S, Ev] values (E, Ev <= ATT_MAXD), in f32, never forming the [L, S] score matrix:
//   attn_fwd: a block per 16 queries of one head, two queries per warp; key and value
//     tiles of 32 in shared memory; each lane scores one key of the tile, an online
//     softmax (running max and sum) rescales the output, which lanes hold by dimension;
//     writes the output and each query's log-sum-exp;
//   attn_bwd_dq: a block per 8 queries, one per warp: the softmax recomputed from the
//     log-sum-exp, D = grad_out . out (kept in the node's scratch for the next kernel) and
//     grad_query = scale * sum_j P (grad_out . v_j - D) k_j;
//   attn_bwd_dkv: a block per 8 keys, one per warp, over tiles of 32 queries:
//     grad_value = sum_i P grad_out_i and grad_key = scale * sum_i dS q_i.
// Sums run in a fixed order: no atomics, the same result every run. Head `head`'s
// log-sum-exps start at element head * lses. With dropout every path multiplies each
// probability by its factor (att_factor) where it weighs the values (the output) or the
// output's gradient (grad_value), and takes dS = P (factor dP - D); the row sums and the
// log-sum-exp are the undropped ones.

#define ATT_TILE 32
#define ATT_DPL (ATT_MAXD / 32)
#define ATT_WARPS (BLOCK / 32)
#define ATT_ROWS 2  // queries per warp in the forward: 16 per block (lower/attention.rs)
#define ATT_QROWS (ATT_WARPS * ATT_ROWS)
#define ATT_NEG_INF (-__int_as_float(0x7f800000))

// What the mask and causality add to the score of query i and key j of head (b, h):
// 0, -inf (masked) or the float mask's value.
__device__ float att_mask(const AttentionArgs& a, i64 b, i64 h, i64 i, i64 j) {
    if (a.causal && j > i) return ATT_NEG_INF;
    if (!a.mask) return 0.0f;
    i64 at = b * a.ms[0] + h * a.ms[1] + i * a.ms[2] + j * a.ms[3];
    double m = ld(a.mask, a.mdt, at);
    if (a.mdt == DT_BOOL) return m != 0.0 ? 0.0f : ATT_NEG_INF;
    return (float)m;
}

// Dropout's keep-flags, the CPU device's bit for bit: probability `at` (its flat index
// over [batch, heads, lq, lk]) is kept when u, the top 24 bits of mix64(seed + at * 0x9e37..)
// over 2^24, is below 1 - dropout (compared in double, as bernoulli compares), and then
// scaled by 1 / (1 - dropout).

// The keep-flags' seed, read once a launch: the i64 at `a.seed`, mixed with the node's key
// when `a.keyed` (the forward reads the generator state); 0 without dropout.
__device__ u64 att_seed(const AttentionArgs& a) {
    if (!(a.dropout > 0.0)) return 0;
    u64 s = (u64)*(const i64*)a.seed;
    return a.keyed ? mix64(s ^ a.key) : s;
}

// The factor of probability `at`: 0 (dropped) or 1 / (1 - dropout); 1 without dropout.
__device__ float att_factor(const AttentionArgs& a, u64 seed, i64 at) {
    if (!(a.dropout > 0.0)) return 1.0f;
    u64 bits = mix64(seed + (u64)at * 0x9e3779b97f4a7c15ull);
    float u = (float)(bits >> 40) / 16777216.0f;
    return (double)u < 1.0 - a.dropout ? (float)(1.0 / (1.0 - a.dropout)) : 0.0f;
}

// Loads `rows` rows of `len` elements of `p` (dtype dt), from row `first` of a head whose
// rows start at element `head_base`, into sh (row stride `stride`); rows past `limit`
// read as 0.
__device__ void att_load(float* sh, i64 stride, u64 p, i64 dt, i64 head_base, i64 first,
                         i64 rows, i64 limit, i64 len) {
    for (i64 t = threadIdx.x; t < rows * len; t += BLOCK) {
        i64 r = t / len, d = t % len, row = first + r;
        sh[r * stride + d] = row < limit ? (float)ld(p, dt, head_base + row * len + d) : 0.0f;
    }
}

extern "C" __global__ void attn_fwd(const AttentionArgs a) {
    __shared__ float ks[ATT_TILE * (ATT_MAXD + 1)];
    __shared__ float vs[ATT_TILE * ATT_MAXD];
    __shared__ float qs[ATT_QROWS * ATT_MAXD];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float scale = (float)a.scale;
    u64 seed = att_seed(a);
    i64 qtiles = (a.lq + ATT_QROWS - 1) / ATT_QROWS;
    for (i64 blk = blockIdx.x; blk < a.batch * a.heads * qtiles; blk += gridDim.x) {
        i64 head = blk / qtiles, b = head / a.heads, h = head % a.heads;
        i64 i0 = (blk % qtiles) * ATT_QROWS;
        __syncthreads();
        att_load(qs, ATT_MAXD, a.q, a.qdt, head * a.lq * a.e, i0, ATT_QROWS, a.lq, a.e);
        float m[ATT_ROWS], l[ATT_ROWS], acc[ATT_ROWS][ATT_DPL];
        for (int rr = 0; rr < ATT_ROWS; rr++) {
            m[rr] = ATT_NEG_INF;
            l[rr] = 0.0f;
            for (int t = 0; t < ATT_DPL; t++) acc[rr][t] = 0.0f;
        }
        i64 kend = a.lk;
        if (a.causal && i0 + ATT_QROWS < kend) kend = i0 + ATT_QROWS;
        for (i64 j0 = 0; j0 < kend; j0 += ATT_TILE) {
            __syncthreads();
            att_load(ks, ATT_MAXD + 1, a.k, a.kdt, head * a.lk * a.e, j0, ATT_TILE, a.lk, a.e);
            att_load(vs, ATT_MAXD, a.v, a.vdt, head * a.lk * a.ev, j0, ATT_TILE, a.lk, a.ev);
            __syncthreads();
            i64 j = j0 + lane;
            for (int rr = 0; rr < ATT_ROWS; rr++) {
                int r = warp * ATT_ROWS + rr;
                i64 i = i0 + r;
                float sc = ATT_NEG_INF;
                if (i < a.lq && j < a.lk) {
                    float dot = 0.0f;
                    for (i64 d = 0; d < a.e; d++) dot += qs[r * ATT_MAXD + d] * ks[lane * (ATT_MAXD + 1) + d];
                    sc = scale * dot + att_mask(a, b, h, i, j);
                }
                float mnew = fmaxf(m[rr], warp_max_f(sc));
                float p = sc == ATT_NEG_INF ? 0.0f : expf(sc - mnew);
                float alpha = m[rr] == ATT_NEG_INF ? 0.0f : expf(m[rr] - mnew);
                l[rr] = l[rr] * alpha + warp_sum_f(p);
                for (int t = 0; t < ATT_DPL; t++) acc[rr][t] *= alpha;
                p *= att_factor(a, seed, (head * a.lq + i) * a.lk + j);
                for (int jj = 0; jj < ATT_TILE; jj++) {
                    float pj = __shfl_sync(0xffffffffu, p, jj);
                    for (int t = 0; t < ATT_DPL; t++) {
                        int d = lane + 32 * t;
                        if (d < a.ev) acc[rr][t] += pj * vs[jj * ATT_MAXD + d];
                    }
                }
                m[rr] = mnew;
            }
        }
        for (int rr = 0; rr < ATT_ROWS; rr++) {
            i64 i = i0 + warp * ATT_ROWS + rr;
            if (i >= a.lq) continue;
            for (int t = 0; t < ATT_DPL; t++) {
                int d = lane + 32 * t;
                if (d < a.ev && a.o)
                    st(a.o, a.odt, (head * a.lq + i) * a.ev + d,
                       l[rr] > 0.0f ? acc[rr][t] / l[rr] : __int_as_float(0x7fc00000));
            }
            if (lane == 0 && a.lse)
                st(a.lse, a.lsedt, head * a.lses + i, l[rr] > 0.0f ? m[rr] + logf(l[rr]) : ATT_NEG_INF);
        }
    }
}

// The forward in register tiles (head dims up to ATT_TD): a block of 256 threads per 64
// queries of one head, key and value tiles of 32. Each thread holds a 4 x 2 tile of the
// scores (rows ty*4.., keys tx*2..; ty = thread / 16, tx = thread % 16) summed over the
// head dim from shared memory (the queries and keys stored dim-major, four rows or two
// keys per load), and a 4 x 4 tile of the output (rows ty*4.., value dims tx*4..).
// An online softmax per row (the 16 threads of a row combine by shuffles) rescales the
// output; the probabilities go through shared memory (over the keys' tile) into
// output += P v. Causal blocks stop at their last query's key. Sums in a fixed order.
#define ATT_TQ 64
#define ATT_TK 32
#define ATT_PAD 4

extern "C" __global__ void attn_fwd_tiled(const AttentionArgs a) {
    __shared__ __align__(16) float qt[ATT_TD * (ATT_TQ + ATT_PAD)];  // qt[d][row]
    __shared__ __align__(16) float kt[ATT_TD * (ATT_TK + ATT_PAD)];  // kt[d][key]; pt[key][row]
    __shared__ __align__(16) float vs[ATT_TK * ATT_TD];              // vs[key][dim]
    float* pt = kt;
    const int QS = ATT_TQ + ATT_PAD, KS = ATT_TK + ATT_PAD;
    int tid = threadIdx.x, ty = tid >> 4, tx = tid & 15;
    float scale = (float)a.scale;
    u64 seed = att_seed(a);
    i64 qtiles = (a.lq + ATT_TQ - 1) / ATT_TQ;
    for (i64 blk = blockIdx.x; blk < a.batch * a.heads * qtiles; blk += gridDim.x) {
        i64 head = blk / qtiles, b = head / a.heads, h = head % a.heads;
        i64 i0 = (blk % qtiles) * ATT_TQ;
        __syncthreads();
        for (i64 t = tid; t < ATT_TQ * ATT_TD; t += BLOCK) {
            i64 r = t / ATT_TD, d = t % ATT_TD, i = i0 + r;
            qt[d * QS + r] = (i < a.lq && d < a.e) ? (float)ld(a.q, a.qdt, (head * a.lq + i) * a.e + d) : 0.0f;
        }
        float m[4], l[4], acc[4][4];
        for (int r = 0; r < 4; r++) {
            m[r] = ATT_NEG_INF;
            l[r] = 0.0f;
            for (int c = 0; c < 4; c++) acc[r][c] = 0.0f;
        }
        i64 kend = a.lk;
        if (a.causal && i0 + ATT_TQ < kend) kend = i0 + ATT_TQ;
        for (i64 j0 = 0; j0 < kend; j0 += ATT_TK) {
            __syncthreads();
            for (i64 t = tid; t < ATT_TK * ATT_TD; t += BLOCK) {
                i64 c = t / ATT_TD, d = t % ATT_TD, j = j0 + c;
                bool in = j < a.lk;
                kt[d * KS + c] = (in && d < a.e) ? (float)ld(a.k, a.kdt, (head * a.lk + j) * a.e + d) : 0.0f;
                vs[c * ATT_TD + d] = (in && d < a.ev) ? (float)ld(a.v, a.vdt, (head * a.lk + j) * a.ev + d) : 0.0f;
            }
            __syncthreads();
            float sc[4][2];
            for (int r = 0; r < 4; r++) sc[r][0] = sc[r][1] = 0.0f;
            for (i64 d = 0; d < a.e; d++) {
                float4 qv = *(const float4*)&qt[d * QS + ty * 4];
                float k0 = kt[d * KS + tx * 2], k1 = kt[d * KS + tx * 2 + 1];
                sc[0][0] += qv.x * k0; sc[0][1] += qv.x * k1;
                sc[1][0] += qv.y * k0; sc[1][1] += qv.y * k1;
                sc[2][0] += qv.z * k0; sc[2][1] += qv.z * k1;
                sc[3][0] += qv.w * k0; sc[3][1] += qv.w * k1;
            }
            __syncthreads();  // every score is in registers: kt becomes pt
            for (int r = 0; r < 4; r++) {
                i64 i = i0 + ty * 4 + r;
                float tmax = ATT_NEG_INF;
                for (int c = 0; c < 2; c++) {
                    i64 j = j0 + tx * 2 + c;
                    float x = (i < a.lq && j < a.lk) ? scale * sc[r][c] + att_mask(a, b, h, i, j) : ATT_NEG_INF;
                    sc[r][c] = x;
                    tmax = fmaxf(tmax, x);
                }
                for (int o = 1; o < 16; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
                float mnew = fmaxf(m[r], tmax);
                float psum = 0.0f;
                for (int c = 0; c < 2; c++) {
                    float p = sc[r][c] == ATT_NEG_INF ? 0.0f : expf(sc[r][c] - mnew);
                    i64 at = (head * a.lq + i) * a.lk + j0 + tx * 2 + c;
                    pt[(tx * 2 + c) * QS + ty * 4 + r] = p * att_factor(a, seed, at);
                    psum += p;
                }
                for (int o = 1; o < 16; o <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
                float alpha = m[r] == ATT_NEG_INF ? 0.0f : expf(m[r] - mnew);
                l[r] = l[r] * alpha + psum;
                for (int c = 0; c < 4; c++) acc[r][c] *= alpha;
                m[r] = mnew;
            }
            __syncthreads();
            for (int c = 0; c < ATT_TK; c++) {
                float4 pv = *(const float4*)&pt[c * QS + ty * 4];
                float4 vv = *(const float4*)&vs[c * ATT_TD + tx * 4];
                acc[0][0] += pv.x * vv.x; acc[0][1] += pv.x * vv.y; acc[0][2] += pv.x * vv.z; acc[0][3] += pv.x * vv.w;
                acc[1][0] += pv.y * vv.x; acc[1][1] += pv.y * vv.y; acc[1][2] += pv.y * vv.z; acc[1][3] += pv.y * vv.w;
                acc[2][0] += pv.z * vv.x; acc[2][1] += pv.z * vv.y; acc[2][2] += pv.z * vv.z; acc[2][3] += pv.z * vv.w;
                acc[3][0] += pv.w * vv.x; acc[3][1] += pv.w * vv.y; acc[3][2] += pv.w * vv.z; acc[3][3] += pv.w * vv.w;
            }
        }
        for (int r = 0; r < 4; r++) {
            i64 i = i0 + ty * 4 + r;
            if (i >= a.lq) continue;
            for (int c = 0; c < 4; c++) {
                i64 d = tx * 4 + c;
                if (d < a.ev && a.o)
                    st(a.o, a.odt, (head * a.lq + i) * a.ev + d,
                       l[r] > 0.0f ? acc[r][c] / l[r] : __int_as_float(0x7fc00000));
            }
            if (tx == 0 && a.lse)
                st(a.lse, a.lsedt, head * a.lses + i, l[r] > 0.0f ? m[r] + logf(l[r]) : ATT_NEG_INF);
        }
    }
}

// The backward in register tiles (head dims up to ATT_TD), from D = grad_out . out per
// query (attn_delta_rows, in `delta`) and the forward's log-sum-exp, in two passes with no
// atomics (a fixed order, the same result every run):
//   attn_bwd_dq_tiled: a block per 32 queries of one head over key tiles of 32: P and
//     dS = P (dP - D) for a 2 x 2 tile a thread (queries qy*2.., keys kx*2..), then
//     grad_query += dS k for a 2 x 4 tile (queries qy*2.., dims dx*4..);
//   attn_bwd_dkv_tiled: a block per 32 keys over query tiles of 32: the same P and dS,
//     then grad_value += P^T grad_out and grad_key += dS^T q for 2 x 4 tiles (keys ky*2..,
//     dims dx*4..).
#define ATT_TB 32
#define ATT_RS (ATT_TD + ATT_PAD)  // row stride of a row-major tile
#define ATT_CS (ATT_TB + ATT_PAD)  // row stride of a dim-major tile (or a P / dS tile)

// Rows `first`.. of `len` elements of head `head` of p (a row past `limit`, or an element
// past `len`, reads 0) into a row-major tile sh[row][d] of ATT_TB rows.
__device__ void att_rows(float* sh, u64 p, i64 dt, i64 head, i64 first, i64 limit, i64 len) {
    for (i64 t = threadIdx.x; t < ATT_TB * ATT_TD; t += BLOCK) {
        i64 r = t / ATT_TD, d = t % ATT_TD, row = first + r;
        sh[r * ATT_RS + d] = (row < limit && d < len) ? (float)ld(p, dt, (head * limit + row) * len + d) : 0.0f;
    }
}

// The same rows into a dim-major tile sh[d][row].
__device__ void att_cols(float* sh, u64 p, i64 dt, i64 head, i64 first, i64 limit, i64 len) {
    for (i64 t = threadIdx.x; t < ATT_TB * ATT_TD; t += BLOCK) {
        i64 r = t / ATT_TD, d = t % ATT_TD, row = first + r;
        sh[d * ATT_CS + r] = (row < limit && d < len) ? (float)ld(p, dt, (head * limit + row) * len + d) : 0.0f;
    }
}

// P (times its dropout factor) and dS of queries i0 + qy*2.. and keys j0 + kx*2.. from
// row-major q and grad_out tiles (qr, gr), a row-major key tile (kr) and a dim-major value
// tile (vt).
__device__ void att_tile_grads(const AttentionArgs& a, u64 seed, i64 b, i64 h,
                               i64 i0, i64 j0, const float* qr, const float* gr,
                               const float* kr, const float* vt, const float lse[2],
                               const float dl[2], float p[2][2], float ds[2][2]) {
    int qy = threadIdx.x >> 4, kx = threadIdx.x & 15;
    float sc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}}, dp[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    for (i64 d = 0; d < a.e; d++) {
        float q0 = qr[(qy * 2) * ATT_RS + d], q1 = qr[(qy * 2 + 1) * ATT_RS + d];
        float k0 = kr[(kx * 2) * ATT_RS + d], k1 = kr[(kx * 2 + 1) * ATT_RS + d];
        sc[0][0] += q0 * k0; sc[0][1] += q0 * k1;
        sc[1][0] += q1 * k0; sc[1][1] += q1 * k1;
    }
    for (i64 d = 0; d < a.ev; d++) {
        float g0 = gr[(qy * 2) * ATT_RS + d], g1 = gr[(qy * 2 + 1) * ATT_RS + d];
        float v0 = vt[d * ATT_CS + kx * 2], v1 = vt[d * ATT_CS + kx * 2 + 1];
        dp[0][0] += g0 * v0; dp[0][1] += g0 * v1;
        dp[1][0] += g1 * v0; dp[1][1] += g1 * v1;
    }
    float scale = (float)a.scale;
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 2; c++) {
            i64 i = i0 + qy * 2 + r, j = j0 + kx * 2 + c;
            float x = (i < a.lq && j < a.lk) ? scale * sc[r][c] + att_mask(a, b, h, i, j) : ATT_NEG_INF;
            float pr = (x == ATT_NEG_INF || lse[r] == ATT_NEG_INF) ? 0.0f : expf(x - lse[r]);
            float f = att_factor(a, seed, ((b * a.heads + h) * a.lq + i) * a.lk + j);
            p[r][c] = pr * f;
            ds[r][c] = pr * (f * dp[r][c] - dl[r]);
        }
}

extern "C" __global__ void attn_bwd_dq_tiled(const AttentionArgs a) {
    __shared__ __align__(16) float qr[ATT_TB * ATT_RS];
    __shared__ __align__(16) float gr[ATT_TB * ATT_RS];
    __shared__ __align__(16) float kr[ATT_TB * ATT_RS];
    __shared__ __align__(16) float vt[ATT_TD * ATT_CS];
    __shared__ __align__(16) float sq[ATT_TB * ATT_CS];  // dS[query][key]
    int tid = threadIdx.x, qy = tid >> 4, kx = tid & 15, dx = tid & 15;
    const float* delta = (const float*)a.delta;
    u64 seed = att_seed(a);
    i64 qtiles = (a.lq + ATT_TB - 1) / ATT_TB;
    for (i64 blk = blockIdx.x; blk < a.batch * a.heads * qtiles; blk += gridDim.x) {
        i64 head = blk / qtiles, b = head / a.heads, h = head % a.heads;
        i64 i0 = (blk % qtiles) * ATT_TB;
        __syncthreads();
        att_rows(qr, a.q, a.qdt, head, i0, a.lq, a.e);
        att_rows(gr, a.go, a.godt, head, i0, a.lq, a.ev);
        float lse[2], dl[2], acc[2][4];
        for (int r = 0; r < 2; r++) {
            i64 i = i0 + qy * 2 + r;
            lse[r] = i < a.lq ? (float)ld(a.lse, a.lsedt, head * a.lses + i) : ATT_NEG_INF;
            dl[r] = i < a.lq ? delta[head * a.lq + i] : 0.0f;
            for (int c = 0; c < 4; c++) acc[r][c] = 0.0f;
        }
        i64 kend = a.lk;
        if (a.causal && i0 + ATT_TB < kend) kend = i0 + ATT_TB;
        for (i64 j0 = 0; j0 < kend; j0 += ATT_TB) {
            __syncthreads();
            att_rows(kr, a.k, a.kdt, head, j0, a.lk, a.e);
            att_cols(vt, a.v, a.vdt, head, j0, a.lk, a.ev);
            __syncthreads();
            float p[2][2], ds[2][2];
            att_tile_grads(a, seed, b, h, i0, j0, qr, gr, kr, vt, lse, dl, p, ds);
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 2; c++) sq[(qy * 2 + r) * ATT_CS + kx * 2 + c] = ds[r][c];
            __syncthreads();
            for (int k = 0; k < ATT_TB; k++) {
                float s0 = sq[(qy * 2) * ATT_CS + k], s1 = sq[(qy * 2 + 1) * ATT_CS + k];
                float4 kv = *(const float4*)&kr[k * ATT_RS + dx * 4];
                acc[0][0] += s0 * kv.x; acc[0][1] += s0 * kv.y; acc[0][2] += s0 * kv.z; acc[0][3] += s0 * kv.w;
                acc[1][0] += s1 * kv.x; acc[1][1] += s1 * kv.y; acc[1][2] += s1 * kv.z; acc[1][3] += s1 * kv.w;
            }
        }
        float scale = (float)a.scale;
        for (int r = 0; r < 2; r++) {
            i64 i = i0 + qy * 2 + r;
            for (int c = 0; c < 4; c++) {
                i64 d = dx * 4 + c;
                if (i < a.lq && d < a.e && a.dq)
                    st(a.dq, a.dqdt, (head * a.lq + i) * a.e + d, scale * acc[r][c]);
            }
        }
    }
}

extern "C" __global__ void attn_bwd_dkv_tiled(const AttentionArgs a) {
    __shared__ __align__(16) float qr[ATT_TB * ATT_RS];
    __shared__ __align__(16) float gr[ATT_TB * ATT_RS];
    __shared__ __align__(16) float kr[ATT_TB * ATT_RS];
    __shared__ __align__(16) float vt[ATT_TD * ATT_CS];
    __shared__ __align__(16) float pq[ATT_TB * ATT_CS];  // P[query][key]
    __shared__ __align__(16) float sq[ATT_TB * ATT_CS];  // dS[query][key]
    __shared__ float lses[ATT_TB];
    __shared__ float dls[ATT_TB];
    int tid = threadIdx.x, qy = tid >> 4, kx = tid & 15, ky = tid >> 4, dx = tid & 15;
    const float* delta = (const float*)a.delta;
    u64 seed = att_seed(a);
    i64 ktiles = (a.lk + ATT_TB - 1) / ATT_TB;
    for (i64 blk = blockIdx.x; blk < a.batch * a.heads * ktiles; blk += gridDim.x) {
        i64 head = blk / ktiles, b = head / a.heads, h = head % a.heads;
        i64 j0 = (blk % ktiles) * ATT_TB;
        __syncthreads();
        att_rows(kr, a.k, a.kdt, head, j0, a.lk, a.e);
        att_cols(vt, a.v, a.vdt, head, j0, a.lk, a.ev);
        float dk[2][4], dv[2][4];
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < 4; c++) dk[r][c] = dv[r][c] = 0.0f;
        // Causal: queries before the block's first key see none of its keys.
        i64 qstart = a.causal ? j0 : 0;
        for (i64 i0 = qstart; i0 < a.lq; i0 += ATT_TB) {
            __syncthreads();
            att_rows(qr, a.q, a.qdt, head, i0, a.lq, a.e);
            att_rows(gr, a.go, a.godt, head, i0, a.lq, a.ev);
            if (tid < ATT_TB) {
                i64 i = i0 + tid;
                lses[tid] = i < a.lq ? (float)ld(a.lse, a.lsedt, head * a.lses + i) : ATT_NEG_INF;
                dls[tid] = i < a.lq ? delta[head * a.lq + i] : 0.0f;
            }
            __syncthreads();
            float lse[2] = {lses[qy * 2], lses[qy * 2 + 1]}, dl[2] = {dls[qy * 2], dls[qy * 2 + 1]};
            float p[2][2], ds[2][2];
            att_tile_grads(a, seed, b, h, i0, j0, qr, gr, kr, vt, lse, dl, p, ds);
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 2; c++) {
                    pq[(qy * 2 + r) * ATT_CS + kx * 2 + c] = p[r][c];
                    sq[(qy * 2 + r) * ATT_CS + kx * 2 + c] = ds[r][c];
                }
            __syncthreads();
            for (int q = 0; q < ATT_TB; q++) {
                float p0 = pq[q * ATT_CS + ky * 2], p1 = pq[q * ATT_CS + ky * 2 + 1];
                float s0 = sq[q * ATT_CS + ky * 2], s1 = sq[q * ATT_CS + ky * 2 + 1];
                float4 gv = *(const float4*)&gr[q * ATT_RS + dx * 4];
                float4 qv = *(const float4*)&qr[q * ATT_RS + dx * 4];
                dv[0][0] += p0 * gv.x; dv[0][1] += p0 * gv.y; dv[0][2] += p0 * gv.z; dv[0][3] += p0 * gv.w;
                dv[1][0] += p1 * gv.x; dv[1][1] += p1 * gv.y; dv[1][2] += p1 * gv.z; dv[1][3] += p1 * gv.w;
                dk[0][0] += s0 * qv.x; dk[0][1] += s0 * qv.y; dk[0][2] += s0 * qv.z; dk[0][3] += s0 * qv.w;
                dk[1][0] += s1 * qv.x; dk[1][1] += s1 * qv.y; dk[1][2] += s1 * qv.z; dk[1][3] += s1 * qv.w;
            }
        }
        float scale = (float)a.scale;
        for (int r = 0; r < 2; r++) {
            i64 j = j0 + ky * 2 + r;
            if (j >= a.lk) continue;
            for (int c = 0; c < 4; c++) {
                i64 d = dx * 4 + c;
                if (d < a.e && a.dk) st(a.dk, a.dkdt, (head * a.lk + j) * a.e + d, scale * dk[r][c]);
                if (d < a.ev && a.dv) st(a.dv, a.dvdt, (head * a.lk + j) * a.ev + d, dv[r][c]);
            }
        }
    }
}

extern "C" __global__ void attn_bwd_dq(const AttentionArgs a) {
    __shared__ float ks[ATT_TILE * (ATT_MAXD + 1)];
    __shared__ float vs[ATT_TILE * (ATT_MAXD + 1)];
    __shared__ float qs[ATT_WARPS * ATT_MAXD];
    __shared__ float gs[ATT_WARPS * ATT_MAXD];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float scale = (float)a.scale;
    i64 qtiles = (a.lq + ATT_WARPS - 1) / ATT_WARPS;
    float* delta = (float*)a.delta;
    u64 seed = att_seed(a);
    for (i64 blk = blockIdx.x; blk < a.batch * a.heads * qtiles; blk += gridDim.x) {
        i64 head = blk / qtiles, b = head / a.heads, h = head % a.heads;
        i64 i0 = (blk % qtiles) * ATT_WARPS, i = i0 + warp;
        __syncthreads();
        att_load(qs, ATT_MAXD, a.q, a.qdt, head * a.lq * a.e, i0, ATT_WARPS, a.lq, a.e);
        att_load(gs, ATT_MAXD, a.go, a.godt, head * a.lq * a.ev, i0, ATT_WARPS, a.lq, a.ev);
        __syncthreads();
        // D_i = grad_out_i . out_i, lanes over the value dims.
        float di = 0.0f, lse = 0.0f;
        if (i < a.lq) {
            for (i64 d = lane; d < a.ev; d += 32)
                di += gs[warp * ATT_MAXD + d] * (float)ld(a.o, a.odt, (head * a.lq + i) * a.ev + d);
            lse = (float)ld(a.lse, a.lsedt, head * a.lses + i);
        }
        di = warp_sum_f(di);
        if (lane == 0 && i < a.lq) delta[head * a.lq + i] = di;
        float acc[ATT_DPL];
        for (int t = 0; t < ATT_DPL; t++) acc[t] = 0.0f;
        i64 kend = a.lk;
        if (a.causal && i0 + ATT_WARPS < kend) kend = i0 + ATT_WARPS;
        for (i64 j0 = 0; j0 < kend; j0 += ATT_TILE) {
            __syncthreads();
            att_load(ks, ATT_MAXD + 1, a.k, a.kdt, head * a.lk * a.e, j0, ATT_TILE, a.lk, a.e);
            att_load(vs, ATT_MAXD + 1, a.v, a.vdt, head * a.lk * a.ev, j0, ATT_TILE, a.lk, a.ev);
            __syncthreads();
            i64 j = j0 + lane;
            float ds = 0.0f;
            if (i < a.lq && j < a.lk) {
                float dot = 0.0f, dp = 0.0f;
                for (i64 d = 0; d < a.e; d++) dot += qs[warp * ATT_MAXD + d] * ks[lane * (ATT_MAXD + 1) + d];
                for (i64 d = 0; d < a.ev; d++) dp += gs[warp * ATT_MAXD + d] * vs[lane * (ATT_MAXD + 1) + d];
                float sc = scale * dot + att_mask(a, b, h, i, j);
                float p = sc == ATT_NEG_INF ? 0.0f : expf(sc - lse);
                ds = p * (att_factor(a, seed, (head * a.lq + i) * a.lk + j) * dp - di);
            }
            for (int jj = 0; jj < ATT_TILE; jj++) {
                float dsj = __shfl_sync(0xffffffffu, ds, jj);
                for (int t = 0; t < ATT_DPL; t++) {
                    int d = lane + 32 * t;
                    if (d < a.e) acc[t] += dsj * ks[jj * (ATT_MAXD + 1) + d];
                }
            }
        }
        if (i < a.lq && a.dq)
            for (int t = 0; t < ATT_DPL; t++) {
                int d = lane + 32 * t;
                if (d < a.e) st(a.dq, a.dqdt, (head * a.lq + i) * a.e + d, scale * acc[t]);
            }
    }
}

extern "C" __global__ void attn_bwd_dkv(const AttentionArgs a) {
    __shared__ float qs[ATT_TILE * (ATT_MAXD + 1)];
    __shared__ float gs[ATT_TILE * (ATT_MAXD + 1)];
    __shared__ float kb[ATT_WARPS * ATT_MAXD];
    __shared__ float vb[ATT_WARPS * ATT_MAXD];
    __shared__ float lses[ATT_TILE];
    __shared__ float deltas[ATT_TILE];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float scale = (float)a.scale;
    i64 ktiles = (a.lk + ATT_WARPS - 1) / ATT_WARPS;
    const float* delta = (const float*)a.delta;
    u64 seed = att_seed(a);
    for (i64 blk = blockIdx.x; blk < a.batch * a.heads * ktiles; blk += gridDim.x) {
        i64 head = blk / ktiles, b = head / a.heads, h = head % a.heads;
        i64 j0 = (blk % ktiles) * ATT_WARPS, j = j0 + warp;
        __syncthreads();
        att_load(kb, ATT_MAXD, a.k, a.kdt, head * a.lk * a.e, j0, ATT_WARPS, a.lk, a.e);
        att_load(vb, ATT_MAXD, a.v, a.vdt, head * a.lk * a.ev, j0, ATT_WARPS, a.lk, a.ev);
        float dk[ATT_DPL], dv[ATT_DPL];
        for (int t = 0; t < ATT_DPL; t++) dk[t] = dv[t] = 0.0f;
        // Causal: queries before the block's first key see none of its keys.
        i64 qstart = a.causal ? (j0 / ATT_TILE) * ATT_TILE : 0;
        for (i64 q0 = qstart; q0 < a.lq; q0 += ATT_TILE) {
            __syncthreads();
            att_load(qs, ATT_MAXD + 1, a.q, a.qdt, head * a.lq * a.e, q0, ATT_TILE, a.lq, a.e);
            att_load(gs, ATT_MAXD + 1, a.go, a.godt, head * a.lq * a.ev, q0, ATT_TILE, a.lq, a.ev);
            if (threadIdx.x < ATT_TILE) {
                i64 i = q0 + threadIdx.x;
                lses[threadIdx.x] = i < a.lq ? (float)ld(a.lse, a.lsedt, head * a.lses + i) : 0.0f;
                deltas[threadIdx.x] = i < a.lq ? delta[head * a.lq + i] : 0.0f;
            }
            __syncthreads();
            i64 i = q0 + lane;
            float p = 0.0f, ds = 0.0f;
            if (i < a.lq && j < a.lk) {
                float dot = 0.0f, dp = 0.0f;
                for (i64 d = 0; d < a.e; d++) dot += qs[lane * (ATT_MAXD + 1) + d] * kb[warp * ATT_MAXD + d];
                for (i64 d = 0; d < a.ev; d++) dp += gs[lane * (ATT_MAXD + 1) + d] * vb[warp * ATT_MAXD + d];
                float sc = scale * dot + att_mask(a, b, h, i, j);
                p = sc == ATT_NEG_INF ? 0.0f : expf(sc - lses[lane]);
                float f = att_factor(a, seed, (head * a.lq + i) * a.lk + j);
                ds = p * (f * dp - deltas[lane]);
                p *= f;
            }
            for (int ii = 0; ii < ATT_TILE; ii++) {
                float pi = __shfl_sync(0xffffffffu, p, ii);
                float dsi = __shfl_sync(0xffffffffu, ds, ii);
                for (int t = 0; t < ATT_DPL; t++) {
                    int d = lane + 32 * t;
                    if (d < a.ev) dv[t] += pi * gs[ii * (ATT_MAXD + 1) + d];
                    if (d < a.e) dk[t] += dsi * qs[ii * (ATT_MAXD + 1) + d];
                }
            }
        }
        if (j < a.lk)
            for (int t = 0; t < ATT_DPL; t++) {
                int d = lane + 32 * t;
                if (d < a.e && a.dk) st(a.dk, a.dkdt, (head * a.lk + j) * a.e + d, scale * dk[t]);
                if (d < a.ev && a.dv) st(a.dv, a.dvdt, (head * a.lk + j) * a.ev + d, dv[t]);
            }
    }
}

// ------------------------------------------------------------------------------------
// Attention through cuBLAS products (f32, when the node's scratch holds the scores): the
// row kernels between the products, over `batch * heads * lq` rows of `lk` scores in the
// scratch `s` (each row's (b, h, i) from its index); a warp per row up to ROW_WARP_MAX
// scores, else a block.

// The row's head indices.
#define ATT_ROW_HEAD(r)                                                                 \
    i64 head = (r) / a.lq, i = (r) % a.lq, b = head / a.heads, h = head % a.heads;

// Scores (already scaled) to probabilities in place (times their dropout factors), masked
// ones 0, and each row's log-sum-exp (of the undropped row); a row with every score masked
// gets NaN probabilities and -inf.
extern "C" __global__ void attn_softmax_rows(const AttentionArgs a) {
    __shared__ float sh[32];
    bool pw = a.lk <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    float* s = (float*)a.s;
    u64 seed = att_seed(a);
    ROW_LOOP(r, a.batch * a.heads * a.lq, pw) {
        ATT_ROW_HEAD(r)
        float* row = s + r * a.lk;
        float m = ATT_NEG_INF;
        for (i64 j = t; j < a.lk; j += nt) m = fmaxf(m, row[j] + att_mask(a, b, h, i, j));
        m = row_max_f(m, pw, sh);
        float sum = 0.0f;
        if (m != ATT_NEG_INF)
            for (i64 j = t; j < a.lk; j += nt) {
                float x = row[j] + att_mask(a, b, h, i, j);
                sum += x == ATT_NEG_INF ? 0.0f : expf(x - m);
            }
        sum = row_sum_f(sum, pw, sh);
        for (i64 j = t; j < a.lk; j += nt) {
            float x = row[j] + att_mask(a, b, h, i, j);
            float f = att_factor(a, seed, r * a.lk + j);
            float p = x == ATT_NEG_INF ? 0.0f : expf(x - m) / sum * f;
            row[j] = m == ATT_NEG_INF ? __int_as_float(0x7fc00000) : p;
        }
        if (t == 0 && a.lse)
            st(a.lse, a.lsedt, head * a.lses + i, m == ATT_NEG_INF ? ATT_NEG_INF : m + logf(sum));
    }
}

// Scores (already scaled) to the forward's probabilities in place, from its log-sum-exp:
// exp(score + mask - lse), 0 where masked (and for a row with every score masked).
extern "C" __global__ void attn_probs_rows(const AttentionArgs a) {
    bool pw = a.lk <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    float* s = (float*)a.s;
    ROW_LOOP(r, a.batch * a.heads * a.lq, pw) {
        ATT_ROW_HEAD(r)
        float lse = (float)ld(a.lse, a.lsedt, head * a.lses + i);
        float* row = s + r * a.lk;
        for (i64 j = t; j < a.lk; j += nt) {
            float x = row[j] + att_mask(a, b, h, i, j);
            row[j] = (x == ATT_NEG_INF || lse == ATT_NEG_INF) ? 0.0f : expf(x - lse);
        }
    }
}

// D = grad_out . out per row, into `delta`: a warp or block per row of `ev`.
extern "C" __global__ void attn_delta_rows(const AttentionArgs a) {
    __shared__ float sh[32];
    bool pw = a.ev <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    float* delta = (float*)a.delta;
    ROW_LOOP(r, a.batch * a.heads * a.lq, pw) {
        float d = 0.0f;
        for (i64 k = t; k < a.ev; k += nt)
            d += (float)ld(a.go, a.godt, r * a.ev + k) * (float)ld(a.o, a.odt, r * a.ev + k);
        d = row_sum_f(d, pw, sh);
        if (t == 0) delta[r] = d;
    }
}

// dS = P * (factor dP - D) * scale in place over dP (`dp`), P in `s`; with dropout, P
// times its factor in place (for grad_value after).
extern "C" __global__ void attn_dscores_rows(const AttentionArgs a) {
    bool pw = a.lk <= ROW_WARP_MAX;
    int t = pw ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
    int nt = pw ? 32 : (int)blockDim.x;
    float* p = (float*)a.s;
    float* dp = (float*)a.dp;
    const float* delta = (const float*)a.delta;
    float scale = (float)a.scale;
    u64 seed = att_seed(a);
    ROW_LOOP(r, a.batch * a.heads * a.lq, pw) {
        float d = delta[r];
        for (i64 j = t; j < a.lk; j += nt) {
            i64 at = r * a.lk + j;
            float f = att_factor(a, seed, at);
            dp[at] = p[at] * (f * dp[at] - d) * scale;
            if (a.dropout > 0.0) p[at] *= f;
        }
    }
}
