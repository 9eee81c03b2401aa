//! Layer norm, forward and backward, group norm, and the backwards of softmax and
//! log-softmax.

use super::{Arg, Out, Result, load, numel, store, store_results, tensor};

/// `_softmax_backward_data` and (`log`) `_log_softmax_backward_data` along `d`:
/// softmax: `grad_input = output * (grad - sum(grad * output))`;
/// log-softmax: `grad_input = grad - exp(output) * sum(grad)`.
pub(super) fn softmax_backward(
    d: usize,
    log: bool,
    args: &[Arg<'_>],
    o: &mut Out<'_>,
) -> Result<()> {
    let (gty, g) = tensor(args, 0)?;
    let (yty, y) = tensor(args, 1)?;
    if gty.shape != yty.shape || o.ty.shape != gty.shape {
        return Err(format!(
            "grad_output {gty}, output {yty} and grad_input {} must have one shape",
            o.ty
        ));
    }
    let len = gty.shape.get(d).copied().unwrap_or(1) as usize;
    let inner: usize = gty
        .shape
        .get(d + 1..)
        .unwrap_or(&[])
        .iter()
        .product::<u64>() as usize;
    let outer = numel(&gty.shape) / (len * inner).max(1);
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
    normalized: &[u64],
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (gty, g) = tensor(args, 0)?;
    let (xty, x) = tensor(args, 1)?;
    let (mty, mean) = tensor(args, 2)?;
    let (rty, rstd) = tensor(args, 3)?;
    let inner = numel(normalized);
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
    store_results(vec![grad_input, grad_weight, grad_bias], outs)
}

/// `native_layer_norm(input, weight?, bias?)` over the last dimensions `normalized`:
/// (output, mean, rstd), whichever are used.
pub(super) fn layer_norm(
    normalized: &[u64],
    eps: f64,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let inner = numel(normalized);
    let outer = numel(&ty.shape) / inner.max(1);
    let param = |k: usize| match args.get(k) {
        Some(Arg::Tensor(pty, pb)) => Some((*pty, *pb)),
        _ => None,
    };
    let (weight, bias) = (param(1), param(2));
    let mut y = vec![0.0; numel(&ty.shape)];
    let mut means = vec![0.0; outer];
    let mut rstds = vec![0.0; outer];
    for a in 0..outer {
        let row: Vec<f64> = (0..inner)
            .map(|j| load(bytes, ty.dtype, a * inner + j))
            .collect();
        let mean = row.iter().sum::<f64>() / inner as f64;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / inner as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for (j, x) in row.iter().enumerate() {
            let mut v = (x - mean) * rstd;
            if let Some((wty, wb)) = weight {
                v *= load(wb, wty.dtype, j);
            }
            if let Some((bty, bb)) = bias {
                v += load(bb, bty.dtype, j);
            }
            y[a * inner + j] = v;
        }
        means[a] = mean;
        rstds[a] = rstd;
    }
    store_results(vec![y, means, rstds], outs)
}

/// The geometry of `native_group_norm`: `batch` images of `channels` channels of `inner`
/// elements, the channels in `groups` groups.
pub(super) struct GroupNorm {
    pub batch: usize,
    pub channels: usize,
    pub inner: usize,
    pub groups: usize,
    pub eps: f64,
}

/// `native_group_norm(input, weight?, bias?)`: (output, mean, rstd), whichever are used.
/// Each (image, group) is normalised over its contiguous `channels / groups * inner`
/// elements (biased variance); weight and bias scale and shift each channel.
pub(super) fn group_norm(
    g: &GroupNorm,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (ty, bytes) = tensor(args, 0)?;
    let per_group = g.channels / g.groups.max(1);
    let count = per_group * g.inner;
    if numel(&ty.shape) != g.batch * g.channels * g.inner {
        return Err(format!(
            "input {ty} must hold {} x {} x {} elements",
            g.batch, g.channels, g.inner
        ));
    }
    let param = |k: usize| match args.get(k) {
        Some(Arg::Tensor(pty, pb)) => Some((*pty, *pb)),
        _ => None,
    };
    let (weight, bias) = (param(1), param(2));
    let mut y = vec![0.0; numel(&ty.shape)];
    let rows = g.batch * g.groups;
    let mut means = vec![0.0; rows];
    let mut rstds = vec![0.0; rows];
    for r in 0..rows {
        let base = r * count;
        let row: Vec<f64> = (0..count)
            .map(|j| load(bytes, ty.dtype, base + j))
            .collect();
        let mean = row.iter().sum::<f64>() / count as f64;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / count as f64;
        let rstd = 1.0 / (var + g.eps).sqrt();
        for (j, x) in row.iter().enumerate() {
            let c = (r % g.groups) * per_group + j / g.inner.max(1);
            let mut v = (x - mean) * rstd;
            if let Some((wty, wb)) = weight {
                v *= load(wb, wty.dtype, c);
            }
            if let Some((bty, bb)) = bias {
                v += load(bb, bty.dtype, c);
            }
            y[base + j] = v;
        }
        means[r] = mean;
        rstds[r] = rstd;
    }
    store_results(vec![y, means, rstds], outs)
}

/// The geometry of batch norm: `batch` images of `channels` channels of `inner` elements;
/// each channel is normalised over its `batch * inner` elements.
pub(super) struct BatchNorm {
    pub batch: usize,
    pub channels: usize,
    pub inner: usize,
    pub momentum: f64,
    pub eps: f64,
}

impl BatchNorm {
    /// Elements each channel is normalised over.
    fn count(&self) -> usize {
        self.batch * self.inner
    }

    /// Indices of channel `c`'s elements, image by image.
    fn channel(&self, c: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.batch).flat_map(move |n| {
            let base = (n * self.channels + c) * self.inner;
            base..base + self.inner
        })
    }

    fn check(&self, what: &str, ty: &salus_graph::TensorType) -> Result<()> {
        if numel(&ty.shape) != self.batch * self.channels * self.inner {
            return Err(format!(
                "{what} {ty} must hold {} x {} x {} elements",
                self.batch, self.channels, self.inner
            ));
        }
        Ok(())
    }
}

/// A per-channel tensor argument (`None` when absent), checked to hold `channels` values.
fn per_channel<'a>(
    args: &'a [Arg<'a>],
    k: usize,
    what: &str,
    channels: usize,
) -> Result<Option<(&'a salus_graph::TensorType, &'a [u8])>> {
    match args.get(k) {
        Some(Arg::Tensor(ty, bytes)) if numel(&ty.shape) == channels => Ok(Some((ty, bytes))),
        Some(Arg::Tensor(ty, _)) => Err(format!("{what} {ty} must have {channels} elements")),
        _ => Ok(None),
    }
}

/// `_native_batch_norm_legit_functional(input, weight?, bias?, running_mean, running_var)`
/// in training: per channel, `mean` and the biased `var` over its elements, `rstd =
/// 1/sqrt(var + eps)`, `out = (x - mean) * rstd * weight + bias`; the running statistics
/// move by `momentum` towards `mean` and the unbiased variance (`var * n / (n - 1)`).
/// Results (out, save_mean, save_rstd, running_mean', running_var'), whichever are used.
pub(super) fn batch_norm(
    g: &BatchNorm,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (ty, x) = tensor(args, 0)?;
    g.check("input", ty)?;
    let weight = per_channel(args, 1, "weight", g.channels)?;
    let bias = per_channel(args, 2, "bias", g.channels)?;
    let (rm, rmb) =
        per_channel(args, 3, "running_mean", g.channels)?.ok_or("running_mean must be a tensor")?;
    let (rv, rvb) =
        per_channel(args, 4, "running_var", g.channels)?.ok_or("running_var must be a tensor")?;
    let n = g.count() as f64;
    let mut y = vec![0.0; numel(&ty.shape)];
    let (mut means, mut rstds) = (Vec::new(), Vec::new());
    let (mut running_mean, mut running_var) = (Vec::new(), Vec::new());
    for c in 0..g.channels {
        let mean = g.channel(c).map(|i| load(x, ty.dtype, i)).sum::<f64>() / n;
        let var = g
            .channel(c)
            .map(|i| (load(x, ty.dtype, i) - mean).powi(2))
            .sum::<f64>()
            / n;
        let rstd = 1.0 / (var + g.eps).sqrt();
        let scale = weight.map_or(1.0, |(wty, wb)| load(wb, wty.dtype, c));
        let shift = bias.map_or(0.0, |(bty, bb)| load(bb, bty.dtype, c));
        for i in g.channel(c) {
            y[i] = (load(x, ty.dtype, i) - mean) * rstd * scale + shift;
        }
        means.push(mean);
        rstds.push(rstd);
        running_mean.push((1.0 - g.momentum) * load(rmb, rm.dtype, c) + g.momentum * mean);
        running_var
            .push((1.0 - g.momentum) * load(rvb, rv.dtype, c) + g.momentum * var * n / (n - 1.0));
    }
    store_results(vec![y, means, rstds, running_mean, running_var], outs)
}

/// `native_batch_norm_backward(grad_out, input, weight?, running_mean?, running_var?,
/// save_mean, save_invstd)` in training: per channel, with `n` elements, `sum_dy = Σ dy`
/// and `dot = Σ dy * (x - mean)`, `grad_input = (dy - sum_dy / n - (x - mean) * rstd² *
/// dot / n) * rstd * weight`, `grad_weight = dot * rstd`, `grad_bias = sum_dy`;
/// whichever are used.
pub(super) fn batch_norm_backward(
    g: &BatchNorm,
    args: &[Arg<'_>],
    outs: &mut [Option<Out<'_>>],
) -> Result<()> {
    let (gty, dy) = tensor(args, 0)?;
    let (xty, x) = tensor(args, 1)?;
    g.check("grad_out", gty)?;
    g.check("input", xty)?;
    let weight = per_channel(args, 2, "weight", g.channels)?;
    let (mty, mb) =
        per_channel(args, 5, "save_mean", g.channels)?.ok_or("save_mean must be a tensor")?;
    let (rty, rb) =
        per_channel(args, 6, "save_invstd", g.channels)?.ok_or("save_invstd must be a tensor")?;
    let n = g.count() as f64;
    let mut dx = vec![0.0; numel(&xty.shape)];
    let mut dw = vec![0.0; g.channels];
    let mut db = vec![0.0; g.channels];
    for c in 0..g.channels {
        let (mean, rstd) = (load(mb, mty.dtype, c), load(rb, rty.dtype, c));
        let (mut sum_dy, mut dot) = (0.0, 0.0);
        for i in g.channel(c) {
            let d = load(dy, gty.dtype, i);
            sum_dy += d;
            dot += d * (load(x, xty.dtype, i) - mean);
        }
        let scale = weight.map_or(1.0, |(wty, wb)| load(wb, wty.dtype, c));
        let k = rstd * rstd * dot / n;
        for i in g.channel(c) {
            let centred = load(x, xty.dtype, i) - mean;
            dx[i] = (load(dy, gty.dtype, i) - sum_dy / n - centred * k) * rstd * scale;
        }
        dw[c] = dot * rstd;
        db[c] = sum_dy;
    }
    store_results(vec![dx, dw, db], outs)
}
