//! Backward kernels of softmax, log-softmax and layer norm.

use salus_graph::{Node, Op};

use super::{Arg, Out, Result, attr_int, attr_ints, load, numel, store, tensor, wrap};

/// `_softmax_backward_data` and `_log_softmax_backward_data` along `dim`:
/// softmax: `grad_input = output * (grad - sum(grad * output))`;
/// log-softmax: `grad_input = grad - exp(output) * sum(grad)`.
pub(super) fn softmax_backward(node: &Node, args: &[Arg<'_>], o: &mut Out<'_>) -> Result<()> {
    let (gty, g) = tensor(args, 0)?;
    let (yty, y) = tensor(args, 1)?;
    if gty.shape != yty.shape || o.ty.shape != gty.shape {
        return Err(format!(
            "grad_output {gty}, output {yty} and grad_input {} must have one shape",
            o.ty
        ));
    }
    let d = wrap(attr_int(node, "dim", -1), gty.rank());
    let len = gty.shape.get(d).copied().unwrap_or(1) as usize;
    let inner: usize = gty
        .shape
        .get(d + 1..)
        .unwrap_or(&[])
        .iter()
        .product::<u64>() as usize;
    let outer = numel(&gty.shape) / (len * inner).max(1);
    let log = node.op == Op::LogSoftmaxBackwardData;
    for a in 0..outer {
        for b in 0..inner {
            let idx = |j: usize| (a * len + j) * inner + b;
            let sum: f64 = (0..len)
                .map(|j| {
                    let gv = load(g, gty.dtype, idx(j));
                    if log {
                        gv
                    } else {
                        gv * load(y, yty.dtype, idx(j))
                    }
                })
                .sum();
            for j in 0..len {
                let (gv, yv) = (load(g, gty.dtype, idx(j)), load(y, yty.dtype, idx(j)));
                let v = if log {
                    gv - yv.exp() * sum
                } else {
                    yv * (gv - sum)
                };
                store(o.bytes, o.ty.dtype, idx(j), v);
            }
        }
    }
    Ok(())
}

/// `native_layer_norm_backward(grad_out, input, mean, rstd, weight?, bias?)`: with
/// `xhat = (x - mean) * rstd` and `dy' = grad_out * weight`, over each normalized row,
/// `grad_input = rstd * (dy' - mean(dy') - xhat * mean(dy' * xhat))`,
/// `grad_weight = sum over rows of grad_out * xhat`, `grad_bias = sum of grad_out`.
/// Computes whichever outputs are used.
pub(super) fn layer_norm_backward(
    node: &Node,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (gty, g) = tensor(args, 0)?;
    let (xty, x) = tensor(args, 1)?;
    let (mty, mean) = tensor(args, 2)?;
    let (rty, rstd) = tensor(args, 3)?;
    let normalized =
        attr_ints(node, "normalized_shape").ok_or("attribute \"normalized_shape\" is missing")?;
    let inner = normalized.iter().product::<i64>().max(0) as usize;
    let total = numel(&xty.shape);
    let outer = total.checked_div(inner).unwrap_or(0);
    if numel(&gty.shape) != total || numel(&mty.shape) != outer || numel(&rty.shape) != outer {
        return Err(format!(
            "grad_out {gty}, mean {mty} and rstd {rty} do not fit input {xty} normalized over {normalized:?}"
        ));
    }
    let weight = match args.get(4) {
        Some(Arg::Tensor(wty, wb)) if numel(&wty.shape) == inner => Some((*wty, *wb)),
        Some(Arg::Tensor(wty, _)) => {
            return Err(format!("weight {wty} must have {inner} elements"));
        }
        _ => None,
    };
    let mut grad_input = vec![0.0; total];
    let mut grad_weight = vec![0.0; inner];
    let mut grad_bias = vec![0.0; inner];
    let mut xhat = vec![0.0; inner];
    let mut dyw = vec![0.0; inner];
    for a in 0..outer {
        let (m, r) = (load(mean, mty.dtype, a), load(rstd, rty.dtype, a));
        for j in 0..inner {
            let i = a * inner + j;
            let dy = load(g, gty.dtype, i);
            xhat[j] = (load(x, xty.dtype, i) - m) * r;
            dyw[j] = dy * weight.map_or(1.0, |(wty, wb)| load(wb, wty.dtype, j));
            grad_weight[j] += dy * xhat[j];
            grad_bias[j] += dy;
        }
        let mean_dyw = dyw.iter().sum::<f64>() / inner as f64;
        let mean_dyw_xhat = dyw.iter().zip(&xhat).map(|(d, h)| d * h).sum::<f64>() / inner as f64;
        for j in 0..inner {
            grad_input[a * inner + j] = r * (dyw[j] - mean_dyw - xhat[j] * mean_dyw_xhat);
        }
    }
    for (k, data) in [grad_input, grad_weight, grad_bias].into_iter().enumerate() {
        if let Some(Some(out)) = outs.get_mut(k) {
            if numel(&out.ty.shape) != data.len() {
                return Err(format!(
                    "output {k} {} must have {} elements",
                    out.ty,
                    data.len()
                ));
            }
            for (i, v) in data.into_iter().enumerate() {
                store(out.bytes, out.ty.dtype, i, v);
            }
        }
    }
    Ok(())
}
