//! 2-d max pooling over f32 planes, forward and backward, parallel over planes.

use rayon::prelude::*;
use salus_graph::PoolParams;

use super::{PARALLEL_WORK, for_chunks, input, typed_mut};
use crate::kernels::{Arg, Out, Result};

/// A pooling window's geometry.
struct Window {
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
}

impl Window {
    /// The window of a pooling of a 4-d input (`None` for 3-d: the generic path's).
    fn new(pool: &PoolParams, input: &[u64]) -> Option<Window> {
        if input.len() != 4 {
            return None;
        }
        let size = |v: [u64; 2]| v.map(|x| x as usize);
        Some(Window {
            kernel: size(pool.kernel),
            stride: size(pool.stride),
            padding: size(pool.padding),
            dilation: size(pool.dilation),
            h: pool.input[0] as usize,
            w: pool.input[1] as usize,
            oh: pool.output[0] as usize,
            ow: pool.output[1] as usize,
        })
    }

    /// Pools one plane: `f(output_index, best_value, its_index_in_the_plane)`.
    fn pool(&self, plane: &[f32], mut f: impl FnMut(usize, f32, usize)) {
        for oy in 0..self.oh {
            for ox in 0..self.ow {
                let mut best = f32::NEG_INFINITY;
                let mut at = usize::MAX;
                for ky in 0..self.kernel[0] {
                    let iy = (oy * self.stride[0] + ky * self.dilation[0]) as isize
                        - self.padding[0] as isize;
                    if iy < 0 || iy as usize >= self.h {
                        continue;
                    }
                    for kx in 0..self.kernel[1] {
                        let ix = (ox * self.stride[1] + kx * self.dilation[1]) as isize
                            - self.padding[1] as isize;
                        if ix < 0 || ix as usize >= self.w {
                            continue;
                        }
                        let p = iy as usize * self.w + ix as usize;
                        let v = plane[p];
                        // The first NaN wins, else the first largest: without branches,
                        // which maxima of real data would mispredict.
                        let take = at == usize::MAX || v > best || (v.is_nan() && !best.is_nan());
                        best = if take { v } else { best };
                        at = if take { p } else { at };
                    }
                }
                if at == usize::MAX {
                    at = 0;
                }
                f(oy * self.ow + ox, best, at);
            }
        }
    }
}

pub(super) fn max_pool2d(
    pool: &PoolParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Option<Result<()>> {
    let (ty, x) = input::<f32>(args, 0)?;
    let [values, indices] = outs else {
        return None;
    };
    let win = Window::new(pool, &ty.shape)?;
    let values = match values {
        Some(o) => Some(typed_mut::<f32>(o.ty, &mut *o.bytes)?),
        None => None,
    };
    let indices = match indices {
        Some(o) => Some(typed_mut::<i64>(o.ty, &mut *o.bytes)?),
        None => None,
    };
    let (plane_in, plane_out) = (win.h * win.w, win.oh * win.ow);
    let planes = x.len() / plane_in.max(1);
    if plane_out == 0
        || planes * plane_out != values.as_ref().map_or(planes * plane_out, |v| v.len())
    {
        return None;
    }
    let work = planes * plane_out * win.kernel[0] * win.kernel[1];
    let parallel = work >= PARALLEL_WORK && rayon::current_num_threads() > 1;
    let one = |p: usize, v: Option<&mut [f32]>, i: Option<&mut [i64]>| {
        let plane = &x[p * plane_in..(p + 1) * plane_in];
        match (v, i) {
            (Some(v), Some(i)) => win.pool(plane, |o, best, at| {
                v[o] = best;
                i[o] = at as i64;
            }),
            (Some(v), None) => win.pool(plane, |o, best, _| v[o] = best),
            (None, Some(i)) => win.pool(plane, |o, _, at| i[o] = at as i64),
            (None, None) => {}
        }
    };
    match (values, indices) {
        (Some(v), Some(i)) if parallel => v
            .par_chunks_mut(plane_out)
            .zip(i.par_chunks_mut(plane_out))
            .enumerate()
            .for_each(|(p, (v, i))| one(p, Some(v), Some(i))),
        (Some(v), Some(i)) => v
            .chunks_mut(plane_out)
            .zip(i.chunks_mut(plane_out))
            .enumerate()
            .for_each(|(p, (v, i))| one(p, Some(v), Some(i))),
        (Some(v), None) => for_chunks(v, plane_out, plane_out, |start, chunk| {
            for (k, v) in chunk.chunks_mut(plane_out).enumerate() {
                one(start / plane_out + k, Some(v), None);
            }
        }),
        (None, Some(i)) => i
            .chunks_mut(plane_out)
            .enumerate()
            .for_each(|(p, i)| one(p, None, Some(i))),
        (None, None) => {}
    }
    Some(Ok(()))
}

pub(super) fn max_pool2d_backward(args: &[Arg<'_>], o: &mut Out<'_>) -> Option<Result<()>> {
    let (gty, g) = input::<f32>(args, 0)?;
    let (ity, _) = input::<f32>(args, 1)?;
    let (_, idx) = input::<i64>(args, 2)?;
    if gty.rank() != 4 || ity.rank() != 4 || idx.len() != g.len() {
        return None;
    }
    let plane_in = (ity.shape[2] * ity.shape[3]) as usize;
    let plane_out = (gty.shape[2] * gty.shape[3]) as usize;
    let dst = typed_mut::<f32>(o.ty, o.bytes)?;
    if plane_in == 0 || plane_out == 0 || dst.len() / plane_in != g.len() / plane_out {
        return None;
    }
    // Every index is checked before anything is written.
    if let Some(&bad) = idx.iter().find(|&&i| i < 0 || i as usize >= plane_in) {
        return Some(Err(format!(
            "pooling index {bad} is out of range for a dimension of size {plane_in}"
        )));
    }
    for_chunks(dst, plane_in, plane_out, |start, chunk| {
        chunk.fill(0.0);
        let first = start / plane_in;
        for (k, plane) in chunk.chunks_mut(plane_in).enumerate() {
            let p = first + k;
            let gs = &g[p * plane_out..(p + 1) * plane_out];
            let is = &idx[p * plane_out..(p + 1) * plane_out];
            for (&v, &i) in gs.iter().zip(is) {
                plane[i as usize] += v;
            }
        }
    });
    Some(Ok(()))
}
