//! Convolutions the typed 2-d `f32` kernel (`fast::conv`) does not take: 1-d, 2-d and
//! 3-d, transposed or not, any float dtype (values in `f64`, each result rounded once).
//! Direct loops: correct for every geometry, not fast; the target models' 2-d `f32`
//! convolutions keep their matrix-product kernel. The geometry is the node's
//! [`ConvParams`].
//!
//! Both kinds of convolution relate a "small" tensor to a "large" one: position `a` of the
//! small one and kernel tap `k` meet position `b = a * stride - padding + k * dilation` of
//! the large one. Not transposed, the input is large and the output small, with weight
//! `[C_out, C_in/groups, *k]`; transposed, the input is small and the output large, with
//! weight `[C_in, C_out/groups, *k]`. [`Geometry::for_each_tap`] walks these triples once;
//! the forward and all three gradients are sums over them.

use salus_graph::{ConvParams, TensorType};

use super::{Arg, Out, Result, load, numel, store, tensor};

/// The geometry of one convolution, spatial dims padded to three with size-1 dims.
struct Geometry {
    n: usize,
    groups: usize,
    /// Channels per group of the input and of the output.
    cin_g: usize,
    cout_g: usize,
    /// Spatial sizes of the input, the output and the kernel.
    input: [usize; 3],
    output: [usize; 3],
    kernel: [usize; 3],
    stride: [i64; 3],
    padding: [i64; 3],
    dilation: [i64; 3],
    transposed: bool,
}

/// Per-dimension values of 1 to 3 spatial dimensions, padded in front to three with `pad`.
fn spatial3<T: Copy>(values: &[u64], pad: T, cast: impl Fn(u64) -> T) -> [T; 3] {
    let mut out = [pad; 3];
    for (o, &v) in out[3 - values.len()..].iter_mut().zip(values) {
        *o = cast(v);
    }
    out
}

impl Geometry {
    fn new(conv: &ConvParams) -> Geometry {
        let size = |v: u64| v as usize;
        let signed = |v: u64| v as i64;
        Geometry {
            n: conv.batch as usize,
            groups: conv.groups as usize,
            cin_g: conv.in_per_group() as usize,
            cout_g: conv.out_per_group() as usize,
            input: spatial3(&conv.input, 1, size),
            output: spatial3(&conv.output, 1, size),
            kernel: spatial3(&conv.kernel, 1, size),
            stride: spatial3(&conv.stride, 1, signed),
            padding: spatial3(&conv.padding, 0, signed),
            dilation: spatial3(&conv.dilation, 1, signed),
            transposed: conv.transposed,
        }
    }

    /// Calls `f(input_index, output_index, weight_index)` for every product term of the
    /// convolution.
    fn for_each_tap(&self, mut f: impl FnMut(usize, usize, usize)) {
        let (small, large) = if self.transposed {
            (self.input, self.output)
        } else {
            (self.output, self.input)
        };
        let plane = |s: [usize; 3]| s[0] * s[1] * s[2];
        let (in_plane, out_plane, k_plane) =
            (plane(self.input), plane(self.output), plane(self.kernel));
        let (c_in, c_out) = (self.cin_g * self.groups, self.cout_g * self.groups);
        let at = |p: [usize; 3], s: [usize; 3]| (p[0] * s[1] + p[1]) * s[2] + p[2];
        for n in 0..self.n {
            for g in 0..self.groups {
                for ci in 0..self.cin_g {
                    for co in 0..self.cout_g {
                        let (c, o) = (g * self.cin_g + ci, g * self.cout_g + co);
                        let x_base = (n * c_in + c) * in_plane;
                        let y_base = (n * c_out + o) * out_plane;
                        let w_base = if self.transposed {
                            (c * self.cout_g + co) * k_plane
                        } else {
                            (o * self.cin_g + ci) * k_plane
                        };
                        for a in 0..plane(small) {
                            let a3 = [
                                a / (small[1] * small[2]),
                                a / small[2] % small[1],
                                a % small[2],
                            ];
                            for k in 0..k_plane {
                                let k3 = [
                                    k / (self.kernel[1] * self.kernel[2]),
                                    k / self.kernel[2] % self.kernel[1],
                                    k % self.kernel[2],
                                ];
                                let mut b3 = [0usize; 3];
                                let inside = (0..3).all(|d| {
                                    let b = a3[d] as i64 * self.stride[d] - self.padding[d]
                                        + k3[d] as i64 * self.dilation[d];
                                    b3[d] = b.max(0) as usize;
                                    (0..large[d] as i64).contains(&b)
                                });
                                if !inside {
                                    continue;
                                }
                                let (s, l) = (at(a3, small), at(b3, large));
                                let (xi, yi) = if self.transposed { (s, l) } else { (l, s) };
                                f(x_base + xi, y_base + yi, w_base + k);
                            }
                        }
                    }
                }
            }
        }
    }
}

fn values(ty: &TensorType, bytes: &[u8]) -> Vec<f64> {
    (0..numel(&ty.shape))
        .map(|i| load(bytes, ty.dtype, i))
        .collect()
}

fn write(o: &mut Out<'_>, data: Vec<f64>) -> Result<()> {
    if numel(&o.ty.shape) != data.len() {
        return Err(format!("output {} must have {} elements", o.ty, data.len()));
    }
    for (i, v) in data.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}

/// `convolution(input, weight, bias?)`.
pub(super) fn convolution(conv: &ConvParams, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ity, ib) = tensor(args, 0)?;
    let (wty, wb) = tensor(args, 1)?;
    let geometry = Geometry::new(conv);
    let (x, w) = (values(ity, ib), values(wty, wb));
    let mut y = vec![0.0; numel(&o.ty.shape)];
    geometry.for_each_tap(|xi, yi, wi| y[yi] += x[xi] * w[wi]);
    if let Some(Arg::Tensor(bty, bb)) = args.get(2) {
        let c_out = o.ty.shape[1] as usize;
        let plane = numel(&o.ty.shape[2..]);
        for (i, v) in y.iter_mut().enumerate() {
            *v += load(bb, bty.dtype, (i / plane.max(1)) % c_out);
        }
    }
    write(o, y)
}

/// `convolution_backward(grad_output, input, weight)`: (grad_input, grad_weight,
/// grad_bias), whichever are used.
pub(super) fn convolution_backward(
    conv: &ConvParams,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (gty, gb) = tensor(args, 0)?;
    let (ity, ib) = tensor(args, 1)?;
    let (wty, wb) = tensor(args, 2)?;
    let geometry = Geometry::new(conv);
    let g = values(gty, gb);
    let want: Vec<bool> = outs.iter().map(Option::is_some).collect();
    let want = |k: usize| want.get(k).copied().unwrap_or(false);
    if want(0) {
        let w = values(wty, wb);
        let mut gx = vec![0.0; numel(&ity.shape)];
        geometry.for_each_tap(|xi, yi, wi| gx[xi] += g[yi] * w[wi]);
        if let Some(Some(o)) = outs.get_mut(0) {
            write(o, gx)?;
        }
    }
    if want(1) {
        let x = values(ity, ib);
        let mut gw = vec![0.0; numel(&wty.shape)];
        geometry.for_each_tap(|xi, yi, wi| gw[wi] += g[yi] * x[xi]);
        if let Some(Some(o)) = outs.get_mut(1) {
            write(o, gw)?;
        }
    }
    if let Some(Some(o)) = outs.get_mut(2) {
        let c_out = gty.shape[1] as usize;
        let plane = numel(&gty.shape[2..]).max(1);
        let mut gbias = vec![0.0; c_out];
        for (i, v) in g.iter().enumerate() {
            gbias[(i / plane) % c_out] += v;
        }
        write(o, gbias)?;
    }
    Ok(())
}
