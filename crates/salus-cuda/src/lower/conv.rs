//! Convolutions: those the device planned on cuDNN (see `crate::cudnn`) call it, their
//! workspace the node's scratch; other 2-d f32 ones unfold the input (im2col) into the
//! node's scratch and multiply with cuBLAS; the rest run the direct kernels. Geometry from
//! [`ConvParams`].

use std::sync::Arc;

use salus_graph::{ConvParams, DType, Node};

use super::matmul::Matrix;
use super::{Command, Lowered, Lowering, Operand};
use crate::abi::{ConvArgs, ElementwiseOp, Im2colArgs, Kernel, ReduceOp};
use crate::driver::cudnn::{Direction, DnnConv, descriptors_for};
use crate::driver::{Gemm, GemmType};

/// Per-dimension values padded in front to the kernels' 3 spatial dims with `fill`.
fn spatial3(values: &[u64], fill: i64) -> [i64; 3] {
    let mut out = [fill; 3];
    for (o, v) in out[3 - values.len().min(3)..].iter_mut().zip(values) {
        *o = *v as i64;
    }
    out
}

/// The direct kernels' arguments for `conv`, operands left at 0.
fn conv_args(conv: &ConvParams) -> ConvArgs {
    ConvArgs {
        n: conv.batch as i64,
        groups: conv.groups as i64,
        cin_g: conv.in_per_group() as i64,
        cout_g: conv.out_per_group() as i64,
        transposed: i64::from(conv.transposed),
        in3: spatial3(&conv.input, 1),
        out3: spatial3(&conv.output, 1),
        k3: spatial3(&conv.kernel, 1),
        stride: spatial3(&conv.stride, 1),
        pad: spatial3(&conv.padding, 0),
        dil: spatial3(&conv.dilation, 1),
        ..ConvArgs::default()
    }
}

/// The unfolding of a 2-d, not transposed convolution: `k x l` per image and group, and
/// whether it is `direct` (the input is its own unfolding).
struct Unfolding {
    k: u64,
    l: u64,
    direct: bool,
}

/// The im2col path's unfolding, when `conv` takes it: 2-d, not transposed, f32 operands.
fn unfolding(conv: &ConvParams, operands: &[&Operand]) -> Option<Unfolding> {
    if conv.transposed || operands.iter().any(|t| t.ty.dtype != DType::F32) {
        return None;
    }
    let (k, l, direct) = conv.unfold_2d()?;
    Some(Unfolding { k, l, direct })
}

/// `im2col`/`col2im` arguments for images `[n0, n0 + count)` of group `g`.
fn im2col_args(conv: &ConvParams, n0: u64, count: u64, g: u64, x: u64, col: u64) -> Im2colArgs {
    let i = |v: u64| v as i64;
    Im2colArgs {
        n0: i(n0),
        count: i(count),
        g: i(g),
        c_in: i(conv.in_channels),
        cin_g: i(conv.in_per_group()),
        h: i(conv.input[0]),
        w: i(conv.input[1]),
        kh: i(conv.kernel[0]),
        kw: i(conv.kernel[1]),
        oh: i(conv.output[0]),
        ow: i(conv.output[1]),
        sh: i(conv.stride[0]),
        sw: i(conv.stride[1]),
        ph: i(conv.padding[0]),
        pw: i(conv.padding[1]),
        dh: i(conv.dilation[0]),
        dw: i(conv.dilation[1]),
        x,
        col,
    }
}

impl Lowering<'_> {
    /// Lowers the node to the cuDNN calls the device planned for it, each call's operands
    /// from `operands`; false (and nothing lowered) when it has none, or when its scratch
    /// cannot hold their workspace (a program planned without the device's scratch sizes).
    fn cudnn(&mut self, operands: impl Fn(Direction) -> Option<(u64, u64, u64)>) -> bool {
        let Some(dnn) = self.dnn else {
            return false;
        };
        let Some(plan) = dnn.plan_node(self.program.graph(), self.index, self.params()) else {
            return false;
        };
        let (scratch, len) = self.scratch();
        if plan.workspace() > len {
            return false;
        }
        let mut calls = Vec::with_capacity(plan.calls.len());
        for choice in &plan.calls {
            let Some((a, b, c)) = operands(choice.direction) else {
                return false;
            };
            let descriptors = match descriptors_for(&plan.shape, choice) {
                Ok(d) => Arc::new(d),
                Err(why) => {
                    tracing::warn!(
                        node = self.index,
                        "cuDNN: {why}; the node runs on salus' own kernels"
                    );
                    return false;
                }
            };
            calls.push(Command::Dnn(DnnConv {
                node: self.index,
                descriptors,
                choice: *choice,
                a,
                b,
                c,
                workspace: if choice.workspace > 0 { scratch } else { 0 },
            }));
        }
        self.commands.extend(calls);
        true
    }

    pub(super) fn convolution(&mut self, node: &Node, conv: &ConvParams, o: &Operand) -> Lowered {
        let (x, w) = (self.need(node, 0)?, self.need(node, 1)?);
        let bias = self.input(node, 2);
        let forward = |d: Direction| (d == Direction::Forward).then_some((x.ptr, w.ptr, o.ptr));
        if self.cudnn(forward) {
            if let Some(b) = &bias {
                let mut shape = vec![1u64; o.ty.rank()];
                shape[1] = conv.out_channels;
                let b = b.viewed_as(b.ty.dtype, shape);
                self.ew(ElementwiseOp::Add, o, &[o, &b], [1.0, 0.0, 0.0])?;
            }
            return Ok(());
        }
        if let Some(Unfolding { k, l, direct }) = unfolding(conv, &[&x, &w, o]) {
            let (scratch, len) = self.scratch();
            let per_image = k * l * 4;
            let slots = if direct {
                conv.batch
            } else {
                len / per_image.max(1)
            };
            if slots > 0 && k > 0 {
                let (n, groups) = (conv.batch, conv.groups);
                let (c_in, c_out) = (conv.in_channels, conv.out_channels);
                let cout_g = conv.out_per_group();
                let mut n0 = 0;
                while n0 < n {
                    let count = slots.min(n - n0);
                    for g in 0..groups {
                        let col = if direct {
                            Matrix {
                                ptr: x.ptr + ((n0 * c_in + g * conv.in_per_group()) * l) * 4,
                                ld: l,
                                batch_stride: (c_in * l) as i64,
                                trans: false,
                            }
                        } else {
                            let args = im2col_args(conv, n0, count, g, x.ptr, scratch);
                            self.launch(Kernel::Im2col, count * k * l, args);
                            Matrix {
                                ptr: scratch,
                                ld: l,
                                batch_stride: (k * l) as i64,
                                trans: false,
                            }
                        };
                        // y[n, g, cout_g, L] = W_g [cout_g, K] @ col [K, L], per image.
                        let weight = Matrix {
                            ptr: w.ptr + g * cout_g * k * 4,
                            ld: k,
                            batch_stride: 0,
                            trans: false,
                        };
                        let out = Matrix {
                            ptr: o.ptr + ((n0 * c_out + g * cout_g) * l) * 4,
                            ld: l,
                            batch_stride: (c_out * l) as i64,
                            trans: false,
                        };
                        let shape = (cout_g, k, l);
                        let f32 = GemmType::F32;
                        self.gemm_row_major(f32, shape, weight, col, out, 1.0, 0.0, count);
                    }
                    n0 += count;
                }
                if let Some(b) = &bias {
                    let mut shape = vec![1u64; 4];
                    shape[1] = c_out;
                    let b4 = b.viewed_as(b.ty.dtype, shape);
                    self.ew(ElementwiseOp::Add, o, &[o, &b4], [1.0, 0.0, 0.0])?;
                }
                return Ok(());
            }
        }
        let mut args = conv_args(conv);
        (args.x, args.xdt) = (x.ptr, x.dt());
        (args.w, args.wdt) = (w.ptr, w.dt());
        if let Some(b) = &bias {
            (args.bias, args.bdt) = (b.ptr, b.dt());
        }
        (args.y, args.ydt) = (o.ptr, o.dt());
        self.launch(Kernel::ConvForward, o.numel(), args);
        Ok(())
    }

    pub(super) fn convolution_backward(&mut self, node: &Node) -> Lowered {
        let Some(conv) = self.params().conv() else {
            return Err("convolution_backward without its convolution parameters".into());
        };
        let (g, x, w) = (
            self.need(node, 0)?,
            self.need(node, 1)?,
            self.need(node, 2)?,
        );
        let (gi, gw, gb) = (
            self.output(node, 0),
            self.output(node, 1),
            self.output(node, 2),
        );
        if let Some(gb) = &gb {
            let dims: Vec<usize> = (0..g.ty.rank()).filter(|&d| d != 1).collect();
            self.reduce(ReduceOp::Sum, &g, &dims, gb, 0.0)?;
        }
        let (gi_ptr, gw_ptr) = (gi.as_ref().map(|t| t.ptr), gw.as_ref().map(|t| t.ptr));
        let backward = |d: Direction| match d {
            Direction::BackwardData => Some((w.ptr, g.ptr, gi_ptr?)),
            Direction::BackwardFilter => Some((x.ptr, g.ptr, gw_ptr?)),
            Direction::Forward => None,
        };
        if self.cudnn(backward) {
            return Ok(());
        }
        let tf32 = self.tf32();
        let mut f32_operands = vec![&g, &x, &w];
        f32_operands.extend(gi.iter().chain(&gw));
        if let Some(Unfolding { k, l, direct }) = unfolding(conv, &f32_operands) {
            let (scratch, len) = self.scratch();
            let per_image = 2 * k * l * 4;
            let slots = if direct {
                conv.batch
            } else {
                len / per_image.max(1)
            };
            if slots > 0 && k > 0 {
                let (n, groups) = (conv.batch, conv.groups);
                let (c_in, c_out) = (conv.in_channels, conv.out_channels);
                let (cin_g, cout_g) = (conv.in_per_group(), conv.out_per_group());
                if let Some(gw) = &gw {
                    self.zero(gw);
                }
                let mut n0 = 0;
                while n0 < n {
                    let count = slots.min(n - n0);
                    let gcol = scratch + count * k * l * 4;
                    for grp in 0..groups {
                        let g_at = |img: u64| g.ptr + (((n0 + img) * c_out + grp * cout_g) * l) * 4;
                        let w_g = w.ptr + grp * cout_g * k * 4;
                        if let Some(gw) = &gw {
                            let (col, col_stride) = if direct {
                                (x.ptr + ((n0 * c_in + grp * cin_g) * l) * 4, c_in * l)
                            } else {
                                let args = im2col_args(conv, n0, count, grp, x.ptr, scratch);
                                self.launch(Kernel::Im2col, count * k * l, args);
                                (scratch, k * l)
                            };
                            // gw_g [cout_g, K] += G_img [cout_g, L] @ col_img^T [L, K].
                            for img in 0..count {
                                self.commands.push(Command::Gemm(Gemm {
                                    ty: GemmType::F32,
                                    tf32,
                                    trans_a: true,
                                    trans_b: false,
                                    m: k as i32,
                                    n: cout_g as i32,
                                    k: l as i32,
                                    alpha: 1.0,
                                    a: col + img * col_stride * 4,
                                    lda: l as i32,
                                    stride_a: 0,
                                    b: g_at(img),
                                    ldb: l as i32,
                                    stride_b: 0,
                                    beta: 1.0,
                                    c: gw.ptr + grp * cout_g * k * 4,
                                    ldc: k as i32,
                                    stride_c: 0,
                                    batch: 1,
                                }));
                            }
                        }
                        if let Some(gi) = &gi {
                            // gcol_img [K, L] = W_g^T [K, cout_g] @ G_img [cout_g, L].
                            let (dst, dst_stride) = if direct {
                                (gi.ptr + ((n0 * c_in + grp * cin_g) * l) * 4, c_in * l)
                            } else {
                                (gcol, k * l)
                            };
                            self.commands.push(Command::Gemm(Gemm {
                                ty: GemmType::F32,
                                tf32,
                                trans_a: false,
                                trans_b: true,
                                m: l as i32,
                                n: k as i32,
                                k: cout_g as i32,
                                alpha: 1.0,
                                a: g_at(0),
                                lda: l as i32,
                                stride_a: (c_out * l) as i64,
                                b: w_g,
                                ldb: k as i32,
                                stride_b: 0,
                                beta: 0.0,
                                c: dst,
                                ldc: l as i32,
                                stride_c: dst_stride as i64,
                                batch: count as i32,
                            }));
                            if !direct {
                                let args = im2col_args(conv, n0, count, grp, gi.ptr, gcol);
                                let threads = count * cin_g * conv.input[0] * conv.input[1];
                                self.launch(Kernel::Col2im, threads, args);
                            }
                        }
                    }
                    n0 += count;
                }
                return Ok(());
            }
        }
        if let Some(gi) = &gi {
            let mut args = conv_args(conv);
            (args.x, args.xdt) = (gi.ptr, gi.dt());
            (args.w, args.wdt) = (w.ptr, w.dt());
            (args.g, args.gdt) = (g.ptr, g.dt());
            self.launch(Kernel::ConvBackwardInput, gi.numel(), args);
        }
        if let Some(gw) = &gw {
            let mut args = conv_args(conv);
            (args.x, args.xdt) = (x.ptr, x.dt());
            (args.w, args.wdt) = (gw.ptr, gw.dt());
            (args.g, args.gdt) = (g.ptr, g.dt());
            self.launch(Kernel::ConvBackwardWeight, gw.numel(), args);
        }
        Ok(())
    }
}
