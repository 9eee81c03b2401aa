//! Elementwise ops in `f64` for every dtype: one engine that walks broadcast inputs
//! ([`elementwise`]) and the exact error function the `erf` and `gelu` kernels need.
//! `run` in the parent module picks each op's formula; the typed f32 kernels of
//! `fast` run the common f32 cases before this.

use salus_graph::DType;

use super::{
    Arg, Out, Result, as_f32, as_f32_mut, broadcast_strides, contiguous_strides, for_each_index,
    load, store,
};

/// An elementwise op over broadcast inputs: `f(values) -> value`, written to output 0.
pub(super) fn elementwise(
    args: &[Arg<'_>],
    out: &mut Out<'_>,
    f: impl Fn(&[f64]) -> f64,
) -> Result<()> {
    let out_ty = out.ty;
    let mut strides = Vec::with_capacity(args.len());
    let mut sources: Vec<Option<(&[u8], DType)>> = Vec::with_capacity(args.len());
    for arg in args {
        match arg {
            Arg::Tensor(ty, bytes) => {
                strides.push(broadcast_strides(&ty.shape, &out_ty.shape));
                sources.push(Some((bytes, ty.dtype)));
            }
            Arg::InOutput(ty) => {
                if ty.shape != out_ty.shape {
                    return Err("in-place input must have the output's shape".into());
                }
                strides.push(contiguous_strides(&out_ty.shape));
                sources.push(None);
            }
            Arg::Absent => return Err("elementwise op with an absent input".into()),
        }
    }
    let in_place_dtype = args.iter().find_map(|a| match a {
        Arg::InOutput(ty) => Some(ty.dtype),
        _ => None,
    });
    let mut values = vec![0.0; args.len()];
    let typed: Option<Vec<Option<&[f32]>>> = sources
        .iter()
        .map(|s| match s {
            Some((b, dtype)) => as_f32(b, *dtype).map(Some),
            None => (in_place_dtype == Some(DType::F32)).then_some(None),
        })
        .collect();
    let contiguous = args.iter().all(|a| match a {
        Arg::Tensor(ty, _) => ty.shape == out_ty.shape,
        _ => true,
    });
    if let (Some(typed), Some(dst), true) = (
        typed.as_ref(),
        as_f32_mut(out.bytes, out_ty.dtype),
        contiguous,
    ) {
        // f32, no broadcasting: one pass over the elements.
        for i in 0..dst.len() {
            for (k, source) in typed.iter().enumerate() {
                values[k] = f64::from(match source {
                    Some(src) => src[i],
                    None => dst[i],
                });
            }
            dst[i] = f(&values) as f32;
        }
        return Ok(());
    }
    if let (Some(typed), Some(dst)) = (typed, as_f32_mut(out.bytes, out_ty.dtype)) {
        // f32 throughout: typed loads and stores, same arithmetic.
        for_each_index(&out_ty.shape, &strides, |i, offsets| {
            for (k, source) in typed.iter().enumerate() {
                values[k] = f64::from(match source {
                    Some(src) => src[offsets[k]],
                    None => dst[i],
                });
            }
            dst[i] = f(&values) as f32;
        });
        return Ok(());
    }
    let bytes = &mut *out.bytes;
    for_each_index(&out_ty.shape, &strides, |i, offsets| {
        for (k, source) in sources.iter().enumerate() {
            values[k] = match source {
                Some((b, dtype)) => load(b, *dtype, offsets[k]),
                None => load(bytes, in_place_dtype.unwrap_or(out_ty.dtype), i),
            };
        }
        store(bytes, out_ty.dtype, i, f(&values));
    });
    Ok(())
}

/// Abramowitz and Stegun 7.1.26 is not exact enough for parity; this uses the
/// series/continued-fraction pair with double precision.
pub(super) fn erf(x: f64) -> f64 {
    if x.abs() < 2.5 {
        // Maclaurin series: converges quickly for |x| < 2.5.
        let mut sum = x;
        let mut term = x;
        let x2 = x * x;
        for n in 1..200 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // Continued fraction for erfc.
        let ax = x.abs();
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (ax + f);
        }
        let erfc = (-ax * ax).exp() / std::f64::consts::PI.sqrt() / (ax + f);
        (1.0 - erfc).copysign(x)
    }
}
