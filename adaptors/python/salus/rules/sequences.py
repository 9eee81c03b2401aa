"""Sequence and pair models written out above autograd or in IR ops: the CTC loss,
bilinear layers and pairwise distances."""

from __future__ import annotations

import torch

aten = torch.ops.aten


# A log-probability no path reaches: finite, so that the recursion's log-sum-exp always
# has a term of 0 after its maximum is taken out and its gradient is never 0 * inf.
_UNREACHED = -1e30


def _log_add(*terms):
    """``log(sum(exp(terms)))`` with the largest term taken out first."""
    top = terms[0]
    for t in terms[1:]:
        top = torch.maximum(top, t)
    total = sum(torch.exp(t - top) for t in terms)
    return top + torch.log(total)


def _lengths(lengths, device):
    if isinstance(lengths, torch.Tensor):
        return lengths.to(torch.int64)
    return torch.tensor(list(lengths), dtype=torch.int64, device=device)


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1,
              zero_infinity=False):
    """``F.ctc_loss`` as the forward recursion over the blank-extended targets, unrolled
    over time in the step's graph (its gradient is autograd's of the recursion, which is
    what ``_ctc_loss_backward`` computes in closed form): each sample's paths stop at its
    input length, its loss is minus the log-probability of its target, infinite where no
    path fits (0 with ``zero_infinity``); ``reduction`` 0 none, 1 mean over target
    lengths then batch, 2 sum. Padded (``[B, S]``) or concatenated targets, batched or
    not, lengths as lists or tensors. Computed in float32 at least."""
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs = log_probs.unsqueeze(1)
        targets = targets.unsqueeze(0)
    dtype = log_probs.dtype
    lp = log_probs.float() if dtype in (torch.float16, torch.bfloat16) else log_probs
    steps, batch, _ = lp.shape
    device = lp.device
    input_lengths = _lengths(input_lengths, device).reshape(batch)
    target_lengths = _lengths(target_lengths, device).reshape(batch)
    targets = targets.to(torch.int64)
    if targets.dim() == 1:  # concatenated: gather each sample's run into a padded row
        width = targets.shape[0]
        starts = torch.cumsum(target_lengths, 0) - target_lengths
        where = (starts[:, None] + torch.arange(width, device=device)[None, :]).clamp(
            max=max(width - 1, 0))
        targets = targets[where] if width > 0 else targets.reshape(batch, 0)
    width = targets.shape[1]
    # The extended targets: blank, l1, blank, l2, ..., blank.
    blanks = torch.full_like(targets, blank)
    extended = torch.cat([torch.stack([blanks, targets], -1).reshape(batch, 2 * width),
                          torch.full_like(targets[:, :1], blank)], 1)
    states = 2 * width + 1
    position = torch.arange(states, device=device)[None, :]
    length = 2 * target_lengths[:, None] + 1
    previous = torch.cat([torch.full_like(extended[:, :2], blank), extended[:, :-2]], 1)
    skip = (extended != blank) & (extended != previous) & (position >= 2)
    emit = lp.gather(2, extended[None].expand(steps, batch, states))
    unreached = torch.full((batch, states), _UNREACHED, dtype=lp.dtype, device=device)
    alpha = torch.where((position < 2) & (position < length), emit[0], unreached)
    for t in range(1, steps):
        one = torch.cat([unreached[:, :1], alpha[:, :-1]], 1)
        two = torch.where(skip, torch.cat([unreached[:, :2], alpha[:, :-2]], 1), unreached)
        step = _log_add(alpha, one, two) + emit[t]
        alpha = torch.where((t < input_lengths)[:, None], step, alpha)
    last = alpha.gather(1, length - 1)
    before = torch.where(length >= 2, alpha.gather(1, (length - 2).clamp(min=0)),
                         unreached[:, :1])
    loss = -_log_add(last, before).squeeze(1)
    reached = (loss < -_UNREACHED / 10) & (input_lengths > 0)
    loss = torch.where(reached, loss, torch.zeros_like(loss) if zero_infinity
                       else torch.full_like(loss, float("inf")))
    loss = loss.to(dtype)
    if reduction == 1:
        return (loss / target_lengths.clamp(min=1).to(dtype)).mean()
    if reduction == 2:
        return loss.sum()
    return loss.squeeze(0) if unbatched else loss


def _bilinear(x1, x2, weight, bias=None):
    """``nn.Bilinear``: ``y[.., o] = sum_ij x1[.., i] weight[o, i, j] x2[.., j] + bias``,
    as one matrix product of ``x1`` with the weight laid out ``[i, o * j]``, a product
    with ``x2`` and a sum over ``j``."""
    out, in1, in2 = weight.shape
    lead = x1.shape[:-1]
    flat1, flat2 = x1.reshape(-1, in1), x2.reshape(-1, in2)
    mixed = (flat1 @ weight.permute(1, 0, 2).reshape(in1, out * in2)).view(-1, out, in2)
    y = (mixed * flat2.unsqueeze(1)).sum(-1)
    if bias is not None:
        y = y + bias
    return y.view(*lead, out)


def _cdist(x1, x2, p=2.0, compute_mode=None):
    """``torch.cdist`` as PyTorch computes it: for p = 2 on more than 25 rows a side (or
    when ``compute_mode`` asks), through a matrix product of the rows padded with their
    squared norms, clamped at 1e-30 before the root (PyTorch's ``_euclidean_dist``);
    otherwise from the differences of every pair, whose gradient is 0 where a distance
    is 0 (``_cdist_backward``'s)."""
    rows1, rows2 = x1.shape[-2], x2.shape[-2]
    by_product = p == 2 and (
        compute_mode == 1
        or (compute_mode in (None, 0) and (rows1 > 25 or rows2 > 25)))
    if by_product:
        norm1 = x1.pow(2).sum(-1, keepdim=True)
        norm2 = x2.pow(2).sum(-1, keepdim=True)
        ones1, ones2 = torch.ones_like(norm1), torch.ones_like(norm2)
        padded1 = torch.cat([x1 * -2, norm1, ones1], -1)
        padded2 = torch.cat([x2, ones2, norm2], -1)
        return (padded1 @ padded2.transpose(-1, -2)).clamp_min(1e-30).sqrt()
    return _p_norms((x1.unsqueeze(-2) - x2.unsqueeze(-3)).abs(), p)


def _pdist(x, p=2.0):
    """``F.pdist``: the distance of every pair of rows ``i < j`` (in the order of ``i``,
    then ``j``), from the differences of each pair as PyTorch's kernel computes it, whose
    gradient is 0 where a distance is 0 (``_pdist_backward``'s)."""
    rows = x.shape[0]
    pairs = [(i, j) for i in range(rows) for j in range(i + 1, rows)]
    first = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=x.device)
    second = torch.tensor([j for _, j in pairs], dtype=torch.int64, device=x.device)
    return _p_norms((x.index_select(0, first) - x.index_select(0, second)).abs(), p)


def _p_norms(diff, p):
    """The p-norms of ``diff`` (magnitudes) along its last dim, 0 for p = 0 counting the
    non-zeros; the gradient of a zero norm is 0."""
    if p == 0:
        return (diff != 0).to(diff.dtype).sum(-1)
    if p == float("inf"):
        return diff.amax(-1)
    if p == 1:
        return diff.sum(-1)
    total = diff.pow(p).sum(-1)
    positive = total > 0
    safe = torch.where(positive, total, torch.ones_like(total))
    return torch.where(positive, safe.pow(1.0 / p), torch.zeros_like(total))
