//! Typed f32 kernels for the ops that dominate training steps: elementwise ops with
//! broadcasting (here), reductions, softmax and layer norm (`reduce`), shape copies
//! (`copy`), pooling (`pool`), convolutions (`conv`), small matrix products (`matmul`) and
//! fused attention (`attention`).
//!
//! Each kernel reads its operands in place and writes its outputs directly: no scratch
//! vector, no index vector. Shapes are collapsed into at most [`MAX_RANK`] dims held in
//! stack arrays, and loops run over contiguous inner runs. Large ops are split across the
//! one bounded rayon pool that matrix products use ([`for_chunks`]); small ones stay on the
//! calling thread. Whatever a kernel here does not cover (other dtypes, ranks above
//! [`MAX_RANK`], unusual layouts) falls back to the generic paths of the parent module.

use bytemuck::Pod;
use rayon::prelude::*;
use salus_graph::{DType, GeluApproximate, Op, OpParams, TensorType};

use super::attention::{Dropout, Layout};
use super::{Arg, Out, Result, number_or};

mod attention;
pub(super) use attention::{backward as attention_backward, forward as attention_forward};
pub(super) mod batch_norm;
mod conv;
mod copy;
mod exp;
mod matmul;
mod pool;
mod reduce;
mod simd;

/// Most dims a typed kernel handles (`salus_graph::Limits::default().max_rank`).
pub(super) const MAX_RANK: usize = 8;

/// Work (elements times a rough per-element cost) below which an op stays on the calling
/// thread: splitting costs a few microseconds.
const PARALLEL_WORK: usize = 1 << 15;

/// An element type a typed kernel reads or writes.
pub(super) trait Elem: Pod + Send + Sync {
    const DTYPE: DType;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
}

impl Elem for u8 {
    const DTYPE: DType = DType::Bool;
}

impl Elem for i64 {
    const DTYPE: DType = DType::I64;
}

/// The elements of a tensor of type `T`, if its dtype is `T`'s and its bytes hold them.
pub(super) fn typed<'a, T: Elem>(ty: &TensorType, bytes: &'a [u8]) -> Option<&'a [T]> {
    if ty.dtype != T::DTYPE {
        return None;
    }
    let v: &[T] = bytemuck::try_cast_slice(bytes).ok()?;
    (v.len() == numel(&ty.shape)).then_some(v)
}

pub(super) fn typed_mut<'a, T: Elem>(ty: &TensorType, bytes: &'a mut [u8]) -> Option<&'a mut [T]> {
    if ty.dtype != T::DTYPE {
        return None;
    }
    let v: &mut [T] = bytemuck::try_cast_slice_mut(bytes).ok()?;
    (v.len() == numel(&ty.shape)).then_some(v)
}

/// An input tensor of type `T` (not in place).
pub(super) fn input<'a, T: Elem>(
    args: &'a [Arg<'a>],
    k: usize,
) -> Option<(&'a TensorType, &'a [T])> {
    match args.get(k) {
        Some(Arg::Tensor(ty, bytes)) => Some((ty, typed(ty, bytes)?)),
        _ => None,
    }
}

pub(super) fn numel(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize
}

/// Runs `f(first_element, chunk)` over chunks of `out`, each a multiple of `unit`
/// elements: on the rayon pool when the work (`out.len() * cost`) is large, else in one
/// call on this thread.
pub(super) fn for_chunks<T: Send>(
    out: &mut [T],
    unit: usize,
    cost: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    let n = out.len();
    let unit = unit.max(1);
    let threads = rayon::current_num_threads();
    if threads <= 1 || n.saturating_mul(cost) < PARALLEL_WORK || n <= unit {
        f(0, out);
        return;
    }
    // A few chunks per thread keeps the cores busy when chunks finish unevenly.
    let units = n.div_ceil(unit);
    let per = units.div_ceil(threads * 4).max(1) * unit;
    out.par_chunks_mut(per)
        .enumerate()
        .for_each(|(i, chunk)| f(i * per, chunk));
}

/// Where a source of an elementwise op is along one segment of the output.
#[derive(Clone, Copy)]
enum Src<'a, T> {
    /// One element per output element.
    Slice(&'a [T]),
    /// One element for the whole segment (broadcast).
    Scalar(T),
    /// The output's own element (the op runs in place).
    Out,
}

/// An output of `N` broadcast sources, its dims collapsed: `dims[..rank]`, and per source
/// the stride of each dim (0 along broadcast dims). The innermost stride is 0 or 1.
#[derive(Clone, Copy)]
struct Broadcast<const N: usize> {
    dims: [usize; MAX_RANK],
    strides: [[usize; MAX_RANK]; N],
    rank: usize,
}

impl<const N: usize> Broadcast<N> {
    /// `sources[k]`: the shape of source `k`, `None` for a source in the output's bytes.
    fn new(out: &[u64], sources: [Option<&[u64]>; N]) -> Option<Broadcast<N>> {
        if out.len() > MAX_RANK {
            return None;
        }
        let rank = out.len();
        let mut full = [[0usize; MAX_RANK]; N];
        for (k, source) in sources.iter().enumerate() {
            let shape = source.unwrap_or(out);
            if shape.len() > rank {
                return None;
            }
            let lead = rank - shape.len();
            let mut stride = 1usize;
            for d in (0..shape.len()).rev() {
                let size = shape[d];
                if size != 1 && size != out[lead + d] {
                    return None;
                }
                full[k][lead + d] = if size == 1 { 0 } else { stride };
                stride *= size as usize;
            }
        }
        let b = Self::with_strides(out, full)?;
        let inner_ok = (0..N).all(|k| b.strides[k][b.rank - 1] <= 1);
        inner_ok.then_some(b)
    }

    /// The output's dims with each source's element strides given per dim, collapsed:
    /// size-1 dims dropped, neighbours that every source walks contiguously merged.
    fn with_strides(out: &[u64], full: [[usize; MAX_RANK]; N]) -> Option<Broadcast<N>> {
        if out.len() > MAX_RANK {
            return None;
        }
        let mut b = Broadcast {
            dims: [1; MAX_RANK],
            strides: [[0; MAX_RANK]; N],
            rank: 0,
        };
        for (d, &size) in out.iter().enumerate() {
            let size = size as usize;
            if size == 1 {
                continue;
            }
            if b.rank > 0 {
                let p = b.rank - 1;
                let mergeable = (0..N).all(|k| b.strides[k][p] == full[k][d] * size);
                if mergeable {
                    b.dims[p] *= size;
                    for (s, f) in b.strides.iter_mut().zip(&full) {
                        s[p] = f[d];
                    }
                    continue;
                }
            }
            b.dims[b.rank] = size;
            for (s, f) in b.strides.iter_mut().zip(&full) {
                s[b.rank] = f[d];
            }
            b.rank += 1;
        }
        if b.rank == 0 {
            b.rank = 1;
        }
        Some(b)
    }

    /// Calls `f(segment_start, segment_len, offsets)` for the runs of output elements
    /// `start..start + len` along the innermost dim, `offsets[k]` being where source `k`
    /// is at the segment's first element.
    fn segments(&self, start: usize, len: usize, mut f: impl FnMut(usize, usize, [usize; N])) {
        let r = self.rank;
        let inner = self.dims[r - 1];
        let end = start + len;
        let mut e = start;
        while e < end {
            let row = e / inner;
            let col = e % inner;
            let seg = (inner - col).min(end - e);
            let mut offsets = [0usize; N];
            let mut rest = row;
            for d in (0..r - 1).rev() {
                let c = rest % self.dims[d];
                rest /= self.dims[d];
                for (o, s) in offsets.iter_mut().zip(&self.strides) {
                    *o += c * s[d];
                }
            }
            for (o, s) in offsets.iter_mut().zip(&self.strides) {
                *o += col * s[r - 1];
            }
            f(e - start, seg, offsets);
            e += seg;
        }
    }

    fn inner_stride(&self, k: usize) -> usize {
        self.strides[k][self.rank - 1]
    }
}

/// Source `k` of an elementwise op: its shape (`None` in place) and its elements.
fn source<'a, T: Elem>(args: &'a [Arg<'a>], k: usize) -> Option<(Option<&'a [u64]>, &'a [T])> {
    match args.get(k)? {
        Arg::Tensor(ty, bytes) => Some((Some(&ty.shape), typed(ty, bytes)?)),
        Arg::InOutput(ty) if ty.dtype == T::DTYPE => Some((None, &[])),
        _ => None,
    }
}

fn src<T: Copy>(data: &[T], in_place: bool, stride: usize, at: usize, len: usize) -> Src<'_, T> {
    if in_place {
        Src::Out
    } else if stride == 0 {
        Src::Scalar(data[at])
    } else {
        Src::Slice(&data[at..at + len])
    }
}

fn same<A: Pod, O: Pod>(o: O) -> A {
    // In-place sources have the output's type (checked before any loop runs).
    bytemuck::cast(o)
}

/// `out = f(a)` elementwise, `a` broadcast to `out`.
fn unary<A: Elem, O: Elem>(
    args: &[Arg<'_>],
    out: &mut Out<'_>,
    cost: usize,
    f: impl Fn(A) -> O + Sync + Send,
) -> Option<Result<()>> {
    let (sa, a) = source::<A>(args, 0)?;
    if sa.is_none() && size_of::<A>() != size_of::<O>() {
        return None;
    }
    let b = Broadcast::new(&out.ty.shape, [sa])?;
    let dst = typed_mut::<O>(out.ty, out.bytes)?;
    let ia = sa.is_none();
    for_chunks(dst, 1, cost, |start, chunk| {
        b.segments(start, chunk.len(), |at, len, off| {
            let o = &mut chunk[at..at + len];
            match src(a, ia, b.inner_stride(0), off[0], len) {
                Src::Slice(x) => o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x)),
                Src::Scalar(x) => o.fill(f(x)),
                Src::Out => o.iter_mut().for_each(|o| *o = f(same(*o))),
            }
        });
    });
    Some(Ok(()))
}

/// `out = f(a, b)` elementwise, both broadcast to `out`.
fn binary<A: Elem, B: Elem, O: Elem>(
    args: &[Arg<'_>],
    out: &mut Out<'_>,
    cost: usize,
    f: impl Fn(A, B) -> O + Sync + Send,
) -> Option<Result<()>> {
    let (sa, a) = source::<A>(args, 0)?;
    let (sb, b) = source::<B>(args, 1)?;
    if (sa.is_none() && size_of::<A>() != size_of::<O>())
        || (sb.is_none() && size_of::<B>() != size_of::<O>())
    {
        return None;
    }
    let g = Broadcast::new(&out.ty.shape, [sa, sb])?;
    let dst = typed_mut::<O>(out.ty, out.bytes)?;
    let (ia, ib) = (sa.is_none(), sb.is_none());
    for_chunks(dst, 1, cost, |start, chunk| {
        g.segments(start, chunk.len(), |at, len, off| {
            let o = &mut chunk[at..at + len];
            let x = src(a, ia, g.inner_stride(0), off[0], len);
            let y = src(b, ib, g.inner_stride(1), off[1], len);
            match (x, y) {
                (Src::Slice(x), Src::Slice(y)) => o
                    .iter_mut()
                    .zip(x.iter().zip(y))
                    .for_each(|(o, (&x, &y))| *o = f(x, y)),
                (Src::Slice(x), Src::Scalar(y)) => {
                    o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, y))
                }
                (Src::Scalar(x), Src::Slice(y)) => {
                    o.iter_mut().zip(y).for_each(|(o, &y)| *o = f(x, y))
                }
                (Src::Scalar(x), Src::Scalar(y)) => o.fill(f(x, y)),
                (Src::Out, Src::Slice(y)) => {
                    o.iter_mut().zip(y).for_each(|(o, &y)| *o = f(same(*o), y))
                }
                (Src::Out, Src::Scalar(y)) => o.iter_mut().for_each(|o| *o = f(same(*o), y)),
                (Src::Slice(x), Src::Out) => {
                    o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, same(*o)))
                }
                (Src::Scalar(x), Src::Out) => o.iter_mut().for_each(|o| *o = f(x, same(*o))),
                (Src::Out, Src::Out) => o.iter_mut().for_each(|o| *o = f(same(*o), same(*o))),
            }
        });
    });
    Some(Ok(()))
}

/// `where(cond, a, b)` elementwise, all broadcast to `out`.
fn select(args: &[Arg<'_>], out: &mut Out<'_>) -> Option<Result<()>> {
    let (sc, c) = source::<u8>(args, 0)?;
    let (sa, a) = source::<f32>(args, 1)?;
    let (sb, b) = source::<f32>(args, 2)?;
    sc?;
    let g = Broadcast::new(&out.ty.shape, [sc, sa, sb])?;
    let dst = typed_mut::<f32>(out.ty, out.bytes)?;
    let (ia, ib) = (sa.is_none(), sb.is_none());
    for_chunks(dst, 1, 1, |start, chunk| {
        g.segments(start, chunk.len(), |at, len, off| {
            let o = &mut chunk[at..at + len];
            let cs = src(c, false, g.inner_stride(0), off[0], len);
            let x = src(a, ia, g.inner_stride(1), off[1], len);
            let y = src(b, ib, g.inner_stride(2), off[2], len);
            // Branch-free: conditions such as relu masks are unpredictable.
            let pick = |c: u8, x: f32, y: f32| {
                let mask = u32::from(c != 0).wrapping_neg();
                f32::from_bits((x.to_bits() & mask) | (y.to_bits() & !mask))
            };
            match (cs, x, y) {
                (Src::Scalar(c), _, _) => {
                    // One condition for the segment: a copy or a fill.
                    let chosen = if c != 0 { x } else { y };
                    match chosen {
                        Src::Slice(v) => o.copy_from_slice(v),
                        Src::Scalar(v) => o.fill(v),
                        Src::Out => {}
                    }
                }
                (Src::Slice(c), Src::Slice(x), Src::Slice(y)) => {
                    for (i, o) in o.iter_mut().enumerate() {
                        *o = pick(c[i], x[i], y[i]);
                    }
                }
                (Src::Slice(c), Src::Scalar(x), Src::Slice(y)) => {
                    for (i, o) in o.iter_mut().enumerate() {
                        *o = pick(c[i], x, y[i]);
                    }
                }
                (Src::Slice(c), Src::Slice(x), Src::Scalar(y)) => {
                    for (i, o) in o.iter_mut().enumerate() {
                        *o = pick(c[i], x[i], y);
                    }
                }
                (Src::Slice(c), x, y) => {
                    for (i, o) in o.iter_mut().enumerate() {
                        let get = |s: Src<'_, f32>, own: f32| match s {
                            Src::Slice(v) => v[i],
                            Src::Scalar(v) => v,
                            Src::Out => own,
                        };
                        *o = pick(c[i], get(x, *o), get(y, *o));
                    }
                }
                (Src::Out, _, _) => {}
            }
        });
    });
    Some(Ok(()))
}

/// The exact error function in f32 (musl's `erff`, within 1 ulp).
fn erf(x: f32) -> f32 {
    libm::erff(x)
}

/// Runs a node of `op` with a typed kernel when one covers it (`None`: the generic path
/// runs it).
pub(crate) fn run(
    op: Op,
    params: &OpParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
    scratch: &mut [u8],
) -> Option<Result<()>> {
    use Op::*;
    match (op, params) {
        (ConvolutionBackward, OpParams::Conv(c)) => return conv::backward(c, args, outs, scratch),
        (MaxPool2dWithIndices, OpParams::Pool(p)) => return pool::max_pool2d(p, args, outs),
        (ScaledDotProductAttention, OpParams::Attention(p)) => {
            return attention_forward(p, Layout::FLASH_FORWARD, Dropout::NONE, args, outs);
        }
        (ScaledDotProductAttentionBackward, OpParams::Attention(p)) => {
            return attention_backward(p, Layout::FLASH_BACKWARD, Dropout::NONE, args, outs);
        }
        (
            NativeLayerNorm,
            OpParams::LayerNorm {
                normalized_shape,
                eps,
                ..
            },
        ) => {
            return reduce::layer_norm(normalized_shape, *eps, args, outs);
        }
        (
            NativeLayerNormBackward,
            OpParams::LayerNorm {
                normalized_shape, ..
            },
        ) => {
            return reduce::layer_norm_backward(normalized_shape, args, outs);
        }
        (
            NativeBatchNorm | NativeBatchNormBackward,
            &OpParams::BatchNorm {
                batch,
                channels,
                inner,
                momentum,
                eps,
            },
        ) => {
            let g = (
                batch as usize,
                channels as usize,
                inner as usize,
                momentum,
                eps,
            );
            return if op == NativeBatchNorm {
                batch_norm::forward(g, args, outs)
            } else {
                batch_norm::backward(g, args, outs)
            };
        }
        _ => {}
    }
    let o = outs.first_mut()?.as_mut()?;
    match (op, params) {
        (AddTensor | SubTensor, &OpParams::Binary { alpha }) => {
            let scale = (if op == SubTensor { -alpha } else { alpha }) as f32;
            if scale == 1.0 {
                binary(args, o, 1, |x: f32, y: f32| x + y)
            } else if scale == -1.0 {
                binary(args, o, 1, |x: f32, y: f32| x - y)
            } else {
                binary(args, o, 1, move |x: f32, y: f32| x + scale * y)
            }
        }
        (MulTensor, _) => binary(args, o, 1, |x: f32, y: f32| x * y),
        (DivTensor, _) => binary(args, o, 1, |x: f32, y: f32| x / y),
        (AddScalar, &OpParams::WithScalar { scalar, alpha }) => {
            let v = (scalar.as_f64() * alpha) as f32;
            unary(args, o, 1, move |x: f32| x + v)
        }
        (MulScalar, &OpParams::WithScalar { scalar, .. }) => {
            let v = scalar.as_f64() as f32;
            unary(args, o, 1, move |x: f32| x * v)
        }
        (DivScalar, &OpParams::WithScalar { scalar, .. }) => {
            let v = scalar.as_f64() as f32;
            unary(args, o, 1, move |x: f32| x / v)
        }
        (Neg, _) => unary(args, o, 1, |x: f32| -x),
        (Abs, _) => unary(args, o, 1, |x: f32| x.abs()),
        (Exp, _) => unary(args, o, 8, |x: f32| x.exp()),
        (Log, _) => unary(args, o, 8, |x: f32| x.ln()),
        (Sqrt, _) => unary(args, o, 2, |x: f32| x.sqrt()),
        (Rsqrt, _) => unary(args, o, 2, |x: f32| 1.0 / x.sqrt()),
        (Reciprocal, _) => unary(args, o, 1, |x: f32| 1.0 / x),
        (Sigmoid, _) => unary(args, o, 8, |x: f32| 1.0 / (1.0 + (-x).exp())),
        (Tanh, _) => unary(args, o, 8, |x: f32| x.tanh()),
        // NaN passes through, as in PyTorch (`f32::max` would turn it into 0).
        (Relu, _) => unary(args, o, 1, |x: f32| if x.is_nan() { x } else { x.max(0.0) }),
        (LeakyRelu, &OpParams::LeakyRelu { negative_slope }) => {
            let slope = negative_slope as f32;
            unary(
                args,
                o,
                1,
                move |x: f32| if x > 0.0 { x } else { slope * x },
            )
        }
        (Gelu, OpParams::Gelu { approximate }) => match approximate {
            GeluApproximate::Tanh => unary(args, o, 8, |x: f32| {
                let c = (2.0 / std::f32::consts::PI).sqrt();
                0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
            }),
            GeluApproximate::None => unary(args, o, 8, |x: f32| {
                0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
            }),
        },
        (Erf, _) => unary(args, o, 8, erf),
        (Log1p, _) => unary(args, o, 8, f32::ln_1p),
        (Expm1, _) => unary(args, o, 8, f32::exp_m1),
        (Sin, _) => unary(args, o, 8, f32::sin),
        (Cos, _) => unary(args, o, 8, f32::cos),
        (Atan, _) => unary(args, o, 8, f32::atan),
        (Floor, _) => unary(args, o, 1, f32::floor),
        (Ceil, _) => unary(args, o, 1, f32::ceil),
        (Round, _) => unary(args, o, 1, f32::round_ties_even),
        (Trunc, _) => unary(args, o, 1, f32::trunc),
        (PowTensorScalar, &OpParams::WithScalar { scalar, .. }) => {
            let e = scalar.as_f64();
            if e == 2.0 {
                unary(args, o, 1, |x: f32| x * x)
            } else if e == 1.0 {
                unary(args, o, 1, |x: f32| x)
            } else {
                let e = e as f32;
                unary(args, o, 8, move |x: f32| x.powf(e))
            }
        }
        (Clamp, &OpParams::Clamp { min, max }) => {
            let lo = number_or(min, f64::NEG_INFINITY) as f32;
            let hi = number_or(max, f64::INFINITY) as f32;
            unary(
                args,
                o,
                1,
                move |x: f32| {
                    if x.is_nan() { x } else { x.max(lo).min(hi) }
                },
            )
        }
        (
            EqScalar | NeScalar | LtScalar | LeScalar | GtScalar | GeScalar,
            &OpParams::WithScalar { scalar, .. },
        ) => {
            let v = scalar.as_f64();
            let cmp = move |x: f32| -> u8 {
                let x = f64::from(x);
                u8::from(match op {
                    EqScalar => x == v,
                    NeScalar => x != v,
                    LtScalar => x < v,
                    LeScalar => x <= v,
                    GtScalar => x > v,
                    _ => x >= v,
                })
            };
            unary(args, o, 1, cmp)
        }
        (LogicalNot | BitwiseNot, _) if o.ty.dtype == DType::Bool => {
            unary(args, o, 1, |x: u8| u8::from(x == 0))
        }
        (LogicalAnd, _) => binary(args, o, 1, |x: u8, y: u8| u8::from(x != 0 && y != 0)),
        (Maximum, _) => binary(args, o, 1, |x: f32, y: f32| {
            if x.is_nan() || y.is_nan() {
                x + y
            } else if x < y {
                y
            } else {
                x
            }
        }),
        (Minimum, _) => binary(args, o, 1, |x: f32, y: f32| {
            if x.is_nan() || y.is_nan() {
                x + y
            } else if y < x {
                y
            } else {
                x
            }
        }),
        // PyTorch's f32 kernels: C's fmodf (exact), and for `remainder` the divisor added
        // to a non-zero remainder of the other sign.
        (RemainderTensor, _) => binary(args, o, 1, |x: f32, y: f32| {
            let m = x % y;
            if m != 0.0 && (y < 0.0) != (m < 0.0) {
                m + y
            } else {
                m
            }
        }),
        (FmodTensor, _) => binary(args, o, 1, |x: f32, y: f32| x % y),
        // In double, rounded once: within PyTorch's kernels' ulp of the true power.
        (PowTensorTensor, _) => binary(args, o, 1, |x: f32, y: f32| {
            (x as f64).powf(y as f64) as f32
        }),
        (EqTensor, _) => binary(args, o, 1, |x: f32, y: f32| u8::from(x == y)),
        (LtTensor, _) => binary(args, o, 1, |x: f32, y: f32| u8::from(x < y)),
        (GtTensor, _) => binary(args, o, 1, |x: f32, y: f32| u8::from(x > y)),
        (WhereSelf, _) => select(args, o),
        (ToCopy | Clone, _) => match args.first()? {
            Arg::Tensor(ty, _) if ty.dtype == o.ty.dtype && ty.shape == o.ty.shape => {
                copy::same(args, o)
            }
            // Conversions as PyTorch's: true is 1, anything but 0 (NaN too) is true, an
            // integer rounds to the nearest f32.
            Arg::Tensor(ty, _) => match (ty.dtype, o.ty.dtype) {
                (DType::Bool, DType::F32) => unary(args, o, 1, |x: u8| f32::from(x != 0)),
                (DType::F32, DType::Bool) => unary(args, o, 1, |x: f32| u8::from(x != 0.0)),
                (DType::I64, DType::F32) => unary(args, o, 1, |x: i64| x as f32),
                (DType::I64, DType::Bool) => unary(args, o, 1, |x: i64| u8::from(x != 0)),
                _ => unary(args, o, 1, |x: f32| x),
            },
            _ => None,
        },
        (Permute, OpParams::Permute { dims }) => copy::permute(dims, args, o),
        (Expand, _) => copy::expand(args, o),
        (SumDimIntList | MeanDim | Mean | Amax, OpParams::Reduce(r)) => {
            reduce::reduce(op, r, args, o)
        }
        (
            VarCorrection,
            OpParams::Var {
                reduction,
                correction,
            },
        ) => reduce::variance(reduction, *correction, args, o),
        (Softmax | LogSoftmax, &OpParams::Softmax { dim, .. }) => {
            reduce::softmax(dim, op == LogSoftmax, args, o)
        }
        (MaxPool2dWithIndicesBackward, _) => pool::max_pool2d_backward(args, o),
        (Convolution, OpParams::Conv(c)) => conv::forward(c, args, o, scratch),
        (Mm, _) => matmul::matmul(None, 1.0, args, o),
        (Addmm, &OpParams::Addmm { beta, alpha }) => matmul::matmul(Some(beta), alpha, args, o),
        (Bmm, _) => matmul::bmm(args, o),
        _ => None,
    }
}
