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

/// Uniform in [0, 1) with 24 bits, for element `i` of the stream `key`.
pub(crate) fn uniform(key: u64, i: u64) -> f32 {
    let bits = mix(key.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (bits >> 40) as f32 / (1u64 << 24) as f32
}

/// The stream of a node under a generator state.
pub(crate) fn stream(node: &Node, state: i64) -> u64 {
    mix(state as u64 ^ name_key(&node.name))
}

/// The stream of `node` under the generator state in input 1.
fn node_stream(node: &Node, args: &[Arg<'_>]) -> Result<u64> {
    let (ty, bytes) = tensor(args, 1)?;
    if ty.dtype != salus_graph::DType::I64 || bytes.len() != 8 {
        return Err(format!("the generator must be an i64 scalar, got {ty}"));
    }
    let state = i64::from_le_bytes(bytes.try_into().map_err(|_| "generator bytes")?);
    Ok(stream(node, state))
}

/// bernoulli.p: 1 with probability `p`, else 0, in the dtype of `self`.
pub(crate) fn bernoulli(node: &Node, p: f64, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let key = node_stream(node, args)?;
    let n = o.ty.numel().unwrap_or(0) as usize;
    for i in 0..n {
        let one = f64::from(uniform(key, i as u64)) < p;
        store(o.bytes, o.ty.dtype, i, f64::from(u8::from(one)));
    }
    Ok(())
}

/// The bits of a uniform draw that a dtype holds exactly below 1: 24 (f32), 11
/// (f16), 8 (bf16).
pub(crate) fn uniform_bits(dtype: salus_graph::DType) -> u32 {
    match dtype {
        salus_graph::DType::F16 => 11,
        salus_graph::DType::Bf16 => 8,
        _ => 24,
    }
}

/// rand_like: uniform in [0, 1) in the dtype of `self`, multiples of 2^-24 (2^-11 in
/// f16, 2^-8 in bf16: each exact there, so none rounds up to 1). Element `i` takes the
/// high bits of the same mix as [`uniform`].
pub(crate) fn rand_like(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let key = node_stream(node, args)?;
    let bits = uniform_bits(o.ty.dtype);
    let n = o.ty.numel().unwrap_or(0) as usize;
    for i in 0..n {
        let mixed = mix(key.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        let u = (mixed >> (64 - bits)) as f64 / (1u64 << bits) as f64;
        store(o.bytes, o.ty.dtype, i, u);
    }
    Ok(())
}
