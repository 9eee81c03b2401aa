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
        Op::Erf,
        &[],
        Fp32,
        Fp32,
        (-4.0, 4.0),
        &[NAN, 0.0, 9.0, -9.0],
        t,
        erf_ref,
    );
    let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
    unary(Op::Sigmoid, &[], Fp32, Fp32, (-8.0, 8.0), sp, t, sigmoid);
    unary(Op::Tanh, &[], Fp32, Fp32, (-4.0, 4.0), sp, t, f64::tanh);
    let relu = |x: f64| {
        if x > 0.0 {
            x
        } else if x.is_nan() {
            x
        } else {
            0.0
        }
    };
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
    let cmp: [(Op, fn(f64, f64) -> bool); 6] = [
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
    let cases: &[(&[u64], &[u64], &[u64], &[u64])] = &[
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
