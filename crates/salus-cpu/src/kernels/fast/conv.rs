//! 2-d convolutions over f32: matrix products over the unfolded input (im2col), in the
//! lane scratch the plan reserved (`salus_graph::plan::scratch_bytes`). The batch runs in
//! products of `fold` images side by side ([`ConvParams::fold`]: one image, unless its
//! output plane is small), split over `slots` tasks ([`conv_slots`]) that run on
//! different cores at once, each in its own buffers. 1x1 convolutions with stride 1 and
//! no padding ("direct"), one image per product, multiply the input as it is. The
//! unfolded matrix's size and whether it is direct come from [`ConvParams::unfold_2d`],
//! as the planner's do. A transposed convolution runs as the gradients of its adjoint
//! ([`ConvParams::adjoint`]): its forward is the adjoint's input gradient, its input
//! gradient the adjoint's forward, its weight gradient the adjoint's with the two
//! operands' roles swapped.

use std::ops::Range;

use rayon::prelude::*;
use salus_graph::ConvParams;
use salus_graph::plan::conv_slots;

use super::matmul::{gemm, rows, transposed};
use super::{PARALLEL_WORK, for_chunks, input, typed_mut};
use crate::kernels::{Arg, Out, Result};

/// The geometry of a 2-d convolution, from its [`ConvParams`].
struct Geometry {
    n: usize,
    c_in: usize,
    h: usize,
    w: usize,
    c_out: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    groups: usize,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    /// Rows of the unfolded input of one image and group: `C_in/groups * kh * kw`.
    k: usize,
    /// Its columns: `oh * ow`.
    l: usize,
    /// The unfolded input is the input itself (for one image per product).
    direct: bool,
    /// Images side by side in one product ([`ConvParams::fold`]).
    fold: usize,
    /// Tasks the batch is split over, each with its own scratch ([`conv_slots`]).
    slots: usize,
}

impl Geometry {
    /// The geometry of a 2-d, non-transposed convolution (`None` for others: the
    /// generic path's).
    fn new(conv: &ConvParams) -> Option<Geometry> {
        if conv.transposed || conv.batch == 0 {
            return None;
        }
        let (k, l, direct) = conv.unfold_2d()?;
        let size = |v: u64| v as usize;
        let pair = |v: &[u64]| [size(v[0]), size(v[1])];
        Some(Geometry {
            n: size(conv.batch),
            c_in: size(conv.in_channels),
            h: size(conv.input[0]),
            w: size(conv.input[1]),
            c_out: size(conv.out_channels),
            kh: size(conv.kernel[0]),
            kw: size(conv.kernel[1]),
            oh: size(conv.output[0]),
            ow: size(conv.output[1]),
            groups: size(conv.groups),
            stride: pair(&conv.stride),
            padding: pair(&conv.padding),
            dilation: pair(&conv.dilation),
            k: size(k),
            l: size(l),
            direct,
            fold: size(conv.fold()),
            slots: size(conv_slots(conv)),
        })
    }

    fn cin_g(&self) -> usize {
        self.c_in / self.groups
    }

    fn cout_g(&self) -> usize {
        self.c_out / self.groups
    }

    /// Columns of one product: `fold` images' output planes.
    fn cols(&self) -> usize {
        self.fold * self.l
    }

    /// Whether a product multiplies the input itself (one image, direct).
    fn in_place(&self) -> bool {
        self.direct && self.fold == 1
    }

    /// The unfolded input of one product and group, in f32 (none when in place).
    fn unfold_len(&self) -> usize {
        if self.in_place() {
            0
        } else {
            self.k * self.cols()
        }
    }

    /// One product's result (or output gradient) of one group, gathered from the images'
    /// planes (none for one image, whose planes it is).
    fn gathered_len(&self) -> usize {
        if self.fold > 1 {
            self.cout_g() * self.cols()
        } else {
            0
        }
    }

    /// Scratch f32 of one slot of the forward pass.
    fn forward_slot_len(&self) -> usize {
        self.unfold_len() + self.gathered_len()
    }

    /// Scratch f32 of one slot of the backward pass: the unfolded input and its
    /// gradient, the gathered output gradient and a partial weight gradient.
    fn backward_slot_len(&self) -> usize {
        2 * self.unfold_len() + self.gathered_len() + self.c_out * self.k
    }

    /// Images of one task: whole products, as evenly over the slots as they go.
    fn per_task(&self) -> usize {
        self.n.div_ceil(self.fold).div_ceil(self.slots) * self.fold
    }

    /// Unfolds (im2col) each of `images` (each `c_in` planes) for group `g` into `col`:
    /// image `j` in columns `j l..(j + 1) l` of rows `ld` long, each row segment's
    /// geometry worked out once for all the images. With `split`, a large unfolding runs
    /// blocks of input channels on different cores (the copies are the same whoever
    /// makes them).
    fn unfold(&self, images: &[f32], g: usize, col: &mut [f32], ld: usize, split: bool) {
        let (size, ow) = (self.image_in(), self.ow);
        let group = g * self.cin_g() * self.h * self.w;
        let per_channel = self.kh * self.kw * ld;
        // The rows of whole input channels, from element `start` of `col`.
        let channels = |start: usize, rows: &mut [f32]| {
            let first = start / per_channel;
            let count = rows.len() / per_channel;
            self.rows(first..first + count, |row, oy, inside, cols| {
                for (j, image) in images.chunks_exact(size).enumerate() {
                    let at = row * ld + j * self.l + oy * ow;
                    self.unfold_row(&image[group..], &mut rows[at..at + ow], inside, cols);
                }
            });
        };
        let col = &mut col[..self.cin_g() * per_channel];
        if split {
            for_chunks(col, per_channel, 1, channels);
        } else {
            channels(0, col);
        }
    }

    /// One output row's `ow` columns of an unfolded row (`dst`), from the row of `planes`
    /// (a group's input planes) that starts at `inside`: zeros where the window is over
    /// padding.
    fn unfold_row(
        &self,
        planes: &[f32],
        dst: &mut [f32],
        inside: Option<usize>,
        (lo, hi, dx): (usize, usize, isize),
    ) {
        let Some(at) = inside else {
            dst.fill(0.0);
            return;
        };
        dst[..lo].fill(0.0);
        dst[hi..].fill(0.0);
        if lo == hi {
            // Every column of this row is padding (a kernel wider than the input).
            return;
        }
        let src = &planes[at..at + self.w];
        let s = self.stride[1];
        if s == 1 {
            let from = (lo as isize + dx) as usize;
            dst[lo..hi].copy_from_slice(&src[from..from + hi - lo]);
        } else {
            for (ox, d) in dst[lo..hi].iter_mut().enumerate() {
                *d = src[(((lo + ox) * s) as isize + dx) as usize];
            }
        }
    }

    /// Adds the unfolded gradient `col` of group `g` (`k` rows, image `j`'s `l` columns
    /// from `j l`, rows `ld` long) back into each of `images` (each `c_in` planes). With
    /// `split`, a large one runs images on different cores (each image's sums in the same
    /// order).
    fn fold_back(&self, col: &[f32], g: usize, images: &mut [f32], ld: usize, split: bool) {
        let size = self.image_in();
        // Whole images, from element `start` of `images`.
        let back = |start: usize, chunk: &mut [f32]| {
            for (j, x) in chunk.chunks_exact_mut(size).enumerate() {
                self.col2im(&col[(start / size + j) * self.l..], g, x, ld);
            }
        };
        if split {
            for_chunks(images, size, 1, back);
        } else {
            back(0, images);
        }
    }

    fn image_in(&self) -> usize {
        self.c_in * self.h * self.w
    }

    fn image_out(&self) -> usize {
        self.c_out * self.l
    }

    /// The valid output columns `lo..hi` for kernel column `kx` (the input column
    /// `ox * stride + kx * dilation - padding` lies inside), and that offset.
    fn columns(&self, kx: usize) -> (usize, usize, isize) {
        let dx = (kx * self.dilation[1]) as isize - self.padding[1] as isize;
        let s = self.stride[1] as isize;
        let lo = if dx >= 0 {
            0
        } else {
            ((-dx + s - 1) / s) as usize
        };
        let room = self.w as isize - dx;
        let hi = if room <= 0 {
            0
        } else {
            (((room + s - 1) / s) as usize).min(self.ow)
        };
        (lo.min(hi), hi, dx)
    }

    /// Calls `f(row_of_col, oy, input_row, lo, hi, dx)` for every unfolded row of the
    /// input channels `channels` (rows counted from the first of them) and output row
    /// whose input row lies inside; `None` as the input row when it is padding.
    fn rows(
        &self,
        channels: Range<usize>,
        mut f: impl FnMut(usize, usize, Option<usize>, (usize, usize, isize)),
    ) {
        for ci in channels.clone() {
            for ky in 0..self.kh {
                for kx in 0..self.kw {
                    let row = ((ci - channels.start) * self.kh + ky) * self.kw + kx;
                    let cols = self.columns(kx);
                    for oy in 0..self.oh {
                        let iy = (oy * self.stride[0] + ky * self.dilation[0]) as isize
                            - self.padding[0] as isize;
                        let inside = (iy >= 0 && (iy as usize) < self.h)
                            .then(|| (ci * self.h + iy as usize) * self.w);
                        f(row, oy, inside, cols);
                    }
                }
            }
        }
    }

    /// Adds the unfolded gradient `col` of group `g` (`k` rows of `l` columns, `ld` apart)
    /// back into one image's planes `x`.
    fn col2im(&self, col: &[f32], g: usize, x: &mut [f32], ld: usize) {
        let (ow, s, w) = (self.ow, self.stride[1], self.w);
        let planes = &mut x[g * self.cin_g() * self.h * w..];
        self.rows(0..self.cin_g(), |row, oy, inside, (lo, hi, dx)| {
            let Some(at) = inside else {
                return;
            };
            if lo == hi {
                return;
            }
            let src = &col[row * ld + oy * ow + lo..row * ld + oy * ow + hi];
            let dst = &mut planes[at..at + w];
            if s == 1 {
                let from = (lo as isize + dx) as usize;
                dst[from..from + hi - lo]
                    .iter_mut()
                    .zip(src)
                    .for_each(|(d, &v)| *d += v);
            } else {
                for (ox, &v) in src.iter().enumerate() {
                    dst[(((lo + ox) * s) as isize + dx) as usize] += v;
                }
            }
        });
    }

    /// Multiply-adds of one pass over the batch, to decide whether to split it.
    fn work(&self) -> usize {
        self.n * self.c_out * self.k * self.l
    }
}

fn scratch_f32(scratch: &mut [u8], need: usize) -> std::result::Result<&mut [f32], String> {
    // A node that needs no scratch (a direct 1x1 convolution) gets an empty slice at
    // whatever address the lane layout gives it, which need not be f32-aligned.
    if need == 0 {
        return Ok(&mut []);
    }
    let s: &mut [f32] = bytemuck::try_cast_slice_mut(scratch)
        .map_err(|e| format!("convolution scratch is not f32-aligned: {e}"))?;
    let have = s.len();
    s.get_mut(..need)
        .ok_or_else(|| format!("convolution needs {need} f32 of scratch, the plan gave {have}"))
}

pub(super) fn forward(
    conv: &ConvParams,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
    scratch: &mut [u8],
) -> Option<Result<()>> {
    let (_, x) = input::<f32>(args, 0)?;
    let (_, w) = input::<f32>(args, 1)?;
    let bias = match args.get(2) {
        None | Some(Arg::Absent) => None,
        Some(_) => Some(input::<f32>(args, 2)?.1),
    };
    let dst = typed_mut::<f32>(o.ty, o.bytes)?;
    if conv.transposed {
        // The input gradient of its adjoint, whose output gradient `x` is.
        let geo = Geometry::new(&conv.adjoint()?)?;
        if bias.is_some_and(|b| b.len() != geo.c_in)
            || w.len() != geo.c_out * geo.k
            || x.len() != geo.n * geo.image_out()
            || dst.len() != geo.n * geo.image_in()
        {
            return None;
        }
        let space = match scratch_f32(scratch, geo.slots * geo.backward_slot_len()) {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        let result = backward_core(&geo, x, &[], w, Some(&mut *dst), None, space);
        if let (Ok(()), Some(b)) = (&result, bias) {
            add_bias(dst, b, geo.h * geo.w);
        }
        return Some(result);
    }
    let geo = Geometry::new(conv)?;
    if bias.is_some_and(|b| b.len() != geo.c_out)
        || w.len() != geo.c_out * geo.k
        || x.len() != geo.n * geo.image_in()
        || dst.len() != geo.n * geo.image_out()
    {
        return None;
    }
    let space = match scratch_f32(scratch, geo.slots * geo.forward_slot_len()) {
        Ok(s) => s,
        Err(e) => return Some(Err(e)),
    };
    Some(forward_core(&geo, x, w, bias, dst, space))
}

/// Adds `bias[c]` to every element of channel `c` of whole images (`bias.len()` planes of
/// `plane` elements each).
fn add_bias(images: &mut [f32], bias: &[f32], plane: usize) {
    for image in images.chunks_exact_mut(bias.len() * plane) {
        for (channel, &b) in image.chunks_exact_mut(plane).zip(bias) {
            channel.iter_mut().for_each(|v| *v += b);
        }
    }
}

/// `dst = conv(x, w) + bias` (the sizes checked), in slots of `space`.
fn forward_core(
    geo: &Geometry,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    dst: &mut [f32],
    space: &mut [f32],
) -> Result<()> {
    let (k, l, cout_g) = (geo.k, geo.l, geo.cout_g());
    let slot_len = geo.forward_slot_len();
    let per = geo.per_task();
    let parallel = geo.slots > 1 && geo.work() >= PARALLEL_WORK && rayon::current_num_threads() > 1;
    // Task `t` runs images `t * per..`, `fold` at a time; tasks on different cores
    // unfold on their own, one task with every core.
    let task = |t: usize, out: &mut [f32], slot: &mut [f32]| -> Result<()> {
        let (col, gathered) = slot.split_at_mut(geo.unfold_len());
        for (p, out) in out.chunks_mut(geo.fold * geo.image_out()).enumerate() {
            let m = out.len() / geo.image_out();
            let n0 = t * per + p * geo.fold;
            let images = &x[n0 * geo.image_in()..(n0 + m) * geo.image_in()];
            for g in 0..geo.groups {
                let weight = rows(&w[g * cout_g * k..(g + 1) * cout_g * k], cout_g, k);
                if geo.fold == 1 {
                    let unfolded = if geo.in_place() {
                        &images[g * k * l..(g + 1) * k * l]
                    } else {
                        geo.unfold(images, g, col, l, !parallel);
                        &*col
                    };
                    let out = &mut out[g * cout_g * l..(g + 1) * cout_g * l];
                    gemm(weight, rows(unfolded, k, l), out, false, 1.0)?;
                    continue;
                }
                // The product's columns are the images' planes side by side: spread them.
                let ml = m * l;
                geo.unfold(images, g, col, ml, !parallel);
                gemm(weight, rows(col, k, ml), gathered, false, 1.0)?;
                for (j, image) in out.chunks_exact_mut(geo.image_out()).enumerate() {
                    let planes = &mut image[g * cout_g * l..(g + 1) * cout_g * l];
                    for (o, plane) in planes.chunks_exact_mut(l).enumerate() {
                        plane.copy_from_slice(&gathered[o * ml + j * l..o * ml + (j + 1) * l]);
                    }
                }
            }
            if let Some(b) = bias {
                add_bias(out, b, l);
            }
        }
        Ok(())
    };
    let chunk = per * geo.image_out();
    match (parallel, slot_len) {
        (true, 0) => dst
            .par_chunks_mut(chunk)
            .enumerate()
            .try_for_each(|(t, out)| task(t, out, &mut [])),
        (true, _) => dst
            .par_chunks_mut(chunk)
            .zip(space.par_chunks_mut(slot_len))
            .enumerate()
            .try_for_each(|(t, (out, slot))| task(t, out, slot)),
        (false, _) => dst
            .chunks_mut(chunk)
            .enumerate()
            .try_for_each(|(t, out)| task(t, out, &mut space[..slot_len])),
    }
}

/// An optional output's f32 elements (`Some(None)`: unused).
fn typed_out<'a>(o: &'a mut Option<Out<'_>>) -> Option<Option<&'a mut [f32]>> {
    match o {
        Some(o) => typed_mut::<f32>(o.ty, &mut *o.bytes).map(Some),
        None => Some(None),
    }
}

pub(super) fn backward(
    conv: &ConvParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
    scratch: &mut [u8],
) -> Option<Result<()>> {
    let (_, gout) = input::<f32>(args, 0)?;
    let (_, x) = input::<f32>(args, 1)?;
    let (_, w) = input::<f32>(args, 2)?;
    let [gi, gw, gb] = outs else {
        return None;
    };
    let (gi, gw, gb) = (typed_out(gi)?, typed_out(gw)?, typed_out(gb)?);
    let transposed = conv.transposed;
    let geo = if transposed {
        Geometry::new(&conv.adjoint()?)?
    } else {
        Geometry::new(conv)?
    };
    // Transposed, the adjoint's input is the output gradient and its output the input.
    let (y_len, x_len) = (geo.n * geo.image_out(), geo.n * geo.image_in());
    let (gout_len, input_len, bias_len) = if transposed {
        (x_len, y_len, geo.c_in)
    } else {
        (y_len, x_len, geo.c_out)
    };
    if w.len() != geo.c_out * geo.k
        || x.len() != input_len
        || gout.len() != gout_len
        || gi.as_ref().is_some_and(|g| g.len() != input_len)
        || gw.as_ref().is_some_and(|g| g.len() != geo.c_out * geo.k)
        || gb.as_ref().is_some_and(|g| g.len() != bias_len)
    {
        return None;
    }
    let space = match scratch_f32(scratch, geo.slots * geo.backward_slot_len()) {
        Ok(s) => s,
        Err(e) => return Some(Err(e)),
    };
    let result = if transposed {
        // The input's gradient is the adjoint's forward of the output gradient; the
        // weight's, the adjoint's weight gradient with the roles of the two swapped.
        let mut result = Ok(());
        if let Some(gi) = gi {
            result = forward_core(&geo, gout, w, None, gi, space);
        }
        if result.is_ok() && gw.is_some() {
            result = backward_core(&geo, x, gout, w, None, gw, space);
        }
        result
    } else {
        backward_core(&geo, gout, x, w, gi, gw, space)
    };
    if let Err(e) = result {
        return Some(Err(e));
    }
    if let Some(gb) = gb {
        let plane = gout.len() / (geo.n * bias_len).max(1);
        for (c, b) in gb.iter_mut().enumerate() {
            let mut total = 0f64;
            for n in 0..geo.n {
                let at = (n * bias_len + c) * plane;
                total += gout[at..at + plane]
                    .iter()
                    .map(|&v| f64::from(v))
                    .sum::<f64>();
            }
            *b = total as f32;
        }
    }
    Some(Ok(()))
}

/// The input gradient `gi` and the weight gradient `gw` (each when given) of `conv(x, w)`
/// for the output gradient `gout` (the sizes checked; `x` may be empty without `gw`), in
/// slots of `space`.
fn backward_core(
    geo: &Geometry,
    gout: &[f32],
    x: &[f32],
    w: &[f32],
    gi: Option<&mut [f32]>,
    gw: Option<&mut [f32]>,
    space: &mut [f32],
) -> Result<()> {
    let (k, l, cout_g, cin_g) = (geo.k, geo.l, geo.cout_g(), geo.cin_g());
    let (unfold, gathered) = (geo.unfold_len(), geo.gathered_len());
    let slot_len = geo.backward_slot_len();
    let per = geo.per_task();
    let want_gw = gw.is_some();
    let tasks = geo.n.div_ceil(per);
    let parallel = tasks > 1 && 2 * geo.work() >= PARALLEL_WORK && rayon::current_num_threads() > 1;
    // Task `t` runs images `t * per..`, `fold` at a time, adding its grad_weight into its
    // slot's partial sum; tasks on different cores unfold on their own, one task with
    // every core.
    let task = |t: usize, gi: Option<&mut [f32]>, slot: &mut [f32]| -> Result<()> {
        let (col, rest) = slot.split_at_mut(unfold);
        let (gcol, rest) = rest.split_at_mut(unfold);
        let (g_buf, partial) = rest.split_at_mut(gathered);
        partial.fill(0.0);
        let first = t * per;
        let images = (geo.n - first.min(geo.n)).min(per);
        let mut gi = gi;
        if let Some(gi) = gi.as_deref_mut() {
            gi.fill(0.0);
        }
        for n0 in (first..first + images).step_by(geo.fold) {
            let m = geo.fold.min(first + images - n0);
            let ml = m * l;
            for g in 0..geo.groups {
                let g_mat = if geo.fold == 1 {
                    let at = (n0 * geo.c_out + g * cout_g) * l;
                    rows(&gout[at..at + cout_g * l], cout_g, l)
                } else {
                    // The images' output-gradient planes side by side, as the product's
                    // columns.
                    for j in 0..m {
                        for o in 0..cout_g {
                            let at = ((n0 + j) * geo.c_out + g * cout_g + o) * l;
                            g_buf[o * ml + j * l..o * ml + (j + 1) * l]
                                .copy_from_slice(&gout[at..at + l]);
                        }
                    }
                    rows(&g_buf[..cout_g * ml], cout_g, ml)
                };
                if want_gw {
                    let xs = &x[n0 * geo.image_in()..(n0 + m) * geo.image_in()];
                    let unfolded = if geo.in_place() {
                        &xs[g * k * l..(g + 1) * k * l]
                    } else {
                        geo.unfold(xs, g, col, ml, !parallel);
                        &*col
                    };
                    gemm(
                        g_mat,
                        transposed(unfolded, ml, k),
                        &mut partial[g * cout_g * k..(g + 1) * cout_g * k],
                        true,
                        1.0,
                    )?;
                }
                if let Some(gi) = gi.as_deref_mut() {
                    let at = (n0 - first) * geo.image_in();
                    let gi_images = &mut gi[at..at + m * geo.image_in()];
                    let w_t = transposed(&w[g * cout_g * k..(g + 1) * cout_g * k], k, cout_g);
                    if geo.in_place() {
                        let at = g * cin_g * geo.h * geo.w;
                        gemm(w_t, g_mat, &mut gi_images[at..at + k * l], false, 1.0)?;
                    } else {
                        gemm(w_t, g_mat, gcol, false, 1.0)?;
                        geo.fold_back(gcol, g, gi_images, ml, !parallel);
                    }
                }
            }
        }
        Ok(())
    };
    let slots_used = &mut space[..tasks * slot_len];
    let chunk = per * geo.image_in();
    let result = match (gi, parallel) {
        (Some(gi), true) => gi
            .par_chunks_mut(chunk)
            .zip(slots_used.par_chunks_mut(slot_len))
            .enumerate()
            .try_for_each(|(t, (gi, slot))| task(t, Some(gi), slot)),
        (None, true) => slots_used
            .par_chunks_mut(slot_len)
            .enumerate()
            .try_for_each(|(t, slot)| task(t, None, slot)),
        (Some(gi), false) => gi
            .chunks_mut(chunk)
            .zip(slots_used.chunks_mut(slot_len))
            .enumerate()
            .try_for_each(|(t, (gi, slot))| task(t, Some(gi), slot)),
        (None, false) => slots_used
            .chunks_mut(slot_len)
            .enumerate()
            .try_for_each(|(t, slot)| task(t, None, slot)),
    };
    result?;
    if let Some(gw) = gw {
        gw.fill(0.0);
        for slot in slots_used.chunks_exact(slot_len) {
            let partial = &slot[2 * unfold + gathered..];
            gw.iter_mut().zip(partial).for_each(|(a, &p)| *a += p);
        }
    }
    Ok(())
}
