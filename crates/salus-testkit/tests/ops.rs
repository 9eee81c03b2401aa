//! Every op of the IR on the CPU device, each checked against a plain reference written
//! here (naive loops over `f64`): broadcasting, odd shapes, zero-size dimensions, negative
//! dimensions, and for the backward ops central finite differences of the forward op as
//! the device runs it. `every_op_is_tested` fails when an op of `Op::ALL` is run by no
//! case, so a new op cannot go untested.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use salus_graph::{Attr, DType, Op};

use DType::{Bf16, Bool, F16, F32 as Fp32, I32, I64};

// ---------------------------------------------------------------------------------------
// Elementwise

/// Shapes every elementwise case runs at: odd sizes, a 0-dim scalar, a zero-size tensor.
const UNARY_SHAPES: &[&[u64]] = &[&[3, 5, 7], &[], &[0, 4]];

/// A unary op over `dtype` inputs drawn from `[lo, hi)` (plus `specials` appended to the
/// first shape), against `f`, at every shape of [`UNARY_SHAPES`].
#[allow(clippy::too_many_arguments)]
fn unary(
    op: Op,
    attrs: &[(&str, Attr)],
    dtype: DType,
    out: DType,
    (lo, hi): (f64, f64),
    specials: &[f64],
    tol: Tol,
    f: impl Fn(f64) -> f64,
) {
    let mut rng = Rng::new(op as u64);
    for (k, &shape) in UNARY_SHAPES.iter().enumerate() {
        let mut data = rng.vec(numel(shape), lo, hi);
        let mut shape = shape.to_vec();
        if k == 0 && !specials.is_empty() {
            data.extend(specials);
            shape = vec![data.len() as u64];
        }
        let x = val(dtype, &shape, data);
        let mut case = Case::new(op).input(x.clone()).output(out, &shape);
        for (name, a) in attrs {
            case = case.attr(name, a.clone());
        }
        let want: Vec<f64> = x.data.iter().map(|&v| round_to(out, f(v))).collect();
        assert_close(
            &case.run1(),
            &want,
            tol,
            &format!("{op} of {dtype}{shape:?}"),
        );
    }
}

const NAN: f64 = f64::NAN;
const INF: f64 = f64::INFINITY;

/// erf by Simpson's rule on `2/sqrt(pi) * exp(-t^2)` over `[0, x]` (2000 panels): slow
/// and obviously right.
fn erf_ref(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let x_clamped = x.clamp(-8.0, 8.0);
    let n = 2000;
    let h = x_clamped / n as f64;
    let f = |t: f64| (-t * t).exp();
    let mut s = f(0.0) + f(x_clamped);
    for i in 1..n {
        s += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
    }
    s * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn unary_float_functions() {
    let sp = &[NAN, INF, -INF, 0.0, -0.0, 1e-30];
    let t = F32;
    unary(Op::Neg, &[], Fp32, Fp32, (-3.0, 3.0), sp, EXACT, |x| -x);
    unary(Op::Abs, &[], Fp32, Fp32, (-3.0, 3.0), sp, EXACT, f64::abs);
    let sign = |x: f64| {
        if x.is_nan() {
            x
        } else if x > 0.0 {
            1.0
        } else if x < 0.0 {
            -1.0
        } else {
            0.0
        }
    };
    unary(Op::Sign, &[], Fp32, Fp32, (-3.0, 3.0), sp, EXACT, sign);
    unary(Op::Exp, &[], Fp32, Fp32, (-5.0, 5.0), sp, t, f64::exp);
    unary(
        Op::Log,
        &[],
        Fp32,
        Fp32,
        (0.01, 9.0),
        &[-1.0, 0.0, INF, NAN],
        t,
        f64::ln,
    );
    unary(
        Op::Sqrt,
        &[],
        Fp32,
        Fp32,
        (0.0, 9.0),
        &[-1.0, INF, NAN],
        t,
        f64::sqrt,
    );
    unary(
        Op::Rsqrt,
        &[],
        Fp32,
        Fp32,
        (0.01, 9.0),
        &[0.0, INF, NAN],
        t,
        |x| 1.0 / x.sqrt(),
    );
    unary(
        Op::Reciprocal,
        &[],
        Fp32,
        Fp32,
        (-9.0, 9.0),
        &[0.0, -0.0, INF, NAN],
        t,
        |x| 1.0 / x,
    );
    unary(
        Op::Erf,
        &[],
        Fp32,
        Fp32,
        (-4.0, 4.0),
        &[NAN, 0.0, 9.0, -9.0],
        t,
        erf_ref,
    );
    unary(
        Op::Log1p,
        &[],
        Fp32,
        Fp32,
        (-0.9, 9.0),
        &[-1.0, -2.0, 1e-10, -1e-10, 0.0, INF, NAN],
        t,
        f64::ln_1p,
    );
    unary(
        Op::Expm1,
        &[],
        Fp32,
        Fp32,
        (-5.0, 5.0),
        &[1e-10, -1e-10, 0.0, -INF, INF, NAN],
        t,
        f64::exp_m1,
    );
    // Arguments as a timestep embedding makes them (up to 1000 radians), and past.
    let specials = [0.0, -0.0, 1e-10, 1000.0, -999.5, 1e5, INF, -INF, NAN];
    unary(
        Op::Sin,
        &[],
        Fp32,
        Fp32,
        (-10.0, 10.0),
        &specials,
        t,
        f64::sin,
    );
    unary(
        Op::Cos,
        &[],
        Fp32,
        Fp32,
        (-10.0, 10.0),
        &specials,
        t,
        f64::cos,
    );
    // atan's range ends (+-pi/2 at the infinities) and signed zeros.
    unary(
        Op::Atan,
        &[],
        Fp32,
        Fp32,
        (-20.0, 20.0),
        &specials,
        t,
        f64::atan,
    );
    unary(Op::Atan, &[], I64, Fp32, (-20.0, 20.0), &[], t, f64::atan);
    let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
    unary(Op::Sigmoid, &[], Fp32, Fp32, (-8.0, 8.0), sp, t, sigmoid);
    unary(Op::Tanh, &[], Fp32, Fp32, (-4.0, 4.0), sp, t, f64::tanh);
    let relu = |x: f64| if x > 0.0 || x.is_nan() { x } else { 0.0 };
    unary(
        Op::Relu,
        &[],
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[NAN, INF, -INF],
        EXACT,
        relu,
    );
    let slope = [("negative_slope", Attr::Float(0.2))];
    let leaky = |x: f64| if x > 0.0 { x } else { 0.2 * x };
    unary(
        Op::LeakyRelu,
        &slope,
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[INF, -INF],
        t,
        leaky,
    );
    // Integer inputs of float functions compute in f32.
    unary(Op::Exp, &[], I64, Fp32, (-5.0, 5.0), &[], t, f64::exp);
    unary(Op::Neg, &[], I64, I64, (-50.0, 50.0), &[], EXACT, |x| -x);
    unary(Op::Abs, &[], I32, I32, (-50.0, 50.0), &[], EXACT, f64::abs);
    // Half precision: stored as such, computed in f32, rounded once.
    unary(
        Op::Exp,
        &[],
        F16,
        F16,
        (-3.0, 3.0),
        &[],
        tol(1e-3, 0.0),
        f64::exp,
    );
    unary(
        Op::Tanh,
        &[],
        Bf16,
        Bf16,
        (-3.0, 3.0),
        &[],
        tol(8e-3, 0.0),
        f64::tanh,
    );
}

#[test]
fn gelu_exact_and_tanh() {
    let exact = |x: f64| 0.5 * x * (1.0 + erf_ref(x / std::f64::consts::SQRT_2));
    unary(
        Op::Gelu,
        &[],
        Fp32,
        Fp32,
        (-5.0, 5.0),
        &[0.0, -0.0, NAN],
        F32,
        exact,
    );
    let none = [("approximate", Attr::Str("none".into()))];
    unary(Op::Gelu, &none, Fp32, Fp32, (-5.0, 5.0), &[], F32, exact);
    let tanh = [("approximate", Attr::Str("tanh".into()))];
    let approx = |x: f64| {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (k * (x + 0.044715 * x.powi(3))).tanh())
    };
    unary(Op::Gelu, &tanh, Fp32, Fp32, (-5.0, 5.0), &[], F32, approx);
}

#[test]
fn scalar_ops() {
    let other = |v: f64| [("other", Attr::Float(v)), ("alpha", Attr::Float(-2.0))];
    unary(
        Op::AddScalar,
        &other(1.5),
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[NAN],
        F32,
        |x| x - 3.0,
    );
    unary(
        Op::MulScalar,
        &other(1.5)[..1],
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[INF],
        F32,
        |x| x * 1.5,
    );
    unary(
        Op::DivScalar,
        &other(-4.0)[..1],
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[],
        F32,
        |x| x / -4.0,
    );
    // An integer tensor and a float number give f32; an integer number keeps i64.
    unary(
        Op::AddScalar,
        &other(0.25),
        I64,
        Fp32,
        (-9.0, 9.0),
        &[],
        F32,
        |x| x - 0.5,
    );
    let int = [("other", Attr::Int(3))];
    unary(
        Op::MulScalar,
        &int,
        I64,
        I64,
        (-9.0, 9.0),
        &[],
        EXACT,
        |x| x * 3.0,
    );
    unary(Op::DivScalar, &int, I64, Fp32, (-9.0, 9.0), &[], F32, |x| {
        x / 3.0
    });
    let e = |v: f64| [("exponent", Attr::Float(v))];
    unary(
        Op::PowTensorScalar,
        &e(2.5),
        Fp32,
        Fp32,
        (0.0, 3.0),
        &[],
        F32,
        |x| x.powf(2.5),
    );
    unary(
        Op::PowTensorScalar,
        &e(3.0),
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[],
        F32,
        |x| x.powi(3),
    );
    unary(
        Op::PowTensorScalar,
        &e(-0.5),
        Fp32,
        Fp32,
        (0.1, 3.0),
        &[0.0],
        F32,
        |x| 1.0 / x.sqrt(),
    );
    let base = [("self", Attr::Float(2.0))];
    unary(
        Op::PowScalar,
        &base,
        Fp32,
        Fp32,
        (-4.0, 4.0),
        &[INF, -INF],
        F32,
        f64::exp2,
    );
    let both = [("min", Attr::Float(-0.5)), ("max", Attr::Float(1.0))];
    unary(
        Op::Clamp,
        &both,
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[NAN],
        EXACT,
        |x| {
            if x.is_nan() { x } else { x.clamp(-0.5, 1.0) }
        },
    );
    let lo = [("min", Attr::Float(0.0))];
    unary(
        Op::Clamp,
        &lo,
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[-INF],
        EXACT,
        |x| x.max(0.0),
    );
    let hi = [("max", Attr::Int(2))];
    unary(Op::Clamp, &hi, I64, I64, (-9.0, 9.0), &[], EXACT, |x| {
        x.min(2.0)
    });
}

#[test]
fn comparisons_with_a_number() {
    let other = [("other", Attr::Float(0.5))];
    let specials = &[0.5, -0.5, NAN, INF];
    type Compare = (Op, fn(f64, f64) -> bool);
    let cmp: [Compare; 6] = [
        (Op::EqScalar, |a, b| a == b),
        (Op::NeScalar, |a, b| a != b),
        (Op::LtScalar, |a, b| a < b),
        (Op::LeScalar, |a, b| a <= b),
        (Op::GtScalar, |a, b| a > b),
        (Op::GeScalar, |a, b| a >= b),
    ];
    for (op, f) in cmp {
        let r = move |x: f64| f64::from(u8::from(f(x, 0.5)));
        unary(op, &other, Fp32, Bool, (-1.0, 1.0), specials, EXACT, r);
        // Integers compare exactly with an integer number.
        let two = [("other", Attr::Int(2))];
        let ri = move |x: f64| f64::from(u8::from(f(x, 2.0)));
        unary(op, &two, I64, Bool, (-4.0, 5.0), &[], EXACT, ri);
    }
}

#[test]
fn logical_and_bitwise_not() {
    let not = |x: f64| f64::from(u8::from(x == 0.0));
    unary(
        Op::LogicalNot,
        &[],
        Fp32,
        Bool,
        (-1.0, 1.0),
        &[0.0, -0.0, NAN],
        EXACT,
        not,
    );
    unary(
        Op::LogicalNot,
        &[],
        Bool,
        Bool,
        (-1.0, 1.0),
        &[0.0],
        EXACT,
        not,
    );
    unary(
        Op::BitwiseNot,
        &[],
        Bool,
        Bool,
        (-1.0, 1.0),
        &[0.0],
        EXACT,
        not,
    );
    let bnot = |x: f64| !(x as i64) as f64;
    unary(
        Op::BitwiseNot,
        &[],
        I64,
        I64,
        (-100.0, 100.0),
        &[0.0],
        EXACT,
        bnot,
    );
    unary(
        Op::BitwiseNot,
        &[],
        I32,
        I32,
        (-100.0, 100.0),
        &[0.0],
        EXACT,
        bnot,
    );
}

#[test]
fn copies_and_conversions() {
    unary(
        Op::Clone,
        &[],
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[NAN, INF],
        EXACT,
        |x| x,
    );
    unary(Op::Clone, &[], I64, I64, (-30.0, 30.0), &[], EXACT, |x| x);
    let to = |d: DType| [("dtype", Attr::DType(d))];
    unary(
        Op::ToCopy,
        &[],
        Fp32,
        Fp32,
        (-3.0, 3.0),
        &[NAN],
        EXACT,
        |x| x,
    );
    // Float to integer truncates toward zero; to bool is != 0.
    unary(
        Op::ToCopy,
        &to(I64),
        Fp32,
        I64,
        (-9.0, 9.0),
        &[-0.5, 2.99],
        EXACT,
        f64::trunc,
    );
    unary(
        Op::ToCopy,
        &to(I32),
        Fp32,
        I32,
        (-9.0, 9.0),
        &[-1.5],
        EXACT,
        f64::trunc,
    );
    unary(
        Op::ToCopy,
        &to(Bool),
        Fp32,
        Bool,
        (-1.0, 1.0),
        &[0.0, NAN],
        EXACT,
        |x| f64::from(u8::from(x != 0.0)),
    );
    unary(
        Op::ToCopy,
        &to(Fp32),
        I64,
        Fp32,
        (-99.0, 99.0),
        &[],
        EXACT,
        |x| x,
    );
    unary(
        Op::ToCopy,
        &to(Fp32),
        Bool,
        Fp32,
        (-1.0, 1.0),
        &[],
        EXACT,
        |x| x,
    );
    // To half precision rounds to nearest; back to f32 is exact.
    let f16 = |x: f64| half::f16::from_f64(x).to_f64();
    unary(
        Op::ToCopy,
        &to(F16),
        Fp32,
        F16,
        (-70000.0, 70000.0),
        &[1e-8, NAN],
        EXACT,
        f16,
    );
    let bf16 = |x: f64| half::bf16::from_f64(x).to_f64();
    unary(
        Op::ToCopy,
        &to(Bf16),
        Fp32,
        Bf16,
        (-3.0, 3.0),
        &[1e30, -INF],
        EXACT,
        bf16,
    );
    unary(
        Op::ToCopy,
        &to(Fp32),
        F16,
        Fp32,
        (-3.0, 3.0),
        &[],
        EXACT,
        |x| x,
    );
    unary(
        Op::ToCopy,
        &to(Fp32),
        Bf16,
        Fp32,
        (-3.0, 3.0),
        &[],
        EXACT,
        |x| x,
    );
}

/// A binary op at broadcasting shape pairs against `f`, checking the output dtype too.
fn binary(
    op: Op,
    attrs: &[(&str, Attr)],
    (da, db, out): (DType, DType, DType),
    range: (f64, f64),
    tol: Tol,
    f: impl Fn(f64, f64) -> f64,
) {
    let pairs: &[(&[u64], &[u64], &[u64])] = &[
        (&[3, 5, 7], &[3, 5, 7], &[3, 5, 7]),
        (&[3, 1, 7], &[5, 1], &[3, 5, 7]),
        (&[7], &[3, 5, 1], &[3, 5, 7]),
        (&[2, 3], &[], &[2, 3]),
        (&[], &[], &[]),
        (&[0, 3], &[3], &[0, 3]),
        (&[4, 1], &[0], &[4, 0]),
    ];
    let mut rng = Rng::new(op as u64 + 100);
    for &(sa, sb, so) in pairs {
        let a = val(da, sa, rng.vec(numel(sa), range.0, range.1));
        let b = val(db, sb, rng.vec(numel(sb), range.0, range.1));
        let mut case = Case::new(op)
            .input(a.clone())
            .input(b.clone())
            .output(out, so);
        for (name, v) in attrs {
            case = case.attr(name, v.clone());
        }
        let want: Vec<f64> = (0..numel(so))
            .map(|i| {
                let idx = unravel(i, so);
                let (x, y) = (
                    a.data[broadcast_at(&idx, sa)],
                    b.data[broadcast_at(&idx, sb)],
                );
                round_to(out, f(x, y))
            })
            .collect();
        assert_close(
            &case.run1(),
            &want,
            tol,
            &format!("{op} of {da}{sa:?} and {db}{sb:?}"),
        );
    }
}

#[test]
fn binary_arithmetic_broadcasts() {
    let r = (-3.0, 3.0);
    let ff = (Fp32, Fp32, Fp32);
    binary(Op::AddTensor, &[], ff, r, F32, |a, b| a + b);
    let alpha = [("alpha", Attr::Float(0.5))];
    binary(Op::AddTensor, &alpha, ff, r, F32, |a, b| a + 0.5 * b);
    binary(Op::SubTensor, &[], ff, r, F32, |a, b| a - b);
    binary(Op::SubTensor, &alpha, ff, r, F32, |a, b| a - 0.5 * b);
    binary(Op::MulTensor, &[], ff, r, F32, |a, b| a * b);
    binary(Op::DivTensor, &[], ff, (0.5, 3.0), F32, |a, b| a / b);
    // Promotion: integers add exactly, integer / integer is true division in f32, an
    // integer tensor with a float tensor gives f32, half with half stays half.
    binary(
        Op::AddTensor,
        &[],
        (I64, I64, I64),
        (-99.0, 99.0),
        EXACT,
        |a, b| a + b,
    );
    binary(
        Op::MulTensor,
        &[],
        (I32, I32, I32),
        (-99.0, 99.0),
        EXACT,
        |a, b| a * b,
    );
    binary(
        Op::DivTensor,
        &[],
        (I64, I64, Fp32),
        (1.0, 99.0),
        F32,
        |a, b| a / b,
    );
    binary(Op::SubTensor, &[], (I64, Fp32, Fp32), r, F32, |a, b| a - b);
    binary(
        Op::MulTensor,
        &[],
        (F16, F16, F16),
        r,
        tol(1e-3, 1e-3),
        |a, b| a * b,
    );
    binary(
        Op::AddTensor,
        &[],
        (Bf16, Bf16, Bf16),
        r,
        tol(8e-3, 8e-3),
        |a, b| a + b,
    );
}

#[test]
fn binary_logical_and_bitwise() {
    let truth = |v: bool| f64::from(u8::from(v));
    binary(
        Op::LogicalAnd,
        &[],
        (Fp32, Bool, Bool),
        (-1.0, 1.0),
        EXACT,
        |a, b| truth(a != 0.0 && b != 0.0),
    );
    // Inputs drawn from -1..1 truncate to many zeros: both branches are exercised.
    binary(
        Op::LogicalAnd,
        &[],
        (I64, I64, Bool),
        (-2.0, 2.0),
        EXACT,
        |a, b| truth(a != 0.0 && b != 0.0),
    );
    binary(
        Op::BitwiseAndTensor,
        &[],
        (I64, I64, I64),
        (-200.0, 200.0),
        EXACT,
        |a, b| ((a as i64) & (b as i64)) as f64,
    );
    binary(
        Op::BitwiseAndTensor,
        &[],
        (Bool, Bool, Bool),
        (-1.0, 1.0),
        EXACT,
        |a, b| truth(a != 0.0 && b != 0.0),
    );
}

#[test]
fn where_broadcasts_three_ways() {
    let mut rng = Rng::new(7);
    type Shapes<'a> = (&'a [u64], &'a [u64], &'a [u64], &'a [u64]);
    let cases: &[Shapes<'_>] = &[
        (&[3, 1, 7], &[5, 1], &[], &[3, 5, 7]),
        (&[4], &[4], &[4], &[4]),
        (&[0, 2], &[2], &[1], &[0, 2]),
    ];
    for &(sc, sa, sb, so) in cases {
        let c = val(
            Bool,
            sc,
            rng.vec(numel(sc), -1.0, 1.0)
                .iter()
                .map(|v| f64::from(u8::from(*v > 0.0)))
                .collect(),
        );
        let a = rng.f32s(sa, -3.0, 3.0);
        let b = rng.f32s(sb, -3.0, 3.0);
        let got = Case::new(Op::WhereSelf)
            .input(c.clone())
            .input(a.clone())
            .input(b.clone())
            .output(Fp32, so)
            .run1();
        let want: Vec<f64> = (0..numel(so))
            .map(|i| {
                let idx = unravel(i, so);
                if c.data[broadcast_at(&idx, sc)] != 0.0 {
                    a.data[broadcast_at(&idx, sa)]
                } else {
                    b.data[broadcast_at(&idx, sb)]
                }
            })
            .collect();
        assert_close(&got, &want, EXACT, &format!("where {sc:?} {sa:?} {sb:?}"));
    }
    // Mixed dtypes promote: i64 and f32 give f32.
    let got = Case::new(Op::WhereSelf)
        .input(val(Bool, &[3], vec![1.0, 0.0, 1.0]))
        .input(i64v(&[3], &[1, 2, 3]))
        .input(f32v(&[], vec![-0.5]))
        .output(Fp32, &[3])
        .run1();
    assert_close(&got, &[1.0, -0.5, 3.0], EXACT, "where i64/f32");
}

// ---------------------------------------------------------------------------------------
// Reductions

/// The reduced dimensions (all when `dims` is empty) and the output shape.
fn reduced_shape(shape: &[u64], dims: &[i64], keepdim: bool) -> (Vec<bool>, Vec<u64>) {
    let rank = shape.len() as i64;
    let mut reduced = vec![dims.is_empty(); shape.len()];
    for &d in dims {
        reduced[(if d < 0 { d + rank } else { d }) as usize] = true;
    }
    let out = shape
        .iter()
        .zip(&reduced)
        .filter_map(|(&n, &r)| match (r, keepdim) {
            (true, true) => Some(1),
            (true, false) => None,
            (false, _) => Some(n),
        })
        .collect();
    (reduced, out)
}

/// The elements of `x` that fall into each output element of the reduction.
fn groups(x: &Value, dims: &[i64]) -> Vec<Vec<f64>> {
    let (reduced, out) = reduced_shape(&x.ty.shape, dims, true);
    let mut groups = vec![vec![]; numel(&out)];
    for (i, &v) in x.data.iter().enumerate() {
        let mut idx = unravel(i, &x.ty.shape);
        for (d, r) in reduced.iter().enumerate() {
            if *r {
                idx[d] = 0;
            }
        }
        groups[ravel(&idx, &out)].push(v);
    }
    groups
}

const REDUCE_CASES: &[(&[u64], &[i64], bool)] = &[
    (&[3, 5, 7], &[1], false),
    (&[3, 5, 7], &[0, 2], true),
    (&[3, 5, 7], &[-1], false),
    (&[3, 5, 7], &[-3, -2], true),
    (&[3, 5, 7], &[], false),
    (&[4, 6], &[], true),
    (&[0, 3], &[0], false),
    (&[3, 0], &[0], true),
];

/// A reduction over every case of [`REDUCE_CASES`] against `f` of each group.
fn reduction(
    op: Op,
    extra: &[(&str, Attr)],
    dtype: DType,
    out: DType,
    tol: Tol,
    f: impl Fn(&[f64]) -> f64,
) {
    let mut rng = Rng::new(op as u64 + 200);
    for &(shape, dims, keepdim) in REDUCE_CASES {
        let x = val(dtype, shape, rng.vec(numel(shape), -3.0, 3.0));
        let (_, out_shape) = reduced_shape(shape, dims, keepdim);
        let mut case = Case::new(op)
            .input(x.clone())
            .ints("dim", dims)
            .flag("keepdim", keepdim)
            .output(out, &out_shape);
        for (name, a) in extra {
            case = case.attr(name, a.clone());
        }
        let want: Vec<f64> = groups(&x, dims)
            .iter()
            .map(|g| round_to(out, f(g)))
            .collect();
        assert_close(
            &case.run1(),
            &want,
            tol,
            &format!("{op} of {shape:?} over {dims:?}"),
        );
    }
}

fn sum(g: &[f64]) -> f64 {
    g.iter().sum()
}

fn mean(g: &[f64]) -> f64 {
    sum(g) / g.len() as f64
}

#[test]
fn sums_means_and_maxima() {
    reduction(Op::SumDimIntList, &[], Fp32, Fp32, SUM32, sum);
    reduction(Op::SumDimIntList, &[], I64, I64, EXACT, sum);
    reduction(Op::SumDimIntList, &[], Bool, I64, EXACT, sum);
    let to_f32 = [("dtype", Attr::DType(Fp32))];
    reduction(Op::SumDimIntList, &to_f32, I32, Fp32, EXACT, sum);
    reduction(Op::SumDimIntList, &[], F16, F16, tol(2e-3, 2e-3), sum);
    // Means of nothing are NaN, as in PyTorch.
    reduction(Op::MeanDim, &[], Fp32, Fp32, SUM32, mean);
    let amax = |g: &[f64]| g.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut rng = Rng::new(5);
    for &(shape, dims, keepdim) in &REDUCE_CASES[..6] {
        let x = rng.f32s(shape, -3.0, 3.0);
        let (_, out_shape) = reduced_shape(shape, dims, keepdim);
        let got = Case::new(Op::Amax)
            .input(x.clone())
            .ints("dim", dims)
            .flag("keepdim", keepdim)
            .output(Fp32, &out_shape)
            .run1();
        let want: Vec<f64> = groups(&x, dims).iter().map(|g| amax(g)).collect();
        assert_close(
            &got,
            &want,
            EXACT,
            &format!("amax of {shape:?} over {dims:?}"),
        );
    }
    // amax propagates NaN.
    let got = Case::new(Op::Amax)
        .input(f32v(&[2, 3], vec![1.0, NAN, 2.0, -1.0, -2.0, -3.0]))
        .ints("dim", &[1])
        .flag("keepdim", false)
        .output(Fp32, &[2])
        .run1();
    assert_close(&got, &[NAN, -1.0], EXACT, "amax with NaN");
    for shape in [&[3u64, 5, 7][..], &[1], &[]] {
        let x = rng.f32s(shape, -3.0, 3.0);
        let got = Case::new(Op::Mean)
            .input(x.clone())
            .output(Fp32, &[])
            .run1();
        assert_close(&got, &[mean(&x.data)], SUM32, &format!("mean of {shape:?}"));
    }
    let half = val(Bf16, &[4, 4], rng.vec(16, -3.0, 3.0));
    let got = Case::new(Op::Mean)
        .input(half.clone())
        .output(Bf16, &[])
        .run1();
    assert_close(&got, &[mean(&half.data)], tol(8e-3, 8e-3), "mean of bf16");
}

#[test]
fn variance_and_any() {
    let var = |correction: f64| {
        move |g: &[f64]| {
            let m = mean(g);
            g.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (g.len() as f64 - correction)
        }
    };
    let mut rng = Rng::new(11);
    for correction in [0.0, 1.0] {
        for &(shape, dims, keepdim) in &REDUCE_CASES[..6] {
            let x = rng.f32s(shape, -3.0, 3.0);
            let (_, out_shape) = reduced_shape(shape, dims, keepdim);
            let got = Case::new(Op::VarCorrection)
                .input(x.clone())
                .ints("dim", dims)
                .float("correction", correction)
                .flag("keepdim", keepdim)
                .output(Fp32, &out_shape)
                .run1();
            let want: Vec<f64> = groups(&x, dims)
                .iter()
                .map(|g| var(correction)(g))
                .collect();
            assert_close(
                &got,
                &want,
                SUM32,
                &format!("var of {shape:?} over {dims:?}"),
            );
        }
    }
    for &(shape, dims, keepdim) in REDUCE_CASES.iter().filter(|c| c.1.len() == 1) {
        // Mostly zeros: some groups hold no non-zero element.
        let data: Vec<f64> = rng
            .vec(numel(shape), -1.0, 1.0)
            .iter()
            .map(|v| if *v > 0.8 { *v } else { 0.0 })
            .collect();
        for dtype in [Fp32, Bool, I64] {
            let x = val(dtype, shape, data.iter().map(|v| v * 10.0).collect());
            let (_, out_shape) = reduced_shape(shape, dims, keepdim);
            let got = Case::new(Op::AnyDim)
                .input(x.clone())
                .int("dim", dims[0])
                .flag("keepdim", keepdim)
                .output(Bool, &out_shape)
                .run1();
            let want: Vec<f64> = groups(&x, dims)
                .iter()
                .map(|g| f64::from(u8::from(g.iter().any(|v| *v != 0.0))))
                .collect();
            assert_close(
                &got,
                &want,
                EXACT,
                &format!("any of {dtype}{shape:?} over {dims:?}"),
            );
        }
    }
}

/// Softmax (or log-softmax) of `x` along `dim`, the plain way.
fn softmax_ref(x: &Value, dim: i64, log: bool) -> Vec<f64> {
    let shape = &x.ty.shape;
    let d = if dim < 0 {
        (dim + shape.len() as i64) as usize
    } else {
        dim as usize
    };
    (0..x.data.len())
        .map(|i| {
            let idx = unravel(i, shape);
            let row: Vec<f64> = (0..shape[d] as usize)
                .map(|j| {
                    let mut k = idx.clone();
                    k[d] = j;
                    x.data[ravel(&k, shape)]
                })
                .collect();
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
            if log {
                x.data[i] - m - z.ln()
            } else {
                (x.data[i] - m).exp() / z
            }
        })
        .collect()
}

const SOFTMAX_CASES: &[(&[u64], i64)] = &[
    (&[3, 5, 7], 1),
    (&[3, 5, 7], -1),
    (&[4, 6], 0),
    (&[5], -1),
    (&[0, 3], 1),
    (&[2, 3, 0], 1),
];

#[test]
fn softmax_and_log_softmax() {
    let mut rng = Rng::new(13);
    for &(shape, dim) in SOFTMAX_CASES {
        for (op, log) in [(Op::Softmax, false), (Op::LogSoftmax, true)] {
            let x = rng.f32s(shape, -6.0, 6.0);
            let got = Case::new(op)
                .input(x.clone())
                .int("dim", dim)
                .flag("half_to_float", false)
                .output(Fp32, shape)
                .run1();
            assert_close(
                &got,
                &softmax_ref(&x, dim, log),
                tol(1e-6, 1e-6),
                &format!("{op} of {shape:?} along {dim}"),
            );
        }
    }
    // Large inputs do not overflow.
    let x = f32v(&[3], vec![1000.0, 1001.0, 999.0]);
    let got = Case::new(Op::Softmax)
        .input(x.clone())
        .int("dim", 0)
        .output(Fp32, &[3])
        .run1();
    assert_close(
        &got,
        &softmax_ref(&x, 0, false),
        F32,
        "softmax of large values",
    );
    // half_to_float: f16 in, f32 out.
    let x = val(F16, &[2, 5], rng.vec(10, -3.0, 3.0));
    let got = Case::new(Op::LogSoftmax)
        .input(x.clone())
        .int("dim", -1)
        .flag("half_to_float", true)
        .output(Fp32, &[2, 5])
        .run1();
    assert_close(
        &got,
        &softmax_ref(&x, -1, true),
        F32,
        "log_softmax f16 to f32",
    );
}

#[test]
fn softmax_backwards_match_formula_and_finite_differences() {
    let mut rng = Rng::new(17);
    for &(shape, dim) in SOFTMAX_CASES {
        for (fwd, bwd, log) in [
            (Op::Softmax, Op::SoftmaxBackwardData, false),
            (Op::LogSoftmax, Op::LogSoftmaxBackwardData, true),
        ] {
            let x = rng.f32s(shape, -2.0, 2.0);
            let g = rng.f32s(shape, -1.0, 1.0);
            let forward = Case::new(fwd)
                .input(x.clone())
                .int("dim", dim)
                .flag("half_to_float", false)
                .output(Fp32, shape);
            let y = f32v(shape, forward.run1());
            let got = Case::new(bwd)
                .input(g.clone())
                .input(y.clone())
                .int("dim", dim)
                .dtype("input_dtype", Fp32)
                .output(Fp32, shape)
                .run1();
            // The formula, summing along dim the plain way.
            let d = if dim < 0 {
                (dim + shape.len() as i64) as usize
            } else {
                dim as usize
            };
            let want: Vec<f64> = (0..g.data.len())
                .map(|i| {
                    let idx = unravel(i, shape);
                    let along = |j: usize| {
                        let mut k = idx.clone();
                        k[d] = j;
                        ravel(&k, shape)
                    };
                    let n = shape[d] as usize;
                    if log {
                        let s: f64 = (0..n).map(|j| g.data[along(j)]).sum();
                        g.data[i] - y.data[i].exp() * s
                    } else {
                        let s: f64 = (0..n).map(|j| g.data[along(j)] * y.data[along(j)]).sum();
                        y.data[i] * (g.data[i] - s)
                    }
                })
                .collect();
            assert_close(
                &got,
                &want,
                tol(1e-5, 1e-6),
                &format!("{bwd} of {shape:?} along {dim}"),
            );
            let numeric = numeric_grad(&forward, 0, 0, &g.data, 1e-2);
            assert_grad(
                &got,
                &numeric,
                2e-3,
                &format!("{bwd} vs finite differences of {fwd}"),
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Matrix products

fn matmul_ref(a: &[f64], b: &[f64], n: usize, k: usize, m: usize) -> Vec<f64> {
    let mut c = vec![0.0; n * m];
    for i in 0..n {
        for j in 0..m {
            for p in 0..k {
                c[i * m + j] += a[i * k + p] * b[p * m + j];
            }
        }
    }
    c
}

#[test]
fn mm_addmm_bmm() {
    let mut rng = Rng::new(19);
    for (n, k, m) in [(3, 5, 7), (1, 1, 1), (4, 0, 3), (0, 3, 2), (17, 33, 9)] {
        let a = rng.f32s(&[n, k], -1.0, 1.0);
        let b = rng.f32s(&[k, m], -1.0, 1.0);
        let (nu, ku, mu) = (n as usize, k as usize, m as usize);
        let want = matmul_ref(&a.data, &b.data, nu, ku, mu);
        let got = Case::new(Op::Mm)
            .input(a.clone())
            .input(b.clone())
            .output(Fp32, &[n, m])
            .run1();
        assert_close(&got, &want, SUM32, &format!("mm {n}x{k}x{m}"));
        for bias_shape in [vec![m], vec![n, m], vec![1, m], vec![]] {
            let bias = rng.f32s(&bias_shape, -1.0, 1.0);
            let got = Case::new(Op::Addmm)
                .input(bias.clone())
                .input(a.clone())
                .input(b.clone())
                .float("beta", 0.5)
                .float("alpha", -2.0)
                .output(Fp32, &[n, m])
                .run1();
            let want: Vec<f64> = (0..nu * mu)
                .map(|i| {
                    0.5 * bias.data[broadcast_at(&unravel(i, &[n, m]), &bias_shape)] - 2.0 * want[i]
                })
                .collect();
            assert_close(
                &got,
                &want,
                SUM32,
                &format!("addmm {n}x{k}x{m} bias {bias_shape:?}"),
            );
        }
        let batches = 3;
        let a = rng.f32s(&[batches, n, k], -1.0, 1.0);
        let b = rng.f32s(&[batches, k, m], -1.0, 1.0);
        let got = Case::new(Op::Bmm)
            .input(a.clone())
            .input(b.clone())
            .output(Fp32, &[batches, n, m])
            .run1();
        let want: Vec<f64> = (0..batches as usize)
            .flat_map(|i| {
                matmul_ref(
                    &a.data[i * nu * ku..(i + 1) * nu * ku],
                    &b.data[i * ku * mu..(i + 1) * ku * mu],
                    nu,
                    ku,
                    mu,
                )
            })
            .collect();
        assert_close(&got, &want, SUM32, &format!("bmm {batches}x{n}x{k}x{m}"));
    }
    // Half precision goes through f32 and rounds once.
    let a = val(Bf16, &[3, 4], rng.vec(12, -1.0, 1.0));
    let b = val(Bf16, &[4, 2], rng.vec(8, -1.0, 1.0));
    let got = Case::new(Op::Mm)
        .input(a.clone())
        .input(b.clone())
        .output(Bf16, &[3, 2])
        .run1();
    assert_close(
        &got,
        &matmul_ref(&a.data, &b.data, 3, 4, 2),
        tol(8e-3, 8e-3),
        "mm bf16",
    );
}

// ---------------------------------------------------------------------------------------
// Shape

/// `x` gathered to `out_shape`, output element `i` taken from `x` at `source(idx)`.
fn remap(x: &Value, out_shape: &[u64], source: impl Fn(&[usize]) -> Vec<usize>) -> Vec<f64> {
    (0..numel(out_shape))
        .map(|i| x.data[ravel(&source(&unravel(i, out_shape)), &x.ty.shape)])
        .collect()
}

#[test]
fn views_keep_the_elements() {
    let mut rng = Rng::new(23);
    let x = rng.f32s(&[3, 5, 7], -1.0, 1.0);
    let view = |x: &Value, size: &[i64], out: &[u64]| {
        Case::new(Op::View)
            .input(x.clone())
            .ints("size", size)
            .output(x.ty.dtype, out)
            .run1()
    };
    assert_close(&view(&x, &[15, -1], &[15, 7]), &x.data, EXACT, "view");
    assert_close(&view(&x, &[105], &[105]), &x.data, EXACT, "view flat");
    let i = i64v(&[2, 3], &[1, -2, 3, 4, 5, 6]);
    assert_close(
        &view(&i, &[3, 1, 2], &[3, 1, 2]),
        &i.data,
        EXACT,
        "view i64",
    );
    let e = f32v(&[0, 4], vec![]);
    assert_close(&view(&e, &[2, 0, 2], &[2, 0, 2]), &[], EXACT, "view empty");
    let unsq = |x: &Value, d: i64, out: &[u64]| {
        Case::new(Op::Unsqueeze)
            .input(x.clone())
            .int("dim", d)
            .output(x.ty.dtype, out)
            .run1()
    };
    assert_close(&unsq(&x, 0, &[1, 3, 5, 7]), &x.data, EXACT, "unsqueeze 0");
    assert_close(&unsq(&x, -1, &[3, 5, 7, 1]), &x.data, EXACT, "unsqueeze -1");
    assert_close(&unsq(&x, -3, &[3, 1, 5, 7]), &x.data, EXACT, "unsqueeze -3");
    let y = rng.f32s(&[3, 1, 5, 1], -1.0, 1.0);
    let squeeze = |d: &[i64], out: &[u64]| {
        Case::new(Op::SqueezeDims)
            .input(y.clone())
            .ints("dim", d)
            .output(Fp32, out)
            .run1()
    };
    assert_close(&squeeze(&[1, -1], &[3, 5]), &y.data, EXACT, "squeeze both");
    assert_close(
        &squeeze(&[0, 1], &[3, 5, 1]),
        &y.data,
        EXACT,
        "squeeze keeps size > 1",
    );
}

/// `permute` of the f32 tensor `x` by `dims` (negative ones count from the end) against
/// the elements moved one by one.
fn assert_permutes(x: &Value, dims: &[i64]) {
    let rank = x.ty.shape.len();
    let pos: Vec<usize> = dims
        .iter()
        .map(|&d| (if d < 0 { d + rank as i64 } else { d }) as usize)
        .collect();
    let out: Vec<u64> = pos.iter().map(|&d| x.ty.shape[d]).collect();
    let got = Case::new(Op::Permute)
        .input(x.clone())
        .ints("dims", dims)
        .output(Fp32, &out)
        .run1();
    let want = remap(x, &out, |o| {
        let mut src = vec![0; rank];
        for (k, &d) in pos.iter().enumerate() {
            src[d] = o[k];
        }
        src
    });
    let what = format!("permute {:?} by {dims:?}", x.ty.shape);
    assert_close(&got, &want, EXACT, &what);
}

#[test]
fn permute_and_expand() {
    let mut rng = Rng::new(29);
    let x = rng.f32s(&[3, 5, 7], -1.0, 1.0);
    for dims in [[2i64, 0, 1], [-1, -2, -3], [0, 2, 1], [1, 0, 2]] {
        assert_permutes(&x, &dims);
    }
    // Transposes copied in tiles: sizes not multiples of a tile, batches, matrices split
    // across threads (the largest), and 8-byte elements.
    for (shape, dims) in [
        (vec![67u64, 129], vec![1i64, 0]),
        (vec![3, 70, 45], vec![0, 2, 1]),
        (vec![2, 130, 150], vec![0, 2, 1]),
        (vec![5, 33, 2, 40], vec![0, 3, 2, 1]),
    ] {
        assert_permutes(&rng.f32s(&shape, -1.0, 1.0), &dims);
    }
    let wide: Vec<i64> = (0..40 * 50).map(|i| (i as i64) << 33).collect();
    let got = Case::new(Op::Permute)
        .input(i64v(&[40, 50], &wide))
        .ints("dims", &[1, 0])
        .output(I64, &[50, 40])
        .run1();
    let want: Vec<f64> = (0..50 * 40)
        .map(|o| wide[(o % 40) * 50 + o / 40] as f64)
        .collect();
    assert_close(&got, &want, EXACT, "permute of i64");
    let b = i64v(&[2, 0, 3], &[]);
    Case::new(Op::Permute)
        .input(b)
        .ints("dims", &[2, 1, 0])
        .output(I64, &[3, 0, 2])
        .run1();
    let y = rng.f32s(&[3, 1, 7], -1.0, 1.0);
    for (size, out) in [
        (vec![3i64, 5, 7], vec![3u64, 5, 7]),
        (vec![2, -1, 4, -1], vec![2, 3, 4, 7]),
        (vec![3, 0, 7], vec![3, 0, 7]),
    ] {
        let got = Case::new(Op::Expand)
            .input(y.clone())
            .ints("size", &size)
            .output(Fp32, &out)
            .run1();
        let want: Vec<f64> = (0..numel(&out))
            .map(|i| y.data[broadcast_at(&unravel(i, &out), &y.ty.shape)])
            .collect();
        assert_close(&got, &want, EXACT, &format!("expand to {size:?}"));
    }
    let s = val(Bool, &[], vec![1.0]);
    let got = Case::new(Op::Expand)
        .input(s)
        .ints("size", &[2, 2])
        .output(Bool, &[2, 2])
        .run1();
    assert_close(&got, &[1.0; 4], EXACT, "expand a scalar");
}

#[test]
fn split_cat_slice_select() {
    let mut rng = Rng::new(31);
    let x = rng.f32s(&[3, 5, 7], -1.0, 1.0);
    // split_with_sizes along -1 into 2, 0 and 5.
    let got = Case::new(Op::SplitWithSizes)
        .input(x.clone())
        .ints("split_sizes", &[2, 0, 5])
        .int("dim", -1)
        .output(Fp32, &[3, 5, 2])
        .output(Fp32, &[3, 5, 0])
        .output(Fp32, &[3, 5, 5])
        .run();
    let mut at = 0;
    for (k, len) in [2usize, 0, 5].into_iter().enumerate() {
        let out = [3, 5, len as u64];
        let want = remap(&x, &out, |o| vec![o[0], o[1], o[2] + at]);
        assert_close(&got[k], &want, EXACT, &format!("split piece {k}"));
        at += len;
    }
    // An unused piece is skipped.
    let got = Case::new(Op::SplitWithSizes)
        .input(x.clone())
        .ints("split_sizes", &[1, 2])
        .int("dim", 0)
        .unused()
        .output(Fp32, &[2, 5, 7])
        .run();
    assert_close(&got[1], &x.data[35..], EXACT, "split second piece");
    // cat of three along dim 1 (one of them empty), and along -1 with promotion.
    let parts = [
        rng.f32s(&[3, 2, 7], -1.0, 1.0),
        rng.f32s(&[3, 0, 7], -1.0, 1.0),
        rng.f32s(&[3, 4, 7], -1.0, 1.0),
    ];
    let mut case = Case::new(Op::Cat).int("tensors.len", 3).int("dim", 1);
    for p in &parts {
        case = case.input(p.clone());
    }
    let got = case.output(Fp32, &[3, 6, 7]).run1();
    let want = remap(&x.clone(), &[3, 6, 7], |_| vec![0, 0, 0]); // shape only
    let mut want = want;
    for (i, w) in want.iter_mut().enumerate() {
        let o = unravel(i, &[3, 6, 7]);
        *w = if o[1] < 2 {
            parts[0].data[ravel(&o, &[3, 2, 7])]
        } else {
            parts[2].data[ravel(&[o[0], o[1] - 2, o[2]], &[3, 4, 7])]
        };
    }
    assert_close(&got, &want, EXACT, "cat along 1");
    let a = i64v(&[2, 1], &[7, -8]);
    let b = f32v(&[2, 2], vec![0.5, 1.5, 2.5, 3.5]);
    let got = Case::new(Op::Cat)
        .int("tensors.len", 2)
        .int("dim", -1)
        .input(a)
        .input(b)
        .output(Fp32, &[2, 3])
        .run1();
    assert_close(
        &got,
        &[7.0, 0.5, 1.5, -8.0, 2.5, 3.5],
        EXACT,
        "cat promotes",
    );
    // slice.Tensor: negative dims and bounds, clamping, steps, empty results.
    for (dim, start, end, step) in [
        (1i64, Some(1i64), Some(4i64), 1i64),
        (-1, Some(-5), None, 2),
        (-2, None, Some(i64::MAX), 3),
        (0, Some(-100), Some(100), 1),
        (2, Some(5), Some(2), 1),
        (1, Some(4), Some(4), 2),
    ] {
        let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
        let n = x.ty.shape[d] as i64;
        let clamp = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
        let s = clamp(start.unwrap_or(0));
        let e = clamp(end.unwrap_or(n)).max(s);
        let picked: Vec<i64> = (s..e).step_by(step as usize).collect();
        let mut out = x.ty.shape.clone();
        out[d] = picked.len() as u64;
        let mut case = Case::new(Op::SliceTensor)
            .input(x.clone())
            .int("dim", dim)
            .int("step", step);
        if let Some(s) = start {
            case = case.int("start", s);
        }
        if let Some(e) = end {
            case = case.int("end", e);
        }
        let got = case.output(Fp32, &out).run1();
        let want = remap(&x, &out, |o| {
            let mut src = o.to_vec();
            src[d] = picked[o[d]] as usize;
            src
        });
        assert_close(
            &got,
            &want,
            EXACT,
            &format!("slice dim {dim} {start:?}..{end:?} step {step}"),
        );
    }
    // select.int with negative dims and indices.
    for (dim, index) in [(0i64, 2i64), (-1, -1), (1, -5), (-2, 3)] {
        let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
        let row = (if index < 0 {
            index + x.ty.shape[d] as i64
        } else {
            index
        }) as usize;
        let mut out = x.ty.shape.clone();
        out.remove(d);
        let got = Case::new(Op::SelectInt)
            .input(x.clone())
            .int("dim", dim)
            .int("index", index)
            .output(Fp32, &out)
            .run1();
        let want = remap(&x, &out, |o| {
            let mut src = o.to_vec();
            src.insert(d, row);
            src
        });
        assert_close(
            &got,
            &want,
            EXACT,
            &format!("select dim {dim} index {index}"),
        );
    }
    let v = i64v(&[4], &[5, 6, 7, 8]);
    let got = Case::new(Op::SelectInt)
        .input(v)
        .int("dim", 0)
        .int("index", -4)
        .output(I64, &[])
        .run1();
    assert_close(&got, &[5.0], EXACT, "select to a scalar");
}

// ---------------------------------------------------------------------------------------
// Convolution

/// Convolution geometry for the reference.
#[derive(Clone)]
struct ConvSpec {
    input: Vec<u64>,
    weight: Vec<u64>,
    stride: Vec<i64>,
    padding: Vec<i64>,
    dilation: Vec<i64>,
    output_padding: Vec<i64>,
    groups: i64,
    transposed: bool,
}

impl ConvSpec {
    fn dims(&self) -> usize {
        self.input.len() - 2
    }

    fn output(&self) -> Vec<u64> {
        let g = self.groups as u64;
        let c_out = if self.transposed {
            self.weight[1] * g
        } else {
            self.weight[0]
        };
        let mut out = vec![self.input[0], c_out];
        for i in 0..self.dims() {
            let (n, k) = (self.input[2 + i] as i64, self.weight[2 + i] as i64);
            let (s, p, d) = (self.stride[i], self.padding[i], self.dilation[i]);
            out.push(if self.transposed {
                (n - 1) * s - 2 * p + d * (k - 1) + self.output_padding[i] + 1
            } else {
                (n + 2 * p - d * (k - 1) - 1) / s + 1
            } as u64);
        }
        out
    }

    fn case(&self, op: Op) -> Case {
        Case::new(op)
            .ints("stride", &self.stride)
            .ints("padding", &self.padding)
            .ints("dilation", &self.dilation)
            .flag("transposed", self.transposed)
            .ints("output_padding", &self.output_padding)
            .int("groups", self.groups)
    }

    /// The convolution by its definition: each output element a sum over the input
    /// channels of its group and the kernel taps that reach it.
    fn reference(&self, x: &[f64], w: &[f64], bias: Option<&[f64]>) -> Vec<f64> {
        let out = self.output();
        let g = self.groups as usize;
        let (c_in, c_out) = (self.input[1] as usize, out[1] as usize);
        let (cin_g, cout_g) = (c_in / g, c_out / g);
        let k_shape = &self.weight[2..];
        (0..numel(&out))
            .map(|i| {
                let o = unravel(i, &out);
                let (n, co) = (o[0], o[1]);
                let grp = co / cout_g;
                let mut acc = bias.map_or(0.0, |b| b[co]);
                for ci in grp * cin_g..(grp + 1) * cin_g {
                    for kk in 0..numel(k_shape) {
                        let k = unravel(kk, k_shape);
                        // The input position this tap reads, if any.
                        let mut pos = vec![n, ci];
                        let ok = (0..self.dims()).all(|d| {
                            let (s, p, dil) = (self.stride[d], self.padding[d], self.dilation[d]);
                            let oo = o[2 + d] as i64;
                            let ip = if self.transposed {
                                // out = in * s - p + k * dil
                                let t = oo + p - k[d] as i64 * dil;
                                if t % s != 0 {
                                    return false;
                                }
                                t / s
                            } else {
                                oo * s - p + k[d] as i64 * dil
                            };
                            pos.push(ip.max(0) as usize);
                            (0..self.input[2 + d] as i64).contains(&ip)
                        });
                        if !ok {
                            continue;
                        }
                        let widx = if self.transposed {
                            let mut v = vec![ci, co - grp * cout_g];
                            v.extend(&k);
                            v
                        } else {
                            let mut v = vec![co, ci - grp * cin_g];
                            v.extend(&k);
                            v
                        };
                        acc += x[ravel(&pos, &self.input)] * w[ravel(&widx, &self.weight)];
                    }
                }
                acc
            })
            .collect()
    }
}

fn conv_specs() -> Vec<ConvSpec> {
    let spec = |input: &[u64],
                weight: &[u64],
                s: &[i64],
                p: &[i64],
                d: &[i64],
                op: &[i64],
                groups: i64,
                transposed: bool| ConvSpec {
        input: input.to_vec(),
        weight: weight.to_vec(),
        stride: s.to_vec(),
        padding: p.to_vec(),
        dilation: d.to_vec(),
        output_padding: op.to_vec(),
        groups,
        transposed,
    };
    vec![
        // 2-d: plain, strided and padded, dilated and grouped (the f32 matrix-product kernel).
        spec(
            &[2, 3, 5, 7],
            &[4, 3, 3, 3],
            &[1, 1],
            &[0, 0],
            &[1, 1],
            &[0, 0],
            1,
            false,
        ),
        spec(
            &[2, 4, 7, 6],
            &[6, 2, 3, 2],
            &[2, 1],
            &[1, 1],
            &[1, 2],
            &[0, 0],
            2,
            false,
        ),
        // 1x1 stride 1 (multiplied directly, no scratch), with an odd number of channels.
        spec(
            &[2, 3, 4, 5],
            &[5, 3, 1, 1],
            &[1, 1],
            &[0, 0],
            &[1, 1],
            &[0, 0],
            1,
            false,
        ),
        // A depthwise kernel wider than the input, padded (ConvNeXt's 7x7 at a 1x1 last
        // stage): whole rows of the unfolded input are padding.
        spec(
            &[2, 3, 1, 2],
            &[3, 1, 7, 7],
            &[1, 1],
            &[3, 3],
            &[1, 1],
            &[0, 0],
            3,
            false,
        ),
        // Small output planes: images side by side in one product, the last product
        // short (4x4 planes: 16 images a product, 37 images), direct 1x1 ones too, and a
        // 1x1 plane over 300 "images" (a weight gradient written as a convolution).
        spec(
            &[37, 4, 4, 4],
            &[6, 2, 3, 3],
            &[1, 1],
            &[1, 1],
            &[1, 1],
            &[0, 0],
            2,
            false,
        ),
        spec(
            &[37, 3, 4, 4],
            &[5, 3, 1, 1],
            &[1, 1],
            &[0, 0],
            &[1, 1],
            &[0, 0],
            1,
            false,
        ),
        spec(
            &[300, 1, 2, 2],
            &[3, 1, 2, 2],
            &[1, 1],
            &[0, 0],
            &[1, 1],
            &[0, 0],
            1,
            false,
        ),
        // 1-d and 3-d.
        spec(&[2, 3, 11], &[4, 3, 3], &[2], &[1], &[2], &[0], 1, false),
        spec(
            &[1, 2, 4, 5, 3],
            &[3, 2, 2, 3, 2],
            &[1, 2, 1],
            &[1, 0, 1],
            &[1, 1, 1],
            &[0, 0, 0],
            1,
            false,
        ),
        // Transposed 1-d and 2-d, with output padding and groups; the last two as U-Nets
        // upsample (ConvTranspose2d with kernel 2 or 3, stride 2).
        spec(&[2, 3, 5], &[3, 2, 3], &[2], &[1], &[1], &[1], 1, true),
        spec(
            &[2, 4, 3, 3],
            &[4, 2, 3, 3],
            &[2, 2],
            &[1, 1],
            &[1, 1],
            &[1, 1],
            1,
            true,
        ),
        spec(
            &[1, 2, 4, 4],
            &[2, 3, 2, 2],
            &[2, 2],
            &[0, 0],
            &[1, 1],
            &[0, 0],
            1,
            true,
        ),
        spec(
            &[1, 4, 3, 4],
            &[4, 3, 3, 2],
            &[2, 3],
            &[1, 0],
            &[1, 2],
            &[1, 2],
            2,
            true,
        ),
        // Transposed over several images and groups with small input planes (the f32
        // kernel runs it as its adjoint's gradients, images side by side).
        spec(
            &[9, 4, 3, 3],
            &[4, 3, 3, 3],
            &[2, 2],
            &[1, 1],
            &[1, 1],
            &[1, 1],
            2,
            true,
        ),
    ]
}

#[test]
fn convolutions_match_their_definition() {
    let mut rng = Rng::new(37);
    for spec in conv_specs() {
        let x = rng.f32s(&spec.input, -1.0, 1.0);
        let w = rng.f32s(&spec.weight, -1.0, 1.0);
        let out = spec.output();
        let b = rng.f32s(&[out[1]], -1.0, 1.0);
        let what = format!(
            "convolution {:?} * {:?} transposed {}",
            spec.input, spec.weight, spec.transposed
        );
        let got = spec
            .case(Op::Convolution)
            .input(x.clone())
            .input(w.clone())
            .input(b.clone())
            .output(Fp32, &out)
            .run1();
        assert_close(
            &got,
            &spec.reference(&x.data, &w.data, Some(&b.data)),
            SUM32,
            &what,
        );
        let got = spec
            .case(Op::Convolution)
            .input(x.clone())
            .input(w.clone())
            .absent()
            .output(Fp32, &out)
            .run1();
        assert_close(
            &got,
            &spec.reference(&x.data, &w.data, None),
            SUM32,
            &format!("{what}, no bias"),
        );
    }
    // Half precision: stored as f16 or bf16, computed wide, rounded once.
    let spec = &conv_specs()[1];
    for (dtype, t) in [(F16, tol(2e-3, 2e-3)), (Bf16, tol(1e-2, 1e-2))] {
        let x = val(dtype, &spec.input, rng.vec(numel(&spec.input), -1.0, 1.0));
        let w = val(dtype, &spec.weight, rng.vec(numel(&spec.weight), -1.0, 1.0));
        let got = spec
            .case(Op::Convolution)
            .input(x.clone())
            .input(w.clone())
            .absent()
            .output(dtype, &spec.output())
            .run1();
        assert_close(
            &got,
            &spec.reference(&x.data, &w.data, None),
            t,
            &format!("convolution {dtype}"),
        );
    }
}

#[test]
fn convolution_backward_matches_finite_differences() {
    let mut rng = Rng::new(41);
    for spec in conv_specs() {
        let x = rng.f32s(&spec.input, -1.0, 1.0);
        let w = rng.f32s(&spec.weight, -1.0, 1.0);
        let out = spec.output();
        let b = rng.f32s(&[out[1]], -1.0, 1.0);
        let g = rng.f32s(&out, -1.0, 1.0);
        let what = format!(
            "convolution_backward {:?} * {:?} transposed {}",
            spec.input, spec.weight, spec.transposed
        );
        let grads = spec
            .case(Op::ConvolutionBackward)
            .input(g.clone())
            .input(x.clone())
            .input(w.clone())
            .ints("bias_sizes", &[out[1] as i64])
            .attr("output_mask", Attr::Bools(vec![true, true, true]))
            .output(Fp32, &spec.input)
            .output(Fp32, &spec.weight)
            .output(Fp32, &[out[1]])
            .run();
        let forward = spec
            .case(Op::Convolution)
            .input(x.clone())
            .input(w.clone())
            .input(b.clone())
            .output(Fp32, &out);
        for (k, name) in [(0, "grad_input"), (1, "grad_weight"), (2, "grad_bias")] {
            let numeric = numeric_grad(&forward, k, 0, &g.data, 1e-2);
            assert_grad(&grads[k], &numeric, 1e-3, &format!("{what}: {name}"));
        }
        // Only grad_weight asked for.
        let only = spec
            .case(Op::ConvolutionBackward)
            .input(g.clone())
            .input(x.clone())
            .input(w.clone())
            .attr("output_mask", Attr::Bools(vec![false, true, false]))
            .unused()
            .output(Fp32, &spec.weight)
            .unused()
            .run();
        assert_close(
            &only[1],
            &grads[1],
            EXACT,
            &format!("{what}: grad_weight alone"),
        );
    }
}

// ---------------------------------------------------------------------------------------
// Neural-network ops

#[test]
fn layer_norm_and_its_backward() {
    let mut rng = Rng::new(43);
    for (shape, normalized, affine) in [
        (&[3u64, 5, 7][..], &[7i64][..], true),
        (&[3, 5, 7], &[5, 7], false),
        (&[4, 6], &[4, 6], true),
        // More rows than one task of the CPU's backward takes.
        (&[5, 13, 8], &[8], true),
        (&[0, 5], &[5], true),
    ] {
        let axis = shape.len() - normalized.len();
        let inner = numel(&shape[axis..]);
        let rows = numel(shape) / inner;
        let x = rng.f32s(shape, -2.0, 2.0);
        let w = rng.f32s(&shape[axis..], 0.5, 1.5);
        let b = rng.f32s(&shape[axis..], -1.0, 1.0);
        let mut stats_shape = shape[..axis].to_vec();
        stats_shape.extend(std::iter::repeat_n(1, normalized.len()));
        let mut forward = Case::new(Op::NativeLayerNorm).input(x.clone());
        forward = if affine {
            forward.input(w.clone()).input(b.clone())
        } else {
            forward.absent().absent()
        };
        let forward = forward
            .ints("normalized_shape", normalized)
            .float("eps", 1e-5)
            .output(Fp32, shape)
            .output(Fp32, &stats_shape)
            .output(Fp32, &stats_shape);
        let got = forward.run();
        let (mut y, mut means, mut rstds) = (vec![], vec![], vec![]);
        for r in 0..rows {
            let row = &x.data[r * inner..(r + 1) * inner];
            let m = mean(row);
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / inner as f64;
            let rstd = 1.0 / (var + 1e-5).sqrt();
            for (j, v) in row.iter().enumerate() {
                let n = (v - m) * rstd;
                y.push(if affine { n * w.data[j] + b.data[j] } else { n });
            }
            means.push(m);
            rstds.push(rstd);
        }
        let what = format!("native_layer_norm of {shape:?} over {normalized:?}");
        assert_close(&got[0], &y, tol(1e-5, 1e-5), &what);
        assert_close(&got[1], &means, tol(1e-6, 1e-6), &what);
        assert_close(&got[2], &rstds, tol(1e-5, 1e-6), &what);
        // Backward against finite differences of the forward's output 0.
        let g = rng.f32s(shape, -1.0, 1.0);
        let mut backward = Case::new(Op::NativeLayerNormBackward)
            .input(g.clone())
            .input(x.clone())
            .input(f32v(&stats_shape, got[1].clone()))
            .input(f32v(&stats_shape, got[2].clone()));
        backward = if affine {
            backward.input(w.clone()).input(b.clone())
        } else {
            backward.absent().absent()
        };
        let grads = backward
            .ints("normalized_shape", normalized)
            .attr("output_mask", Attr::Bools(vec![true, affine, affine]))
            .output(Fp32, shape)
            .output(Fp32, &shape[axis..])
            .output(Fp32, &shape[axis..])
            .run();
        let what = format!("native_layer_norm_backward of {shape:?} over {normalized:?}");
        assert_grad(
            &grads[0],
            &numeric_grad(&forward, 0, 0, &g.data, 1e-2),
            2e-3,
            &format!("{what}: grad_input"),
        );
        if affine {
            assert_grad(
                &grads[1],
                &numeric_grad(&forward, 1, 0, &g.data, 1e-2),
                2e-3,
                &format!("{what}: grad_weight"),
            );
            assert_grad(
                &grads[2],
                &numeric_grad(&forward, 2, 0, &g.data, 1e-2),
                2e-3,
                &format!("{what}: grad_bias"),
            );
        }
    }
}

/// Training-mode batch norm's forward against f64 per-channel statistics, and its
/// backward against finite differences of the forward.
#[test]
fn batch_norm_and_its_backward() {
    let mut rng = Rng::new(47);
    for (shape, affine) in [
        (&[4u64, 3, 5, 6][..], true),
        (&[6, 4][..], true),
        (&[2, 3, 7][..], false),
        (&[3, 2, 2, 2, 3][..], true),
    ] {
        let (batch, channels) = (shape[0] as usize, shape[1] as usize);
        let inner = numel(&shape[2..]);
        let count = (batch * inner) as f64;
        // Offset channels, as convolution outputs are: the variance must not cancel.
        let mut x = rng.f32s(shape, -2.0, 2.0);
        for (i, v) in x.data.iter_mut().enumerate() {
            *v = f64::from((*v + 3.0 * ((i / inner) % channels) as f64) as f32);
        }
        let w = rng.f32s(&[shape[1]], 0.5, 1.5);
        let b = rng.f32s(&[shape[1]], -1.0, 1.0);
        let rm = rng.f32s(&[shape[1]], -0.5, 0.5);
        let rv = rng.f32s(&[shape[1]], 0.5, 2.0);
        let c = &[shape[1]][..];
        let mut forward = Case::new(Op::NativeBatchNorm).input(x.clone());
        forward = if affine {
            forward.input(w.clone()).input(b.clone())
        } else {
            forward.absent().absent()
        };
        let forward = forward
            .input(rm.clone())
            .input(rv.clone())
            .attr("training", Attr::Bool(true))
            .float("momentum", 0.1)
            .float("eps", 1e-5)
            .output(Fp32, shape)
            .output(Fp32, c)
            .output(Fp32, c)
            .output(Fp32, c)
            .output(Fp32, c);
        let got = forward.run();
        let mut y = vec![0.0; x.data.len()];
        let mut want: [Vec<f64>; 4] = Default::default();
        for ch in 0..channels {
            let idx: Vec<usize> = (0..batch)
                .flat_map(|n| (0..inner).map(move |j| (n * channels + ch) * inner + j))
                .collect();
            let m = idx.iter().map(|&i| x.data[i]).sum::<f64>() / count;
            let var = idx.iter().map(|&i| (x.data[i] - m).powi(2)).sum::<f64>() / count;
            let rstd = 1.0 / (var + 1e-5).sqrt();
            for &i in &idx {
                let n = (x.data[i] - m) * rstd;
                y[i] = if affine {
                    n * w.data[ch] + b.data[ch]
                } else {
                    n
                };
            }
            want[0].push(m);
            want[1].push(rstd);
            want[2].push(0.9 * rm.data[ch] + 0.1 * m);
            want[3].push(0.9 * rv.data[ch] + 0.1 * var * count / (count - 1.0));
        }
        let what = format!("_native_batch_norm_legit_functional of {shape:?}");
        assert_close(&got[0], &y, tol(1e-5, 1e-5), &what);
        for (k, name) in ["save_mean", "save_rstd", "running_mean", "running_var"]
            .iter()
            .enumerate()
        {
            assert_close(
                &got[k + 1],
                &want[k],
                tol(1e-6, 1e-6),
                &format!("{what}: {name}"),
            );
        }
        let g = rng.f32s(shape, -1.0, 1.0);
        let mut backward = Case::new(Op::NativeBatchNormBackward)
            .input(g.clone())
            .input(x.clone());
        backward = if affine {
            backward.input(w.clone())
        } else {
            backward.absent()
        };
        let grads = backward
            .input(f32v(c, got[3].clone()))
            .input(f32v(c, got[4].clone()))
            .input(f32v(c, got[1].clone()))
            .input(f32v(c, got[2].clone()))
            .attr("train", Attr::Bool(true))
            .float("eps", 1e-5)
            .attr("output_mask", Attr::Bools(vec![true, affine, affine]))
            .output(Fp32, shape)
            .output(Fp32, c)
            .output(Fp32, c)
            .run();
        let what = format!("native_batch_norm_backward of {shape:?}");
        assert_grad(
            &grads[0],
            &numeric_grad(&forward, 0, 0, &g.data, 1e-2),
            2e-3,
            &format!("{what}: grad_input"),
        );
        if affine {
            for (k, name) in [(1, "grad_weight"), (2, "grad_bias")] {
                assert_grad(
                    &grads[k],
                    &numeric_grad(&forward, k, 0, &g.data, 1e-2),
                    2e-3,
                    &format!("{what}: {name}"),
                );
            }
        }
    }
}

/// The attention mask of a case: none, bool (true keeps a score) or float (added).
#[derive(Clone, Copy, Debug)]
enum AttnMask {
    None,
    /// `[L, S]`, broadcast over batch and heads.
    Bool2d,
    /// `[B, 1, L, S]`, broadcast over heads.
    FloatPerBatch,
}

/// The mask of a case. A bool mask keeps key 0 in every row, so no row is dropped whole.
fn attention_mask(rng: &mut Rng, mask: AttnMask, b: u64, l: u64, s: u64) -> Option<Value> {
    match mask {
        AttnMask::None => None,
        AttnMask::Bool2d => {
            let data = (0..l * s)
                .map(|i| {
                    if i % s == 0 || (i * 7) % 3 != 0 {
                        1.0
                    } else {
                        0.0
                    }
                })
                .collect();
            Some(val(DType::Bool, &[l, s], data))
        }
        AttnMask::FloatPerBatch => Some(rng.f32s(&[b, 1, l, s], -2.0, 1.0)),
    }
}

/// An attention case's geometry: `[B, H, L, S, E, Ev]`, causality, scale and mask kind.
struct AttnGeometry {
    dims: [u64; 6],
    causal: bool,
    scale: f64,
    mask: AttnMask,
}

/// Naive f64 attention: `softmax(scale q k^T + mask)`, each probability times
/// `factor(flat index)` (dropout), times `v`; and each query's log-sum-exp.
fn attention_reference(
    g: &AttnGeometry,
    q: &Value,
    k: &Value,
    v: &Value,
    mask_value: Option<&Value>,
    factor: impl Fn(usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let [b, h, l, s, e, ev] = g.dims;
    let (causal, scale_v, mask) = (g.causal, g.scale, g.mask);
    // The reference.
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for bi in 0..b as usize {
        for hi in 0..h as usize {
            let head = bi * h as usize + hi;
            for i in 0..l as usize {
                let scores: Vec<f64> = (0..s as usize)
                    .map(|j| {
                        if causal && j > i {
                            return f64::NEG_INFINITY;
                        }
                        let qi = &q.data[(head * l as usize + i) * e as usize..][..e as usize];
                        let kj = &k.data[(head * s as usize + j) * e as usize..][..e as usize];
                        let mut x = scale_v * qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f64>();
                        match (mask_value, mask) {
                            (Some(m), AttnMask::Bool2d) if m.data[i * s as usize + j] == 0.0 => {
                                x = f64::NEG_INFINITY
                            }
                            (Some(m), AttnMask::FloatPerBatch) => {
                                x += m.data[(bi * l as usize + i) * s as usize + j]
                            }
                            _ => {}
                        }
                        x
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let total: f64 = w.iter().sum();
                let row = (head * l as usize + i) * s as usize;
                let w: Vec<f64> = w
                    .iter()
                    .enumerate()
                    .map(|(j, x)| x * factor(row + j))
                    .collect();
                for d in 0..ev as usize {
                    out.push(
                        (0..s as usize)
                            .map(|j| w[j] * v.data[(head * s as usize + j) * ev as usize + d])
                            .sum::<f64>()
                            / total,
                    );
                }
                lse.push(m + total.ln());
            }
        }
    }
    (out, lse)
}

/// An attention backward's gradients against finite differences of its forward's output.
fn assert_attention_grads(grads: &[Vec<f64>], forward: &Case, g: &Value, what: &str) {
    for (k_in, name) in [(0, "grad_query"), (1, "grad_key"), (2, "grad_value")] {
        assert_grad(
            &grads[k_in],
            &numeric_grad(forward, k_in, 0, &g.data, 1e-2),
            2e-3,
            &format!("{what}: {name}"),
        );
    }
}

/// Fused attention against a naive f64 softmax(scale q k^T + mask) v, and its backward
/// against finite differences of the forward's output.
#[test]
fn fused_attention_and_its_backward() {
    let mut rng = Rng::new(59);
    for (b, h, l, s, e, ev, causal, scale, mask) in [
        (
            2u64,
            3u64,
            5u64,
            6u64,
            4u64,
            3u64,
            false,
            None,
            AttnMask::None,
        ),
        (1, 2, 7, 7, 8, 8, true, None, AttnMask::None),
        (2, 1, 4, 6, 5, 2, false, Some(0.3), AttnMask::Bool2d),
        (2, 2, 3, 5, 4, 4, true, None, AttnMask::FloatPerBatch),
    ] {
        let q = rng.f32s(&[b, h, l, e], -1.5, 1.5);
        let k = rng.f32s(&[b, h, s, e], -1.5, 1.5);
        let v = rng.f32s(&[b, h, s, ev], -1.0, 1.0);
        let mask_value = attention_mask(&mut rng, mask, b, l, s);
        let scale_v = scale.unwrap_or(1.0 / (e as f64).sqrt());
        let with_flags = |mut case: Case| {
            case = case.float("dropout_p", 0.0).flag("is_causal", causal);
            if let Some(sc) = scale {
                case = case.float("scale", sc);
            }
            case
        };
        let mut forward = Case::new(Op::ScaledDotProductAttention)
            .input(q.clone())
            .input(k.clone())
            .input(v.clone());
        forward = match &mask_value {
            Some(m) => forward.input(m.clone()),
            None => forward.absent(),
        };
        let forward = with_flags(forward)
            .output(Fp32, &[b, h, l, ev])
            .output(Fp32, &[b, h, l]);
        let got = forward.run();
        let geometry = AttnGeometry {
            dims: [b, h, l, s, e, ev],
            causal,
            scale: scale_v,
            mask,
        };
        let (out, lse) = attention_reference(&geometry, &q, &k, &v, mask_value.as_ref(), |_| 1.0);
        let what = format!("attention {b}x{h}x{l}x{s} e {e} ev {ev} causal {causal} mask {mask:?}");
        assert_close(&got[0], &out, tol(1e-5, 1e-6), &what);
        assert_close(&got[1], &lse, tol(1e-6, 1e-6), &what);
        // The backward, against finite differences of output 0.
        let g = rng.f32s(&[b, h, l, ev], -1.0, 1.0);
        let mut backward = Case::new(Op::ScaledDotProductAttentionBackward)
            .input(g.clone())
            .input(q.clone())
            .input(k.clone())
            .input(v.clone())
            .input(f32v(&[b, h, l, ev], got[0].clone()))
            .input(f32v(&[b, h, l], got[1].clone()));
        backward = match &mask_value {
            Some(m) => backward.input(m.clone()),
            None => backward.absent(),
        };
        let grads = with_flags(backward)
            .output(Fp32, &[b, h, l, e])
            .output(Fp32, &[b, h, s, e])
            .output(Fp32, &[b, h, s, ev])
            .run();
        assert_attention_grads(&grads, &forward, &g, &what);
    }
}

/// Fused attention refuses dropout, naming it.
#[test]
fn fused_attention_refuses_dropout() {
    let mut rng = Rng::new(61);
    let t = rng.f32s(&[1, 1, 2, 4], -1.0, 1.0);
    let err = Case::new(Op::ScaledDotProductAttention)
        .input(t.clone())
        .input(t.clone())
        .input(t)
        .absent()
        .float("dropout_p", 0.1)
        .output(Fp32, &[1, 1, 2, 4])
        .output(Fp32, &[1, 1, 2])
        .fails();
    assert!(err.contains("dropout_p 0.1"), "{err}");
}

/// Attention with dropout (the efficient op): the seed is the node's stream under the
/// generator state, each probability is kept when its 24-bit draw under that seed is
/// below `1 - p` and scaled by `1 / (1 - p)`, against a naive f64 reference drawing the
/// same flags; the log-sum-exps are padded to 32 per head with zeros; the backward against
/// finite differences of the forward (the flags fixed by the state).
#[test]
fn efficient_attention_drops_probabilities_by_the_session_stream() {
    let mut rng = Rng::new(67);
    for (b, h, l, s, e, ev, causal, mask, p) in [
        (
            2u64,
            3u64,
            5u64,
            37u64,
            4u64,
            3u64,
            false,
            AttnMask::None,
            0.3,
        ),
        (1, 2, 33, 33, 8, 8, true, AttnMask::None, 0.5),
        (2, 1, 4, 6, 5, 2, false, AttnMask::Bool2d, 0.2),
        (2, 2, 3, 5, 4, 4, true, AttnMask::FloatPerBatch, 0.0),
    ] {
        let q = rng.f32s(&[b, h, l, e], -1.5, 1.5);
        let k = rng.f32s(&[b, h, s, e], -1.5, 1.5);
        let v = rng.f32s(&[b, h, s, ev], -1.0, 1.0);
        let mask_value = attention_mask(&mut rng, mask, b, l, s);
        let padded = l.next_multiple_of(32);
        let forward_in = |state: i64, dtype: DType| {
            let cast = |x: &Value| val(dtype, &x.ty.shape, x.data.clone());
            let mut case = Case::new(Op::EfficientAttention)
                .input(cast(&q))
                .input(cast(&k))
                .input(cast(&v));
            case = match &mask_value {
                Some(m) if m.ty.dtype == Fp32 => case.input(cast(m)),
                Some(m) => case.input(m.clone()),
                None => case.absent(),
            };
            case.input(i64v(&[], &[state]))
                .flag("compute_log_sumexp", true)
                .float("dropout_p", p)
                .flag("is_causal", causal)
                .output(dtype, &[b, h, l, ev])
                .output(Fp32, &[b, h, padded])
                .output(I64, &[])
                .output(I64, &[])
        };
        let forward_at = |state: i64| forward_in(state, Fp32);
        let state = exact_seed_state(0);
        let forward = forward_at(state);
        let got = forward.run();
        let seed = attention_seed(state);
        assert_eq!(
            got[2],
            [seed as i64 as f64],
            "the seed is the node's stream"
        );
        assert_eq!(got[3], [0.0], "the offset is 0");
        let factor = |at: usize| dropout_factor(seed, p, at);
        let geometry = AttnGeometry {
            dims: [b, h, l, s, e, ev],
            causal,
            scale: 1.0 / (e as f64).sqrt(),
            mask,
        };
        let (out, lse) = attention_reference(&geometry, &q, &k, &v, mask_value.as_ref(), factor);
        let what = format!("attention {b}x{h}x{l}x{s} causal {causal} mask {mask:?} dropout {p}");
        assert_close(&got[0], &out, tol(1e-5, 1e-6), &what);
        // The generic path (f16 here, computed in f64) draws the same flags.
        let half = |x: &Value| val(F16, &x.ty.shape, x.data.clone());
        let (out16, _) = attention_reference(
            &geometry,
            &half(&q),
            &half(&k),
            &half(&v),
            mask_value
                .as_ref()
                .map(|m| {
                    if m.ty.dtype == Fp32 {
                        half(m)
                    } else {
                        m.clone()
                    }
                })
                .as_ref(),
            factor,
        );
        let got16 = forward_in(state, F16).run();
        assert_close(&got16[0], &out16, tol(1e-3, 1e-3), &format!("{what}, f16"));
        let mut lse_padded = Vec::new();
        for head in lse.chunks(l as usize) {
            lse_padded.extend(head);
            lse_padded.extend(std::iter::repeat_n(0.0, (padded - l) as usize));
        }
        assert_close(&got[1], &lse_padded, tol(1e-6, 1e-6), &what);
        // The next state (the next iteration) drops others.
        if p > 0.0 {
            assert_ne!(
                forward_at(state + 1).run()[0],
                got[0],
                "{what}: a new state"
            );
        }
        // The backward, against finite differences of output 0 under the same state.
        let g = rng.f32s(&[b, h, l, ev], -1.0, 1.0);
        let mut backward = Case::new(Op::EfficientAttentionBackward)
            .input(g.clone())
            .input(q.clone())
            .input(k.clone())
            .input(v.clone());
        backward = match &mask_value {
            Some(m) => backward.input(m.clone()),
            None => backward.absent(),
        };
        let grads = backward
            .input(f32v(&[b, h, l, ev], got[0].clone()))
            .input(f32v(&[b, h, padded], got[1].clone()))
            .input(i64v(&[], &[seed as i64]))
            .input(i64v(&[], &[0]))
            .float("dropout_p", p)
            .attr(
                "grad_input_mask",
                Attr::Bools(vec![true, true, true, false]),
            )
            .flag("is_causal", causal)
            .output(Fp32, &[b, h, l, e])
            .output(Fp32, &[b, h, s, e])
            .output(Fp32, &[b, h, s, ev])
            .unused()
            .run();
        assert_attention_grads(&grads, &forward, &g, &what);
    }
}

/// The efficient op refuses a dropout of 1 or more and a bias gradient, naming them.
#[test]
fn efficient_attention_refuses_what_it_cannot_run() {
    let mut rng = Rng::new(71);
    let t = rng.f32s(&[1, 1, 2, 4], -1.0, 1.0);
    let err = Case::new(Op::EfficientAttention)
        .input(t.clone())
        .input(t.clone())
        .input(t.clone())
        .absent()
        .input(i64v(&[], &[1]))
        .float("dropout_p", 1.0)
        .output(Fp32, &[1, 1, 2, 4])
        .output(Fp32, &[1, 1, 32])
        .output(I64, &[])
        .output(I64, &[])
        .fails();
    assert!(err.contains("dropout_p must be in [0, 1)"), "{err}");
    let err = Case::new(Op::EfficientAttentionBackward)
        .input(t.clone())
        .input(t.clone())
        .input(t.clone())
        .input(t.clone())
        .input(rng.f32s(&[1, 1, 2, 2], -1.0, 1.0))
        .input(t)
        .input(rng.f32s(&[1, 1, 32], -1.0, 1.0))
        .input(i64v(&[], &[1]))
        .input(i64v(&[], &[0]))
        .float("dropout_p", 0.1)
        .attr("grad_input_mask", Attr::Bools(vec![true, true, true, true]))
        .output(Fp32, &[1, 1, 2, 4])
        .output(Fp32, &[1, 1, 2, 4])
        .output(Fp32, &[1, 1, 2, 4])
        .unused()
        .fails();
    assert!(err.contains("gradient of attn_bias"), "{err}");
}

/// Batch norm in evaluation mode is plain arithmetic in the IR: the op refuses it, naming
/// the flag.
#[test]
fn batch_norm_refuses_evaluation_mode() {
    let c = &[3u64][..];
    let mut rng = Rng::new(5);
    let err = Case::new(Op::NativeBatchNorm)
        .input(rng.f32s(&[2, 3, 4], -1.0, 1.0))
        .absent()
        .absent()
        .input(rng.f32s(c, -1.0, 1.0))
        .input(rng.f32s(c, 0.5, 1.0))
        .attr("training", Attr::Bool(false))
        .float("momentum", 0.1)
        .float("eps", 1e-5)
        .output(Fp32, &[2, 3, 4])
        .output(Fp32, c)
        .output(Fp32, c)
        .output(Fp32, c)
        .output(Fp32, c)
        .fails();
    assert!(err.contains("training must be true"), "{err}");
}

/// Pooling geometry for the references.
struct PoolSpec {
    input: Vec<u64>,
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    dilation: [i64; 2],
    ceil: bool,
}

impl PoolSpec {
    fn output(&self) -> Vec<u64> {
        let rank = self.input.len();
        let mut out = self.input.clone();
        for d in 0..2 {
            let n = self.input[rank - 2 + d] as i64;
            let (k, s, p, dil) = (
                self.kernel[d],
                self.stride[d],
                self.padding[d],
                self.dilation[d],
            );
            let span = n + 2 * p - dil * (k - 1) - 1;
            let mut o = if self.ceil {
                (span + s - 1) / s + 1
            } else {
                span / s + 1
            };
            if self.ceil && (o - 1) * s >= n + p {
                o -= 1;
            }
            out[rank - 2 + d] = o as u64;
        }
        out
    }

    fn case(&self, op: Op) -> Case {
        let case = Case::new(op)
            .ints("kernel_size", &self.kernel)
            .ints("stride", &self.stride)
            .ints("padding", &self.padding)
            .flag("ceil_mode", self.ceil);
        if matches!(
            op,
            Op::MaxPool2dWithIndices | Op::MaxPool2dWithIndicesBackward
        ) {
            case.ints("dilation", &self.dilation)
        } else {
            case
        }
    }

    /// For output element `i`: its plane and the in-bounds input positions (row, col) of
    /// its window, plus the window's size counting padding (clipped at the padded edge).
    fn window(&self, i: usize) -> (usize, Vec<(usize, usize)>, usize) {
        let out = self.output();
        let rank = out.len();
        let (oh, ow) = (out[rank - 2] as usize, out[rank - 1] as usize);
        let (h, w) = (self.input[rank - 2] as i64, self.input[rank - 1] as i64);
        let (plane, oy, ox) = (i / (oh * ow), i / ow % oh, i % ow);
        let mut cells = vec![];
        let mut padded = [0i64; 2];
        for (d, o) in [oy, ox].into_iter().enumerate() {
            let start = o as i64 * self.stride[d] - self.padding[d];
            let size = if d == 0 { h } else { w };
            padded[d] = (start + (self.kernel[d] - 1) * self.dilation[d] + 1)
                .min(size + self.padding[d])
                - start;
        }
        for ky in 0..self.kernel[0] {
            for kx in 0..self.kernel[1] {
                let y = oy as i64 * self.stride[0] - self.padding[0] + ky * self.dilation[0];
                let x = ox as i64 * self.stride[1] - self.padding[1] + kx * self.dilation[1];
                if (0..h).contains(&y) && (0..w).contains(&x) {
                    cells.push((y as usize, x as usize));
                }
            }
        }
        (plane, cells, (padded[0] * padded[1]) as usize)
    }
}

fn pool_specs() -> Vec<PoolSpec> {
    let spec =
        |input: &[u64], k: [i64; 2], s: [i64; 2], p: [i64; 2], d: [i64; 2], ceil: bool| PoolSpec {
            input: input.to_vec(),
            kernel: k,
            stride: s,
            padding: p,
            dilation: d,
            ceil,
        };
    vec![
        spec(&[2, 3, 6, 7], [2, 2], [2, 2], [0, 0], [1, 1], false),
        spec(&[2, 2, 7, 5], [3, 3], [2, 1], [1, 1], [1, 1], true),
        spec(&[1, 2, 7, 8], [3, 2], [2, 3], [1, 1], [2, 1], true),
        spec(&[3, 5, 7], [3, 3], [2, 2], [1, 0], [1, 1], false),
    ]
}

#[test]
fn max_pool_and_its_backward() {
    let mut rng = Rng::new(47);
    for spec in pool_specs() {
        let n = numel(&spec.input);
        // Distinct values far apart: the argmax does not move under small perturbations.
        let x = f32v(&spec.input, rng.distinct(n, 0.1));
        let out = spec.output();
        let rank = out.len();
        let w = spec.input[rank - 1] as usize;
        let plane = (spec.input[rank - 2] * spec.input[rank - 1]) as usize;
        let forward = spec
            .case(Op::MaxPool2dWithIndices)
            .input(x.clone())
            .output(Fp32, &out)
            .output(I64, &out);
        let got = forward.run();
        let (mut values, mut indices) = (vec![], vec![]);
        for i in 0..numel(&out) {
            let (p, cells, _) = spec.window(i);
            let &(y, xx) = cells
                .iter()
                .max_by(|a, b| {
                    x.data[p * plane + a.0 * w + a.1].total_cmp(&x.data[p * plane + b.0 * w + b.1])
                })
                .unwrap();
            values.push(x.data[p * plane + y * w + xx]);
            indices.push((y * w + xx) as f64);
        }
        let what = format!("max_pool2d of {:?} kernel {:?}", spec.input, spec.kernel);
        assert_close(&got[0], &values, EXACT, &what);
        assert_close(&got[1], &indices, EXACT, &what);
        let g = rng.f32s(&out, -1.0, 1.0);
        let grad = spec
            .case(Op::MaxPool2dWithIndicesBackward)
            .input(g.clone())
            .input(x.clone())
            .input(i64v(
                &out,
                &got[1].iter().map(|v| *v as i64).collect::<Vec<_>>(),
            ))
            .output(Fp32, &spec.input)
            .run1();
        assert_grad(
            &grad,
            &numeric_grad(&forward, 0, 0, &g.data, 1e-2),
            1e-4,
            &format!("{what}: backward"),
        );
        // An index outside its plane fails the node, naming it and the plane's size.
        let mut bad: Vec<i64> = got[1].iter().map(|v| *v as i64).collect();
        bad[0] = plane as i64;
        let err = spec
            .case(Op::MaxPool2dWithIndicesBackward)
            .input(g.clone())
            .input(x.clone())
            .input(i64v(&out, &bad))
            .output(Fp32, &spec.input)
            .fails();
        assert_mentions(
            &err,
            &[
                "max_pool2d_with_indices_backward",
                &format!("index {plane} is out of range"),
                &format!("size {plane}"),
            ],
        );
    }
}

#[test]
fn avg_pool_and_its_backward() {
    let mut rng = Rng::new(53);
    for spec in pool_specs().into_iter().filter(|s| s.dilation == [1, 1]) {
        for (include_pad, divisor) in [(true, None), (false, None), (true, Some(5i64))] {
            let x = rng.f32s(&spec.input, -1.0, 1.0);
            let out = spec.output();
            let rank = out.len();
            let w = spec.input[rank - 1] as usize;
            let plane = (spec.input[rank - 2] * spec.input[rank - 1]) as usize;
            let with = |case: Case| {
                let case = case.flag("count_include_pad", include_pad);
                match divisor {
                    Some(d) => case.int("divisor_override", d),
                    None => case,
                }
            };
            let forward = with(spec.case(Op::AvgPool2d))
                .input(x.clone())
                .output(Fp32, &out);
            let want: Vec<f64> = (0..numel(&out))
                .map(|i| {
                    let (p, cells, padded) = spec.window(i);
                    let s: f64 = cells
                        .iter()
                        .map(|&(y, xx)| x.data[p * plane + y * w + xx])
                        .sum();
                    let div = divisor
                        .map_or(if include_pad { padded } else { cells.len() } as f64, |d| {
                            d as f64
                        });
                    s / div
                })
                .collect();
            let what = format!(
                "avg_pool2d of {:?} kernel {:?} include_pad {include_pad} divisor {divisor:?}",
                spec.input, spec.kernel
            );
            assert_close(&forward.run1(), &want, tol(1e-6, 1e-6), &what);
            let g = rng.f32s(&out, -1.0, 1.0);
            let grad = with(spec.case(Op::AvgPool2dBackward))
                .input(g.clone())
                .input(x.clone())
                .output(Fp32, &spec.input)
                .run1();
            assert_grad(
                &grad,
                &numeric_grad(&forward, 0, 0, &g.data, 1e-2),
                1e-3,
                &format!("{what}: backward"),
            );
        }
    }
}

#[test]
fn adaptive_avg_pool_and_its_backward() {
    let mut rng = Rng::new(59);
    for (input, size) in [
        (&[2u64, 3, 7, 5][..], [3i64, 2]),
        (&[1, 2, 1, 1], [2, 3]),
        (&[2, 6, 4], [4, 4]),
        (&[1, 1, 5, 9], [1, 1]),
    ] {
        let rank = input.len();
        let (h, w) = (input[rank - 2] as usize, input[rank - 1] as usize);
        let (oh, ow) = (size[0] as usize, size[1] as usize);
        let mut out = input.to_vec();
        out[rank - 2] = oh as u64;
        out[rank - 1] = ow as u64;
        let x = rng.f32s(input, -1.0, 1.0);
        let forward = Case::new(Op::AdaptiveAvgPool2d)
            .input(x.clone())
            .ints("output_size", &size)
            .output(Fp32, &out);
        let want: Vec<f64> = (0..numel(&out))
            .map(|i| {
                let (p, oy, ox) = (i / (oh * ow), i / ow % oh, i % ow);
                // Window [floor(o * n / out), ceil((o + 1) * n / out)).
                let (y0, y1) = (
                    (oy * h) as f64 / oh as f64,
                    ((oy + 1) * h) as f64 / oh as f64,
                );
                let (x0, x1) = (
                    (ox * w) as f64 / ow as f64,
                    ((ox + 1) * w) as f64 / ow as f64,
                );
                let mut cells = vec![];
                for y in y0.floor() as usize..y1.ceil() as usize {
                    for xx in x0.floor() as usize..x1.ceil() as usize {
                        cells.push(x.data[p * h * w + y * w + xx]);
                    }
                }
                mean(&cells)
            })
            .collect();
        let what = format!("_adaptive_avg_pool2d of {input:?} to {size:?}");
        assert_close(&forward.run1(), &want, tol(1e-6, 1e-6), &what);
        let g = rng.f32s(&out, -1.0, 1.0);
        let grad = Case::new(Op::AdaptiveAvgPool2dBackward)
            .input(g.clone())
            .input(x.clone())
            .output(Fp32, input)
            .run1();
        assert_grad(
            &grad,
            &numeric_grad(&forward, 0, 0, &g.data, 1e-2),
            1e-3,
            &format!("{what}: backward"),
        );
    }
}

#[test]
fn embedding_and_its_backward() {
    let mut rng = Rng::new(61);
    let table = rng.f32s(&[6, 4], -1.0, 1.0);
    let ids = i64v(&[2, 3], &[0, 5, 2, 5, 5, -1]);
    let forward = Case::new(Op::Embedding)
        .input(table.clone())
        .input(ids.clone())
        .int("padding_idx", -1)
        .flag("scale_grad_by_freq", false)
        .flag("sparse", false)
        .output(Fp32, &[2, 3, 4]);
    let got = forward.run1();
    let rows = [0usize, 5, 2, 5, 5, 5];
    let want: Vec<f64> = rows
        .iter()
        .flat_map(|&r| table.data[r * 4..(r + 1) * 4].to_vec())
        .collect();
    assert_close(&got, &want, EXACT, "embedding");
    let g = rng.f32s(&[2, 3, 4], -1.0, 1.0);
    for (padding, scale) in [(-1i64, false), (2, false), (5, true)] {
        let grad = Case::new(Op::EmbeddingDenseBackward)
            .input(g.clone())
            .input(ids.clone())
            .int("num_weights", 6)
            .int("padding_idx", padding)
            .flag("scale_grad_by_freq", scale)
            .output(Fp32, &[6, 4])
            .run1();
        let mut want = vec![0.0; 24];
        for (i, &r) in rows.iter().enumerate() {
            if r as i64 == padding {
                continue;
            }
            let count = rows.iter().filter(|&&q| q == r).count() as f64;
            for j in 0..4 {
                want[r * 4 + j] += g.data[i * 4 + j] / if scale { count } else { 1.0 };
            }
        }
        let what = format!("embedding_dense_backward padding_idx {padding} scale {scale}");
        assert_close(&grad, &want, tol(1e-6, 1e-6), &what);
        if padding == -1 {
            let numeric = numeric_grad(&forward, 0, 0, &g.data, 1e-2);
            assert_grad(
                &grad,
                &numeric,
                1e-4,
                &format!("{what} vs finite differences"),
            );
        }
    }
    // Bad indices fail with the index and the bound.
    let bad = i64v(&[3], &[1, 6, 0]);
    let err = Case::new(Op::EmbeddingDenseBackward)
        .input(f32v(&[3, 4], vec![0.0; 12]))
        .input(bad.clone())
        .int("num_weights", 6)
        .int("padding_idx", -1)
        .flag("scale_grad_by_freq", false)
        .output(Fp32, &[6, 4])
        .fails();
    assert_mentions(
        &err,
        &[
            "embedding_dense_backward",
            "index 6 is out of range",
            "size 6",
        ],
    );
    let err = Case::new(Op::Embedding)
        .input(table.clone())
        .input(i64v(&[1], &[-7]))
        .output(Fp32, &[1, 4])
        .fails();
    assert_mentions(&err, &["embedding", "index -7 is out of range", "size 6"]);
}

// ---------------------------------------------------------------------------------------
// Indexing

#[test]
fn gather_and_scatters() {
    let mut rng = Rng::new(67);
    let x = rng.f32s(&[3, 5, 7], -1.0, 1.0);
    for (dim, index_shape) in [(1i64, [3u64, 4, 7]), (-1, [2, 5, 3]), (0, [3, 1, 2])] {
        let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
        let n = x.ty.shape[d] as i64;
        let index_data = rng.ints(numel(&index_shape), -n, n);
        let index = i64v(&index_shape, &index_data);
        let wrap = |v: f64| (if v < 0.0 { v + n as f64 } else { v }) as usize;
        let got = Case::new(Op::Gather)
            .input(x.clone())
            .input(index.clone())
            .int("dim", dim)
            .flag("sparse_grad", false)
            .output(Fp32, &index_shape)
            .run1();
        let want = (0..numel(&index_shape))
            .map(|i| {
                let mut src = unravel(i, &index_shape);
                src[d] = wrap(index.data[i]);
                x.data[ravel(&src, &x.ty.shape)]
            })
            .collect::<Vec<_>>();
        let what = format!("gather dim {dim} index {index_shape:?}");
        assert_close(&got, &want, EXACT, &what);
        // scatter.value: the value at every indexed place.
        let got = Case::new(Op::ScatterValue)
            .input(x.clone())
            .input(index.clone())
            .int("dim", dim)
            .float("value", 9.5)
            .output(Fp32, &x.ty.shape)
            .run1();
        let mut want = x.data.clone();
        for i in 0..numel(&index_shape) {
            let mut dst = unravel(i, &index_shape);
            dst[d] = wrap(index.data[i]);
            want[ravel(&dst, &x.ty.shape)] = 9.5;
        }
        assert_close(&got, &want, EXACT, &format!("scatter.value dim {dim}"));
        // scatter_add: src may be larger than index; duplicates add up.
        let mut src_shape = index_shape;
        src_shape[0] += 1;
        let src = rng.f32s(&src_shape, -1.0, 1.0);
        let got = Case::new(Op::ScatterAdd)
            .input(x.clone())
            .input(index.clone())
            .input(src.clone())
            .int("dim", dim)
            .output(Fp32, &x.ty.shape)
            .run1();
        let mut want = x.data.clone();
        for i in 0..numel(&index_shape) {
            let at = unravel(i, &index_shape);
            let mut dst = at.clone();
            dst[d] = wrap(index.data[i]);
            want[ravel(&dst, &x.ty.shape)] += src.data[ravel(&at, &src_shape)];
        }
        assert_close(
            &got,
            &want,
            tol(1e-6, 1e-6),
            &format!("scatter_add dim {dim}"),
        );
        // Each of them refuses an index out of range, naming it and the bound.
        let mut bad = index_data.clone();
        bad[1] = n;
        let bad = i64v(&index_shape, &bad);
        for case in [
            Case::new(Op::Gather)
                .input(x.clone())
                .input(bad.clone())
                .int("dim", dim)
                .output(Fp32, &index_shape),
            Case::new(Op::ScatterValue)
                .input(x.clone())
                .input(bad.clone())
                .int("dim", dim)
                .float("value", 1.0)
                .output(Fp32, &x.ty.shape),
            Case::new(Op::ScatterAdd)
                .input(x.clone())
                .input(bad.clone())
                .input(src.clone())
                .int("dim", dim)
                .output(Fp32, &x.ty.shape),
        ] {
            assert_mentions(
                &case.fails(),
                &[&format!("index {n} is out of range"), &format!("size {n}")],
            );
        }
    }
}

#[test]
fn scatter_reduce_takes_products_and_extremes_nan_winning() {
    let mut rng = Rng::new(68);
    let mut x = rng.f32s(&[3, 5, 4], -2.0, 2.0);
    x.data[7] = f64::NAN;
    let index_shape = [3u64, 6, 4];
    // Every place along dim 1 named about once, some twice or more.
    let index = i64v(&index_shape, &rng.ints(numel(&index_shape), 0, 5));
    let src_shape = [3u64, 7, 4];
    let mut src = rng.f32s(&src_shape, -2.0, 2.0);
    src.data[ravel(&[1, 2, 3], &src_shape)] = f64::NAN;
    let case = |reduce: &str, include_self: bool| {
        Case::new(Op::ScatterReduce)
            .input(x.clone())
            .input(index.clone())
            .input(src.clone())
            .int("dim", 1)
            .attr("reduce", Attr::Str(reduce.into()))
            .flag("include_self", include_self)
            .output(Fp32, &x.ty.shape)
    };
    for (reduce, combine) in [
        ("prod", (|a: f64, v: f64| a * v) as fn(f64, f64) -> f64),
        ("amax", |a, v| {
            if a.is_nan() || v.is_nan() {
                f64::NAN
            } else {
                a.max(v)
            }
        }),
        ("amin", |a, v| {
            if a.is_nan() || v.is_nan() {
                f64::NAN
            } else {
                a.min(v)
            }
        }),
    ] {
        let got = case(reduce, true).run1();
        let mut want = x.data.clone();
        for i in 0..numel(&index_shape) {
            let at = unravel(i, &index_shape);
            let mut dst = at.clone();
            dst[1] = index.data[i] as usize;
            let place = ravel(&dst, &x.ty.shape);
            want[place] = combine(want[place], src.data[ravel(&at, &src_shape)]);
        }
        assert!(want.iter().any(|v| v.is_nan()), "the NaNs reach the result");
        assert_close(
            &got,
            &want,
            tol(1e-6, 0.0),
            &format!("scatter_reduce {reduce}"),
        );
    }
    // What the adaptors write otherwise is refused by name.
    assert_mentions(
        &case("sum", true).fails(),
        &["reduce", "scatter_add", "sum"],
    );
    assert_mentions(&case("amax", false).fails(), &["include_self must be true"]);
}

#[test]
fn index_select_and_index_put() {
    let mut rng = Rng::new(71);
    let x = rng.f32s(&[3, 5, 7], -1.0, 1.0);
    for (dim, picks) in [
        (1i64, vec![4i64, 0, -1, 4]),
        (-1, vec![6]),
        (0, vec![]),
        (2, vec![-7, 3]),
    ] {
        let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
        let n = x.ty.shape[d] as i64;
        let mut out = x.ty.shape.clone();
        out[d] = picks.len() as u64;
        let index = i64v(&[picks.len() as u64], &picks);
        let got = Case::new(Op::IndexSelect)
            .input(x.clone())
            .input(index.clone())
            .int("dim", dim)
            .output(Fp32, &out)
            .run1();
        let want = remap(&x, &out, |o| {
            let mut src = o.to_vec();
            let p = picks[o[d]];
            src[d] = (if p < 0 { p + n } else { p }) as usize;
            src
        });
        assert_close(
            &got,
            &want,
            EXACT,
            &format!("index_select dim {dim} {picks:?}"),
        );
        let bad = i64v(&[2], &[0, -n - 1]);
        let err = Case::new(Op::IndexSelect)
            .input(x.clone())
            .input(bad)
            .int("dim", dim)
            .output(Fp32, &{
                let mut o = x.ty.shape.clone();
                o[d] = 2;
                o
            })
            .fails();
        assert_mentions(
            &err,
            &[
                "index_select",
                &format!("index {} is out of range", -n - 1),
                &format!("size {n}"),
            ],
        );
    }
    let i32_index = val(I32, &[2], vec![2.0, 0.0]);
    let got = Case::new(Op::IndexSelect)
        .input(i64v(&[3], &[10, 20, 30]))
        .input(i32_index)
        .int("dim", 0)
        .output(I64, &[2])
        .run1();
    assert_close(&got, &[30.0, 10.0], EXACT, "index_select with i32 indices");
    // index_put with two leading index tensors: values per indexed row, one shared row,
    // or a scalar; accumulate adds (duplicates too), otherwise writes. As in PyTorch, which
    // of several values written to one place without accumulate wins is undefined (the
    // GPU writes in parallel), so those cases index distinct places.
    for (values_shape, accumulate) in [
        (vec![3u64, 7], true),
        (vec![7], true),
        (vec![], false),
        (vec![3, 7], false),
    ] {
        let places: [(usize, usize); 3] = if accumulate {
            [(0, 1), (2, 4), (0, 1)]
        } else {
            [(0, 1), (2, 4), (1, 3)]
        };
        let rows = i64v(&[3], &places.map(|(r, _)| r as i64));
        let cols = i64v(
            &[3],
            &places.map(|(_, c)| if c == 4 { -1 } else { c as i64 }),
        );
        let values = rng.f32s(&values_shape, -1.0, 1.0);
        let got = Case::new(Op::IndexPut)
            .input(x.clone())
            .input(rows.clone())
            .input(cols.clone())
            .input(values.clone())
            .int("indices.len", 2)
            .flag("accumulate", accumulate)
            .output(Fp32, &x.ty.shape)
            .run1();
        let mut want = x.data.clone();
        for (i, (r, c)) in places.into_iter().enumerate() {
            for j in 0..7 {
                let v = match values_shape.len() {
                    2 => values.data[i * 7 + j],
                    1 => values.data[j],
                    _ => values.data[0],
                };
                let at = (r * 5 + c) * 7 + j;
                want[at] = if accumulate { want[at] + v } else { v };
            }
        }
        assert_close(
            &got,
            &want,
            tol(1e-6, 1e-6),
            &format!("index_put values {values_shape:?} accumulate {accumulate}"),
        );
    }
    let err = Case::new(Op::IndexPut)
        .input(x.clone())
        .input(i64v(&[1], &[3]))
        .input(f32v(&[], vec![1.0]))
        .int("indices.len", 1)
        .flag("accumulate", false)
        .output(Fp32, &x.ty.shape)
        .fails();
    assert_mentions(&err, &["index_put", "index 3 is out of range", "size 3"]);
}

// ---------------------------------------------------------------------------------------
// Creation and randomness

#[test]
fn creation_ops() {
    let got = Case::new(Op::Full)
        .ints("size", &[2, 3])
        .float("fill_value", 1.25)
        .output(Fp32, &[2, 3])
        .run1();
    assert_close(&got, &[1.25; 6], EXACT, "full f32");
    let got = Case::new(Op::Full)
        .ints("size", &[4])
        .int("fill_value", -3)
        .output(I64, &[4])
        .run1();
    assert_close(&got, &[-3.0; 4], EXACT, "full i64");
    let got = Case::new(Op::Full)
        .ints("size", &[0, 2])
        .attr("fill_value", Attr::Bool(true))
        .output(Bool, &[0, 2])
        .run1();
    assert!(got.is_empty());
    let got = Case::new(Op::Full)
        .ints("size", &[3])
        .float("fill_value", 0.1)
        .dtype("dtype", Bf16)
        .output(Bf16, &[3])
        .run1();
    assert_close(
        &got,
        &[half::bf16::from_f64(0.1).to_f64(); 3],
        EXACT,
        "full bf16",
    );
    let like = f32v(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let got = Case::new(Op::FullLike)
        .input(like.clone())
        .float("fill_value", -0.5)
        .output(Fp32, &[2, 2])
        .run1();
    assert_close(&got, &[-0.5; 4], EXACT, "full_like");
    let got = Case::new(Op::FullLike)
        .input(like)
        .int("fill_value", 7)
        .dtype("dtype", I32)
        .output(I32, &[2, 2])
        .run1();
    assert_close(&got, &[7.0; 4], EXACT, "full_like i32");
    let got = Case::new(Op::ScalarTensor)
        .float("s", 2.5)
        .output(Fp32, &[])
        .run1();
    assert_close(&got, &[2.5], EXACT, "scalar_tensor");
    let got = Case::new(Op::ScalarTensor)
        .int("s", -4)
        .dtype("dtype", I64)
        .output(I64, &[])
        .run1();
    assert_close(&got, &[-4.0], EXACT, "scalar_tensor i64");
    for (start, end, step, dtype) in [
        (Attr::Int(0), Attr::Int(5), Attr::Int(1), I64),
        (Attr::Int(10), Attr::Int(-3), Attr::Int(-4), I64),
        (Attr::Float(0.5), Attr::Float(2.0), Attr::Float(0.25), Fp32),
        (Attr::Int(3), Attr::Int(3), Attr::Int(1), I64),
    ] {
        let num = |a: &Attr| match a {
            Attr::Int(v) => *v as f64,
            Attr::Float(v) => *v,
            _ => unreachable!(),
        };
        let (a, b, s) = (num(&start), num(&end), num(&step));
        let len = ((b - a) / s).ceil() as usize;
        let want: Vec<f64> = (0..len).map(|i| a + s * i as f64).collect();
        let got = Case::new(Op::ArangeStartStep)
            .attr("start", start.clone())
            .attr("end", end.clone())
            .attr("step", step.clone())
            .output(dtype, &[len as u64])
            .run1();
        assert_close(&got, &want, F32, &format!("arange {a} {b} {s}"));
    }
}

fn bernoulli(n: u64, p: f64, state: i64) -> Vec<f64> {
    Case::new(Op::BernoulliP)
        .input(f32v(&[n], vec![0.0; n as usize]))
        .input(i64v(&[], &[state]))
        .float("p", p)
        .output(Fp32, &[n])
        .run1()
}

#[test]
fn bernoulli_draws_ones_with_probability_p_from_the_session_generator() {
    let n = 20_000;
    for p in [0.0, 0.1, 0.5, 0.75, 1.0] {
        let mask = bernoulli(n, p, 7);
        assert!(
            mask.iter().all(|&v| v == 0.0 || v == 1.0),
            "p {p}: values other than 0, 1"
        );
        let ones = mask.iter().sum::<f64>();
        // Within 5 standard deviations of n p.
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (ones - n as f64 * p).abs() <= 5.0 * sd + 1e-9,
            "p {p}: {ones} ones of {n}"
        );
    }
    // A pure function of the state: the same state draws the same mask, the next state
    // (the next iteration) a different one, with no correlation between the two.
    let (a, again, b) = (
        bernoulli(n, 0.5, 41),
        bernoulli(n, 0.5, 41),
        bernoulli(n, 0.5, 42),
    );
    assert_eq!(a, again);
    let agree = a.iter().zip(&b).filter(|(x, y)| x == y).count() as f64 / n as f64;
    assert!(
        (agree - 0.5).abs() < 0.03,
        "masks of consecutive states agree on {agree}"
    );
    // Neighbouring elements are independent: ones follow ones half the time.
    let runs = a.windows(2).filter(|w| w[0] == 1.0 && w[1] == 1.0).count() as f64;
    let ones = a.iter().filter(|&&v| v == 1.0).count() as f64;
    assert!((runs / ones - 0.5).abs() < 0.03, "{runs} of {ones}");
}

#[test]
fn assert_async_fails_the_iteration_with_its_message() {
    let check = |cond: f64| {
        Case::new(Op::AssertAsyncMsg)
            .input(val(Bool, &[], vec![cond]))
            .attr(
                "assert_msg",
                Attr::Str("one_hot: Class values must be non-negative.".into()),
            )
    };
    assert_eq!(check(1.0).try_run().unwrap(), Vec::<Vec<f64>>::new());
    let err = check(0.0).fails();
    assert_mentions(&err, &["one_hot: Class values must be non-negative."]);
    let err = Case::new(Op::AssertAsyncMsg)
        .input(val(Bool, &[2], vec![1.0, 1.0]))
        .fails();
    assert_mentions(&err, &["the condition must have one element"]);
}

fn rand_like(n: u64, dtype: DType, state: i64) -> Vec<f64> {
    Case::new(Op::RandLike)
        .input(val(dtype, &[n], vec![0.0; n as usize]))
        .input(i64v(&[], &[state]))
        .output(dtype, &[n])
        .run1()
}

#[test]
fn rand_like_draws_uniforms_from_the_session_generator() {
    let n = 20_000;
    let u = rand_like(n, Fp32, 7);
    assert!(
        u.iter().all(|&v| (0.0..1.0).contains(&v)),
        "values outside [0, 1)"
    );
    // Mean 1/2 and variance 1/12, within 5 standard errors.
    let mean = u.iter().sum::<f64>() / n as f64;
    let var = u.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
    assert!(
        (mean - 0.5).abs() < 5.0 * (1.0 / 12.0 / n as f64).sqrt(),
        "mean {mean}"
    );
    assert!(
        (var - 1.0 / 12.0).abs() < 5.0 * (1.0 / 180.0 / n as f64).sqrt(),
        "var {var}"
    );
    // Each tenth of [0, 1) gets a tenth of the draws (within 5 standard deviations).
    for k in 0..10 {
        let inside = u
            .iter()
            .filter(|&&v| (v * 10.0).floor() as usize == k)
            .count() as f64;
        let sd = (n as f64 * 0.1 * 0.9).sqrt();
        assert!(
            (inside - n as f64 * 0.1).abs() <= 5.0 * sd,
            "tenth {k}: {inside}"
        );
    }
    // A pure function of the state; the next state draws values unrelated to these.
    assert_eq!(u, rand_like(n, Fp32, 7));
    let next = rand_like(n, Fp32, 8);
    let cov = u
        .iter()
        .zip(&next)
        .map(|(a, b)| (a - 0.5) * (b - 0.5))
        .sum::<f64>()
        / n as f64;
    assert!(
        cov.abs() < 5.0 / 12.0 / (n as f64).sqrt(),
        "covariance {cov}"
    );
    // 16-bit draws are exact multiples of their own step, every one below 1.
    for (dtype, step) in [(F16, 2f64.powi(-11)), (Bf16, 2f64.powi(-8))] {
        let h = rand_like(4096, dtype, 3);
        assert!(
            h.iter().all(|&v| v < 1.0 && (v / step).fract() == 0.0),
            "{dtype}"
        );
        let mean = h.iter().sum::<f64>() / 4096.0;
        assert!(
            (mean - 0.5 + step / 2.0).abs() < 0.03,
            "{dtype} mean {mean}"
        );
    }
    let err = Case::new(Op::RandLike)
        .input(i64v(&[4], &[0; 4]))
        .input(i64v(&[], &[1]))
        .output(I64, &[4])
        .fails();
    assert_mentions(&err, &["rand_like draws floats"]);
}

#[test]
fn bernoulli_needs_the_generator() {
    let err = Case::new(Op::BernoulliP)
        .input(f32v(&[4], vec![0.0; 4]))
        .float("p", 0.5)
        .output(Fp32, &[4])
        .fails();
    assert_mentions(&err, &["bernoulli.p", "takes 2 tensor inputs, got 1"]);
    let err = Case::new(Op::BernoulliP)
        .input(f32v(&[4], vec![0.0; 4]))
        .input(f32v(&[], vec![0.0]))
        .float("p", 0.5)
        .output(Fp32, &[4])
        .fails();
    assert_mentions(&err, &["generator (input 1) must be an i64 scalar"]);
}

// ---------------------------------------------------------------------------------------
// Maxima, comparisons of two tensors, cumulative sums, flips and padding

/// f32's machine epsilon: tolerances below are multiples of it, from how many roundings
/// a correct f32 computation makes.
const EPS32: f64 = f32::EPSILON as f64;

/// PyTorch's `maximum`: NaN if either is NaN, else the larger.
fn maximum_ref(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn minimum_ref(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

#[test]
fn maximum_minimum_and_tensor_comparisons() {
    let r = (-3.0, 3.0);
    let ff = (Fp32, Fp32, Fp32);
    binary(Op::Maximum, &[], ff, r, EXACT, maximum_ref);
    binary(Op::Minimum, &[], ff, r, EXACT, minimum_ref);
    let fb = (Fp32, Fp32, Bool);
    let flag = |b: bool| f64::from(u8::from(b));
    binary(Op::EqTensor, &[], fb, r, EXACT, |a, b| flag(a == b));
    binary(Op::LtTensor, &[], fb, r, EXACT, |a, b| flag(a < b));
    binary(Op::GtTensor, &[], fb, r, EXACT, |a, b| flag(a > b));
    // Integers: many ties, and promotion to the wider type.
    let ints = (-4.0, 4.0);
    binary(Op::Maximum, &[], (I64, I64, I64), ints, EXACT, maximum_ref);
    binary(Op::Minimum, &[], (I64, I32, I64), ints, EXACT, minimum_ref);
    binary(Op::EqTensor, &[], (I64, I64, Bool), ints, EXACT, |a, b| {
        flag(a == b)
    });
    binary(Op::LtTensor, &[], (I64, Fp32, Bool), ints, EXACT, |a, b| {
        flag(a < b)
    });
    binary(
        Op::Maximum,
        &[],
        (I64, Fp32, Fp32),
        ints,
        EXACT,
        maximum_ref,
    );
    // NaN wins both ways; comparisons with NaN are false; ties and infinities.
    let a = f32v(&[6], vec![NAN, 1.0, 2.0, -INF, 0.0, NAN]);
    let b = f32v(&[6], vec![1.0, NAN, 2.0, 5.0, INF, NAN]);
    let run = |op: Op, out: DType| {
        Case::new(op)
            .input(a.clone())
            .input(b.clone())
            .output(out, &[6])
            .run1()
    };
    let pairs = || a.data.iter().zip(&b.data);
    let want_max: Vec<f64> = pairs().map(|(&x, &y)| maximum_ref(x, y)).collect();
    let want_min: Vec<f64> = pairs().map(|(&x, &y)| minimum_ref(x, y)).collect();
    assert_close(&run(Op::Maximum, Fp32), &want_max, EXACT, "maximum, NaN");
    assert_close(&run(Op::Minimum, Fp32), &want_min, EXACT, "minimum, NaN");
    let cmp =
        |f: fn(&f64, &f64) -> bool| -> Vec<f64> { pairs().map(|(x, y)| flag(f(x, y))).collect() };
    assert_close(&run(Op::EqTensor, Bool), &cmp(f64::eq), EXACT, "eq, NaN");
    assert_close(&run(Op::LtTensor, Bool), &cmp(f64::lt), EXACT, "lt, NaN");
    assert_close(&run(Op::GtTensor, Bool), &cmp(f64::gt), EXACT, "gt, NaN");
}

/// Asserts `got[i]` is within `bound[i]` of `want[i]`.
#[track_caller]
fn assert_within(got: &[f64], want: &[f64], bound: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
        assert!(
            (g - w).abs() <= *b || (g.is_nan() && w.is_nan()),
            "{what}: element {i} is {g}, expected {w} within {b}"
        );
    }
}

#[test]
fn cumsum_along_each_dimension() {
    let mut rng = Rng::new(83);
    let shape = [3u64, 5, 7];
    let x = rng.f32s(&shape, -2.0, 2.0);
    for dim in [0i64, 1, 2, -1, -3] {
        let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
        let got = Case::new(Op::Cumsum)
            .input(x.clone())
            .int("dim", dim)
            .output(Fp32, &shape)
            .run1();
        // The exact prefix sums, and what a correct f32 evaluation may be off by: each of
        // the k additions of a prefix of k terms rounds once (at most eps/2 of the running
        // sum, itself at most the sum of |terms|), plus the final rounding.
        let (mut want, mut bound) = (vec![0.0; x.data.len()], vec![0.0; x.data.len()]);
        for i in 0..x.data.len() {
            let mut idx = unravel(i, &shape);
            let (mut sum, mut magnitude) = (0.0, 0.0);
            for j in 0..=idx[d] {
                idx[d] = j;
                let v = x.data[ravel(&idx, &shape)];
                sum += v;
                magnitude += v.abs();
            }
            want[i] = sum;
            bound[i] = (idx[d] + 1) as f64 * EPS32 / 2.0 * magnitude + EPS32 / 2.0 * sum.abs();
        }
        assert_within(&got, &want, &bound, &format!("cumsum dim {dim}"));
    }
    // Integers and bools sum exactly into i64 (PyTorch's default), or into a given dtype.
    let i = i64v(&[2, 3], &[1, -2, 3, 4, 5, 6]);
    let got = Case::new(Op::Cumsum)
        .input(i.clone())
        .int("dim", 1)
        .output(I64, &[2, 3])
        .run1();
    assert_close(&got, &[1.0, -1.0, 2.0, 4.0, 9.0, 15.0], EXACT, "cumsum i64");
    let b = val(Bool, &[4], vec![1.0, 0.0, 1.0, 1.0]);
    let got = Case::new(Op::Cumsum)
        .input(b)
        .int("dim", 0)
        .output(I64, &[4])
        .run1();
    assert_close(&got, &[1.0, 1.0, 2.0, 3.0], EXACT, "cumsum bool");
    let got = Case::new(Op::Cumsum)
        .input(i)
        .int("dim", 0)
        .dtype("dtype", Fp32)
        .output(Fp32, &[2, 3])
        .run1();
    assert_close(
        &got,
        &[1.0, -2.0, 3.0, 5.0, 3.0, 9.0],
        EXACT,
        "cumsum to f32",
    );
    // A 0-dim tensor is its own sum; a zero-size one stays empty.
    let got = Case::new(Op::Cumsum)
        .input(f32v(&[], vec![2.5]))
        .int("dim", -1)
        .output(Fp32, &[])
        .run1();
    assert_close(&got, &[2.5], EXACT, "cumsum 0-dim");
    let got = Case::new(Op::Cumsum)
        .input(f32v(&[0, 3], vec![]))
        .int("dim", 0)
        .output(Fp32, &[0, 3])
        .run1();
    assert!(got.is_empty());
}

#[test]
fn flip_reverses_the_named_dimensions() {
    let mut rng = Rng::new(89);
    let shape = [2u64, 3, 4];
    let x = rng.f32s(&shape, -1.0, 1.0);
    for dims in [vec![0i64, 2], vec![-1], vec![], vec![1, 0, 2]] {
        let flipped: Vec<usize> = dims
            .iter()
            .map(|&d| (if d < 0 { d + 3 } else { d }) as usize)
            .collect();
        let got = Case::new(Op::Flip)
            .input(x.clone())
            .ints("dims", &dims)
            .output(Fp32, &shape)
            .run1();
        let want = remap(&x, &shape, |o| {
            let mut src = o.to_vec();
            for &d in &flipped {
                src[d] = shape[d] as usize - 1 - o[d];
            }
            src
        });
        assert_close(&got, &want, EXACT, &format!("flip {dims:?}"));
    }
    let i = i64v(&[5], &[1, 2, 3, 4, 1 << 60]);
    let got = Case::new(Op::Flip)
        .input(i)
        .ints("dims", &[0])
        .output(I64, &[5])
        .run1();
    assert_close(
        &got,
        &[(1i64 << 60) as f64, 4.0, 3.0, 2.0, 1.0],
        EXACT,
        "flip i64",
    );
    let err = Case::new(Op::Flip)
        .input(x)
        .ints("dims", &[0, -3])
        .output(Fp32, &shape)
        .fails();
    assert_mentions(&err, &["flip", "appears twice"]);
}

#[test]
fn constant_pad_nd_pads_and_crops() {
    let mut rng = Rng::new(97);
    let shape = [2u64, 3, 4];
    let x = rng.f32s(&shape, -1.0, 1.0);
    // (pad, output shape): the last dimension first; negative amounts crop.
    let cases: &[(&[i64], &[u64])] = &[
        (&[1, 2], &[2, 3, 7]),
        (&[1, -1, 0, 2], &[2, 5, 4]),
        (&[0, 0, 2, 1, 1, 1], &[4, 6, 4]),
        (&[-2, -2], &[2, 3, 0]),
        (&[], &[2, 3, 4]),
    ];
    for &(pad, out) in cases {
        let got = Case::new(Op::ConstantPadNd)
            .input(x.clone())
            .ints("pad", pad)
            .float("value", 0.5)
            .output(Fp32, out)
            .run1();
        let mut before = [0i64; 3];
        for (k, pair) in pad.chunks(2).enumerate() {
            before[2 - k] = pair[0];
        }
        let want: Vec<f64> = (0..numel(out))
            .map(|i| {
                let o = unravel(i, out);
                let src: Vec<i64> = (0..3).map(|d| o[d] as i64 - before[d]).collect();
                let inside = (0..3).all(|d| (0..shape[d] as i64).contains(&src[d]));
                if inside {
                    let src: Vec<usize> = src.iter().map(|&v| v as usize).collect();
                    x.data[ravel(&src, &shape)]
                } else {
                    0.5
                }
            })
            .collect();
        assert_close(&got, &want, EXACT, &format!("constant_pad_nd {pad:?}"));
    }
    // Integers, and the value's default 0.
    let got = Case::new(Op::ConstantPadNd)
        .input(i64v(&[2], &[7, 1 << 60]))
        .ints("pad", &[1, 1])
        .output(I64, &[4])
        .run1();
    assert_close(
        &got,
        &[0.0, 7.0, (1i64 << 60) as f64, 0.0],
        EXACT,
        "pad i64",
    );
    let err = Case::new(Op::ConstantPadNd)
        .input(x.clone())
        .ints("pad", &[-3, -2])
        .output(Fp32, &shape)
        .fails();
    assert_mentions(
        &err,
        &["constant_pad_nd", "leaves dimension 2", "-1 elements"],
    );
    let err = Case::new(Op::ConstantPadNd)
        .input(x)
        .ints("pad", &[1, 1, 1])
        .output(Fp32, &shape)
        .fails();
    assert_mentions(&err, &["constant_pad_nd", "(before, after) pairs"]);
}

/// The reflection of output position `j` of a dimension of `n` padded by `before`: the
/// padded dimension spelled out as PyTorch documents it (`[before..1]`, `[0..n)`, then
/// `[n-2..]`), indexed.
fn reflected(j: usize, before: usize, n: usize) -> usize {
    let mut padded: Vec<usize> = (1..=before).rev().collect();
    padded.extend(0..n);
    padded.extend((0..n - 1).rev());
    padded[j]
}

#[test]
fn reflection_pad2d_and_its_backward() {
    let mut rng = Rng::new(101);
    for (shape, padding) in [
        (&[2u64, 3, 5, 6][..], [2i64, 1, 3, 4]),
        (&[2, 4, 3], [2, 2, 1, 0]),
        (&[1, 1, 1, 2], [1, 0, 0, 0]),
    ] {
        let rank = shape.len();
        let (h, w) = (shape[rank - 2] as usize, shape[rank - 1] as usize);
        let [left, right, top, bottom] = padding.map(|p| p as usize);
        let mut out = shape.to_vec();
        out[rank - 2] += (top + bottom) as u64;
        out[rank - 1] += (left + right) as u64;
        let x = rng.f32s(shape, -1.0, 1.0);
        let what = format!("reflection_pad2d {shape:?} by {padding:?}");
        let got = Case::new(Op::ReflectionPad2d)
            .input(x.clone())
            .ints("padding", &padding)
            .output(Fp32, &out)
            .run1();
        let source = |o: &[usize]| {
            let mut src = o.to_vec();
            src[rank - 2] = reflected(o[rank - 2], top, h);
            src[rank - 1] = reflected(o[rank - 1], left, w);
            src
        };
        assert_close(&got, &remap(&x, &out, source), EXACT, &what);
        // The backward sums the gradient of every position that reflects an element (at
        // most 3 per dimension): in f32, each addition rounds once, by at most eps/2 of
        // the running sum.
        let g = rng.f32s(&out, -1.0, 1.0);
        let got = Case::new(Op::ReflectionPad2dBackward)
            .input(g.clone())
            .input(x.clone())
            .ints("padding", &padding)
            .output(Fp32, shape)
            .run1();
        let mut want = vec![0.0; x.data.len()];
        let mut bound = vec![0.0; x.data.len()];
        for (i, gv) in g.data.iter().enumerate() {
            let at = ravel(&source(&unravel(i, &out)), shape);
            want[at] += gv;
            bound[at] += 9.0 * EPS32 / 2.0 * gv.abs();
        }
        assert_within(&got, &want, &bound, &format!("{what}: backward"));
    }
    let x = rng.f32s(&[2, 3, 4], -1.0, 1.0);
    let err = Case::new(Op::ReflectionPad2d)
        .input(x.clone())
        .ints("padding", &[4, 0, 0, 0])
        .output(Fp32, &[2, 3, 8])
        .fails();
    assert_mentions(
        &err,
        &["reflection_pad2d", "must be less than the dimensions"],
    );
    let err = Case::new(Op::ReflectionPad2dBackward)
        .input(rng.f32s(&[2, 3, 5], -1.0, 1.0))
        .input(x)
        .ints("padding", &[2, 0, 0, 0])
        .output(Fp32, &[2, 3, 4])
        .fails();
    assert_mentions(
        &err,
        &["reflection_pad2d_backward", "grad_output f32[2, 3, 5]"],
    );
}

#[test]
fn group_norm_normalizes_each_group() {
    let mut rng = Rng::new(103);
    for (shape, groups, affine) in [
        (&[2u64, 6, 3, 4][..], 3i64, true),
        (&[3, 4, 5], 2, false),
        (&[2, 4], 4, true),
        (&[2, 8, 2, 2, 3], 1, true),
    ] {
        let (n, c) = (shape[0] as usize, shape[1] as usize);
        let inner = numel(&shape[2..]);
        let g = groups as usize;
        let x = rng.f32s(shape, -2.0, 2.0);
        let w = rng.f32s(&[c as u64], 0.5, 1.5);
        let b = rng.f32s(&[c as u64], -1.0, 1.0);
        let stats = [n as u64, g as u64];
        let mut case = Case::new(Op::NativeGroupNorm).input(x.clone());
        case = if affine {
            case.input(w.clone()).input(b.clone())
        } else {
            case.absent().absent()
        };
        let got = case
            .int("N", n as i64)
            .int("C", c as i64)
            .int("HxW", inner as i64)
            .int("group", groups)
            .float("eps", 1e-5)
            .output(Fp32, shape)
            .output(Fp32, &stats)
            .output(Fp32, &stats)
            .run();
        let count = c / g * inner;
        let (mut y, mut scale, mut means, mut rstds) = (vec![], vec![], vec![], vec![]);
        for r in 0..n * g {
            let row = &x.data[r * count..(r + 1) * count];
            let m = mean(row);
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / count as f64;
            let rstd = 1.0 / (var + 1e-5).sqrt();
            for (j, v) in row.iter().enumerate() {
                let ch = (r % g) * (c / g) + j / inner;
                let (wv, bv) = if affine {
                    (w.data[ch], b.data[ch])
                } else {
                    (1.0, 0.0)
                };
                let xhat = (v - m) * rstd;
                y.push(xhat * wv + bv);
                // x - mean rounds on the magnitudes of x and mean, not of their difference.
                scale.push((v.abs() + m.abs()) * rstd * wv + bv.abs());
            }
            means.push(m);
            rstds.push(rstd);
        }
        // An f32 evaluation rounds the statistics (a sum of `count` terms: up to `count`
        // roundings of the running sum), then a few more times per element (subtract,
        // scale, shift): bounded by (count + 8) eps of the magnitudes involved.
        let what = format!("native_group_norm of {shape:?} in {groups} groups");
        let slack = (count as f64 + 8.0) * EPS32;
        let bound: Vec<f64> = scale.iter().map(|s| slack * s).collect();
        assert_within(&got[0], &y, &bound, &what);
        let magnitude = x.data.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        assert_close(&got[1], &means, tol(0.0, slack * magnitude), &what);
        assert_close(&got[2], &rstds, tol(slack, 0.0), &what);
    }
    // Only the output used; channels that do not split into the groups are refused.
    let x = rng.f32s(&[2, 6, 3], -1.0, 1.0);
    let case = |groups: i64| {
        Case::new(Op::NativeGroupNorm)
            .input(x.clone())
            .absent()
            .absent()
            .int("N", 2)
            .int("C", 6)
            .int("HxW", 3)
            .int("group", groups)
            .float("eps", 1e-5)
            .output(Fp32, &[2, 6, 3])
            .unused()
            .unused()
    };
    assert_eq!(case(2).run()[0].len(), 36);
    let err = case(4).fails();
    assert_mentions(
        &err,
        &["native_group_norm", "6 channels do not split into 4 groups"],
    );
}

// ---------------------------------------------------------------------------------------
// Advanced indexing

/// `self[indices]` by PyTorch's rules, for the reference: index tensors (`None` for a
/// dimension taken whole) broadcast together; the selection is the whole dimensions in
/// order with the broadcast index shape where the first indexed dimension was when the
/// indexed dimensions are adjacent, else in front. Returns the selection's shape and, per
/// element, the element of self it selects.
fn selection(self_shape: &[u64], indices: &[Option<&Value>]) -> (Vec<u64>, Vec<usize>) {
    let rank = self_shape.len();
    let given: Vec<usize> = (0..indices.len())
        .filter(|&d| indices[d].is_some())
        .collect();
    let mut bshape: Vec<u64> = vec![];
    for &d in &given {
        let s = &indices[d].unwrap().ty.shape;
        let r = bshape.len().max(s.len());
        let at = |v: &[u64], i: usize| {
            if i + v.len() >= r {
                v[i + v.len() - r]
            } else {
                1
            }
        };
        bshape = (0..r).map(|i| at(&bshape, i).max(at(s, i))).collect();
    }
    let adjacent = given.windows(2).all(|w| w[1] == w[0] + 1);
    let whole: Vec<usize> = (0..rank).filter(|d| !given.contains(d)).collect();
    let front = if adjacent { given[0] } else { 0 };
    let mut shape: Vec<u64> = whole[..front].iter().map(|&d| self_shape[d]).collect();
    shape.extend(&bshape);
    shape.extend(whole[front..].iter().map(|&d| self_shape[d]));
    let picks = (0..numel(&shape))
        .map(|i| {
            let c = unravel(i, &shape);
            let bc = &c[front..front + bshape.len()];
            let mut src = vec![0usize; rank];
            for (k, &d) in whole.iter().enumerate() {
                src[d] = c[if k < front { k } else { k + bshape.len() }];
            }
            for &d in &given {
                let v = indices[d].unwrap();
                let p = v.data[broadcast_at(bc, &v.ty.shape)] as i64;
                let n = self_shape[d] as i64;
                src[d] = (if p < 0 { p + n } else { p }) as usize;
            }
            ravel(&src, self_shape)
        })
        .collect();
    (shape, picks)
}

/// An `indices` list: index tensors, `None` for dimensions taken whole.
type Indices<'a> = Vec<Option<&'a Value>>;

/// A case of `op` over `x` with `indices` (absent where `None`).
fn indexed(op: Op, x: &Value, indices: &[Option<&Value>]) -> Case {
    let mut case = Case::new(op).input(x.clone());
    for index in indices {
        case = match index {
            Some(v) => case.input((*v).clone()),
            None => case.absent(),
        };
    }
    case.int("indices.len", indices.len() as i64)
}

#[test]
fn index_tensor_selects_as_pytorch_does() {
    let mut rng = Rng::new(107);
    let x = rng.f32s(&[2, 3, 4, 5], -1.0, 1.0);
    let rows = i64v(&[3, 1], &[3, 0, -1]);
    let cols = i64v(&[4], &[4, 0, 2, -5]);
    let pair = i64v(&[2], &[1, -2]);
    let grid = val(I32, &[2, 3], vec![0.0, 1.0, 2.0, 2.0, 1.0, 0.0]);
    let halves = val(I32, &[2, 3], vec![0.0, 1.0, 1.0, 0.0, 1.0, 0.0]);
    let scalar = i64v(&[], &[1]);
    let cases: Vec<(&str, Indices<'_>, Vec<u64>)> = vec![
        // Nearest upsampling's form: the last two dims picked by a column and a row.
        (
            "rows and columns",
            vec![None, None, Some(&rows), Some(&cols)],
            vec![2, 3, 3, 4],
        ),
        ("a leading index", vec![Some(&halves)], vec![2, 3, 3, 4, 5]),
        (
            "apart: in front",
            vec![Some(&pair), None, Some(&pair)],
            vec![2, 3, 5],
        ),
        (
            "one inner dim",
            vec![None, Some(&grid)],
            vec![2, 2, 3, 4, 5],
        ),
        (
            "a 0-dim index",
            vec![None, Some(&scalar), Some(&rows)],
            vec![2, 3, 1, 5],
        ),
    ];
    for (what, indices, shape) in cases {
        let (want_shape, picks) = selection(&x.ty.shape, &indices);
        assert_eq!(want_shape, shape, "{what}");
        let got = indexed(Op::IndexTensor, &x, &indices)
            .output(Fp32, &shape)
            .run1();
        let want: Vec<f64> = picks.iter().map(|&p| x.data[p]).collect();
        assert_close(&got, &want, EXACT, &format!("index.Tensor: {what}"));
    }
    // i64 values are copied whole.
    let big = i64v(&[3], &[1, 1 << 60, 3]);
    let got = indexed(Op::IndexTensor, &big, &[Some(&pair)])
        .output(I64, &[2])
        .run1();
    assert_close(
        &got,
        &[(1i64 << 60) as f64, (1i64 << 60) as f64],
        EXACT,
        "i64",
    );
    let bad = i64v(&[2], &[0, 4]);
    let err = indexed(Op::IndexTensor, &x, &[None, None, Some(&bad)])
        .output(Fp32, &[2, 3, 2, 5])
        .fails();
    assert_mentions(&err, &["index.Tensor", "index 4 is out of range", "size 4"]);
    // Whole rows (an embedding's lookup) are checked the same way.
    let err = indexed(Op::IndexTensor, &x, &[Some(&bad)])
        .output(Fp32, &[2, 3, 4, 5])
        .fails();
    assert_mentions(&err, &["index.Tensor", "index 4 is out of range", "size 2"]);
    let mask = val(Bool, &[2], vec![1.0, 0.0]);
    let err = indexed(Op::IndexTensor, &x, &[Some(&mask)])
        .output(Fp32, &[1, 3, 4, 5])
        .fails();
    assert_mentions(
        &err,
        &["index.Tensor", "bool (mask) indices are not supported"],
    );
    let err = indexed(Op::IndexTensor, &x, &[None, None])
        .output(Fp32, &[2, 3, 4, 5])
        .fails();
    assert_mentions(&err, &["index.Tensor", "at least one index tensor"]);
}

#[test]
fn index_put_accumulates_into_a_selection() {
    let mut rng = Rng::new(109);
    // Nearest upsampling's backward: the gradient of [2, 3, 6, 4] summed into [2, 3, 3, 2]
    // through repeated rows and columns.
    let x = f32v(&[2, 3, 3, 2], vec![0.0; 36]);
    let rows = i64v(&[6, 1], &[0, 0, 1, 1, 2, 2]);
    let cols = i64v(&[4], &[0, 0, 1, -1]);
    let lead = i64v(&[5], &[0, 1, -1, 1, 0]);
    let cases: Vec<(Indices<'_>, Vec<u64>)> = vec![
        (vec![None, None, Some(&rows), Some(&cols)], vec![2, 3, 6, 4]),
        (vec![None, None, Some(&rows), Some(&cols)], vec![6, 1]),
        (vec![Some(&cols), None, Some(&cols)], vec![4, 3, 2]),
        // Whole rows, repeated (an embedding's gradient), and a broadcast value.
        (vec![Some(&lead)], vec![5, 3, 3, 2]),
        (vec![Some(&lead)], vec![3, 1, 2]),
    ];
    for (indices, values_shape) in cases {
        let (shape, picks) = selection(&x.ty.shape, &indices);
        let values = rng.f32s(&values_shape, -1.0, 1.0);
        let what = format!("index_put of {values_shape:?} into the selection {shape:?}");
        let got = indexed(Op::IndexPut, &x, &indices)
            .input(values.clone())
            .flag("accumulate", true)
            .output(Fp32, &x.ty.shape)
            .run1();
        let mut want = x.data.clone();
        let (mut terms, mut magnitude) = (vec![0.0; want.len()], vec![0.0; want.len()]);
        for (i, &p) in picks.iter().enumerate() {
            let v = values.data[broadcast_at(&unravel(i, &shape), &values_shape)];
            want[p] += v;
            terms[p] += 1.0;
            magnitude[p] += v.abs();
        }
        // Each place adds its values one at a time, in f32: each addition rounds by at
        // most eps/2 of the running sum, itself at most the sum of |values|.
        let bound: Vec<f64> = terms
            .iter()
            .zip(&magnitude)
            .map(|(t, m)| t * EPS32 / 2.0 * m)
            .collect();
        assert_within(&got, &want, &bound, &what);
    }
    // Whole rows of a 2-byte dtype add up too: small integers, exact in f16.
    let zeros = val(F16, &x.ty.shape, vec![0.0; 36]);
    let ones: Vec<f64> = (0..90).map(|i| f64::from(i % 4)).collect();
    let got = indexed(Op::IndexPut, &zeros, &[Some(&lead)])
        .input(val(F16, &[5, 3, 3, 2], ones.clone()))
        .flag("accumulate", true)
        .output(F16, &x.ty.shape)
        .run1();
    let mut want = vec![0.0; 36];
    for (p, &row) in [0usize, 1, 1, 1, 0].iter().enumerate() {
        for k in 0..18 {
            want[row * 18 + k] += ones[p * 18 + k];
        }
    }
    assert_close(&got, &want, EXACT, "index_put of f16 rows");
    // Values that do not broadcast to the selection are refused.
    let values = rng.f32s(&[5], -1.0, 1.0);
    let err = indexed(Op::IndexPut, &x, &[None, None, Some(&rows), Some(&cols)])
        .input(values)
        .flag("accumulate", true)
        .output(Fp32, &x.ty.shape)
        .fails();
    assert_mentions(&err, &["index_put", "do not broadcast"]);
}

// ---------------------------------------------------------------------------------------
// Coverage

/// Every test of this file above, to run again under the op recorder.
const ALL_TESTS: &[(&str, fn())] = &[
    ("unary_float_functions", unary_float_functions),
    ("gelu_exact_and_tanh", gelu_exact_and_tanh),
    ("scalar_ops", scalar_ops),
    ("comparisons_with_a_number", comparisons_with_a_number),
    ("logical_and_bitwise_not", logical_and_bitwise_not),
    ("copies_and_conversions", copies_and_conversions),
    ("binary_arithmetic_broadcasts", binary_arithmetic_broadcasts),
    ("binary_logical_and_bitwise", binary_logical_and_bitwise),
    ("where_broadcasts_three_ways", where_broadcasts_three_ways),
    ("sums_means_and_maxima", sums_means_and_maxima),
    ("variance_and_any", variance_and_any),
    ("softmax_and_log_softmax", softmax_and_log_softmax),
    (
        "softmax_backwards_match_formula_and_finite_differences",
        softmax_backwards_match_formula_and_finite_differences,
    ),
    ("mm_addmm_bmm", mm_addmm_bmm),
    ("views_keep_the_elements", views_keep_the_elements),
    ("permute_and_expand", permute_and_expand),
    ("split_cat_slice_select", split_cat_slice_select),
    (
        "convolutions_match_their_definition",
        convolutions_match_their_definition,
    ),
    (
        "convolution_backward_matches_finite_differences",
        convolution_backward_matches_finite_differences,
    ),
    ("layer_norm_and_its_backward", layer_norm_and_its_backward),
    ("max_pool_and_its_backward", max_pool_and_its_backward),
    ("avg_pool_and_its_backward", avg_pool_and_its_backward),
    (
        "adaptive_avg_pool_and_its_backward",
        adaptive_avg_pool_and_its_backward,
    ),
    ("embedding_and_its_backward", embedding_and_its_backward),
    ("gather_and_scatters", gather_and_scatters),
    ("pow_of_two_tensors_is_cs_pow", pow_of_two_tensors_is_cs_pow),
    (
        "erfc_and_erfinv_meet_their_references",
        erfc_and_erfinv_meet_their_references,
    ),
    (
        "gamma_functions_meet_known_values",
        gamma_functions_meet_known_values,
    ),
    (
        "scatter_reduce_takes_products_and_extremes_nan_winning",
        scatter_reduce_takes_products_and_extremes_nan_winning,
    ),
    ("index_select_and_index_put", index_select_and_index_put),
    (
        "maximum_minimum_and_tensor_comparisons",
        maximum_minimum_and_tensor_comparisons,
    ),
    ("cumsum_along_each_dimension", cumsum_along_each_dimension),
    ("rounding_functions", rounding_functions),
    ("cumprod_along_each_dimension", cumprod_along_each_dimension),
    ("atan2_of_every_quadrant", atan2_of_every_quadrant),
    (
        "remainder_and_fmod_take_the_divisors_or_the_dividends_sign",
        remainder_and_fmod_take_the_divisors_or_the_dividends_sign,
    ),
    ("argmax_and_argmin", argmax_and_argmin),
    (
        "stable_sort_along_each_dimension",
        stable_sort_along_each_dimension,
    ),
    (
        "scatter_src_writes_each_source_element",
        scatter_src_writes_each_source_element,
    ),
    (
        "flip_reverses_the_named_dimensions",
        flip_reverses_the_named_dimensions,
    ),
    (
        "constant_pad_nd_pads_and_crops",
        constant_pad_nd_pads_and_crops,
    ),
    (
        "reflection_pad2d_and_its_backward",
        reflection_pad2d_and_its_backward,
    ),
    (
        "group_norm_normalizes_each_group",
        group_norm_normalizes_each_group,
    ),
    (
        "index_tensor_selects_as_pytorch_does",
        index_tensor_selects_as_pytorch_does,
    ),
    (
        "index_put_accumulates_into_a_selection",
        index_put_accumulates_into_a_selection,
    ),
    ("creation_ops", creation_ops),
    (
        "bernoulli_draws_ones_with_probability_p_from_the_session_generator",
        bernoulli_draws_ones_with_probability_p_from_the_session_generator,
    ),
    (
        "bernoulli_needs_the_generator",
        bernoulli_needs_the_generator,
    ),
    (
        "assert_async_fails_the_iteration_with_its_message",
        assert_async_fails_the_iteration_with_its_message,
    ),
    (
        "rand_like_draws_uniforms_from_the_session_generator",
        rand_like_draws_uniforms_from_the_session_generator,
    ),
    ("batch_norm_and_its_backward", batch_norm_and_its_backward),
    (
        "batch_norm_refuses_evaluation_mode",
        batch_norm_refuses_evaluation_mode,
    ),
    (
        "fused_attention_and_its_backward",
        fused_attention_and_its_backward,
    ),
    (
        "fused_attention_refuses_dropout",
        fused_attention_refuses_dropout,
    ),
    (
        "efficient_attention_drops_probabilities_by_the_session_stream",
        efficient_attention_drops_probabilities_by_the_session_stream,
    ),
    (
        "efficient_attention_refuses_what_it_cannot_run",
        efficient_attention_refuses_what_it_cannot_run,
    ),
];

#[test]
fn every_op_is_tested() {
    let ran = record_ops(|| {
        for (_, test) in ALL_TESTS {
            test();
        }
    });
    let missing: Vec<&str> = Op::ALL
        .iter()
        .filter(|op| !ran.contains(op))
        .map(|op| op.name())
        .collect();
    assert!(
        missing.is_empty(),
        "ops no test runs on the CPU device: {missing:?}"
    );
    // The list above names every test of this file (but this one).
    let source = include_str!("ops.rs");
    let tests = source.matches("#[test]\nfn ").count();
    assert_eq!(
        tests,
        ALL_TESTS.len() + 1,
        "a test is missing from ALL_TESTS"
    );
}

// ---------------------------------------------------------------------------------------
// Rounding and ordering

#[test]
fn rounding_functions() {
    // Half-way cases (round: to even, as PyTorch's), signed zeros, and past 2^23 where
    // every f32 is an integer already.
    let sp = &[
        0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 0.0, -0.0, 1e10, -1e10, INF, -INF, NAN,
    ];
    let t = EXACT;
    unary(Op::Floor, &[], Fp32, Fp32, (-10.0, 10.0), sp, t, f64::floor);
    unary(Op::Ceil, &[], Fp32, Fp32, (-10.0, 10.0), sp, t, f64::ceil);
    unary(
        Op::Round,
        &[],
        Fp32,
        Fp32,
        (-10.0, 10.0),
        sp,
        t,
        f64::round_ties_even,
    );
    unary(Op::Trunc, &[], Fp32, Fp32, (-10.0, 10.0), sp, t, f64::trunc);
    unary(Op::Floor, &[], Bf16, Bf16, (-10.0, 10.0), sp, t, f64::floor);
    // Integers are their own rounding.
    let i = i64v(&[4], &[-3, 0, 7, 1 << 40]);
    for op in [Op::Floor, Op::Ceil, Op::Round, Op::Trunc] {
        let got = Case::new(op).input(i.clone()).output(I64, &[4]).run1();
        assert_close(&got, &i.data, EXACT, &format!("{op} of i64"));
    }
}

/// The position of the first largest (`largest`) or smallest element of each line of `x`
/// along `dim` (every dim: `None`), a NaN before every number.
fn arg_extreme_ref(x: &Value, dim: Option<usize>, largest: bool) -> Vec<f64> {
    let better = |v: f64, b: f64| {
        (v.is_nan() && !b.is_nan()) || (!b.is_nan() && if largest { v > b } else { v < b })
    };
    let lines: Vec<Vec<f64>> = match dim {
        None => vec![x.data.clone()],
        Some(d) => groups(x, &[d as i64]),
    };
    lines
        .iter()
        .map(|line| {
            let mut best = 0;
            for (j, &v) in line.iter().enumerate() {
                if better(v, line[best]) {
                    best = j;
                }
            }
            best as f64
        })
        .collect()
}

#[test]
fn argmax_and_argmin() {
    let mut rng = Rng::new(89);
    let shape = [4u64, 6, 5];
    let mut x = rng.f32s(&shape, -2.0, 2.0);
    // Ties (the first wins) and NaNs (the first NaN wins, for argmin too).
    x.data[3] = x.data[3 + 5 * 2];
    x.data[7] = NAN;
    x.data[7 + 5 * 3] = NAN;
    x.data[40] = 9.0;
    x.data[45] = 9.0;
    for op in [Op::Argmax, Op::Argmin] {
        let largest = op == Op::Argmax;
        for dim in [0i64, 1, -1] {
            let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
            for keepdim in [false, true] {
                let (_, out_shape) = reduced_shape(&shape, &[dim], keepdim);
                let got = Case::new(op)
                    .input(x.clone())
                    .int("dim", dim)
                    .flag("keepdim", keepdim)
                    .output(I64, &out_shape)
                    .run1();
                let want = arg_extreme_ref(&x, Some(d), largest);
                assert_close(
                    &got,
                    &want,
                    EXACT,
                    &format!("{op} dim {dim} keepdim {keepdim}"),
                );
            }
        }
        // No dim: the position in the flattened tensor.
        let got = Case::new(op).input(x.clone()).output(I64, &[]).run1();
        assert_close(
            &got,
            &arg_extreme_ref(&x, None, largest),
            EXACT,
            &format!("{op} of all"),
        );
        let got = Case::new(op)
            .input(x.clone())
            .flag("keepdim", true)
            .output(I64, &[1, 1, 1])
            .run1();
        assert_close(
            &got,
            &arg_extreme_ref(&x, None, largest),
            EXACT,
            &format!("{op} kept"),
        );
    }
    let i = i64v(&[5], &[4, -2, 7, 7, 1]);
    let got = Case::new(Op::Argmax)
        .input(i.clone())
        .int("dim", 0)
        .output(I64, &[])
        .run1();
    assert_close(&got, &[2.0], EXACT, "argmax of i64");
    // Over an empty dim there is no answer.
    let empty = f32v(&[2, 0], vec![]);
    let message = Case::new(Op::Argmax)
        .input(empty)
        .int("dim", 1)
        .output(I64, &[2])
        .fails();
    assert_mentions(&message, &["argmax", "empty"]);
}

/// The stable order of each line of `x` along `d`: (values, positions), NaNs last
/// ascending and first descending.
fn sort_ref(x: &Value, d: usize, descending: bool) -> (Vec<f64>, Vec<f64>) {
    let shape = &x.ty.shape;
    let (mut values, mut indices) = (vec![0.0; x.data.len()], vec![0.0; x.data.len()]);
    for i in 0..x.data.len() {
        let idx = unravel(i, shape);
        if idx[d] != 0 {
            continue;
        }
        let at = |j: usize| {
            let mut k = idx.clone();
            k[d] = j;
            ravel(&k, shape)
        };
        let n = shape[d] as usize;
        let value = |j: usize| x.data[at(j)];
        let nans = (0..n).filter(|&j| value(j).is_nan());
        let mut numbers: Vec<usize> = (0..n).filter(|&j| !value(j).is_nan()).collect();
        numbers.sort_by(|&a, &b| {
            let by_value = value(a).partial_cmp(&value(b)).unwrap();
            let by_value = if descending {
                by_value.reverse()
            } else {
                by_value
            };
            by_value.then(a.cmp(&b))
        });
        let order: Vec<usize> = if descending {
            nans.chain(numbers).collect()
        } else {
            numbers.into_iter().chain(nans).collect()
        };
        for (rank, &j) in order.iter().enumerate() {
            values[at(rank)] = x.data[at(j)];
            indices[at(rank)] = j as f64;
        }
    }
    (values, indices)
}

#[test]
fn stable_sort_along_each_dimension() {
    let mut rng = Rng::new(97);
    let shape = [3u64, 9, 4];
    let mut x = rng.f32s(&shape, -2.0, 2.0);
    // Repeated values, signed zeros (equal: they keep their order) and NaNs.
    for (i, v) in [
        (0, 0.5),
        (4, 0.5),
        (8, 0.5),
        (12, -0.0),
        (16, 0.0),
        (20, NAN),
        (5, NAN),
    ] {
        x.data[i] = v;
    }
    for dim in [0i64, 1, -1] {
        let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
        for descending in [false, true] {
            let got = Case::new(Op::Sort)
                .input(x.clone())
                .flag("stable", true)
                .int("dim", dim)
                .flag("descending", descending)
                .output(Fp32, &shape)
                .output(I64, &shape)
                .run();
            let (values, indices) = sort_ref(&x, d, descending);
            let what = format!("sort dim {dim} descending {descending}");
            assert_close(&got[0], &values, EXACT, &what);
            assert_close(&got[1], &indices, EXACT, &what);
            // Bit for bit: -0.0 stays where the sort put it.
            let signs = |v: &[f64]| v.iter().map(|x| x.is_sign_negative()).collect::<Vec<_>>();
            assert_eq!(signs(&got[0]), signs(&values), "{what}: signed zeros");
        }
    }
    // Only the indices (argsort), a 0-dim input, integers.
    let got = Case::new(Op::Sort)
        .input(x.clone())
        .unused()
        .output(I64, &shape)
        .run();
    assert_close(&got[1], &sort_ref(&x, 2, false).1, EXACT, "argsort");
    let got = Case::new(Op::Sort)
        .input(f32v(&[], vec![3.0]))
        .output(Fp32, &[])
        .output(I64, &[])
        .run();
    assert_close(&got[0], &[3.0], EXACT, "sort of a scalar");
    assert_close(&got[1], &[0.0], EXACT, "sort of a scalar");
    let got = Case::new(Op::Sort)
        .input(i64v(&[4], &[3, -1, 3, 2]))
        .flag("descending", true)
        .output(I64, &[4])
        .output(I64, &[4])
        .run();
    assert_close(&got[0], &[3.0, 3.0, 2.0, -1.0], EXACT, "sort of i64");
    assert_close(&got[1], &[0.0, 2.0, 3.0, 1.0], EXACT, "sort of i64");
}

#[test]
fn scatter_src_writes_each_source_element() {
    // max.dim's gradient: each line's gradient written at its argmax into zeros.
    let mut rng = Rng::new(101);
    let x = f32v(&[3, 4], vec![0.0; 12]);
    let index = i64v(&[3, 1], &[2, 0, 3]);
    let src = rng.f32s(&[3, 2], -1.0, 1.0);
    let got = Case::new(Op::ScatterSrc)
        .input(x.clone())
        .input(index.clone())
        .input(src.clone())
        .int("dim", 1)
        .output(Fp32, &[3, 4])
        .run1();
    let mut want = vec![0.0; 12];
    for (row, col) in [(0, 2), (1, 0), (2, 3)] {
        want[row * 4 + col] = src.data[row * 2];
    }
    assert_close(&got, &want, EXACT, "scatter.src");
    let bad = i64v(&[3, 1], &[2, 4, 3]);
    let message = Case::new(Op::ScatterSrc)
        .input(x)
        .input(bad)
        .input(src)
        .int("dim", 1)
        .output(Fp32, &[3, 4])
        .fails();
    assert_mentions(&message, &["index 4 is out of range", "size 4"]);
}

#[test]
fn atan2_of_every_quadrant() {
    // Angles in every quadrant, broadcast; the result float for integer inputs.
    let f32x3 = (Fp32, Fp32, Fp32);
    binary(Op::Atan2, &[], f32x3, (-3.0, 3.0), F32, f64::atan2);
    binary(
        Op::Atan2,
        &[],
        (I64, I64, Fp32),
        (-3.0, 3.0),
        F32,
        f64::atan2,
    );
    // Signed zeros and infinities: atan2's special values (C's, and PyTorch's).
    let y = f32v(&[8], vec![0.0, -0.0, 0.0, -0.0, 1.0, -1.0, INF, -INF]);
    let x = f32v(&[8], vec![0.0, 0.0, -0.0, -0.0, INF, -INF, INF, -INF]);
    let got = Case::new(Op::Atan2)
        .input(y.clone())
        .input(x.clone())
        .output(Fp32, &[8])
        .run1();
    let want: Vec<f64> = (0..8)
        .map(|i| round_to(Fp32, y.data[i].atan2(x.data[i])))
        .collect();
    assert_close(&got, &want, EXACT, "atan2 special values");
    let signs = |v: &[f64]| v.iter().map(|x| x.is_sign_negative()).collect::<Vec<_>>();
    assert_eq!(signs(&got), signs(&want), "atan2 keeps the zeros' signs");
}

#[test]
fn cumprod_along_each_dimension() {
    // Factors near 1 (a volume renderer's transmittances), zeros and a sign change.
    let mut rng = Rng::new(103);
    let shape = [3u64, 5, 4];
    let mut x = rng.f32s(&shape, 0.5, 1.5);
    x.data[7] = 0.0;
    x.data[12] = -2.0;
    for dim in [0i64, 1, -1] {
        let d = (if dim < 0 { dim + 3 } else { dim }) as usize;
        let got = Case::new(Op::Cumprod)
            .input(x.clone())
            .int("dim", dim)
            .output(Fp32, &shape)
            .run1();
        // The products in f64 are exact to far below f32's rounding; the device rounds
        // each prefix once to f32 (half an epsilon of it) after accumulating in f64.
        let (mut want, mut bound) = (vec![0.0; x.data.len()], vec![0.0; x.data.len()]);
        for i in 0..x.data.len() {
            let mut idx = unravel(i, &shape);
            let upto = idx[d];
            let mut product = 1.0;
            for j in 0..=upto {
                idx[d] = j;
                product *= x.data[ravel(&idx, &shape)];
            }
            want[i] = product;
            bound[i] = EPS32 / 2.0 * product.abs();
        }
        assert_within(&got, &want, &bound, &format!("cumprod dim {dim}"));
    }
    // Integers multiply exactly into i64 (PyTorch's default).
    let i = i64v(&[2, 3], &[1, -2, 3, 4, 5, 6]);
    let got = Case::new(Op::Cumprod)
        .input(i)
        .int("dim", 1)
        .output(I64, &[2, 3])
        .run1();
    assert_close(
        &got,
        &[1.0, -2.0, -6.0, 4.0, 20.0, 120.0],
        EXACT,
        "cumprod i64",
    );
}

#[test]
fn gamma_functions_meet_known_values() {
    use std::f64::consts::{LN_2, PI};
    let euler = 0.577_215_664_901_532_9;
    let zeta3 = 1.202_056_903_159_594_3;
    let x = f32v(&[8], vec![1.0, 2.0, 0.5, 10.0, -0.5, 100.0, 0.0, -3.0]);
    let squares: f64 = (1..10).map(|k| 1.0 / (k * k) as f64).sum();
    let cubes: f64 = (1..10).map(|k| 1.0 / (k * k * k) as f64).sum();
    let psi_half = -euler - 2.0 * LN_2;
    // ln Γ(1/2) = ln √π, ln Γ(10) = ln 9!, ln Γ(-1/2) = ln 2√π, ln Γ(100) = ln 99!.
    let log_factorial = |n: u32| (1..=n).map(|k| (k as f64).ln()).sum::<f64>();
    // At 0 and the negative integers: poles (ψ(+0) = -∞; NaN for ψ, whose sign there
    // depends on the side; ψ⁽ⁿ⁾ as (-1)^(n+1) n! ζ(n + 1, x) with ζ infinite).
    let cases: [(Op, Option<i64>, [f64; 8]); 4] = [
        (
            Op::Lgamma,
            None,
            [
                0.0,
                0.0,
                PI.sqrt().ln(),
                log_factorial(9),
                (2.0 * PI.sqrt()).ln(),
                log_factorial(99),
                INF,
                INF,
            ],
        ),
        (
            Op::Digamma,
            None,
            [
                -euler,
                1.0 - euler,
                psi_half,
                -euler + (1..10).map(|k| 1.0 / k as f64).sum::<f64>(),
                psi_half + 2.0,
                4.600_161_852_738_087,
                -INF,
                NAN,
            ],
        ),
        (
            Op::Polygamma,
            Some(1),
            [
                PI * PI / 6.0,
                PI * PI / 6.0 - 1.0,
                PI * PI / 2.0,
                PI * PI / 6.0 - squares,
                PI * PI / 2.0 + 4.0,
                0.010_050_166_663_333_571,
                INF,
                INF,
            ],
        ),
        (
            Op::Polygamma,
            Some(2),
            [
                -2.0 * zeta3,
                -2.0 * zeta3 + 2.0,
                -14.0 * zeta3,
                -2.0 * (zeta3 - cubes),
                -14.0 * zeta3 + 16.0,
                // The asymptotic series at 100.
                -(1e-4 + 1e-6 + 0.5e-8 - 1e-12 / 6.0),
                -INF,
                -INF,
            ],
        ),
    ];
    for (op, n, want) in cases {
        let mut case = Case::new(op).input(x.clone()).output(Fp32, &[8]);
        if let Some(n) = n {
            case = case.int("n", n);
        }
        let got = case.run1();
        assert_close(&got, &want, tol(3e-7, 0.0), &format!("{} {n:?}", op.name()));
    }
}

#[test]
fn erfc_and_erfinv_meet_their_references() {
    // erfc from the reference erf where 1 - erf keeps the digits, a known tail value
    // (erfc(5)), and erf⁻¹ as the reference erf's inverse, by bisection; ±∞ at ±1, NaN
    // past them.
    let x = f32v(&[7], vec![-2.0, -0.5, 0.0, 0.25, 1.0, 2.0, 5.0]);
    let mut want: Vec<f64> = x.data.iter().map(|&v| 1.0 - erf_ref(v)).collect();
    want[6] = 1.537_459_794_428_035e-12;
    let got = Case::new(Op::Erfc).input(x).output(Fp32, &[7]).run1();
    assert_close(&got, &want, tol(2e-7, 0.0), "erfc");
    let inverse = |p: f64| {
        let (mut lo, mut hi) = (-7.0, 7.0);
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if erf_ref(mid) < p { lo = mid } else { hi = mid }
        }
        0.5 * (lo + hi)
    };
    let p = f32v(&[8], vec![-0.75, -0.5, 0.0, 0.125, 0.9375, 1.0, -1.0, 1.5]);
    let mut want: Vec<f64> = p.data[..5].iter().map(|&v| inverse(v)).collect();
    want[2] = 0.0; // the bisection's midpoint, not exactly 0
    want.extend([INF, -INF, NAN]);
    let got = Case::new(Op::Erfinv).input(p).output(Fp32, &[8]).run1();
    assert_close(&got, &want, tol(2e-7, 0.0), "erfinv");
    assert!(got[7].is_nan());
}

#[test]
fn pow_of_two_tensors_is_cs_pow() {
    // Positive bases and exponents, broadcast.
    binary(
        Op::PowTensorTensor,
        &[],
        (Fp32, Fp32, Fp32),
        (0.1, 3.0),
        F32,
        f64::powf,
    );
    // C's special values: 0 ^ 0 and NaN ^ 0 are 1, 1 ^ NaN is 1, 0 to a negative power is
    // infinite, a negative base takes an integer power and gives NaN for any other.
    let a = f32v(&[8], vec![0.0, 0.0, -2.0, -2.0, 2.0, NAN, 1.0, INF]);
    let b = f32v(&[8], vec![0.0, -1.0, 3.0, 0.5, -2.0, 0.0, NAN, -1.0]);
    let got = Case::new(Op::PowTensorTensor)
        .input(a.clone())
        .input(b.clone())
        .output(Fp32, &[8])
        .run1();
    let want = [1.0, INF, -8.0, NAN, 0.25, 1.0, 1.0, 0.0];
    assert_close(&got, &want, EXACT, "pow.Tensor_Tensor");
    assert!(got[3].is_nan());
    // Integers are refused: PyTorch raises for a negative integer power.
    let ints = i64v(&[2], &[2, 3]);
    let err = Case::new(Op::PowTensorTensor)
        .input(ints.clone())
        .input(ints)
        .output(I64, &[2])
        .fails();
    assert_mentions(&err, &["pow.Tensor_Tensor", "floating-point"]);
}

#[test]
fn remainder_and_fmod_take_the_divisors_or_the_dividends_sign() {
    // Random floats of either sign, broadcast, in f32 and f16.
    let remainder = |a: f64, b: f64| {
        let m = a % b;
        if m != 0.0 && (b < 0.0) != (m < 0.0) {
            m + b
        } else {
            m
        }
    };
    let f32x3 = (Fp32, Fp32, Fp32);
    binary(Op::RemainderTensor, &[], f32x3, (-3.0, 3.0), F32, remainder);
    binary(Op::FmodTensor, &[], f32x3, (-3.0, 3.0), F32, |a, b| a % b);
    // Half precision: computed in f32 and rounded once to f16 (the reference rounds its
    // f64 result to f16, a tie apart from twice-rounded).
    let f16x3 = (F16, F16, F16);
    binary(
        Op::RemainderTensor,
        &[],
        f16x3,
        (-3.0, 3.0),
        tol(1e-3, 1e-4),
        remainder,
    );
    // Special values, each result PyTorch 2.15's: zeros keep the dividend's sign, an
    // infinite divisor leaves the dividend (remainder: adds it when the signs differ), an
    // infinite dividend, a zero divisor or a NaN give NaN; 1 % 0.1 is exact in f32.
    let a = f32v(
        &[14],
        vec![
            5.5, -5.5, 5.5, -5.5, 0.0, -0.0, 1.0, -1.0, INF, 3.0, NAN, 3.0, 1.0, 0.75,
        ],
    );
    let b = f32v(
        &[14],
        vec![
            2.0, 2.0, -2.0, -2.0, 3.0, 3.0, INF, INF, 2.0, 0.0, 2.0, NAN, 0.1, -0.25,
        ],
    );
    let tenth = 0.09999998658895493;
    let cases = [
        (
            Op::RemainderTensor,
            [
                1.5, 0.5, -0.5, -1.5, 0.0, -0.0, 1.0, INF, NAN, NAN, NAN, NAN, tenth, 0.0,
            ],
        ),
        (
            Op::FmodTensor,
            [
                1.5, -1.5, 1.5, -1.5, 0.0, -0.0, 1.0, -1.0, NAN, NAN, NAN, NAN, tenth, 0.0,
            ],
        ),
    ];
    for (op, want) in cases {
        let got = Case::new(op)
            .input(a.clone())
            .input(b.clone())
            .output(Fp32, &[14])
            .run1();
        assert_close(&got, &want, EXACT, op.name());
        let signs = |v: &[f64]| v.iter().map(|x| x.is_sign_negative()).collect::<Vec<_>>();
        let finite = |v: &[f64]| v.iter().map(|x| x.is_nan()).collect::<Vec<_>>();
        assert_eq!(finite(&got), finite(&want), "{}: NaNs", op.name());
        assert_eq!(signs(&got[..8]), signs(&want[..8]), "{}: signs", op.name());
    }
    // Integers (the hashing trick's `ids % buckets`): exact, the sign of the divisor for
    // remainder and of the dividend for fmod.
    let a = i64v(&[8], &[7, -7, 7, -7, 0, 12, -1, 5]);
    let b = i64v(&[8], &[3, 3, -3, -3, 5, 4, 1000, 1]);
    for (op, want) in [
        (
            Op::RemainderTensor,
            [1.0, 2.0, -2.0, -1.0, 0.0, 0.0, 999.0, 0.0],
        ),
        (Op::FmodTensor, [1.0, -1.0, 1.0, -1.0, 0.0, 0.0, -1.0, 0.0]),
    ] {
        let got = Case::new(op)
            .input(a.clone())
            .input(b.clone())
            .output(I64, &[8])
            .run1();
        assert_eq!(got, want, "{}", op.name());
    }
}
