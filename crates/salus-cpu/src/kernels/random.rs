//! Random ops: a counter-based generator, so every value is a pure function of the
//! session's generator state, the node and the element's index. Iterations draw new
//! values because the graph advances the state (an i64 STATE tensor) every iteration;
//! a checkpoint of the session's tensors captures the generator too. The stream is the
//! session's own, not PyTorch's: masks are statistically, not bitwise, what PyTorch draws.

use salus_exec::random::name_key;
use salus_graph::Node;

use super::{Arg, Out, Result, store, tensor};

/// SplitMix64's finalizer: a bijective mix of all 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in [0, 1), a multiple of `2^-bits`, for element `i` of the stream `key`.
pub(crate) fn uniform(key: u64, i: u64, bits: u32) -> f64 {
    let mixed = mix(key.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (mixed >> (64 - bits)) as f64 / (1u64 << bits) as f64
}

/// The stream of a node under a generator state.
pub(crate) fn stream(node: &Node, state: i64) -> u64 {
    mix(state as u64 ^ name_key(&node.name))
}

/// Input `k`, an i64 scalar (`what` names it in the error): a generator state or a seed.
pub(crate) fn i64_scalar(args: &[Arg<'_>], k: usize, what: &str) -> Result<i64> {
    let (ty, bytes) = tensor(args, k)?;
    if ty.dtype != salus_graph::DType::I64 || bytes.len() != 8 {
        return Err(format!("{what} must be an i64 scalar, got {ty}"));
    }
    Ok(i64::from_le_bytes(
        bytes.try_into().map_err(|_| format!("{what} bytes"))?,
    ))
}

/// The stream of `node` under the generator state in input `k`.
pub(crate) fn node_stream(node: &Node, args: &[Arg<'_>], k: usize) -> Result<u64> {
    Ok(stream(node, i64_scalar(args, k, "the generator")?))
}

/// bernoulli.p: 1 with probability `p`, else 0, in the dtype of `self`.
pub(crate) fn bernoulli(node: &Node, p: f64, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let key = node_stream(node, args, 1)?;
    let n = o.ty.numel().unwrap_or(0) as usize;
    for i in 0..n {
        let one = uniform(key, i as u64, 24) < p;
        store(o.bytes, o.ty.dtype, i, f64::from(u8::from(one)));
    }
    Ok(())
}

/// rand_like: uniform in [0, 1) in the dtype of `self`, with as many bits as it holds
/// exactly ([`salus_exec::random::uniform_bits`]).
pub(crate) fn rand_like(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let key = node_stream(node, args, 1)?;
    let bits = salus_exec::random::uniform_bits(o.ty.dtype);
    let n = o.ty.numel().unwrap_or(0) as usize;
    for i in 0..n {
        store(o.bytes, o.ty.dtype, i, uniform(key, i as u64, bits));
    }
    Ok(())
}
