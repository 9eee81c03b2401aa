"""Ordering and reductions by position: sorts, ``topk``, medians and ``kthvalue``, ``max``
and ``min`` along a dim, products, and scans by doubling (``cummax``, ``cummin``,
``logcumsumexp``)."""

from __future__ import annotations

import math

import torch

from .common import _extreme_of

aten = torch.ops.aten


def _shifted(t, dim, steps, fill):
    """``t`` moved ``steps`` places along ``dim``, ``fill`` coming in at the start."""
    head = list(t.shape)
    head[dim] = steps
    return aten.cat.default([aten.full.default(head, fill, dtype=t.dtype, device=t.device),
                             aten.slice.Tensor(t, dim, 0, t.shape[dim] - steps)], dim)


def _scan(state, dim, fills, combine):
    """An inclusive scan along ``dim`` of the tensors ``state`` by doubling: each step
    combines every position with the one ``steps`` before it (``fills``, the identity,
    before the start), ``steps`` 1, 2, 4, ...: ceil(log2 n) elementwise steps.
    ``combine(earlier, later)`` must be associative."""
    steps = 1
    while steps < state[0].shape[dim]:
        earlier = tuple(_shifted(t, dim, steps, f) for t, f in zip(state, fills))
        state = combine(earlier, state)
        steps *= 2
    return state


def _running_extreme(largest):
    """``cummax`` / ``cummin``: the running largest (smallest) and its position, by
    :func:`_scan`. As PyTorch's kernel, a later equal element takes over, and a NaN
    stays once met (its position the last NaN's); bools as integers."""
    def rule(x, dim):
        if x.dim() == 0:
            return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64,
                                                            device=x.device)
        dim = dim % x.dim()
        values = aten._to_copy.default(x, dtype=torch.int32) if x.dtype == torch.bool else x
        shape = [1] * x.dim()
        shape[dim] = -1
        positions = aten.expand.default(aten.view.default(aten.arange.start_step(
            0, x.shape[dim], 1, dtype=torch.int64, device=x.device), shape), list(x.shape))
        positions = aten.clone.default(positions, memory_format=torch.contiguous_format)

        def combine(earlier, later):
            (v1, i1), (v2, i2) = earlier, later
            beats = aten.ge.Tensor(v2, v1) if largest else aten.le.Tensor(v2, v1)
            takes = aten.logical_or.default(aten.isnan.default(v2), aten.logical_and.default(
                aten.logical_not.default(aten.isnan.default(v1)), beats))
            return (aten.where.self(takes, v2, v1), aten.where.self(takes, i2, i1))

        extreme = _extreme_of(values.dtype, not largest)
        values, index = _scan((values, positions), dim, (extreme, 0), combine)
        if x.dtype == torch.bool:
            values = aten.ne.Scalar(values, 0)
        return values, index
    return rule


def _logcumsumexp(x, dim):
    """``logcumsumexp`` by :func:`_scan` of PyTorch's log-add-exp: the larger plus
    ``log1p(exp(smaller - larger))``, or the larger where both are the same infinity; a
    NaN wins."""
    if x.dim() == 0:
        return aten.clone.default(x)

    def combine(earlier, later):
        (a,), (b,) = earlier, later
        larger, smaller = aten.maximum.default(a, b), aten.minimum.default(a, b)
        finite = aten.logical_not.default(aten.isinf.default(smaller))
        sums = aten.logical_or.default(aten.ne.Tensor(smaller, larger), finite)
        added = aten.add.Tensor(larger, aten.log1p.default(aten.exp.default(
            aten.sub.Tensor(smaller, larger))))
        return (aten.where.self(sums, added, larger),)

    return _scan((x,), dim % x.dim(), (-math.inf,), combine)[0]


def _sort(x, dim=-1, descending=False):
    """``sort`` as the IR's ``sort.stable``: a stable sort is one of the orders an
    unstable one may give (equal elements keep their input order)."""
    return aten.sort.stable(x, stable=True, dim=dim, descending=descending)


def _topk(x, k, dim=-1, largest=True, sorted=True):
    """``topk``: the first ``k`` of a stable sort (largest first where ``largest``), so
    ties go to the lower position and the results are in order either way."""
    values, indices = aten.sort.stable(x, stable=True, dim=dim, descending=largest)
    if x.dim() == 0:
        return values, indices
    dim = dim % x.dim()
    return aten.slice.Tensor(values, dim, 0, k), aten.slice.Tensor(indices, dim, 0, k)


def _kthvalue(x, k, dim=-1, keepdim=False):
    """``kthvalue``: element ``k - 1`` of a stable ascending sort (NaNs last, as PyTorch
    orders them), its value and position; of equal values the first in input order
    (PyTorch leaves which one open)."""
    return _sorted_at(x, dim, keepdim, lambda n: k - 1)


def _median_dim(x, dim=-1, keepdim=False):
    """``median`` along a dim: the lower median (element ``(n - 1) // 2`` of a stable
    ascending sort) and its position; a slice holding a NaN gives its first NaN and that
    NaN's position, as PyTorch's kernel does."""
    return _sorted_at(x, dim, keepdim, lambda n: (n - 1) // 2, nan_first=True)


def _median(x):
    """``median`` of every element: the lower median, a NaN if there is one."""
    return _median_dim(aten.view.default(x, [-1]), 0)[0]


def _nanmedian_dim(x, dim=-1, keepdim=False):
    """``nanmedian`` along a dim: the lower median of each slice's numbers (element
    ``(c - 1) // 2`` of a stable ascending sort, which puts NaNs last; c the count of
    numbers) and its position; a slice of NaNs gives NaN and its first position (which
    PyTorch's kernel leaves open)."""
    return _sorted_at(x, dim, keepdim, lambda n: (n - 1) // 2, numbers_only=True)


def _nanmedian(x):
    """``nanmedian`` of every element."""
    return _nanmedian_dim(aten.view.default(x, [-1]), 0)[0]


def _sorted_at(x, dim, keepdim, position, nan_first=False, numbers_only=False):
    """The value and input position of element ``position(n)`` of each slice (of length
    ``n``) along ``dim`` sorted (stable, ascending); with ``nan_first``, of the first NaN
    of a slice that has one (a stable sort puts NaNs last, in input order); with
    ``numbers_only``, ``n`` is each slice's count of numbers (its NaNs left out; 0 taken
    as 1)."""
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64,
                                                        device=x.device)
    dim = dim % x.dim()
    n = x.shape[dim]
    values, indices = aten.sort.stable(x, stable=True, dim=dim)
    shape = list(x.shape)
    shape[dim] = 1
    at = aten.full.default(shape, position(n), dtype=torch.int64, device=x.device)
    if (nan_first or numbers_only) and x.dtype.is_floating_point:
        nans = aten.sum.dim_IntList(aten._to_copy.default(aten.ne.Tensor(x, x),
                                                          dtype=torch.int64), [dim], True)
    if numbers_only and x.dtype.is_floating_point:
        at = aten.clamp.default(position(aten.add.Scalar(aten.neg.default(nans), n)), 0)
    elif nan_first and x.dtype.is_floating_point:
        at = aten.where.self(aten.gt.Scalar(nans, 0),
                             aten.add.Scalar(aten.neg.default(nans), n), at)
    value, index = aten.gather.default(values, dim, at), aten.gather.default(indices, dim, at)
    if not keepdim:
        value, index = aten.squeeze.dims(value, [dim]), aten.squeeze.dims(index, [dim])
    return value, index


def _extreme_dim(arg, x, dim, keepdim):
    """``max.dim`` / ``min.dim``: the position ``arg`` (``argmax``/``argmin``) finds, and
    the element there gathered, so value and index always agree (a NaN wins; the first
    of equal extremes; of bools, found among them as integers)."""
    if x.dim() == 0:
        return aten.clone.default(x), aten.full.default([], 0, dtype=torch.int64,
                                                        device=x.device)
    dim = dim % x.dim()
    among = aten._to_copy.default(x, dtype=torch.int32) if x.dtype == torch.bool else x
    index = arg(among, dim, True)
    values = aten.gather.default(x, dim, index)
    if keepdim:
        return values, index
    return aten.squeeze.dims(values, [dim]), aten.squeeze.dims(index, [dim])


def _max_dim(x, dim, keepdim=False):
    return _extreme_dim(aten.argmax.default, x, dim, keepdim)


def _min_dim(x, dim, keepdim=False):
    return _extreme_dim(aten.argmin.default, x, dim, keepdim)


def _amin(x, dim=(), keepdim=False):
    """``amin`` of floating-point values as ``-amax(-x)`` (negation is exact and keeps
    NaNs); integer and bool ``amin`` stay whole and are refused by name."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    return aten.neg.default(aten.amax.default(aten.neg.default(x), dim, keepdim))


def _whole_extreme(reduce, x):
    """``max()``/``min()`` of a whole tensor: ``amax``/``amin`` over every dim."""
    if x.numel() == 0:
        return NotImplemented
    return reduce(x, list(range(x.dim())), False)


def _prod_dim(x, dim, keepdim=False, *, dtype=None):
    """``prod`` along a dim as the last of its ``cumprod`` (the same products in the same
    order); of an empty dim, 1."""
    if x.dim() == 0:
        return aten._to_copy.default(x, dtype=dtype) if dtype else aten.clone.default(x)
    dim = dim % x.dim()
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        ones = aten.full.default(shape, 1, dtype=dtype or _product_dtype(x), device=x.device)
        return ones if keepdim else aten.squeeze.dims(ones, [dim])
    out = aten.select.int(aten.cumprod.default(x, dim, dtype=dtype), dim, -1)
    return aten.unsqueeze.default(out, dim) if keepdim else out


def _product_dtype(x):
    return x.dtype if x.dtype.is_floating_point else torch.int64


def _prod(x, *, dtype=None):
    """``prod`` of every element: the last of the flattened tensor's ``cumprod``."""
    return _prod_dim(aten.view.default(x, [x.numel()]), 0, dtype=dtype)
