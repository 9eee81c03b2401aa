// ------------------------------------------------------------------------------------
// Random ops.

// bernoulli.p: the CPU kernel's counter-based stream (salus-cpu's kernels/random.rs, with
// mix64 in common.cu), bit for bit. The generator state is read on the device, so a
// captured graph draws anew each replay.

extern "C" __global__ void bernoulli(const BernoulliArgs a) {
    u64 key = mix64((u64)(*(const i64*)a.state) ^ a.key);
    GRID_LOOP(i, a.n) {
        u64 bits = mix64(key + (u64)i * 0x9e3779b97f4a7c15ull);
        float u = (float)(bits >> 40) / 16777216.0f;
        st(a.out, a.dt, i, ((double)u < a.p) ? 1.0 : 0.0);
    }
}

// _assert_async.msg: the error block names the node when its condition is false (the
// host reads the message from the node's parameters).
extern "C" __global__ void assert_true(const AssertArgs a) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && ld(a.cond, a.dt, 0) == 0.0) {
        report(a.err, a.node, ERR_ASSERT, 0, 0);
    }
}

// rand_like: the CPU kernel's draws, bit for bit (`bits` high bits of the same mix).
extern "C" __global__ void uniform(const UniformArgs a) {
    u64 key = mix64((u64)(*(const i64*)a.state) ^ a.key);
    GRID_LOOP(i, a.n) {
        u64 bits = mix64(key + (u64)i * 0x9e3779b97f4a7c15ull);
        st(a.out, a.dt, i, (double)(bits >> (64 - a.bits)) / (double)(1ull << a.bits));
    }
}

// Attention with dropout: the seed of its keep-flags (the stream attention.cu draws them
// from) and the offset, 0, as the forward's outputs for its backward.
extern "C" __global__ void attention_seed(const AttentionSeedArgs a) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        u64 seed = mix64((u64)(*(const i64*)a.state) ^ a.key);
        if (a.seed) *(i64*)a.seed = (i64)seed;
        if (a.offset) *(i64*)a.offset = 0;
    }
}
