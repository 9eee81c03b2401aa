//! Padding for every dtype: `constant_pad_nd` (any dimensions, negative amounts crop) and
//! `reflection_pad2d` with its backward over the last two dimensions. Copies move elements
//! bit for bit; the backward adds in `f64`, each result rounded once.

use salus_graph::Scalar;

use super::{Arg, Out, Result, contiguous_strides, load, numel, store, tensor};

/// `constant_pad_nd`: output element `c` is input element `c - before` where that lies
/// inside the input, else `value`.
pub(super) fn constant(
    before: &[i64],
    value: Scalar,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    if ty.dtype != o.ty.dtype || ty.rank() != o.ty.rank() || before.len() != ty.rank() {
        return Err(format!("output {} does not pad input {ty}", o.ty));
    }
    let size = ty.dtype.size() as usize;
    let in_strides = contiguous_strides(&ty.shape);
    let out_shape = &o.ty.shape;
    let value = value.as_f64();
    let mut coord = vec![0u64; out_shape.len()];
    for i in 0..numel(out_shape) {
        let mut rest = i as u64;
        for d in (0..out_shape.len()).rev() {
            coord[d] = rest % out_shape[d];
            rest /= out_shape[d];
        }
        let mut src = Some(0usize);
        for d in 0..coord.len() {
            let c = coord[d] as i64 - before[d];
            if c < 0 || c >= ty.shape[d] as i64 {
                src = None;
                break;
            }
            src = src.map(|s| s + c as usize * in_strides[d]);
        }
        match src {
            Some(s) => {
                o.bytes[i * size..(i + 1) * size].copy_from_slice(&bytes[s * size..(s + 1) * size])
            }
            None => store(o.bytes, o.ty.dtype, i, value),
        }
    }
    Ok(())
}

/// The input position output position `j` reflects, along a dimension of `n` elements
/// padded by `before` (`before < n`, as validation checked).
fn reflect(j: u64, before: u64, n: u64) -> u64 {
    let i = j as i64 - before as i64;
    let last = n as i64 - 1;
    let r = if i < 0 {
        -i
    } else if i > last {
        2 * last - i
    } else {
        i
    };
    r as u64
}

/// The padded geometry of `reflection_pad2d`: planes, input (h, w), output (oh, ow) and
/// the (left, top) padding.
pub(super) struct Reflection {
    pub planes: usize,
    pub input: [u64; 2],
    pub output: [u64; 2],
    pub left: u64,
    pub top: u64,
}

/// `reflection_pad2d`: each plane's element (y, x) of the output is the input's at the
/// reflected position.
pub(super) fn reflection(g: &Reflection, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let [h, w] = g.input;
    let [oh, ow] = g.output;
    if ty.dtype != o.ty.dtype
        || numel(&ty.shape) != g.planes * (h * w) as usize
        || numel(&o.ty.shape) != g.planes * (oh * ow) as usize
    {
        return Err(format!("output {} does not pad input {ty}", o.ty));
    }
    let size = ty.dtype.size() as usize;
    let columns: Vec<u64> = (0..ow).map(|x| reflect(x, g.left, w)).collect();
    for p in 0..g.planes {
        for y in 0..oh {
            let row = (p as u64 * h + reflect(y, g.top, h)) * w;
            for (x, &c) in columns.iter().enumerate() {
                let (dst, src) = (((p as u64 * oh + y) * ow) as usize + x, (row + c) as usize);
                o.bytes[dst * size..(dst + 1) * size]
                    .copy_from_slice(&bytes[src * size..(src + 1) * size]);
            }
        }
    }
    Ok(())
}

/// `reflection_pad2d_backward(grad_output, self)`: each input element's gradient is the
/// sum of the output gradients at the positions that reflect it.
pub(super) fn reflection_backward(g: &Reflection, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (gty, grad) = tensor(args, 0)?;
    let [h, w] = g.input;
    let [oh, ow] = g.output;
    if numel(&gty.shape) != g.planes * (oh * ow) as usize
        || numel(&o.ty.shape) != g.planes * (h * w) as usize
    {
        return Err(format!(
            "grad_output {gty} and grad_input {} do not fit the padding",
            o.ty
        ));
    }
    let mut acc = vec![0.0; numel(&o.ty.shape)];
    for p in 0..g.planes {
        for y in 0..oh {
            let row = (p as u64 * h + reflect(y, g.top, h)) * w;
            for x in 0..ow {
                let at = (row + reflect(x, g.left, w)) as usize;
                acc[at] += load(grad, gty.dtype, ((p as u64 * oh + y) * ow + x) as usize);
            }
        }
    }
    for (i, v) in acc.into_iter().enumerate() {
        store(o.bytes, o.ty.dtype, i, v);
    }
    Ok(())
}
