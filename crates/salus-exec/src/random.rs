//! What every backend's random ops share so that they draw the same streams: a random
//! node's stream is `mix(state ^ name_key(node name))` under the session's generator state,
//! and element `i` is drawn from `mix(stream + i * 0x9e37_79b9_7f4a_7c15)` (SplitMix64's
//! finalizer as `mix`; see salus-cpu's `kernels/random.rs` and salus-cuda's `random.cu`).

/// FNV-1a of the node's name: two random nodes of one graph draw different streams.
pub fn name_key(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
