//! What every backend's random ops share so that they draw the same streams: a random
//! node's stream is `mix(state ^ name_key(node name))` under the session's generator state,
//! and element `i` is drawn from `mix(stream + i * 0x9e37_79b9_7f4a_7c15)` (SplitMix64's
//! finalizer as `mix`; see salus-cpu's `kernels/random.rs` and salus-cuda's `random.cu`).

/// The bits of a `rand_like` draw in `dtype`, each draw a multiple of `2^-bits` that the
/// dtype holds exactly below 1 (so none rounds up to 1): 24 (f32), 11 (f16), 8 (bf16).
pub fn uniform_bits(dtype: salus_graph::DType) -> u32 {
    match dtype {
        salus_graph::DType::F16 => 11,
        salus_graph::DType::Bf16 => 8,
        _ => 24,
    }
}

/// FNV-1a of the node's name: two random nodes of one graph draw different streams.
pub fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
