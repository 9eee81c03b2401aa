//! Half precision on the CPU device: every op that the target models run in f16 or bf16
//! when traced under CPU autocast (`salus.amp`), at both dtypes, against references
//! written here in f64.
//!
//! PyTorch's CPU kernels compute f16 and bf16 ops in f32 and round the f32 result to
//! nearest even, so each reference is the exact (f64) value rounded to f32 and then to the
//! half type ([`pytorch`]). Copies, selections and comparisons must match bit for bit;
//! arithmetic too where the device's f64 result is the reference's; sums, products and
//! transcendental functions within one unit in the last place of the half type (the
//! device and the reference add in different orders, so where the exact value lies on a
//! rounding boundary they may land on its two sides). `half_rounding_is_pytorchs` pins
//! down the rounding itself where it differs from rounding the f64 value directly.
//! `every_autocast_op_is_tested_in_half` fails when an op of [`AUTOCAST_OPS`] goes
//! untested.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use salus_graph::{Attr, DType, Graph, Op, OpParams, ScratchSizer};

use DType::{Bf16, Bool, F16, F32 as Fp32, I64};

/// The ops the target models (mlp, cnn, gpt, resnet18) run with f16 or bf16 tensors when
/// traced under CPU autocast, forward, backward and inference, by their IR names
/// (`adaptors/python/tests/test_amp.py` checks the traced graphs against this list).
const AUTOCAST_OPS: &[&str] = &[
    "_to_copy",
    "add.Tensor",
    "sub.Tensor",
    "div.Scalar",
    "relu",
    "gelu",
    "le.Scalar",
    "where.self",
    "scalar_tensor",
    "view",
    "permute",
    "expand",
    "cat",
    "split_with_sizes",
    "sum.dim_IntList",
    "mean.dim",
    "mm",
    "addmm",
    "convolution",
    "convolution_backward",
    "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_native_batch_norm_legit_functional",
    "native_batch_norm_backward",
];

const HALVES: [DType; 2] = [F16, Bf16];

/// `v` as PyTorch's CPU kernels store a result they computed in f32: rounded to f32, then
/// to `dtype` (round to nearest even).
fn pytorch(dtype: DType, v: f64) -> f64 {
    let v = v as f32;
    match dtype {
        F16 => half::f16::from_f32(v).to_f64(),
        Bf16 => half::bf16::from_f32(v).to_f64(),
        _ => unreachable!("not a half type: {dtype}"),
    }
}

/// One unit in the last place of `dtype`, relative, and its smallest subnormal.
fn ulp(dtype: DType) -> Tol {
    match dtype {
        F16 => tol(2f64.powi(-10), 2f64.powi(-24)),
        Bf16 => tol(2f64.powi(-7), 2f64.powi(-133)),
        _ => unreachable!("not a half type: {dtype}"),
    }
}

fn all_pytorch(dtype: DType, values: impl IntoIterator<Item = f64>) -> Vec<f64> {
    values.into_iter().map(|v| pytorch(dtype, v)).collect()
}

// ---------------------------------------------------------------------------------------
// The rounding itself

#[test]
fn half_rounding_is_pytorchs() {
    // Sums of three half values, each case on a tie of the half type (1 + half a unit)
    // plus a little. PyTorch adds in f32 and rounds that sum to nearest even:
    // `torch.tensor([1, 2**-8, 2**-30], dtype=torch.bfloat16).sum()` is 1.0 (the f32 sum
    // is the tie: 2**-30 is below f32's precision at 1), `[1, 2**-8, 2**-22]` gives
    // 1.0078125 (the f32 sum is above the tie). Rounding the f64 sum directly gets the
    // first wrong; rounding it as `half::bf16::from_f64` does (which drops the f64
    // mantissa's last 32 bits first) gets the second wrong. Products accumulate the same
    // way (checked with PyTorch 2.15 on the CPU, `sum()` and `@`).
    let unit = |dtype: DType| {
        if dtype == Bf16 {
            2f64.powi(-7)
        } else {
            2f64.powi(-10)
        }
    };
    for (dtype, tiny, want) in [
        (Bf16, 2f64.powi(-30), 1.0),
        (Bf16, 2f64.powi(-22), 1.0 + 2f64.powi(-7)),
        (F16, 2f64.powi(-24), 1.0),
        (F16, 2f64.powi(-22), 1.0 + 2f64.powi(-10)),
    ] {
        let terms = [1.0, unit(dtype) / 2.0, tiny];
        assert_eq!(
            pytorch(dtype, terms.iter().sum()),
            want,
            "{dtype} {terms:?}"
        );
        let x = val(dtype, &[3], terms.to_vec());
        assert_eq!(x.data, terms, "the terms are {dtype} values");
        let got = Case::new(Op::SumDimIntList)
            .input(x.clone())
            .ints("dim", &[0])
            .flag("keepdim", false)
            .output(dtype, &[])
            .run1();
        assert_eq!(got, [want], "sum of {terms:?} in {dtype}");
        let ones = val(dtype, &[3, 1], vec![1.0; 3]);
        let row = val(dtype, &[1, 3], terms.to_vec());
        let got = Case::new(Op::Mm)
            .input(row)
            .input(ones)
            .output(dtype, &[1, 1])
            .run1();
        assert_eq!(got, [want], "mm of {terms:?} in {dtype}");
    }
    // Conversions from f32 round to nearest even: ties go to the even neighbour, and
    // overflow goes to infinity (f16's largest finite value is 65504).
    for (dtype, x, want) in [
        (Bf16, 1.0 + 2f64.powi(-8), 1.0),
        (Bf16, 1.0 + 3.0 * 2f64.powi(-8), 1.0 + 2f64.powi(-6)),
        (F16, 1.0 + 2f64.powi(-11), 1.0),
        (F16, 65520.0, f64::INFINITY),
        (F16, 65519.0, 65504.0),
        (F16, f64::NAN, f64::NAN),
    ] {
        let got = Case::new(Op::ToCopy)
            .input(f32v(&[1], vec![x]))
            .dtype("dtype", dtype)
            .output(dtype, &[1])
            .run1();
        assert_close(&got, &[want], EXACT, &format!("_to_copy {x} to {dtype}"));
    }
}

// ---------------------------------------------------------------------------------------
// Casts and pointwise ops

#[test]
fn casts_between_f32_and_half() {
    let mut rng = Rng::new(101);
    for dtype in HALVES {
        let x = rng.f32s(&[4, 9], -70000.0, 70000.0);
        let got = Case::new(Op::ToCopy)
            .input(x.clone())
            .dtype("dtype", dtype)
            .output(dtype, &[4, 9])
            .run1();
        let want = all_pytorch(dtype, x.data.iter().copied());
        assert_close(&got, &want, EXACT, &format!("_to_copy f32 to {dtype}"));
        let h = val(dtype, &[4, 9], rng.vec(36, -3.0, 3.0));
        let got = Case::new(Op::ToCopy)
            .input(h.clone())
            .dtype("dtype", Fp32)
            .output(Fp32, &[4, 9])
            .run1();
        assert_close(&got, &h.data, EXACT, &format!("_to_copy {dtype} to f32"));
    }
}

#[test]
fn pointwise_arithmetic_in_half() {
    let mut rng = Rng::new(103);
    for dtype in HALVES {
        let a = val(dtype, &[3, 4], rng.vec(12, -3.0, 3.0));
        let b = val(dtype, &[4], rng.vec(4, -3.0, 3.0));
        let f = f32v(&[3, 4], rng.vec(12, -3.0, 3.0));
        // half + half broadcast stays half; with alpha.
        let got = Case::new(Op::AddTensor)
            .input(a.clone())
            .input(b.clone())
            .float("alpha", 0.5)
            .output(dtype, &[3, 4])
            .run1();
        let want = all_pytorch(dtype, (0..12).map(|i| a.data[i] + 0.5 * b.data[i % 4]));
        assert_close(&got, &want, EXACT, &format!("add.Tensor {dtype}"));
        // f32 + half is f32 (a residual stream plus a half-precision branch).
        let got = Case::new(Op::AddTensor)
            .input(f.clone())
            .input(a.clone())
            .output(Fp32, &[3, 4])
            .run1();
        let want: Vec<f64> = (0..12)
            .map(|i| round_to(Fp32, f.data[i] + a.data[i]))
            .collect();
        assert_close(&got, &want, EXACT, &format!("add.Tensor f32 + {dtype}"));
        // half - f32 is f32.
        let got = Case::new(Op::SubTensor)
            .input(a.clone())
            .input(f.clone())
            .output(Fp32, &[3, 4])
            .run1();
        let want: Vec<f64> = (0..12)
            .map(|i| round_to(Fp32, a.data[i] - f.data[i]))
            .collect();
        assert_close(&got, &want, EXACT, &format!("sub.Tensor {dtype} - f32"));
        let got = Case::new(Op::SubTensor)
            .input(a.clone())
            .input(b.clone())
            .output(dtype, &[3, 4])
            .run1();
        let want = all_pytorch(dtype, (0..12).map(|i| a.data[i] - b.data[i % 4]));
        assert_close(&got, &want, EXACT, &format!("sub.Tensor {dtype}"));
        // A division by a number stays half (the mean's backward, the pooling's).
        let got = Case::new(Op::DivScalar)
            .input(a.clone())
            .float("other", 3.0)
            .output(dtype, &[3, 4])
            .run1();
        // PyTorch divides in f32 by the number rounded to f32; 3.0 is exact.
        let want = all_pytorch(dtype, a.data.iter().map(|v| round_to(Fp32, v / 3.0)));
        assert_close(&got, &want, EXACT, &format!("div.Scalar {dtype}"));
    }
}

fn gelu_ref(x: f64, tanh: bool) -> f64 {
    if tanh {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
    } else {
        // Φ(x) by Simpson's rule on the normal density over [0, x].
        let n = 2000;
        let h = x.clamp(-10.0, 10.0) / n as f64;
        let phi = |t: f64| (-t * t / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
        let mut s = phi(0.0) + phi(h * n as f64);
        for i in 1..n {
            s += phi(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
        }
        x * (0.5 + s * h / 3.0)
    }
}

#[test]
fn activations_comparisons_and_selections_in_half() {
    let mut rng = Rng::new(107);
    for dtype in HALVES {
        let mut data = rng.vec(40, -4.0, 4.0);
        data.extend([0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN]);
        let n = data.len() as u64;
        let x = val(dtype, &[n], data);
        let run = |op: Op, out: DType, attrs: &[(&str, Attr)]| {
            let mut case = Case::new(op).input(x.clone());
            for (name, a) in attrs {
                case = case.attr(name, a.clone());
            }
            case.output(out, &[n]).run1()
        };
        let relu: Vec<f64> = x
            .data
            .iter()
            .map(|&v| if v.is_nan() { v } else { v.max(0.0) })
            .collect();
        assert_close(
            &run(Op::Relu, dtype, &[]),
            &relu,
            EXACT,
            &format!("relu {dtype}"),
        );
        for approximate in ["none", "tanh"] {
            let got = run(
                Op::Gelu,
                dtype,
                &[("approximate", Attr::Str(approximate.into()))],
            );
            let finite: Vec<usize> = (0..x.data.len())
                .filter(|&i| x.data[i].is_finite())
                .collect();
            let want: Vec<f64> = finite
                .iter()
                .map(|&i| pytorch(dtype, gelu_ref(x.data[i], approximate == "tanh")))
                .collect();
            let got: Vec<f64> = finite.iter().map(|&i| got[i]).collect();
            assert_close(
                &got,
                &want,
                ulp(dtype),
                &format!("gelu {approximate} {dtype}"),
            );
        }
        let le: Vec<f64> = x
            .data
            .iter()
            .map(|&v| f64::from(u8::from(v <= 0.5)))
            .collect();
        let got = run(Op::LeScalar, Bool, &[("other", Attr::Float(0.5))]);
        assert_close(&got, &le, EXACT, &format!("le.Scalar {dtype}"));
        // where(x <= 0.5, x, y): relu's backward selects the gradient or a zero.
        let cond = val(Bool, &[n], le.clone());
        let y = val(dtype, &[n], rng.vec(n as usize, -1.0, 1.0));
        let got = Case::new(Op::WhereSelf)
            .input(cond)
            .input(x.clone())
            .input(y.clone())
            .output(dtype, &[n])
            .run1();
        let want: Vec<f64> = (0..n as usize)
            .map(|i| if le[i] != 0.0 { x.data[i] } else { y.data[i] })
            .collect();
        assert_close(&got, &want, EXACT, &format!("where.self {dtype}"));
        let got = Case::new(Op::ScalarTensor)
            .float("s", 0.1)
            .dtype("dtype", dtype)
            .output(dtype, &[])
            .run1();
        assert_close(
            &got,
            &[pytorch(dtype, 0.1)],
            EXACT,
            &format!("scalar_tensor {dtype}"),
        );
    }
}

// ---------------------------------------------------------------------------------------
// Shape ops: copies, bit for bit

#[test]
fn shape_ops_copy_half_values() {
    let mut rng = Rng::new(109);
    for dtype in HALVES {
        let x = val(dtype, &[2, 3, 4], rng.vec(24, -3.0, 3.0));
        let got = Case::new(Op::View)
            .input(x.clone())
            .ints("size", &[6, -1])
            .output(dtype, &[6, 4])
            .run1();
        assert_close(&got, &x.data, EXACT, &format!("view {dtype}"));
        let got = Case::new(Op::Permute)
            .input(x.clone())
            .ints("dims", &[2, 0, 1])
            .output(dtype, &[4, 2, 3])
            .run1();
        let want: Vec<f64> = (0..24)
            .map(|i| {
                let (k, a, b) = (i / 6, i / 3 % 2, i % 3);
                x.data[(a * 3 + b) * 4 + k]
            })
            .collect();
        assert_close(&got, &want, EXACT, &format!("permute {dtype}"));
        let row = val(dtype, &[1, 4], rng.vec(4, -3.0, 3.0));
        let got = Case::new(Op::Expand)
            .input(row.clone())
            .ints("size", &[3, -1])
            .output(dtype, &[3, 4])
            .run1();
        let want: Vec<f64> = (0..12).map(|i| row.data[i % 4]).collect();
        assert_close(&got, &want, EXACT, &format!("expand {dtype}"));
        // split_with_sizes then cat along the last dimension: the qkv projection's split
        // and its backward's concatenation.
        let parts = Case::new(Op::SplitWithSizes)
            .input(x.clone())
            .ints("split_sizes", &[1, 2, 1])
            .int("dim", -1)
            .output(dtype, &[2, 3, 1])
            .output(dtype, &[2, 3, 2])
            .output(dtype, &[2, 3, 1])
            .run();
        for (k, (lo, width)) in [(0usize, 1usize), (1, 2), (3, 1)].into_iter().enumerate() {
            let want: Vec<f64> = (0..6)
                .flat_map(|r| (lo..lo + width).map(move |c| (r, c)))
                .map(|(r, c)| x.data[r * 4 + c])
                .collect();
            assert_close(
                &parts[k],
                &want,
                EXACT,
                &format!("split_with_sizes {dtype} part {k}"),
            );
        }
        let pieces: Vec<Value> = [(1u64, 0usize), (2, 1), (1, 2)]
            .iter()
            .map(|&(w, k)| val(dtype, &[2, 3, w], parts[k].clone()))
            .collect();
        let mut case = Case::new(Op::Cat);
        for p in &pieces {
            case = case.input(p.clone());
        }
        let got = case
            .int("tensors.len", 3)
            .int("dim", 2)
            .output(dtype, &[2, 3, 4])
            .run1();
        assert_close(&got, &x.data, EXACT, &format!("cat {dtype}"));
    }
}

// ---------------------------------------------------------------------------------------
// Reductions and products: computed wide, rounded once

#[test]
fn sums_and_means_in_half() {
    let mut rng = Rng::new(113);
    for dtype in HALVES {
        let x = val(dtype, &[5, 6, 7], rng.vec(210, -2.0, 2.0));
        for (dims, keepdim, out) in [
            (vec![0i64], true, vec![1u64, 6, 7]),
            (vec![0, 1], false, vec![7]),
            (vec![-1], false, vec![5, 6]),
        ] {
            for op in [Op::SumDimIntList, Op::MeanDim] {
                let got = Case::new(op)
                    .input(x.clone())
                    .ints("dim", &dims)
                    .flag("keepdim", keepdim)
                    .output(dtype, &out)
                    .run1();
                // Each input element adds to the output element at its kept dimensions.
                let reduced = |d: usize| dims.iter().any(|&r| r.rem_euclid(3) as usize == d);
                let (mut acc, mut count) = (vec![0.0; numel(&out)], vec![0.0; numel(&out)]);
                for (i, v) in x.data.iter().enumerate() {
                    let idx = unravel(i, &[5, 6, 7]);
                    let at: Vec<usize> = (0..3)
                        .filter_map(|d| match (reduced(d), keepdim) {
                            (false, _) => Some(idx[d]),
                            (true, true) => Some(0),
                            (true, false) => None,
                        })
                        .collect();
                    let o = ravel(&at, &out);
                    acc[o] += v;
                    count[o] += 1.0;
                }
                let want: Vec<f64> = acc
                    .iter()
                    .zip(&count)
                    .map(|(a, c)| pytorch(dtype, if op == Op::MeanDim { a / c } else { *a }))
                    .collect();
                // The sums of 5 to 42 terms of size 2 may cancel: allow one unit of the
                // half type at the terms' scale as well.
                let t = tol(ulp(dtype).rtol, 2.0 * ulp(dtype).rtol);
                assert_close(&got, &want, t, &format!("{op} {dtype} over {dims:?}"));
            }
        }
    }
}

fn matmul_ref(a: &[f64], b: &[f64], n: usize, k: usize, m: usize) -> Vec<f64> {
    (0..n * m)
        .map(|i| (0..k).map(|p| a[i / m * k + p] * b[p * m + i % m]).sum())
        .collect()
}

#[test]
fn products_in_half() {
    let mut rng = Rng::new(127);
    for dtype in HALVES {
        let (n, k, m) = (5, 33, 7);
        let a = val(dtype, &[n, k], rng.vec((n * k) as usize, -1.0, 1.0));
        let b = val(dtype, &[k, m], rng.vec((k * m) as usize, -1.0, 1.0));
        let bias = val(dtype, &[m], rng.vec(m as usize, -1.0, 1.0));
        let exact = matmul_ref(&a.data, &b.data, n as usize, k as usize, m as usize);
        // Products of up to 33 terms of size 1: one unit at the terms' scale too.
        let t = tol(ulp(dtype).rtol, 2.0 * ulp(dtype).rtol);
        let got = Case::new(Op::Mm)
            .input(a.clone())
            .input(b.clone())
            .output(dtype, &[n, m])
            .run1();
        let want = all_pytorch(dtype, exact.iter().copied());
        assert_close(&got, &want, t, &format!("mm {dtype}"));
        // A linear layer: bias + x @ w^T.
        let got = Case::new(Op::Addmm)
            .input(bias.clone())
            .input(a.clone())
            .input(b.clone())
            .output(dtype, &[n, m])
            .run1();
        let want = all_pytorch(
            dtype,
            exact
                .iter()
                .enumerate()
                .map(|(i, v)| bias.data[i % m as usize] + v),
        );
        assert_close(&got, &want, t, &format!("addmm {dtype}"));
        // Batched: attention's products when they run in 16 bits.
        let (b, n, k, m) = (3usize, 4usize, 9usize, 5usize);
        let x = val(dtype, &[3, 4, 9], rng.vec(b * n * k, -1.0, 1.0));
        let y = val(dtype, &[3, 9, 5], rng.vec(b * k * m, -1.0, 1.0));
        let got = Case::new(Op::Bmm)
            .input(x.clone())
            .input(y.clone())
            .output(dtype, &[3, 4, 5])
            .run1();
        let want: Vec<f64> = (0..b)
            .flat_map(|i| {
                matmul_ref(
                    &x.data[i * n * k..(i + 1) * n * k],
                    &y.data[i * k * m..(i + 1) * k * m],
                    n,
                    k,
                    m,
                )
            })
            .map(|v| pytorch(dtype, v))
            .collect();
        assert_close(&got, &want, t, &format!("bmm {dtype}"));
    }
}

/// A 2-d convolution (no groups or dilation), with its two gradients: for each output
/// element, each tap it reads adds `x * w` to it, `g * w` to the input's gradient and
/// `g * x` to the weight's.
struct Conv2d {
    input: [usize; 4],
    weight: [usize; 4],
    stride: usize,
    padding: usize,
}

impl Conv2d {
    fn output(&self) -> [usize; 4] {
        let o = |size: usize, k: usize| (size + 2 * self.padding - k) / self.stride + 1;
        [
            self.input[0],
            self.weight[0],
            o(self.input[2], self.weight[2]),
            o(self.input[3], self.weight[3]),
        ]
    }

    fn shape(dims: [usize; 4]) -> Vec<u64> {
        dims.iter().map(|&d| d as u64).collect()
    }

    fn case(&self, op: Op) -> Case {
        let (s, p) = (self.stride as i64, self.padding as i64);
        Case::new(op)
            .ints("stride", &[s, s])
            .ints("padding", &[p, p])
            .ints("dilation", &[1, 1])
            .flag("transposed", false)
            .ints("output_padding", &[0, 0])
            .int("groups", 1)
    }

    /// `(out, grad_input, grad_weight)` in f64.
    fn reference(&self, x: &[f64], w: &[f64], g: &[f64]) -> [Vec<f64>; 3] {
        let [n, c, h, wd] = self.input;
        let [co, _, kh, kw] = self.weight;
        let [_, _, oh, ow] = self.output();
        let (mut out, mut gx, mut gw) = (
            vec![0.0; n * co * oh * ow],
            vec![0.0; x.len()],
            vec![0.0; w.len()],
        );
        for (b, o, oy, ox) in itertools(n, co, oh, ow) {
            let oi = ((b * co + o) * oh + oy) * ow + ox;
            for ci in 0..c {
                for ky in 0..kh {
                    for kx in 0..kw {
                        let y = (oy * self.stride + ky) as i64 - self.padding as i64;
                        let xx = (ox * self.stride + kx) as i64 - self.padding as i64;
                        if y < 0 || xx < 0 || y >= h as i64 || xx >= wd as i64 {
                            continue;
                        }
                        let xi = ((b * c + ci) * h + y as usize) * wd + xx as usize;
                        let wi = ((o * c + ci) * kh + ky) * kw + kx;
                        out[oi] += x[xi] * w[wi];
                        gx[xi] += g[oi] * w[wi];
                        gw[wi] += g[oi] * x[xi];
                    }
                }
            }
        }
        [out, gx, gw]
    }
}

fn itertools(
    a: usize,
    b: usize,
    c: usize,
    d: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    (0..a).flat_map(move |i| {
        (0..b).flat_map(move |j| (0..c).flat_map(move |k| (0..d).map(move |l| (i, j, k, l))))
    })
}

/// A device's planning that gives no node any scratch.
struct NoScratch;

impl ScratchSizer for NoScratch {
    fn scratch_bytes(&self, _: &Graph, _: usize, _: &OpParams) -> u64 {
        0
    }
}

#[test]
fn convolution_and_its_backward_in_half() {
    let mut rng = Rng::new(131);
    for conv in [
        Conv2d {
            input: [2, 3, 6, 6],
            weight: [4, 3, 3, 3],
            stride: 1,
            padding: 1,
        },
        Conv2d {
            input: [1, 2, 7, 5],
            weight: [3, 2, 3, 3],
            stride: 2,
            padding: 1,
        },
    ] {
        for dtype in HALVES {
            let (xs, ws, os) = (
                Conv2d::shape(conv.input),
                Conv2d::shape(conv.weight),
                Conv2d::shape(conv.output()),
            );
            let x = val(dtype, &xs, rng.vec(numel(&xs), -1.0, 1.0));
            let w = val(dtype, &ws, rng.vec(numel(&ws), -1.0, 1.0));
            let g = val(dtype, &os, rng.vec(numel(&os), -1.0, 1.0));
            let [out, gx, gw] = conv.reference(&x.data, &w.data, &g.data);
            // Sums of up to 27 (forward) and 72 (weight gradient) terms of size 1.
            let t = tol(ulp(dtype).rtol, 4.0 * ulp(dtype).rtol);
            let what = format!("convolution {xs:?} * {ws:?} stride {} {dtype}", conv.stride);
            let got = conv
                .case(Op::Convolution)
                .input(x.clone())
                .input(w.clone())
                .absent()
                .output(dtype, &os)
                .run1();
            assert_close(&got, &all_pytorch(dtype, out.iter().copied()), t, &what);
            let grads = conv
                .case(Op::ConvolutionBackward)
                .input(g.clone())
                .input(x.clone())
                .input(w.clone())
                .attr("output_mask", Attr::Bools(vec![true, true, false]))
                .output(dtype, &xs)
                .output(dtype, &ws)
                .unused()
                .run();
            assert_close(
                &grads[0],
                &all_pytorch(dtype, gx.iter().copied()),
                t,
                &format!("{what}: grad_input"),
            );
            let gw = all_pytorch(dtype, gw);
            assert_close(&grads[1], &gw, t, &format!("{what}: grad_weight"));
            // Planned without the widened scratch (as for another device), the node runs
            // the generic loops, to the same values.
            let generic = conv
                .case(Op::ConvolutionBackward)
                .input(g.clone())
                .input(x.clone())
                .input(w.clone())
                .attr("output_mask", Attr::Bools(vec![true, true, false]))
                .output(dtype, &xs)
                .output(dtype, &ws)
                .unused()
                .run_planned_with(&NoScratch);
            assert_close(
                &generic[0],
                &all_pytorch(dtype, gx.iter().copied()),
                t,
                &format!("{what}: generic grad_input"),
            );
            assert_close(&generic[1], &gw, t, &format!("{what}: generic grad_weight"));
            let generic = conv
                .case(Op::Convolution)
                .input(x.clone())
                .input(w.clone())
                .absent()
                .output(dtype, &os)
                .run_planned_with(&NoScratch);
            assert_close(
                &generic[0],
                &all_pytorch(dtype, out.iter().copied()),
                t,
                &format!("{what}: generic"),
            );
            // The first layer's backward: only the weight's gradient.
            let only = conv
                .case(Op::ConvolutionBackward)
                .input(g.clone())
                .input(x.clone())
                .input(w.clone())
                .attr("output_mask", Attr::Bools(vec![false, true, false]))
                .unused()
                .output(dtype, &ws)
                .unused()
                .run();
            assert_close(&only[1], &gw, t, &format!("{what}: grad_weight alone"));
        }
    }
}

#[test]
fn max_pool_and_its_backward_in_half() {
    let mut rng = Rng::new(137);
    for dtype in HALVES {
        let (n, c, h, w) = (2usize, 3usize, 6usize, 4usize);
        let shape = [n as u64, c as u64, h as u64, w as u64];
        let out = [n as u64, c as u64, (h / 2) as u64, (w / 2) as u64];
        // Distinct half values: the maximum of each window is unique.
        let x = val(dtype, &shape, rng.distinct(n * c * h * w, 0.02));
        let forward = Case::new(Op::MaxPool2dWithIndices)
            .input(x.clone())
            .ints("kernel_size", &[2, 2])
            .ints("stride", &[2, 2])
            .ints("padding", &[0, 0])
            .ints("dilation", &[1, 1])
            .flag("ceil_mode", false);
        let got = forward.clone().output(dtype, &out).output(I64, &out).run();
        let (mut values, mut indices) = (vec![], vec![]);
        for (b, ch, oy, ox) in itertools(n, c, h / 2, w / 2) {
            let plane = (b * c + ch) * h * w;
            let best = [(0, 0), (0, 1), (1, 0), (1, 1)]
                .iter()
                .map(|&(dy, dx)| (2 * oy + dy) * w + 2 * ox + dx)
                .max_by(|&p, &q| x.data[plane + p].total_cmp(&x.data[plane + q]))
                .unwrap();
            values.push(x.data[plane + best]);
            indices.push(best as f64);
        }
        assert_close(&got[0], &values, EXACT, &format!("max_pool2d {dtype}"));
        assert_close(
            &got[1],
            &indices,
            EXACT,
            &format!("max_pool2d indices {dtype}"),
        );
        let g = val(dtype, &out, rng.vec(numel(&out), -1.0, 1.0));
        let grad = Case::new(Op::MaxPool2dWithIndicesBackward)
            .input(g.clone())
            .input(x.clone())
            .input(i64v(
                &out,
                &indices.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            ))
            .ints("kernel_size", &[2, 2])
            .ints("stride", &[2, 2])
            .ints("padding", &[0, 0])
            .ints("dilation", &[1, 1])
            .flag("ceil_mode", false)
            .output(dtype, &shape)
            .run1();
        let mut want = vec![0.0; x.data.len()];
        for (o, &index) in indices.iter().enumerate() {
            let plane = o / (h / 2 * (w / 2));
            want[plane * h * w + index as usize] += g.data[o];
        }
        assert_close(&grad, &want, EXACT, &format!("max_pool2d backward {dtype}"));
    }
}

// ---------------------------------------------------------------------------------------

type Test = (&'static str, fn());

/// Attention over one head of `l` queries and `s` keys (`e` and `ev` long), each
/// probability (query i, key j) weighed by its dropout factor `factor(i * s + j)`: (output,
/// logsumexp, and for the upstream gradient `g`: grad_query, grad_key, grad_value), in f64.
#[allow(clippy::type_complexity)]
fn attention_ref(
    (q, k, v, g): (&[f64], &[f64], &[f64], &[f64]),
    (l, s, e, ev): (usize, usize, usize, usize),
    causal: bool,
    factor: impl Fn(usize) -> f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let scale = 1.0 / (e as f64).sqrt();
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let (mut out, mut lse) = (vec![0.0; l * ev], vec![0.0; l]);
    let mut p = vec![0.0; l * s];
    for i in 0..l {
        let keys = if causal { i + 1 } else { s };
        let sc: Vec<f64> = (0..keys)
            .map(|j| scale * dot(&q[i * e..][..e], &k[j * e..][..e]))
            .collect();
        let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = sc.iter().map(|x| (x - m).exp()).sum();
        lse[i] = m + total.ln();
        for j in 0..keys {
            p[i * s + j] = (sc[j] - lse[i]).exp();
            for d in 0..ev {
                out[i * ev + d] += p[i * s + j] * factor(i * s + j) * v[j * ev + d];
            }
        }
    }
    let (mut dq, mut dk, mut dv) = (vec![0.0; l * e], vec![0.0; s * e], vec![0.0; s * ev]);
    for i in 0..l {
        let di = dot(&g[i * ev..][..ev], &out[i * ev..][..ev]);
        for j in 0..s {
            let f = factor(i * s + j);
            let dp = dot(&g[i * ev..][..ev], &v[j * ev..][..ev]);
            let ds = p[i * s + j] * (f * dp - di) * scale;
            for d in 0..e {
                dq[i * e + d] += ds * k[j * e + d];
                dk[j * e + d] += ds * q[i * e + d];
            }
            for d in 0..ev {
                dv[j * ev + d] += p[i * s + j] * f * g[i * ev + d];
            }
        }
    }
    (out, lse, dq, dk, dv)
}

/// Fused attention in 16 bits (autocast runs attention in the half type): computed wide
/// from the half inputs and rounded once, the log-sum-exp in f32.
#[test]
fn attention_and_its_backward_in_half() {
    let mut rng = Rng::new(131);
    let (l, s, e, ev) = (5usize, 6usize, 8usize, 4usize);
    for dtype in HALVES {
        for causal in [false, true] {
            let shape = |a: usize, b: usize| [1u64, 1, a as u64, b as u64];
            let q = val(dtype, &shape(l, e), rng.vec(l * e, -1.0, 1.0));
            let k = val(dtype, &shape(s, e), rng.vec(s * e, -1.0, 1.0));
            let v = val(dtype, &shape(s, ev), rng.vec(s * ev, -1.0, 1.0));
            let g = val(dtype, &shape(l, ev), rng.vec(l * ev, -1.0, 1.0));
            let (out, lse, dq, dk, dv) = attention_ref(
                (&q.data, &k.data, &v.data, &g.data),
                (l, s, e, ev),
                causal,
                |_| 1.0,
            );
            let what = format!("attention {dtype} causal {causal}");
            let got = Case::new(Op::ScaledDotProductAttention)
                .input(q.clone())
                .input(k.clone())
                .input(v.clone())
                .absent()
                .float("dropout_p", 0.0)
                .flag("is_causal", causal)
                .output(dtype, &shape(l, ev))
                .output(DType::F32, &shape(1, l)[1..])
                .run();
            assert_close(&got[0], &all_pytorch(dtype, out.clone()), ulp(dtype), &what);
            let lse32: Vec<f64> = lse.iter().map(|&x| f64::from(x as f32)).collect();
            assert_close(&got[1], &lse32, tol(2f64.powi(-23), 0.0), &what);
            // The backward from the rounded forward results, as the graph feeds it.
            let grads = Case::new(Op::ScaledDotProductAttentionBackward)
                .input(g)
                .input(q)
                .input(k)
                .input(v)
                .input(val(dtype, &shape(l, ev), out))
                .input(val(DType::F32, &shape(1, l)[1..], lse))
                .absent()
                .float("dropout_p", 0.0)
                .flag("is_causal", causal)
                .output(dtype, &shape(l, e))
                .output(dtype, &shape(s, e))
                .output(dtype, &shape(s, ev))
                .run();
            // The rounded output moves D = g . out by one unit of the half type.
            let t = tol(ulp(dtype).rtol, 4.0 * ulp(dtype).rtol);
            for (k, (name, want)) in [("grad_query", dq), ("grad_key", dk), ("grad_value", dv)]
                .into_iter()
                .enumerate()
            {
                assert_close(
                    &grads[k],
                    &all_pytorch(dtype, want),
                    t,
                    &format!("{what}: {name}"),
                );
            }
        }
    }
}

/// Attention with dropout (the efficient op) in 16 bits, forward and backward, against
/// the reference drawing the same keep-flags: kept when the 24-bit draw of the seed's
/// stream is below `1 - p`, then scaled by `1 / (1 - p)`; the log-sum-exp (of the
/// undropped scores) padded to 32 a head with zeros.
#[test]
fn attention_with_dropout_in_half() {
    let mut rng = Rng::new(139);
    let (l, s, e, ev, p) = (5usize, 6usize, 8usize, 4usize, 0.3);
    // A state whose seed an f64 holds exactly: the backward reads back the forward's.
    let state = exact_seed_state(0);
    let seed = attention_seed(state);
    let factor = |at: usize| dropout_factor(seed, p, at);
    assert!(
        (0..l * s).any(|at| factor(at) == 0.0),
        "some probability dropped"
    );
    for dtype in HALVES {
        for causal in [false, true] {
            let shape = |a: usize, b: usize| [1u64, 1, a as u64, b as u64];
            let q = val(dtype, &shape(l, e), rng.vec(l * e, -1.0, 1.0));
            let k = val(dtype, &shape(s, e), rng.vec(s * e, -1.0, 1.0));
            let v = val(dtype, &shape(s, ev), rng.vec(s * ev, -1.0, 1.0));
            let g = val(dtype, &shape(l, ev), rng.vec(l * ev, -1.0, 1.0));
            let (out, lse, dq, dk, dv) = attention_ref(
                (&q.data, &k.data, &v.data, &g.data),
                (l, s, e, ev),
                causal,
                factor,
            );
            let what = format!("attention with dropout {dtype} causal {causal}");
            let got = Case::new(Op::EfficientAttention)
                .input(q.clone())
                .input(k.clone())
                .input(v.clone())
                .absent()
                .input(val(I64, &[], vec![state as f64]))
                .float("dropout_p", p)
                .flag("is_causal", causal)
                .output(dtype, &shape(l, ev))
                .output(Fp32, &[1, 1, 32])
                .output(I64, &[])
                .output(I64, &[])
                .run();
            assert_close(&got[0], &all_pytorch(dtype, out.clone()), ulp(dtype), &what);
            let mut lse32: Vec<f64> = lse.iter().map(|&x| f64::from(x as f32)).collect();
            lse32.resize(32, 0.0);
            // (Within f32 sums' rounding: the CUDA device's kernels add in f32.)
            assert_close(&got[1], &lse32, tol(1e-6, 1e-6), &what);
            assert_eq!(
                (&got[2][..], &got[3][..]),
                (&[seed as i64 as f64][..], &[0.0][..])
            );
            let grads = Case::new(Op::EfficientAttentionBackward)
                .input(g)
                .input(q)
                .input(k)
                .input(v)
                .absent()
                .input(val(dtype, &shape(l, ev), out))
                .input(val(Fp32, &[1, 1, 32], got[1].clone()))
                .input(val(I64, &[], got[2].clone()))
                .input(val(I64, &[], got[3].clone()))
                .float("dropout_p", p)
                .flag("is_causal", causal)
                .attr(
                    "grad_input_mask",
                    Attr::Bools(vec![true, true, true, false]),
                )
                .output(dtype, &shape(l, e))
                .output(dtype, &shape(s, e))
                .output(dtype, &shape(s, ev))
                .unused()
                .run();
            // The rounded output moves D = g . out by one unit of the half type.
            let t = tol(ulp(dtype).rtol, 4.0 * ulp(dtype).rtol);
            for (k, (name, want)) in [("grad_query", dq), ("grad_key", dk), ("grad_value", dv)]
                .into_iter()
                .enumerate()
            {
                let want = all_pytorch(dtype, want);
                assert_close(&grads[k], &want, t, &format!("{what}: {name}"));
            }
        }
    }
}

/// Batch norm under autocast: a 16-bit input with f32 weights and statistics (PyTorch's
/// mixed batch norm). Computed wide: the output and grad_input rounded once to the half
/// type, the statistics and the parameter gradients f32.
#[test]
fn batch_norm_and_its_backward_in_half() {
    let mut rng = Rng::new(137);
    let (n, c, inner) = (3usize, 2usize, 5usize);
    let shape = [n as u64, c as u64, inner as u64];
    let f32r = |v: f64| f64::from(v as f32);
    for dtype in HALVES {
        let x = val(dtype, &shape, rng.vec(n * c * inner, -2.0, 2.0));
        let g = val(dtype, &shape, rng.vec(n * c * inner, -1.0, 1.0));
        let per_channel = |rng: &mut Rng, lo, hi| val(DType::F32, &[c as u64], rng.vec(c, lo, hi));
        let (w, b) = (
            per_channel(&mut rng, 0.5, 1.5),
            per_channel(&mut rng, -1.0, 1.0),
        );
        let (rm, rv) = (
            per_channel(&mut rng, -0.5, 0.5),
            per_channel(&mut rng, 0.5, 2.0),
        );
        let count = (n * inner) as f64;
        let at = |img: usize, ch: usize, j: usize| (img * c + ch) * inner + j;
        let (mut y, mut dx) = (vec![0.0; n * c * inner], vec![0.0; n * c * inner]);
        let mut want: [Vec<f64>; 6] = Default::default();
        for ch in 0..c {
            let idx: Vec<usize> = (0..n)
                .flat_map(|i| (0..inner).map(move |j| at(i, ch, j)))
                .collect();
            let mean = idx.iter().map(|&i| x.data[i]).sum::<f64>() / count;
            let var = idx.iter().map(|&i| (x.data[i] - mean).powi(2)).sum::<f64>() / count;
            let rstd = 1.0 / (var + 1e-5).sqrt();
            let sum_dy: f64 = idx.iter().map(|&i| g.data[i]).sum();
            let dot: f64 = idx.iter().map(|&i| g.data[i] * (x.data[i] - mean)).sum();
            for &i in &idx {
                y[i] = pytorch(dtype, (x.data[i] - mean) * rstd * w.data[ch] + b.data[ch]);
                let k = rstd * rstd * dot / count;
                dx[i] = pytorch(
                    dtype,
                    (g.data[i] - sum_dy / count - (x.data[i] - mean) * k) * rstd * w.data[ch],
                );
            }
            want[0].push(f32r(mean));
            want[1].push(f32r(rstd));
            want[2].push(f32r(0.9 * rm.data[ch] + 0.1 * mean));
            want[3].push(f32r(0.9 * rv.data[ch] + 0.1 * var * count / (count - 1.0)));
            want[4].push(f32r(dot * rstd));
            want[5].push(f32r(sum_dy));
        }
        let cs = &[c as u64][..];
        let got = Case::new(Op::NativeBatchNorm)
            .input(x.clone())
            .input(w.clone())
            .input(b)
            .input(rm)
            .input(rv)
            .flag("training", true)
            .float("momentum", 0.1)
            .float("eps", 1e-5)
            .output(dtype, &shape)
            .output(DType::F32, cs)
            .output(DType::F32, cs)
            .output(DType::F32, cs)
            .output(DType::F32, cs)
            .run();
        let what = format!("batch norm {dtype}");
        // x - mean cancels: one unit of the half type at the terms' scale as well.
        let t = tol(ulp(dtype).rtol, 4.0 * ulp(dtype).rtol);
        assert_close(&got[0], &y, t, &what);
        for k in 0..4 {
            assert_close(
                &got[k + 1],
                &want[k],
                tol(1e-6, 1e-7),
                &format!("{what}: statistic {k}"),
            );
        }
        let grads = Case::new(Op::NativeBatchNormBackward)
            .input(g)
            .input(x)
            .input(w)
            .input(val(DType::F32, cs, got[3].clone()))
            .input(val(DType::F32, cs, got[4].clone()))
            .input(val(DType::F32, cs, got[1].clone()))
            .input(val(DType::F32, cs, got[2].clone()))
            .flag("train", true)
            .float("eps", 1e-5)
            .attr(
                "output_mask",
                salus_graph::Attr::Bools(vec![true, true, true]),
            )
            .output(dtype, &shape)
            .output(DType::F32, cs)
            .output(DType::F32, cs)
            .run();
        assert_close(&grads[0], &dx, t, &format!("{what}: grad_input"));
        assert_close(
            &grads[1],
            &want[4],
            tol(1e-5, 1e-6),
            &format!("{what}: grad_weight"),
        );
        assert_close(
            &grads[2],
            &want[5],
            tol(1e-6, 1e-6),
            &format!("{what}: grad_bias"),
        );
    }
}

const ALL_TESTS: &[Test] = &[
    (
        "batch_norm_and_its_backward_in_half",
        batch_norm_and_its_backward_in_half,
    ),
    (
        "attention_and_its_backward_in_half",
        attention_and_its_backward_in_half,
    ),
    (
        "attention_with_dropout_in_half",
        attention_with_dropout_in_half,
    ),
    ("half_rounding_is_pytorchs", half_rounding_is_pytorchs),
    ("casts_between_f32_and_half", casts_between_f32_and_half),
    ("pointwise_arithmetic_in_half", pointwise_arithmetic_in_half),
    (
        "activations_comparisons_and_selections_in_half",
        activations_comparisons_and_selections_in_half,
    ),
    ("shape_ops_copy_half_values", shape_ops_copy_half_values),
    ("sums_and_means_in_half", sums_and_means_in_half),
    ("products_in_half", products_in_half),
    (
        "convolution_and_its_backward_in_half",
        convolution_and_its_backward_in_half,
    ),
    (
        "max_pool_and_its_backward_in_half",
        max_pool_and_its_backward_in_half,
    ),
];

#[test]
fn every_autocast_op_is_tested_in_half() {
    let ran = record_ops(|| {
        for (_, test) in ALL_TESTS {
            test();
        }
    });
    let ran: Vec<&str> = ran.iter().map(|op| op.name()).collect();
    let missing: Vec<&str> = AUTOCAST_OPS
        .iter()
        .copied()
        .filter(|name| !ran.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "autocast ops no half test runs: {missing:?}"
    );
    let source = include_str!("half_ops.rs");
    let tests = source.matches("#[test]\nfn ").count();
    assert_eq!(
        tests,
        ALL_TESTS.len() + 1,
        "a test is missing from ALL_TESTS"
    );
}
