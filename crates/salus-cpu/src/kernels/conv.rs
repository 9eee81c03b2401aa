//! Convolutions the 2-d `f32` kernel does not take: 1-d, 2-d and 3-d, transposed or not,
//! any float dtype (values in `f64`, each result rounded once). Direct loops: correct
//! for every geometry, not fast; the target models' 2-d `f32` convolutions keep their
//! matrix-product kernel.
//!
//! Both kinds of convolution relate a "small" tensor to a "large" one: position `a` of the
//! small one and kernel tap `k` meet position `b = a * stride - padding + k * dilation` of
//! the large one. Not transposed, the input is large and the output small, with weight
//! `[C_out, C_in/groups, *k]`; transposed, the input is small and the output large, with
//! weight `[C_in, C_out/groups, *k]`. [`Geometry::for_each_tap`] walks these triples once;
//! the forward and all three gradients are sums over them.

use salus_graph::{DType, Node, Op, TensorType};

use super::{Arg, Out, Result, attr_bool, attr_int, attr_ints, load, numel, store, tensor};

/// True when `convolution` (or its backward) must run here rather than in the 2-d `f32`
/// kernel: another rank, transposed, or a dtype other than f32.
pub(super) fn is_generic(node: &Node, args: &[Arg<'_>]) -> bool {
    let (input, operands) = if node.op == Op::ConvolutionBackward {
        (1, 0..3)
    } else {
        (0, 0..2)
    };
    let rank4 = matches!(args.get(input), Some(Arg::Tensor(t, _)) if t.rank() == 4);
    let mut all_f32 = operands
        .map(|k| args.get(k))
        .all(|a| matches!(a, Some(Arg::Tensor(t, _)) if t.dtype == DType::F32));
    all_f32 &= !attr_bool(node, "transposed");
    !(rank4 && all_f32)
}

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

fn spatial3(shape: &[u64]) -> [usize; 3] {
    let s = &shape[2..];
    let mut out = [1usize; 3];
    for (o, v) in out[3 - s.len()..].iter_mut().zip(s) {
        *o = *v as usize;
    }
    out
}

impl Geometry {
    fn new(node: &Node, input: &TensorType, weight: &TensorType, output: &[u64]) -> Result<Self> {
        let rank = input.rank();
        if !(3..=5).contains(&rank) || weight.rank() != rank || output.len() != rank {
            return Err(format!(
                "convolution needs input, weight and output of one rank from 3 to 5, got {input}, {weight} and {output:?}"
            ));
        }
        let dims = rank - 2;
        let triple = |name: &str, default: i64| -> Result<[i64; 3]> {
            let values = attr_ints(node, name).unwrap_or(&[]);
            let mut out = [default; 3];
            match values.len() {
                0 => {}
                1 => out[3 - dims..].fill(values[0]),
                len if len == dims => out[3 - dims..].copy_from_slice(values),
                len => {
                    return Err(format!(
                        "attribute {name:?} has {len} values for {dims} spatial dimensions"
                    ));
                }
            }
            Ok(out)
        };
        let transposed = attr_bool(node, "transposed");
        let groups = attr_int(node, "groups", 1);
        if groups <= 0 {
            return Err(format!("groups must be positive, got {groups}"));
        }
        let groups = groups as usize;
        let (c_in, c_out) = (input.shape[1] as usize, output[1] as usize);
        let (w0, w1) = (weight.shape[0] as usize, weight.shape[1] as usize);
        let (cin_g, cout_g) = if transposed {
            (w0 / groups, w1)
        } else {
            (w1, w0 / groups)
        };
        if cin_g * groups != c_in || cout_g * groups != c_out {
            return Err(format!(
                "weight {weight} with {groups} groups does not map {c_in} input channels to {c_out}"
            ));
        }
        let geometry = Geometry {
            n: input.shape[0] as usize,
            groups,
            cin_g,
            cout_g,
            input: spatial3(&input.shape),
            output: spatial3(output),
            kernel: spatial3(&weight.shape),
            stride: triple("stride", 1)?,
            padding: triple("padding", 0)?,
            dilation: triple("dilation", 1)?,
            transposed,
        };
        if geometry
            .stride
            .iter()
            .chain(&geometry.dilation)
            .any(|&v| v <= 0)
            || geometry.padding.iter().any(|&p| p < 0)
        {
            return Err("stride and dilation must be positive, padding >= 0".into());
        }
        Ok(geometry)
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
pub(super) fn convolution(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ity, ib) = tensor(args, 0)?;
    let (wty, wb) = tensor(args, 1)?;
    let geometry = Geometry::new(node, ity, wty, &o.ty.shape)?;
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
    node: &Node,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (gty, gb) = tensor(args, 0)?;
    let (ity, ib) = tensor(args, 1)?;
    let (wty, wb) = tensor(args, 2)?;
    let geometry = Geometry::new(node, ity, wty, &gty.shape)?;
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
