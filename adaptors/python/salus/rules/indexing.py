"""Gathers and scatters: ``EmbeddingBag``, ``scatter_reduce`` and ``index_reduce`` (with a
product's gradient above autograd), ``masked_scatter``, ``put``, insertion points
(``bucketize``, ``searchsorted``), slices and diagonals."""

from __future__ import annotations

import math

import torch
from torch._C import DispatchKey

from .arithmetic import _div_mode
from .common import _extreme_of, _of_result_type, _zeros

aten = torch.ops.aten


# EmbeddingBag: the bag of each index, the rows gathered, summed into their bags by an
# accumulating index_put (mean: divided by each bag's count; max: a scatter_reduce); the
# gradient gathers each bag's gradient back to its indices (max: to the rows that gave
# the maxima) and accumulates it into the weight's rows. Sparse gradients and
# scale_grad_by_freq have no decomposition here: the op then stays and is reported
# unsupported. ``mode``: 0 sum, 1 mean, 2 max.


def _bag_of_each_index(indices, offsets, bags):
    """The bag each index belongs to: a one where each later bag starts, summed along
    (one past the end, so that trailing empty bags start in range)."""
    n = indices.shape[0]
    starts = aten.slice.Tensor(offsets, 0, 1, bags)
    marks = aten.index_put.default(
        _zeros([n + 1], torch.int64, indices.device), [starts],
        aten.full.default([bags - 1], 1, dtype=torch.int64, device=indices.device), True)
    return aten.slice.Tensor(aten.cumsum.default(marks, 0), 0, 0, n)


def _counted(indices, padding_idx):
    """1 for each index that counts (not ``padding_idx``), as int64."""
    if padding_idx is None or padding_idx < 0:
        return aten.full.default([indices.shape[0]], 1, dtype=torch.int64,
                                 device=indices.device)
    return aten._to_copy.default(aten.ne.Scalar(indices, padding_idx), dtype=torch.int64)


def _bag_counts(size, dtype):
    """Each bag's count of indices in ``dtype``, at least 1 (an empty bag's mean is 0)."""
    return aten.clamp.default(aten._to_copy.default(size, dtype=dtype), 1)


def _weighted_rows(rows, keep, per_sample_weights):
    """``rows`` (one per index) scaled by ``keep`` and the per-sample weights, if any."""
    if per_sample_weights is not None:
        keep = aten.mul.Tensor(keep, per_sample_weights)
    return aten.mul.Tensor(rows, aten.unsqueeze.default(keep, 1))


def _bag_maxima(weight, indices, bag, bags, counted):
    """Max bags: each bag's largest row element by element (``scatter_reduce`` amax over
    the rows that count), 0 for a bag without any; and which index gave it, the first
    in order, as PyTorch's (0 for an empty bag)."""
    rows = aten.embedding.default(weight, indices)
    width = weight.shape[1]
    keep = aten.unsqueeze.default(aten.ne.Scalar(counted, 0), 1)
    places = aten.expand.default(aten.unsqueeze.default(bag, 1), list(rows.shape))
    lowest = aten.full_like.default(rows, -math.inf)
    out = aten.scatter_reduce.two(_zeros([bags, width], weight.dtype, weight.device), 0,
                                  places, aten.where.self(keep, rows, lowest), "amax",
                                  include_self=False)
    size = aten.index_put.default(_zeros([bags], torch.int64, indices.device), [bag],
                                  counted, True)
    filled = aten.unsqueeze.default(aten.gt.Scalar(size, 0), 1)
    out = aten.where.self(filled, out, aten.full_like.default(out, 0))
    n = indices.shape[0]
    order = aten.expand.default(aten.unsqueeze.default(aten.arange.start_step(
        0, n, 1, dtype=torch.int64, device=indices.device), 1), [n, width])
    reached = aten.logical_and.default(keep, aten.eq.Tensor(rows, aten.gather.default(
        out, 0, places)))
    first = aten.scatter_reduce.two(
        aten.full.default([bags, width], n, dtype=torch.int64, device=indices.device), 0,
        places, aten.where.self(reached, order, aten.full_like.default(order, n)), "amin")
    which = aten.index.Tensor(indices, [aten.clamp.default(first, None, max(n - 1, 0))])
    which = aten.where.self(filled, which, aten.full_like.default(which, 0))
    return out, size, which


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0,
                   sparse=False, per_sample_weights=None, include_last_offset=False,
                   padding_idx=-1):
    if mode not in (0, 1, 2) or indices.dim() != 1:
        return NotImplemented
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    bag = _bag_of_each_index(indices, offsets, bags)
    counted = _counted(indices, padding_idx)
    if mode == 2:
        out, size, which = _bag_maxima(weight, indices, bag, bags, counted)
        return out, bag, size, which
    rows = _weighted_rows(aten.embedding.default(weight, indices),
                          aten._to_copy.default(counted, dtype=weight.dtype), per_sample_weights)
    sums = _zeros([bags, weight.shape[1]], weight.dtype, weight.device)
    out = aten.index_put.default(sums, [bag], rows, True)
    counts = _zeros([bags], torch.int64, indices.device)
    size = aten.index_put.default(counts, [bag], counted, True)
    if mode == 1:
        out = aten.div.Tensor(out, aten.unsqueeze.default(_bag_counts(size, weight.dtype), 1))
    return out, bag, size, _zeros([bags], torch.int64, indices.device)


def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices,
                                  num_weights, scale_grad_by_freq, mode, per_sample_weights,
                                  padding_idx=-1):
    if mode not in (0, 1, 2) or scale_grad_by_freq:
        return NotImplemented
    weights = _zeros([num_weights, grad.shape[1]], grad.dtype, grad.device)
    if mode == 2:
        # Each bag's gradient, element by element, to the row that gave its maximum
        # (none from an empty bag).
        filled = aten.unsqueeze.default(aten.gt.Scalar(bag_size, 0), 1)
        rows = maximum_indices
        columns = aten.expand.default(aten.unsqueeze.default(aten.arange.start_step(
            0, grad.shape[1], 1, dtype=torch.int64, device=grad.device), 0),
            list(grad.shape))
        values = aten.where.self(filled, grad, aten.full_like.default(grad, 0))
        return aten.index_put.default(weights, [rows, columns], values, True)
    rows = aten.index.Tensor(grad, [offset2bag])
    keep = aten._to_copy.default(_counted(indices, padding_idx), dtype=grad.dtype)
    if mode == 1:
        keep = aten.div.Tensor(keep, aten.index.Tensor(_bag_counts(bag_size, grad.dtype),
                                                       [offset2bag]))
    rows = _weighted_rows(rows, keep, per_sample_weights)
    return aten.index_put.default(weights, [indices], rows, True)


def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices,
                            num_weights, scale_grad_by_freq, mode, sparse,
                            per_sample_weights, padding_idx=-1):
    if sparse:
        return NotImplemented
    return _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size,
                                         maximum_indices, num_weights, scale_grad_by_freq,
                                         mode, per_sample_weights, padding_idx)


def _scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    """``scatter_reduce.two``. Without self, the places the index names first become the
    reduction's identity (0, 1, or the dtype's smallest or largest value). ``sum`` and
    ``mean`` are then ``scatter_add``s: a mean divides by how many values met at each
    place (self counted when included, a place nothing met by 1), rounding down for
    integers, as PyTorch's kernels do. ``prod``, ``amax`` and ``amin`` stay whole
    (``NotImplemented``): the IR's op, which starts from self."""
    if not include_self:
        identity = {"sum": 0, "mean": 0, "prod": 1, "amax": _extreme_of(x.dtype, False),
                    "amin": _extreme_of(x.dtype, True)}[reduce]
        x = aten.scatter.value(x, dim, index, identity)
        if reduce not in ("sum", "mean"):
            return aten.scatter_reduce.two(x, dim, index, src, reduce)
    if reduce not in ("sum", "mean"):
        return NotImplemented
    total = aten.scatter_add.default(x, dim, index, src)
    if reduce == "sum":
        return total
    count = aten.scatter_add.default(aten.full_like.default(x, int(include_self)), dim, index,
                                     aten.full_like.default(src, 1))
    count = aten.clamp.default(count, 1)
    if x.dtype.is_floating_point:
        return aten.div.Tensor(total, count)
    return _div_mode(total, count, rounding_mode="floor")


def _flat(t):
    """``t``'s elements in order, as one dim (a contiguous copy first where ``t`` is a
    view)."""
    return aten.view.default(aten.clone.default(t, memory_format=torch.contiguous_format),
                             [-1])


def _mask_order(mask, shape):
    """``mask`` broadcast to ``shape`` and flattened, and each place's position among the
    true places (a running count less one; 0 before the first)."""
    flat = _flat(aten.expand.default(mask, list(shape)))
    order = aten.sub.Scalar(aten.cumsum.default(flat, 0, dtype=torch.int64), 1)
    return flat, aten.clamp.default(order, 0)


def _masked_scatter(x, mask, source):
    """``masked_scatter`` (a vision-language model's image features written over its
    image tokens' embeddings): the k-th place where ``mask`` is true takes ``source``'s
    k-th element, in order; the others keep ``x``'s. A source with fewer elements than
    true places fails the iteration with an index error."""
    _, order = _mask_order(mask, x.shape)
    taken = aten.view.default(aten.index.Tensor(_flat(source), [order]), list(x.shape))
    return aten.where.self(aten.expand.default(mask, list(x.shape)), taken, x)


def _masked_scatter_backward(grad, mask, sizes):
    """The source's gradient of ``masked_scatter``: the k-th true place's gradient at the
    source's k-th element (summed in by an accumulating ``index_put``), 0 past them."""
    flat, order = _mask_order(mask, grad.shape)
    flat_grad = _flat(grad)
    values = aten.where.self(flat, flat_grad, aten.full_like.default(flat_grad, 0))
    numel = math.prod(sizes)
    zeros = aten.full.default([numel], 0, dtype=grad.dtype, device=grad.device)
    return aten.view.default(aten.index_put.default(zeros, [order], values, True), list(sizes))


def _insertion_points(sequence, values, right, out_int32):
    """Where each value would go in ``sequence``'s last dim (sorted, as PyTorch assumes):
    how many of its elements are below the value (at or below it, ``right``), counted by
    comparing with each; a NaN value after them all, as PyTorch's. A 1-d sequence serves
    every value; otherwise its leading dims are the values'."""
    sequence, values = _of_result_type(sequence, values)
    if sequence.dim() > 1:
        sequence = aten.unsqueeze.default(sequence, -2)
    below = (aten.le.Tensor if right else aten.lt.Tensor)(
        sequence, aten.unsqueeze.default(values, -1))
    count = aten.sum.dim_IntList(aten._to_copy.default(below, dtype=torch.int64), [-1])
    count = aten.where.self(aten.isnan.default(values),
                            aten.full_like.default(count, sequence.shape[-1]), count)
    return aten._to_copy.default(count, dtype=torch.int32) if out_int32 else count


def _bucketize(x, boundaries, *, out_int32=False, right=False):
    return _insertion_points(boundaries, x, right, out_int32)


def _searchsorted(sequence, values, *, out_int32=False, right=False, side=None,
                  sorter=None):
    if sorter is not None:
        sequence = aten.gather.default(sequence, -1, sorter)
    return _insertion_points(sequence, values, right or side == "right", out_int32)


def _slice_backward(grad, input_sizes, dim, start, end, step):
    """A slice's gradient: ``grad`` placed at the slice in zeros. With step 1 that is
    constant padding; with a larger step, an ``index_put`` of ``grad`` at the slice's
    indices along ``dim`` (both IR ops, where PyTorch writes ``slice_scatter``)."""
    rank = len(input_sizes)
    dim = dim % rank
    size = input_sizes[dim]
    start = min(max(start + size if start < 0 else start, 0), size)
    length = grad.shape[dim]
    if step == 1:
        pad = [0, 0] * (rank - 1 - dim) + [start, size - start - length]
        return aten.constant_pad_nd.default(grad, pad, 0.0)
    zeros = _zeros(input_sizes, grad.dtype, grad.device)
    return _slice_scatter(zeros, grad, dim, start, end, step)


def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """``x`` with ``src`` written at the slice ``start:end:step`` along ``dim``: an
    ``index_put`` at the slice's indices (an IR op; PyTorch writes ``slice_scatter``, e.g.
    for ``y[..., 1:] = x[..., :-1]``)."""
    rank = x.dim()
    dim = dim % rank
    size = x.shape[dim]
    start = 0 if start is None else start
    start = min(max(start + size if start < 0 else start, 0), size)
    length = src.shape[dim]
    where = aten.arange.start_step(start, start + length * step, step, dtype=torch.int64,
                                   device=x.device)
    return aten.index_put.default(x, [None] * dim + [where], src, False)


def _put(x, index, source, accumulate=False):
    """``put`` (``take``'s gradient): ``source`` written, or added, at the flat positions
    of ``x`` that ``index`` names (an ``index_put`` of the flattened tensor)."""
    return aten.view.default(aten.index_put.default(_flat(x), [_flat(index)], _flat(source),
                                                    accumulate), list(x.shape))


def _diagonal_positions(x, offset, dim1, dim2):
    """The permutation that puts dims ``dim1`` and ``dim2`` last, and the row and column
    of each element of the diagonal ``offset`` between them."""
    rank = x.dim()
    dim1, dim2 = dim1 % rank, dim2 % rank
    order = [d for d in range(rank) if d not in (dim1, dim2)] + [dim1, dim2]
    rows, cols = x.shape[dim1], x.shape[dim2]
    first_row, first_col = max(-offset, 0), max(offset, 0)
    count = max(min(rows - first_row, cols - first_col), 0)
    def positions(start):
        return aten.arange.start_step(start, start + count, dtype=torch.int64,
                                      device=x.device)
    return order, positions(first_row), positions(first_col)


def _diagonal(x, offset=0, dim1=0, dim2=1):
    """``diagonal`` (a view in PyTorch) as the gather of its elements: the other dims
    first, the diagonal last."""
    order, rows, cols = _diagonal_positions(x, offset, dim1, dim2)
    moved = aten.permute.default(x, order)
    return aten.index.Tensor(moved, [None] * (x.dim() - 2) + [rows, cols])


def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """``x`` with its diagonal ``offset`` replaced by ``src``: an ``index_put`` (the
    diagonal's gradient, ``torch.diagonal(c).add_(-1)`` in a loss)."""
    order, rows, cols = _diagonal_positions(x, offset, dim1, dim2)
    moved = aten.permute.default(x, order)
    put = aten.index_put.default(moved, [None] * (x.dim() - 2) + [rows, cols], src, False)
    back = [order.index(d) for d in range(x.dim())]
    return aten.permute.default(put, back)


def _index_reduce(x, dim, index, source, reduce, *, include_self=True):
    """``index_reduce`` as the ``scatter_reduce`` it is, the index spread along ``dim`` of
    ``source``: its gradient is that of ``scatter_reduce`` (``_scatter_reduce_autograd``)."""
    dim = dim % max(x.dim(), 1)
    shape = [1] * source.dim()
    shape[dim] = -1
    spread = index.view(shape).expand(source.shape)
    return x.scatter_reduce(dim, spread, source, reduce, include_self=include_self)


def _scatter_reduce_autograd(x, dim, index, src, reduce, *, include_self=True):
    """``scatter_reduce.two`` above autograd. Every reduction but the product, and a
    product that needs no gradient, runs PyTorch's own autograd kernel. PyTorch's
    gradient of a product reads a value (whether two zeros met at a place, only to refuse
    a second derivative), which a recording cannot answer; here the product is computed
    below autograd and its gradient carried by a linear stand-in, ``result + (linear -
    linear.detach())``, where ``linear`` scatters self and src times PyTorch's
    derivatives of the result by them: the product of the others met at the place, a
    lone zero's the product without it, every value's 0 where two zeros met, and self's
    0 where the index names it without self. (A product that overflows to an infinity
    makes the stand-in NaN instead.)"""
    if reduce != "prod" or not (x.requires_grad or src.requires_grad):
        return aten.scatter_reduce.two._op_dk(DispatchKey.Autograd, x, dim, index, src,
                                              reduce, include_self=include_self)
    if tuple(src.shape) != tuple(index.shape):
        src = src[tuple(slice(0, n) for n in index.shape)]
    with torch._C._AutoDispatchBelowAutograd():
        def product(a, b):
            return aten.scatter_reduce.two(a, dim, index, b, "prod", include_self=include_self)
        result = product(x, src)
        nonzero_x = x.masked_fill(x == 0, 1)
        of_x = product(nonzero_x, src) / nonzero_x
        if not include_self:
            of_x = of_x.scatter(dim, index, 0)
        src_zero = src == 0
        zeros_met = torch.zeros_like(x).scatter_add(dim, index, src_zero.to(x.dtype))
        lone_zero = src_zero & (zeros_met.gather(dim, index) == 1)
        without_it = product(x, src.masked_fill(lone_zero, 1))
        of_src = torch.where(lone_zero, without_it.gather(dim, index),
                             result.gather(dim, index) / src.masked_fill(src_zero, 1))
    linear = (x * of_x).scatter_add(dim, index, src * of_src)
    return result + (linear - linear.detach())


def _strided_positions(x, size, stride, storage_offset):
    """The flat positions in ``x`` of the elements an ``as_strided`` view of ``size`` and
    ``stride`` at ``storage_offset`` reads, as an int64 tensor of ``size``; None where the
    view's positions are not ``x``'s own (``x`` not laid out contiguously, or the view
    reaching outside it), which no gather can express, and where the view is a dense
    block in row-major order, which the recording's layout pass makes a view or a slice
    (``salus.trace._drop_layouts``)."""
    expected = 1
    for n, s in reversed([(n, s) for n, s in zip(size, stride) if n != 1]):
        if s != expected:
            break
        expected *= n
    else:
        return None  # dense in row-major order
    if not x.is_contiguous():
        return None
    start = (x.storage_offset() if storage_offset is None else storage_offset) \
        - x.storage_offset()
    low = start + sum(min(0, (n - 1) * s) for n, s in zip(size, stride) if n > 0)
    high = start + sum(max(0, (n - 1) * s) for n, s in zip(size, stride) if n > 0)
    if any(n == 0 for n in size):
        low = high = 0
    if low < 0 or high >= max(x.numel(), 1):
        return None
    positions = aten.full.default([1] * len(size), start, dtype=torch.int64, device=x.device)
    for dim, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[dim] = n
        step = aten.mul.Scalar(aten.arange.start_step(0, n, dtype=torch.int64,
                                                      device=x.device), s)
        positions = aten.add.Tensor(positions, aten.view.default(step, shape))
    return aten.expand.default(positions, list(size))


def _as_strided(x, size, stride, storage_offset=None):
    """``as_strided`` (an in-place update of a strided view, ``m.view(-1)[::n + 1] +=
    1``, after functionalization; its gradient) as the gather of the positions it reads
    from a contiguous ``x``."""
    positions = _strided_positions(x, size, stride, storage_offset)
    if positions is None:
        return NotImplemented
    return aten.index.Tensor(_flat(x), [positions])


def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    """``x`` with the elements of its ``as_strided`` view replaced by ``src``'s: an
    ``index_put`` of the flattened tensor at the view's positions."""
    positions = _strided_positions(x, size, stride, storage_offset)
    if positions is None:
        return NotImplemented
    put = aten.index_put.default(_flat(x), [_flat(positions)], _flat(src), False)
    return aten.view.default(put, list(x.shape))


def _embedding_renorm(weight, indices, max_norm, norm_type):
    """``embedding_renorm`` (``nn.Embedding(max_norm=...)`` before its lookup): each row
    the indices name whose ``norm_type``-norm exceeds ``max_norm`` scaled by ``max_norm /
    (norm + 1e-7)``, as PyTorch's kernel; the other rows as they are."""
    rows = weight.shape[0]
    looked = aten.index_put.default(
        aten.full.default([rows], False, dtype=torch.bool, device=weight.device),
        [_flat(indices)], aten.full.default([1], True, dtype=torch.bool,
                                            device=weight.device), False)
    norms = aten.linalg_vector_norm.default(weight, norm_type, [1])
    over = aten.logical_and.default(looked, aten.gt.Scalar(norms, max_norm))
    scale = aten.where.self(over, aten.reciprocal.default(
        aten.mul.Scalar(aten.add.Scalar(norms, 1e-7), 1.0 / max_norm)),
        aten.full_like.default(norms, 1.0))
    return aten.mul.Tensor(weight, aten.unsqueeze.default(scale, 1))


def _histc(x, bins=100, min=0, max=0):
    """``histc``: each element's bin ``trunc((x - min) * bins / (max - min))`` in ``x``'s
    dtype (the maximum in the last bin), as PyTorch's kernel computes it, counted with an
    accumulating ``index_put``; elements outside ``[min, max]`` and NaNs not counted.
    ``min == max`` takes the data's extremes (widened by 1 either way when they are
    equal), which must be finite (PyTorch's check, its message less the values)."""
    low, high = float(min), float(max)
    if low > high:
        raise RuntimeError("torch.histc: max must be larger than min")
    flat = _flat(x)
    if low == high:
        lo, hi = aten.amin.default(flat, [0]), aten.amax.default(flat, [0])
        finite = aten.logical_not.default(aten.logical_or.default(
            _nan_or_inf(lo), _nan_or_inf(hi)))
        aten._assert_async.msg(finite, "torch.histc: range of [min, max] is not finite")
        same = aten.eq.Tensor(lo, hi)
        lo = aten.where.self(same, aten.sub.Scalar(lo, 1), lo)
        hi = aten.where.self(same, aten.add.Scalar(hi, 1), hi)
    else:
        lo = aten.full.default([], low, dtype=x.dtype, device=x.device)
        hi = aten.full.default([], high, dtype=x.dtype, device=x.device)
    inside = aten.logical_and.default(aten.ge.Tensor(flat, lo), aten.le.Tensor(flat, hi))
    position = aten.trunc.default(aten.div.Tensor(
        aten.mul.Scalar(aten.sub.Tensor(flat, lo), bins), aten.sub.Tensor(hi, lo)))
    safe = aten.where.self(inside, position, aten.full_like.default(position, 0))
    index = aten.clamp.default(aten._to_copy.default(safe, dtype=torch.int64), 0, bins - 1)
    counts = aten.full.default([bins], 0, dtype=x.dtype, device=x.device)
    return aten.index_put.default(counts, [index], aten._to_copy.default(inside, dtype=x.dtype),
                                  True)


def _nan_or_inf(t):
    return aten.logical_or.default(aten.ne.Tensor(t, t),
                                   aten.eq.Scalar(aten.abs.default(t), math.inf))
