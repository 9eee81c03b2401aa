"""The decomposition table salus traces PyTorch steps with.

Core ATen's decompositions, adjusted to the IR (``proto/salus/v1/ops.txt``): ops the IR
has kernels for stay whole (training-mode batch norm, reflection padding, layer norm's
backward, fused attention), and ops Core ATen keeps whole but the IR has not are written
in IR ops (dropout as ``bernoulli.p`` draws, ``rand``/``randn`` as ``rand_like``,
``max.dim`` as ``argmax`` and a gather, ``topk`` as a sort and a slice, replication and
circular padding as gathers and concatenations, ...). :func:`decomposition_table` says
what each entry does; :mod:`salus.trace` records every step with it.
"""

from __future__ import annotations

import math
import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch._C import DispatchKey
from torch._decomp import core_aten_decompositions
from torch._decomp import decomposition_table as _all_decompositions
from torch._subclasses.fake_tensor import is_fake

from .attention import attention_with_dropout, flash_attention, flash_attention_backward

aten = torch.ops.aten

def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    return (aten.var.correction(x, dim, correction=correction, keepdim=keepdim),
            aten.mean.dim(x, dim, keepdim))


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None,
           memory_format=None):
    # Uninitialised memory may hold anything: zeros are a valid choice, and ``full`` is an
    # IR op (dropout's mask and SiLU's backward start from an empty tensor).
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype(),
                             layout=layout, device=device, pin_memory=pin_memory)


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None,
                    pin_memory=None):
    return _empty(size, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


_BATCH_NORM_OPS = ("native_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_functional", "_batch_norm_with_update",
                   "_batch_norm_with_update_functional",
                   # eval mode
                   "_native_batch_norm_legit_no_training", "_batch_norm_no_update")


def _batch_norm_whole(decomposition: Callable, train_at: int, data: Sequence[int],
                      stats: Sequence[int], required: Sequence[int],
                      saved: Sequence[int] = ()) -> Callable:
    """``decomposition`` where the IR has no batch-norm op for the call; else the op stays
    whole (``NotImplemented`` tells make_fx to record it): training-mode batch norm whose
    fused kernels make one pass to gather each channel's statistics and one to normalise,
    where the decomposition makes many. ``train_at``: the index of the ``training`` /
    ``train`` flag; ``data``: the arguments shaped like the input (f32, or 16-bit as
    under autocast), of one dtype; ``stats``: the per-channel tensor arguments (f32 or
    None), of which ``required`` (the running or the saved statistics) must be there.
    ``saved``: the forward's saved statistics among ``stats``, which a fake trace gives
    the input's dtype (the meta kernel's; :func:`_kernel_dtypes` makes them f32 after)."""
    def maybe_whole(*args, **kwargs):
        whole = (len(args) > train_at and args[train_at] is True and args[0].dim() >= 2
                 and all(isinstance(args[i], torch.Tensor) for i in data)
                 and args[0].dtype in (torch.float32, torch.bfloat16, torch.float16)
                 and all(args[i].dtype == args[0].dtype for i in data)
                 and all(args[i] is None or (
                     isinstance(args[i], torch.Tensor)
                     and (args[i].dtype == torch.float32
                          or (i in saved and is_fake(args[i])
                              and args[i].dtype == args[0].dtype)))
                         for i in stats)
                 and all(args[i] is not None for i in required))
        return NotImplemented if whole else decomposition(*args, **kwargs)
    return maybe_whole


# Ops the IR has kernels for, whose Core ATen decompositions would replace them with
# gathers: reflection padding becomes ``index.Tensor`` with reflected indices, and its
# backward nine masked gathers of the whole gradient.
_KEPT_WHOLE = ("reflection_pad2d", "reflection_pad2d_backward",
               # Layer norm's backward: one op (a pass over each row, column sums for the
               # weight and bias), where the decomposition takes several passes.
               "native_layer_norm_backward",
               # Attention: one fused op each way (the forward's log-sum-exp feeds the
               # backward), where the decomposition would build every score matrix.
               "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward")


def _native_dropout(x, p, train):
    """``native_dropout`` (attention's dropout in scaled-dot-product attention) as
    ``nn.Dropout`` traces: a ``bernoulli.p`` draw of keep-flags from the session's
    generator, scaled by 1 / (1 - p); the mask as bool, for its backward."""
    if not train or p == 0:
        return (aten.clone.default(x),
                aten.full.default(list(x.shape), True, dtype=torch.bool, device=x.device))
    if p >= 1:
        zeros = _zeros(x.shape, x.dtype, x.device)
        return (zeros, aten.ne.Scalar(zeros, 0))
    noise = aten.bernoulli.p(
        _zeros(x.shape, x.dtype, x.device), 1 - p)
    out = aten.mul.Tensor(x, aten.div.Scalar(noise, 1 - p))
    return (out, aten.ne.Scalar(noise, 0))


def _unfold(x, dimension, size, step):
    """``Tensor.unfold`` (sliding windows along a dim, each window a new last dim) as an
    ``index_select`` of the windows' positions, viewed and permuted: the same values as
    PyTorch's strided view."""
    if x.dim() == 0:
        return NotImplemented
    dim = dimension % x.dim()
    count = (x.shape[dim] - size) // step + 1
    starts = aten.mul.Scalar(aten.unsqueeze.default(
        aten.arange.start_step(0, count, dtype=torch.int64, device=x.device), 1), step)
    positions = aten.add.Tensor(
        starts, aten.arange.start_step(0, size, dtype=torch.int64, device=x.device))
    picked = aten.index_select.default(x, dim, aten.view.default(positions, [count * size]))
    shape = list(x.shape)
    shape[dim:dim + 1] = [count, size]
    order = [d for d in range(len(shape)) if d != dim + 1] + [dim + 1]
    return aten.permute.default(aten.view.default(picked, shape), order)


def _any_dims(x, dim=None, keepdim=False):
    """``any`` over several dims (F.one_hot's range checks) as one ``any.dim`` per dim."""
    if x.dim() == 0:
        return aten.ne.Scalar(x, 0)
    dims = range(x.dim()) if not dim else sorted(d % x.dim() for d in dim)
    out = x
    for d in reversed(list(dims)):
        out = aten.any.dim(out, d, keepdim)
    return out


def _clamp_tensor(x, min=None, max=None):
    """``clamp`` by tensor bounds (``cosine_similarity``'s norm floor) as ``maximum`` and
    ``minimum``, which propagate NaN as it does."""
    out = x
    if min is not None:
        out = aten.maximum.default(out, min)
    if max is not None:
        out = aten.minimum.default(out, max)
    return out


def _zeros(shape, dtype, device):
    return aten.full.default(list(shape), 0, dtype=dtype, device=device)


def _rand_like(x, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    """``rand_like`` as the IR draws it, from the session's generator: of a tensor of the
    draw's own dtype (the IR's op takes its dtype from ``self``)."""
    if dtype is None or dtype == x.dtype:
        return NotImplemented  # recorded as it is
    return aten.rand_like.default(_zeros(x.shape, dtype, x.device))


def _randn_like(x, *, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    """``randn_like`` by Box and Muller's transform of two uniform draws from the
    session's generator, in f32: ``sqrt(-2 log(1 - u)) cos(2 pi v)``, ``1 - u`` in (0, 1]."""
    dtype = dtype or x.dtype
    base = _zeros(x.shape, torch.float32, x.device)
    u, v = aten.rand_like.default(base), aten.rand_like.default(base)
    radius = aten.sqrt.default(
        aten.mul.Scalar(aten.log.default(aten.add.Scalar(aten.neg.default(u), 1.0)), -2.0))
    normal = aten.mul.Tensor(radius, aten.cos.default(aten.mul.Scalar(v, 2 * math.pi)))
    return normal if dtype == torch.float32 else aten._to_copy.default(normal, dtype=dtype)


def _rand(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return aten.rand_like.default(_zeros(size, dtype or torch.get_default_dtype(), device))


def _randn(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _randn_like(_zeros(size, dtype or torch.get_default_dtype(), device))


def _sessions_generator(rule: Callable) -> Callable:
    """``rule``, for a draw from the session's generator; a draw from the user's own
    ``torch.Generator`` (``generator=``) stays whole and is refused by the op's name."""
    def draw(*args, generator=None, **kwargs):
        return NotImplemented if generator is not None else rule(*args, **kwargs)
    return draw


@_sessions_generator
def _normal_functional(x, mean=0.0, std=1.0):
    """``Tensor.normal_`` (functionalized): ``mean + std * randn_like(x)``."""
    return aten.add.Scalar(aten.mul.Scalar(_randn_like(x), std), mean)


@_sessions_generator
def _normal_tensors(mean, std):
    """``torch.normal`` with a tensor mean and/or std (broadcast together)."""
    like = mean if isinstance(mean, torch.Tensor) else std
    shape = torch.broadcast_shapes(*(t.shape for t in (mean, std)
                                     if isinstance(t, torch.Tensor)))
    noise = _randn_like(_zeros(shape, like.dtype, like.device))
    scaled = (aten.mul.Tensor(noise, std) if isinstance(std, torch.Tensor)
              else aten.mul.Scalar(noise, std))
    return (aten.add.Tensor(scaled, mean) if isinstance(mean, torch.Tensor)
            else aten.add.Scalar(scaled, mean))


@_sessions_generator
def _normal_numbers(mean, std, size, *, dtype=None, layout=None, device=None,
                    pin_memory=None):
    noise = _randn_like(_zeros(size, dtype or torch.get_default_dtype(), device))
    return aten.add.Scalar(aten.mul.Scalar(noise, std), mean)


@_sessions_generator
def _uniform(x, low=0.0, high=1.0):
    """``Tensor.uniform_`` (functionalized): ``low + (high - low) * rand_like(x)``."""
    return aten.add.Scalar(aten.mul.Scalar(aten.rand_like.default(x), high - low), low)


@_sessions_generator
def _exponential(x, lambd=1.0):
    """``Tensor.exponential_`` (Gumbel noise: ``F.gumbel_softmax``): ``-log(1 - u) /
    lambd`` of a uniform draw ``u`` in [0, 1), as PyTorch transforms its own."""
    u = aten.rand_like.default(x)
    return aten.div.Scalar(aten.neg.default(aten.log1p.default(aten.neg.default(u))), lambd)


def _rrelu_with_noise(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    """``nn.RReLU``: in training, each element at or below 0 times a slope uniform in
    [lower, upper) from the session's generator (the slopes, 1 elsewhere, are the noise
    its gradient multiplies by); in evaluation, a leaky ReLU of slope (lower + upper) / 2,
    the noise left as it is. Slopes from the user's own generator stay whole (refused by
    name)."""
    if generator is not None:
        return NotImplemented
    if not training:
        return aten.leaky_relu.default(x, (lower + upper) / 2), aten.clone.default(noise)
    slopes = _uniform(x, lower, upper)
    noise = aten.where.self(aten.le.Scalar(x, 0), slopes, aten.full_like.default(x, 1))
    return aten.mul.Tensor(x, noise), noise


def _rrelu_with_noise_backward(grad, x, noise, lower, upper, training, self_is_result):
    """``rrelu_with_noise_backward``, as PyTorch's: the gradient times the noise in
    training (slopes drawn), else a leaky ReLU's of slope (lower + upper) / 2."""
    if training and upper - lower > 1e-6:
        return aten.mul.Tensor(grad, noise)
    return aten.leaky_relu_backward.default(grad, x, (lower + upper) / 2, self_is_result)


def _integers(shape, low, high, dtype, device):
    """Integers uniform in [low, high): ``floor(u * (high - low))`` of a float32 draw,
    kept below ``high``, plus ``low``. A float32 draw has 24 bits: wider ranges stay whole
    and are refused by the op's name."""
    if high - low > 2 ** 24:
        return NotImplemented
    u = aten.rand_like.default(_zeros(shape, torch.float32, device))
    picked = aten.clamp.default(aten.floor.default(aten.mul.Scalar(u, high - low)), 0,
                                high - low - 1)
    return aten._to_copy.default(aten.add.Scalar(picked, low), dtype=dtype or torch.int64)


@_sessions_generator
def _randint_low(low, high, size, *, dtype=None, layout=None, device=None,
                 pin_memory=None):
    return _integers(size, low, high, dtype, device)


@_sessions_generator
def _randint(high, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _integers(size, 0, high, dtype, device)


def _randint_like_low(x, low, high, *, dtype=None, layout=None, device=None,
                      pin_memory=None, memory_format=None):
    return _integers(x.shape, low, high, dtype or x.dtype, x.device)


def _randint_like(x, high, *, dtype=None, layout=None, device=None, pin_memory=None,
                  memory_format=None):
    return _integers(x.shape, 0, high, dtype or x.dtype, x.device)


@_sessions_generator
def _randperm(n, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``randperm``: the order that sorts ``n`` uniform draws (equal draws, one in 2^24
    for each pair, keep their order)."""
    u = aten.rand_like.default(_zeros([n], torch.float32, device))
    order = aten.sort.stable(u, stable=True, dim=0)[1]
    return order if dtype in (None, torch.int64) else aten._to_copy.default(order,
                                                                            dtype=dtype)


def _adaptive_avg_pool2d(x, output_size):
    # The composite's 1x1 shortcut (a mean, then `as_strided_` for a channels-last input)
    # would leave view mutations in the graph: the IR has the pooling op itself.
    return aten._adaptive_avg_pool2d.default(x, output_size)


def _adaptive_max_window(x, output_size) -> list[int] | None:
    """The window (and stride) of the plain max pooling that equals adaptive max pooling
    of ``x`` to ``output_size``: each output size must divide its input size (windows of
    uneven sizes have no IR op; the op then stays and is reported unsupported)."""
    sizes = list(x.shape[-2:])
    out = list(output_size)
    if len(out) != 2 or any(o <= 0 or s % o for s, o in zip(sizes, out)):
        return None
    return [s // o for s, o in zip(sizes, out)]


def _adaptive_positions(size, out, device):
    """Adaptive pooling's windows along a dim of ``size`` to ``out``: output i covers
    [floor(i size / out), ceil((i + 1) size / out)) (in float32, exact for sizes below
    2^12). Each window's positions ``[out, width]``, padded to the widest by repeating
    its last (a maximum is the same with it twice), and that width."""
    width = max(-(-((i + 1) * size) // out) - (i * size) // out for i in range(out))
    i = aten.arange.start_step(0, out, 1, dtype=torch.float32, device=device)
    start = aten.floor.default(aten.div.Scalar(aten.mul.Scalar(i, size), out))
    end = aten.ceil.default(aten.div.Scalar(aten.mul.Scalar(aten.add.Scalar(i, 1), size), out))
    j = aten.arange.start_step(0, width, 1, dtype=torch.float32, device=device)
    positions = aten.minimum.default(aten.add.Tensor(aten.unsqueeze.default(start, 1), j),
                                     aten.unsqueeze.default(aten.sub.Scalar(end, 1), 1))
    return aten._to_copy.default(positions, dtype=torch.int64), width


def _adaptive_max_pool2d(x, output_size):
    """Adaptive max pooling: where the output sizes divide the input's, the plain max
    pooling it equals; otherwise each window gathered (``index_select`` of its rows, then
    of its columns), its maximum found by ``argmax`` (the first of equal ones, as
    PyTorch's) and its flat index within the input plane from the positions gathered."""
    window = _adaptive_max_window(x, output_size)
    if window is not None:
        # Both give each maximum's flat index within its input plane.
        return aten.max_pool2d_with_indices.default(x, window, window, [0, 0], [1, 1],
                                                    False)
    (height, width), (out_h, out_w) = x.shape[-2:], output_size
    rows, k_h = _adaptive_positions(height, out_h, x.device)
    cols, k_w = _adaptive_positions(width, out_w, x.device)
    lead = list(x.shape[:-2])
    cells = aten.index_select.default(aten.index_select.default(
        x, x.dim() - 2, aten.view.default(rows, [-1])), x.dim() - 1,
        aten.view.default(cols, [-1]))
    cells = aten.view.default(cells, lead + [out_h, k_h, out_w, k_w])
    n = len(lead)
    cells = aten.permute.default(cells, list(range(n)) + [n, n + 2, n + 1, n + 3])
    cells = aten.view.default(aten.clone.default(cells, memory_format=torch.contiguous_format),
                              lead + [out_h, out_w, k_h * k_w])
    pick = aten.argmax.default(cells, -1, True)
    values = aten.squeeze.dims(aten.gather.default(cells, -1, pick), [-1])
    # Each window cell's flat position in the input plane, [out_h, out_w, k_h * k_w].
    flat = aten.add.Tensor(aten.mul.Scalar(aten.view.default(rows, [out_h, 1, k_h, 1]), width),
                           aten.view.default(cols, [1, out_w, 1, k_w]))
    flat = aten.expand.default(aten.view.default(flat, [out_h, out_w, k_h * k_w]),
                               lead + [out_h, out_w, k_h * k_w])
    return values, aten.squeeze.dims(aten.gather.default(flat, -1, pick), [-1])


def _adaptive_max_pool2d_backward(grad, x, indices):
    """Each output's gradient added at its maximum's flat index in the input plane."""
    window = _adaptive_max_window(x, grad.shape[-2:])
    if window is not None:
        return aten.max_pool2d_with_indices_backward.default(grad, x, window, window,
                                                             [0, 0], [1, 1], False, indices)
    lead = list(x.shape[:-2])
    plane = x.shape[-2] * x.shape[-1]
    zeros = aten.full.default(lead + [plane], 0, dtype=grad.dtype, device=grad.device)
    flat = aten.scatter_add.default(zeros, -1, aten.view.default(indices, lead + [-1]),
                                    aten.view.default(aten.clone.default(
                                        grad, memory_format=torch.contiguous_format),
                                        lead + [-1]))
    return aten.view.default(flat, list(x.shape))


# EmbeddingBag: the bag of each index, the rows gathered, summed into their bags by an
# accumulating index_put (mean: divided by each bag's count); the gradient gathers each
# bag's gradient back to its indices and accumulates it into the weight's rows. Max bags,
# sparse gradients and scale_grad_by_freq have no decomposition here: the op then stays
# and is reported unsupported. ``mode``: 0 sum, 1 mean, 2 max.


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


def _sub_scalar(x, other, alpha=1):
    # x - alpha * other, as the IR's add with the opposite alpha.
    return aten.add.Scalar(x, other, alpha=-alpha)


def _integer_divisor_checked(x, other):
    """``remainder.Tensor`` and ``fmod.Tensor`` stay whole (``NotImplemented``); of two
    integer tensors, the divisor is checked first: PyTorch raises ``ZeroDivisionError``
    on a zero, and the graph's ``_assert_async`` fails the iteration with it."""
    if not (x.dtype.is_floating_point or other.dtype.is_floating_point):
        zero = aten.any.default(aten.eq.Scalar(other, 0))
        aten._assert_async.msg(aten.logical_not.default(zero), "ZeroDivisionError")
    return NotImplemented


def _of_result_type(a, b):
    """``a`` and ``b`` (a tensor and a tensor or a number) as two tensors of PyTorch's
    result type for them: a number becomes a 0-dim tensor."""
    dtype = torch.result_type(a, b)
    device = (a if isinstance(a, torch.Tensor) else b).device
    return tuple((aten._to_copy.default(v, dtype=dtype) if v.dtype != dtype else v)
                 if isinstance(v, torch.Tensor)
                 else aten.scalar_tensor.default(v, dtype=dtype, device=device)
                 for v in (a, b))


def _with_number(op):
    """``op.Scalar`` (``x op number``) and ``op.Scalar_Tensor`` (``number op x``) as
    ``op.Tensor`` of two tensors of PyTorch's result type: the number a 0-dim tensor."""
    return lambda a, b: op.Tensor(*_of_result_type(a, b))


def _div_mode(a, b, *, rounding_mode=None):
    """``div.Tensor_mode`` of floats as PyTorch's kernels compute it (the gradients of
    ``remainder`` and ``fmod`` by their divisor use it): ``trunc`` truncates the true
    quotient; ``floor`` is Python's floor division, from the exact ``fmod``: the
    quotient of ``a - fmod(a, b)``, one less where the remainder's sign is not ``b``'s,
    floored and rounded up past a half, a signed zero for a zero quotient, and ``a / b``
    for a zero divisor. Integers: :func:`_integer_division`."""
    dtype = torch.result_type(a, b)
    a, b = _of_result_type(a, b)
    if rounding_mode is not None and not dtype.is_floating_point:
        return _integer_division(a, b, rounding_mode, dtype)
    quotient = aten.div.Tensor(a, b)
    if rounding_mode is None:
        return quotient
    if rounding_mode == "trunc":
        return aten.trunc.default(quotient)
    mod = aten.fmod.Tensor(a, b)
    div = aten.div.Tensor(aten.sub.Tensor(a, mod), b)
    below = aten.logical_and.default(
        aten.ne.Scalar(mod, 0), aten.ne.Tensor(aten.lt.Scalar(b, 0), aten.lt.Scalar(mod, 0)))
    div = aten.where.self(below, aten.sub.Tensor(div, 1), div)
    floor = aten.floor.default(div)
    floor = aten.where.self(aten.gt.Scalar(aten.sub.Tensor(div, floor), 0.5),
                            aten.add.Tensor(floor, 1), floor)
    floor = aten.where.self(aten.ne.Scalar(div, 0), floor, aten.mul.Tensor(quotient, 0))
    return aten.where.self(aten.eq.Scalar(b, 0), quotient, floor)


_EXACT_QUOTIENTS = 2 ** 24


def _integer_division(a, b, rounding_mode, dtype):
    """Floor (``//``) or truncating division of integers, which the IR has no op for:
    ``a`` less its remainder (``remainder`` for floor, ``fmod`` for trunc; a zero divisor
    fails the iteration with PyTorch's ``ZeroDivisionError``) divided by ``b`` is the
    quotient exactly, computed as a float32, where every integer below 2^24 in magnitude
    is exact. A larger quotient fails the iteration, naming the limit, rather than be
    rounded."""
    rest = (aten.remainder.Tensor if rounding_mode == "floor" else aten.fmod.Tensor)(a, b)
    quotient = aten.div.Tensor(aten.sub.Tensor(a, rest), b)
    large = aten.any.default(aten.ge.Scalar(aten.abs.default(quotient), _EXACT_QUOTIENTS))
    aten._assert_async.msg(aten.logical_not.default(large),
                           "integer division: salus computes quotients exactly only below "
                           "2^24 in magnitude, and this one is larger")
    return aten._to_copy.default(quotient, dtype=dtype)


def _extreme_of(dtype, largest: bool):
    """The largest (or smallest) value of ``dtype``: an infinity for floats."""
    if dtype == torch.bool:
        return largest
    if dtype.is_floating_point:
        return math.inf if largest else -math.inf
    info = torch.iinfo(dtype)
    return info.max if largest else info.min


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


def _mask_order(mask, shape):
    """``mask`` broadcast to ``shape`` and flattened, and each place's position among the
    true places (a running count less one; 0 before the first)."""
    flat = aten.view.default(aten.clone.default(aten.expand.default(mask, list(shape)),
                                                memory_format=torch.contiguous_format), [-1])
    order = aten.sub.Scalar(aten.cumsum.default(flat, 0, dtype=torch.int64), 1)
    return flat, aten.clamp.default(order, 0)


def _masked_scatter(x, mask, source):
    """``masked_scatter`` (a vision-language model's image features written over its
    image tokens' embeddings): the k-th place where ``mask`` is true takes ``source``'s
    k-th element, in order; the others keep ``x``'s. A source with fewer elements than
    true places fails the iteration with an index error."""
    _, order = _mask_order(mask, x.shape)
    flat_source = aten.view.default(aten.clone.default(
        source, memory_format=torch.contiguous_format), [-1])
    taken = aten.view.default(aten.index.Tensor(flat_source, [order]), list(x.shape))
    return aten.where.self(aten.expand.default(mask, list(x.shape)), taken, x)


def _masked_scatter_backward(grad, mask, sizes):
    """The source's gradient of ``masked_scatter``: the k-th true place's gradient at the
    source's k-th element (summed in by an accumulating ``index_put``), 0 past them."""
    flat, order = _mask_order(mask, grad.shape)
    flat_grad = aten.view.default(aten.clone.default(
        grad, memory_format=torch.contiguous_format), [-1])
    values = aten.where.self(flat, flat_grad, aten.full_like.default(flat_grad, 0))
    numel = math.prod(sizes)
    zeros = aten.full.default([numel], 0, dtype=grad.dtype, device=grad.device)
    return aten.view.default(aten.index_put.default(zeros, [order], values, True), list(sizes))


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


def _nan_ignoring(extreme):
    """``fmax`` / ``fmin``: ``maximum`` / ``minimum`` where neither is NaN, else the one
    that is not (NaN when both are)."""
    def rule(a, b):
        a, b = _of_result_type(a, b)
        return aten.where.self(aten.isnan.default(b), a, aten.where.self(
            aten.isnan.default(a), b, extreme(a, b)))
    return rule


def _hypot(a, b):
    """``hypot``: the larger magnitude times sqrt(1 + r^2), r the smaller over the larger
    (no overflow or underflow on the way); 0 for two zeros, infinity where either is
    infinite (even beside a NaN, as C's)."""
    a, b = _of_result_type(a, b)
    a, b = aten.abs.default(a), aten.abs.default(b)
    larger, smaller = aten.maximum.default(a, b), aten.minimum.default(a, b)
    ratio = aten.div.Tensor(smaller, aten.where.self(
        aten.eq.Scalar(larger, 0), aten.full_like.default(larger, 1), larger))
    out = aten.mul.Tensor(larger, aten.sqrt.default(
        aten.add.Scalar(aten.mul.Tensor(ratio, ratio), 1)))
    infinite = aten.logical_or.default(aten.isinf.default(a), aten.isinf.default(b))
    return aten.where.self(infinite, aten.full_like.default(out, math.inf), out)


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


def _isnan(x):
    # NaN is the one value not equal to itself.
    return aten.logical_not.default(aten.eq.Tensor(x, x))


def _hardtanh(x, min_val=-1.0, max_val=1.0):
    return aten.clamp.default(x, min_val, max_val)


def _hardtanh_backward(grad, x, min_val, max_val):
    # PyTorch's: the gradient where min_val < x < max_val, else 0.
    inside = aten.logical_and.default(aten.gt.Scalar(x, min_val), aten.lt.Scalar(x, max_val))
    return aten.where.self(inside, grad, aten.full_like.default(grad, 0))


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


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """``linalg_vector_norm`` in ops the IR has (PyTorch 2.11 keeps it whole under
    autocast): the largest (smallest) magnitude for order inf (-inf), the count of
    non-zeros for order 0, else the p-th root of the sum of the p-th powers of the
    magnitudes."""
    if dtype is not None:
        x = aten._to_copy.default(x, dtype=dtype)
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else list(dim)
    a = aten.abs.default(x)
    if ord == float("inf"):
        return aten.amax.default(a, dims, keepdim)
    if ord == float("-inf"):
        return aten.amin.default(a, dims, keepdim)
    if ord == 0:
        nonzero = aten._to_copy.default(aten.ne.Scalar(a, 0), dtype=a.dtype)
        return aten.sum.dim_IntList(nonzero, dims, keepdim)
    if ord == 1:
        return aten.sum.dim_IntList(a, dims, keepdim)
    if ord == 2:
        return aten.sqrt.default(aten.sum.dim_IntList(aten.mul.Tensor(a, a), dims, keepdim))
    return aten.pow.Tensor_Scalar(
        aten.sum.dim_IntList(aten.pow.Tensor_Scalar(a, ord), dims, keepdim), 1.0 / ord)


# ---------------------------------------------------------------------------------------
# Ordering: sort, topk, max and min along a dim


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


def _put(x, index, source, accumulate=False):
    """``put`` (``take``'s gradient): ``source`` written, or added, at the flat positions
    of ``x`` that ``index`` names (an ``index_put`` of the flattened tensor)."""
    def flat(t):
        return aten.view.default(aten.clone.default(
            t, memory_format=torch.contiguous_format), [-1])
    return aten.view.default(aten.index_put.default(flat(x), [flat(index)], flat(source),
                                                    accumulate), list(x.shape))


def _addmv(x, mat, vec, *, beta=1, alpha=1):
    """``addmv`` (a linear layer on one unbatched vector): ``beta * x + alpha * mat @
    vec``, the product an ``mm`` with the vector as a column; ``x`` left out when beta is
    0, as PyTorch (its NaNs too)."""
    product = aten.squeeze.dims(aten.mm.default(mat, aten.unsqueeze.default(vec, 1)), [1])
    if beta == 0:
        return aten.mul.Scalar(aten.expand.default(product, list(torch.broadcast_shapes(
            x.shape, product.shape))), alpha)
    return aten.add.Tensor(aten.mul.Scalar(x, beta), product, alpha=alpha)


def _isinf(x):
    """``isinf``: a magnitude equal to infinity (never for integers)."""
    if not x.dtype.is_floating_point:
        return aten.full_like.default(x, False, dtype=torch.bool)
    return aten.eq.Scalar(aten.abs.default(x), math.inf)


def _addbmm(input, batch1, batch2, *, beta=1, alpha=1):
    """``addbmm``: ``beta * input + alpha *`` the sum over the batch of the products
    (``input`` ignored for ``beta`` 0, as PyTorch)."""
    products = aten.sum.dim_IntList(aten.bmm.default(batch1, batch2), [0])
    if beta == 0:
        return aten.mul.Scalar(products, alpha)
    return aten.add.Tensor(aten.mul.Scalar(input, beta), products, alpha=alpha)


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


# ---------------------------------------------------------------------------------------
# Comparisons and logic the IR writes with the ops it has


def _ne_tensor(a, b):
    # NaN != NaN holds, as not (NaN == NaN) does.
    return aten.logical_not.default(aten.eq.Tensor(a, b))


def _logical_or(a, b):
    return aten.logical_not.default(aten.logical_and.default(
        aten.logical_not.default(a), aten.logical_not.default(b)))


def _ge_tensor(a, b):
    # a >= b is false where either is NaN: (a > b) or (a == b), not "not (a < b)".
    return _logical_or(aten.gt.Tensor(a, b), aten.eq.Tensor(a, b))


def _le_tensor(a, b):
    return _logical_or(aten.lt.Tensor(a, b), aten.eq.Tensor(a, b))


def _bool_or(a, b):
    """``|`` of bool tensors (masks) as their logical or; integer bit operations stay
    whole and are refused by name."""
    if a.dtype != torch.bool or b.dtype != torch.bool:
        return NotImplemented
    return _logical_or(a, b)


def _bool_xor(a, b):
    if a.dtype != torch.bool or b.dtype != torch.bool:
        return NotImplemented
    return _logical_xor(a, b)


def _logical_xor(a, b):
    return aten.logical_not.default(aten.eq.Tensor(aten.logical_not.default(a),
                                                   aten.logical_not.default(b)))


# ---------------------------------------------------------------------------------------
# Padding and diagonals as gathers, concatenations and index_put


def _replication_pad_backward(grad, x, padding):
    """``replication_pad{1,2,3}d_backward``: each padded dim's gradient added back onto
    the input position it copied (the edge for every padded position), dim by dim, as an
    accumulating ``index_put``."""
    if any(p < 0 for p in padding):
        return NotImplemented
    for i in range(len(padding) // 2):
        dim = grad.dim() - 1 - i
        before, size = padding[2 * i], x.shape[dim]
        positions = aten.clamp.default(
            aten.arange.start_step(-before, grad.shape[dim] - before, dtype=torch.int64,
                                   device=grad.device), 0, size - 1)
        shape = list(grad.shape)
        shape[dim] = size
        zeros = aten.full.default(shape, 0, dtype=grad.dtype, device=grad.device)
        grad = aten.index_put.default(zeros, [None] * dim + [positions], grad, True)
    return grad


def _pad_circular(x, pad):
    """Circular padding (``F.pad(mode="circular")``) as a concatenation of the input's
    ends around it, dim by dim from the last (negative padding crops)."""
    for i in range(len(pad) // 2):
        dim = x.dim() - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before < 0:
            x = aten.slice.Tensor(x, dim, -before, x.shape[dim])
        if after < 0:
            x = aten.slice.Tensor(x, dim, 0, x.shape[dim] + after)
        size = x.shape[dim]
        parts = ([aten.slice.Tensor(x, dim, size - before, size)] if before > 0 else []) + [x]
        if after > 0:
            parts.append(aten.slice.Tensor(x, dim, 0, after))
        if len(parts) > 1:
            x = aten.cat.default(parts, dim)
    return x


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


# ---------------------------------------------------------------------------------------
# 3-d pooling as windows gathered along each dim


def _triple(value, default=None):
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        value = default
    return [value] * 3 if isinstance(value, int) else list(value) * (3 // len(value))


def _pooled_size(size, kernel, stride, pad, dilation, ceil_mode):
    """PyTorch's pooling output size (``pooling_output_shape``)."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _windows(x, outs, kernel, stride, pad, dilation, fill):
    """The pooling windows of ``x``'s last three dims as ``[..., o1, o2, o3, k1 * k2 *
    k3]``: ``x`` padded with ``fill`` (past the last window too, in ceil mode), then each
    dim's windows gathered with ``index_select`` (their gradients: accumulating
    ``index_put``s)."""
    lead = x.dim() - 3
    pads = []
    for i in reversed(range(3)):
        size = x.shape[lead + i]
        after = max(0, (outs[i] - 1) * stride[i] + (kernel[i] - 1) * dilation[i] + 1
                    - (size + pad[i]))
        pads += [pad[i], after]
    if any(pads):
        x = torch.constant_pad_nd(x, pads, fill)
    for i in range(3):
        dim = lead + 2 * i
        starts = torch.arange(outs[i], device=x.device) * stride[i]
        offsets = torch.arange(kernel[i], device=x.device) * dilation[i]
        where = (starts[:, None] + offsets[None, :]).reshape(-1)
        x = x.index_select(dim, where).unflatten(dim, (outs[i], kernel[i]))
    order = (list(range(lead)) + [lead + 2 * i for i in range(3)]
             + [lead + 2 * i + 1 for i in range(3)])
    return x.permute(order).flatten(-3)


def _max_pool3d(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """``max_pool3d_with_indices``: the largest element of each window (the first of equal
    ones) found by ``max`` along the gathered windows, and its position in the input's
    ``D * H * W`` plane, as PyTorch gives it."""
    kernel = _triple(kernel_size)
    stride, pad, dilation = _triple(stride, kernel), _triple(padding), _triple(dilation)
    sizes = list(x.shape[-3:])
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], pad[i], dilation[i], ceil_mode)
            for i in range(3)]
    fill = (float("-inf") if x.dtype.is_floating_point else torch.iinfo(x.dtype).min)
    values, local = _windows(x, outs, kernel, stride, pad, dilation, fill).max(-1)
    place = [torch.arange(outs[i], device=x.device)[:, None] * stride[i] - pad[i]
             + torch.arange(kernel[i], device=x.device)[None, :] * dilation[i]
             for i in range(3)]
    flat = ((place[0][:, None, None, :, None, None] * sizes[1]
             + place[1][None, :, None, None, :, None]) * sizes[2]
            + place[2][None, None, :, None, None, :])
    flat = flat.reshape(*outs, -1).expand(*local.shape, kernel[0] * kernel[1] * kernel[2])
    indices = flat.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    return values, indices


def _avg_pool3d(x, kernel_size, stride=(), padding=0, ceil_mode=False,
                count_include_pad=True, divisor_override=None):
    """``avg_pool3d``: the sum of each zero-padded window over PyTorch's divisor (the
    window clipped to the padded input, or to the input without ``count_include_pad``,
    or ``divisor_override``), a constant of the output's positions."""
    kernel = _triple(kernel_size)
    stride, pad = _triple(stride, kernel), _triple(padding)
    sizes = list(x.shape[-3:])
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], pad[i], 1, ceil_mode)
            for i in range(3)]
    sums = _windows(x, outs, kernel, stride, pad, [1, 1, 1], 0.0).sum(-1)
    if divisor_override:
        return sums / divisor_override
    factors = []
    for i in range(3):
        per = []
        for o in range(outs[i]):
            start = o * stride[i] - pad[i]
            end = min(start + kernel[i], sizes[i] + pad[i])
            if not count_include_pad:
                start, end = max(start, 0), min(end, sizes[i])
            per.append(end - start)
        factors.append(torch.tensor(per, dtype=x.dtype, device=x.device))
    divisor = (factors[0][:, None, None] * factors[1][None, :, None]
               * factors[2][None, None, :])
    return sums / divisor


# ---------------------------------------------------------------------------------------
# Connectionist temporal classification

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


# ---------------------------------------------------------------------------------------
# Products and samplers PyTorch keeps whole with hand-written gradients


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


# ---------------------------------------------------------------------------------------
# Trigonometric, hyperbolic and base-2/10 functions in the IR's sin, cos, atan, atan2,
# exp, expm1, log, log1p and pow: each as precise as its formula's few roundings allow


def _tan(x):
    return aten.div.Tensor(aten.sin.default(x), aten.cos.default(x))


def _sinh(x):
    # (e^x - e^-x) / 2 through expm1: no cancellation near 0.
    return aten.mul.Scalar(aten.sub.Tensor(aten.expm1.default(x),
                                           aten.expm1.default(aten.neg.default(x))), 0.5)


def _cosh(x):
    return aten.mul.Scalar(aten.add.Tensor(aten.exp.default(x),
                                           aten.exp.default(aten.neg.default(x))), 0.5)


def _one_minus_square(x):
    # (1 - x)(1 + x): 1 - x^2 without its cancellation near |x| = 1.
    return aten.mul.Tensor(aten.add.Scalar(aten.neg.default(x), 1.0), aten.add.Scalar(x, 1.0))


def _asin(x):
    return aten.atan2.default(x, aten.sqrt.default(_one_minus_square(x)))


def _acos(x):
    return aten.atan2.default(aten.sqrt.default(_one_minus_square(x)), x)


def _atanh(x):
    # sign(x) log1p(2|x| / (1 - |x|)) / 2: exact near 0, and log1p of a positive number
    # (of a negative one near -1 it would lose the division's rounding to cancellation).
    a = aten.abs.default(x)
    half = aten.mul.Scalar(aten.log1p.default(aten.div.Tensor(
        aten.mul.Scalar(a, 2.0), aten.add.Scalar(aten.neg.default(a), 1.0))), 0.5)
    return aten.mul.Tensor(aten.sign.default(x), half)


_HUGE = 2.0 ** 28  # past it, sqrt(1 + x^2) is |x| in float32 and x^2 may overflow


def _asinh(x):
    """``sign(x) log1p(|x| + x^2 / (1 + sqrt(1 + x^2)))`` (exact near 0), and
    ``sign(x) (log|x| + log 2)`` for huge ``|x|``."""
    a = aten.abs.default(x)
    square = aten.mul.Tensor(a, a)
    small = aten.log1p.default(aten.add.Tensor(a, aten.div.Tensor(
        square, aten.add.Scalar(aten.sqrt.default(aten.add.Scalar(square, 1.0)), 1.0))))
    large = aten.add.Scalar(aten.log.default(a), math.log(2.0))
    return aten.mul.Tensor(aten.sign.default(x),
                           aten.where.self(aten.gt.Scalar(a, _HUGE), large, small))


def _acosh(x):
    """``log1p(t + sqrt(2t + t^2))`` with ``t = x - 1`` (exact near 1), and ``log x +
    log 2`` for huge ``x``; NaN below 1."""
    t = aten.add.Scalar(x, -1.0)
    near = aten.log1p.default(aten.add.Tensor(t, aten.sqrt.default(
        aten.add.Tensor(aten.mul.Scalar(t, 2.0), aten.mul.Tensor(t, t)))))
    large = aten.add.Scalar(aten.log.default(x), math.log(2.0))
    return aten.where.self(aten.gt.Scalar(x, _HUGE), large, near)


def _log_base(base):
    def log(x):
        return aten.mul.Scalar(aten.log.default(x), 1.0 / math.log(base))
    return log


def _exp2(x):
    return aten.pow.Scalar(2.0, x)


def decomposition_table() -> dict:
    """Core ATen's decompositions, without those of the ops of ``_KEPT_WHOLE`` (reflection
    padding, layer norm's backward, fused attention), with batch norm's (its functional
    op stays whole in training where the IR has it, eval mode becomes arithmetic), and
    with the rules of this module for what Core ATen keeps whole and the IR lacks: dropout
    and every random draw (``rand``, ``randn``, ``normal_``, ``uniform_``, ``exponential_``,
    ``randint``, ``randperm``, ``RReLU``'s slopes) from the session's generator, pooling and padding
    variants, ``EmbeddingBag``, ``repeat``, ``unfold``, grouped-query attention, ``sort``
    and ``topk``, ``max``/``min`` along a dim, comparisons and logic of two tensors,
    diagonals, trigonometric and hyperbolic functions, ``scatter_reduce``'s sums and
    means, ``masked_scatter``, and running extremes and log-sum-exps (scans). Each
    function's docstring says
    what it writes; :func:`composite_decompositions` adds the rules that must run above
    autograd."""
    table = dict(core_aten_decompositions().items())
    for name in _KEPT_WHOLE:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            table.pop(getattr(packet, overload), None)
    for name in _BATCH_NORM_OPS:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            if overload.endswith("out"):
                continue
            op = getattr(packet, overload)
            if op in _all_decompositions:
                table[op] = _all_decompositions[op]
    # Training-mode batch norm stays whole (forward: input, weight?, bias?, running_mean,
    # running_var, training; backward: grad_out, input, weight?, running stats?, save_mean,
    # save_invstd, train).
    forward = aten._native_batch_norm_legit_functional.default
    table[forward] = _batch_norm_whole(table[forward], 5, (0,), (1, 2, 3, 4), (3, 4))
    backward = aten.native_batch_norm_backward.default
    table[backward] = _batch_norm_whole(table[backward], 7, (0, 1), (2, 5, 6), (5, 6), (5, 6))
    table[aten.var_mean.correction] = _var_mean
    table[aten.adaptive_avg_pool2d.default] = _adaptive_avg_pool2d
    table[aten.native_dropout.default] = _native_dropout
    table[aten.rand_like.default] = _rand_like
    table[aten.clamp.Tensor] = _clamp_tensor
    table[aten.any.dims] = _any_dims
    table[aten.any.default] = _any_dims  # of every element: every dim
    table[aten.unfold.default] = _unfold
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = flash_attention
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = (
        flash_attention_backward)
    table[aten.randn_like.default] = _randn_like
    table[aten.rand.default] = _rand
    table[aten.randn.default] = _randn
    table[aten.hardtanh.default] = _hardtanh
    table[aten.hardtanh_backward.default] = _hardtanh_backward
    table[aten.slice_backward.default] = _slice_backward
    table[aten.slice_scatter.default] = _slice_scatter
    table.setdefault(aten.linalg_vector_norm.default, _vector_norm)
    # Core ATen keeps these whole; PyTorch's own decompositions are of IR ops (repeat: an
    # expand and a copy; elu and its gradient: expm1, exp and selects).
    for op in (aten.repeat.default, aten.elu.default, aten.elu_backward.default):
        table.setdefault(op, _all_decompositions[op])
    table[aten.isnan.default] = _isnan
    table[aten.scatter_reduce.two] = _scatter_reduce
    table[aten.masked_scatter.default] = _masked_scatter
    table[aten.bucketize.Tensor] = _bucketize
    table[aten.bucketize.Scalar] = _bucketize
    table[aten.searchsorted.Tensor] = _searchsorted
    table[aten.searchsorted.Scalar] = _searchsorted
    table[aten.fmax.default] = _nan_ignoring(aten.maximum.default)
    table[aten.fmin.default] = _nan_ignoring(aten.minimum.default)
    table[aten.hypot.default] = _hypot
    table[aten.cummax.default] = _running_extreme(True)
    table[aten.cummin.default] = _running_extreme(False)
    table[aten.logcumsumexp.default] = _logcumsumexp
    table[aten.masked_scatter_backward.default] = _masked_scatter_backward
    for op in (aten.remainder, aten.fmod):
        table[op.Tensor] = _integer_divisor_checked
        table[op.Scalar] = _with_number(op)
    table[aten.remainder.Scalar_Tensor] = _with_number(aten.remainder)
    table[aten.div.Tensor_mode] = _div_mode
    table[aten.div.Scalar_mode] = _div_mode
    table[aten.sub.Scalar] = _sub_scalar
    table[aten._embedding_bag.default] = _embedding_bag
    table[aten._embedding_bag_forward_only.default] = _embedding_bag
    table[aten._embedding_bag_backward.default] = _embedding_bag_backward
    table[aten._embedding_bag_dense_backward.default] = _embedding_bag_dense_backward
    table[aten.adaptive_max_pool2d.default] = _adaptive_max_pool2d
    table[aten.adaptive_max_pool2d_backward.default] = _adaptive_max_pool2d_backward
    table[aten.empty.memory_format] = _empty
    table[aten.empty_permuted.default] = _empty_permuted
    table[aten.normal_functional.default] = _normal_functional
    for overload in ("Tensor_Tensor", "Tensor_float", "float_Tensor"):
        table[getattr(aten.normal, overload)] = _normal_tensors
    table[aten.normal.float_float] = _normal_numbers
    table[aten.uniform.default] = _uniform
    table[aten.exponential.default] = _exponential
    table[aten.rrelu_with_noise_functional.default] = _rrelu_with_noise
    table[aten.rrelu_with_noise_backward.default] = _rrelu_with_noise_backward
    table[aten.randint.low] = _randint_low
    table[aten.randint.default] = _randint
    table[aten.randint_like.low_dtype] = _randint_like_low
    table[aten.randint_like.default] = _randint_like
    table[aten.randperm.default] = _randperm
    for name, rule in (("tan", _tan), ("sinh", _sinh), ("cosh", _cosh), ("asin", _asin),
                       ("acos", _acos), ("atanh", _atanh), ("asinh", _asinh),
                       ("acosh", _acosh), ("log2", _log_base(2.0)),
                       ("log10", _log_base(10.0)), ("exp2", _exp2)):
        table[getattr(aten, name).default] = rule
    table[aten.sort.default] = _sort
    table[aten.topk.default] = _topk
    table[aten.max.dim] = _max_dim
    table[aten.kthvalue.default] = _kthvalue
    table[aten.median.dim] = _median_dim
    table[aten.median.default] = _median
    table[aten.put.default] = _put
    table[aten.addmv.default] = _addmv
    table[aten.nanmedian.dim] = _nanmedian_dim
    table[aten.nanmedian.default] = _nanmedian
    table[aten.isinf.default] = _isinf
    table[aten.addbmm.default] = _addbmm
    table[aten.min.dim] = _min_dim
    table[aten.amin.default] = _amin
    table[aten.prod.dim_int] = _prod_dim
    table[aten.prod.default] = _prod
    table[aten.max.default] = lambda x: _whole_extreme(aten.amax.default, x)
    table[aten.min.default] = lambda x: _whole_extreme(aten.amin.default, x)
    table[aten.ne.Tensor] = _ne_tensor
    table[aten.ge.Tensor] = _ge_tensor
    table[aten.le.Tensor] = _le_tensor
    table[aten.logical_or.default] = _logical_or
    table[aten.logical_xor.default] = _logical_xor
    table[aten.bitwise_or.Tensor] = _bool_or
    table[aten.bitwise_xor.Tensor] = _bool_xor
    for name in ("replication_pad1d_backward", "replication_pad2d_backward",
                 "replication_pad3d_backward"):
        table[getattr(aten, name).default] = _replication_pad_backward
    table[aten._pad_circular.default] = _pad_circular
    table[aten.diagonal.default] = _diagonal
    table[aten.diagonal_scatter.default] = _diagonal_scatter
    return table


def _lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
          batch_first):
    """``nn.LSTM`` (``lstm.input``) unrolled over time as PyTorch's Python rule writes it
    (each step's gates ``linear(h, W_hh, b_hh) + linear(x, W_ih, b_ih)[t]``, chunked in
    four: input, forget, cell and output gates), with the hidden state [B, H]: every
    layer and direction, projections (``proj_size``), dropout between layers (the
    session's generator), ``batch_first``. PyTorch's own rule, which the Python
    dispatcher would run, keeps the state [1, B, H], and its backward adds a gradient of
    shape [1, B, 4H] into one of [B, 4H] and fails ("output with shape ... doesn't match
    the broadcast shape"); without any Python rule its C++ composite runs oneDNN's fused
    layer, which the IR has no op for."""
    h0, c0 = hx
    directions = 2 if bidirectional else 1
    projected = h0.size(2) != c0.size(2)
    per = (4 if has_biases else 2) + (1 if projected else 0)
    x = input.transpose(0, 1) if batch_first else input
    last_h, last_c = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            p = params[k * per:(k + 1) * per]
            b_ih, b_hh = (p[2], p[3]) if has_biases else (None, None)
            w_hr = p[-1] if projected else None
            h, c = h0[k], c0[k]
            inputs = F.linear(x, p[0], b_ih)
            length = inputs.size(0)
            out = [None] * length
            for t in (reversed(range(length)) if direction else range(length)):
                gates = F.linear(h, p[1], b_hh) + inputs[t]
                i, f, g, o = gates.chunk(4, 1)
                c = f.sigmoid() * c + i.sigmoid() * g.tanh()
                h = o.sigmoid() * c.tanh()
                if w_hr is not None:
                    h = F.linear(h, w_hr)
                out[t] = h
            outputs.append(torch.stack(out))
            last_h.append(h)
            last_c.append(c)
        x = torch.cat(outputs, 2) if directions == 2 else outputs[0]
        if dropout and train and layer < num_layers - 1:
            x = F.dropout(x, dropout, True)
    return (x.transpose(0, 1) if batch_first else x), torch.stack(last_h), torch.stack(last_c)


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


# Ops no table entry can replace, because they are decided before the dispatcher's tracing
# sees them. CompositeImplicitAutograd ops PyTorch writes out in C++ (circular padding
# becomes strided copies the IR has no op for; bilinear layers and cdist become ops with
# hand-written gradients), and ops whose gradient is a kernel of its own
# (``grid_sampler_2d_backward``): run as Python rules above autograd, their gradient is
# that of the IR ops they are written in. While a step records they run as these rules.
_ABOVE_AUTOGRAD = {
    (aten.lstm.input, DispatchKey.CompositeImplicitAutograd): _lstm,
    (aten.lstm.input, DispatchKey.Autograd): _lstm,
    # Attention with dropout as PyTorch's efficient op (salus.attention).
    (aten.scaled_dot_product_attention.default, DispatchKey.CompositeImplicitAutograd):
        attention_with_dropout,
    (aten._pad_circular.default, DispatchKey.CompositeImplicitAutograd): _pad_circular,
    (aten.bilinear.default, DispatchKey.CompositeImplicitAutograd): _bilinear,
    (aten.cdist.default, DispatchKey.CompositeImplicitAutograd): _cdist,
    (aten.pdist.default, DispatchKey.CompositeImplicitAutograd): _pdist,
    (aten.ctc_loss.IntList, DispatchKey.CompositeImplicitAutograd): _ctc_loss,
    (aten.ctc_loss.Tensor, DispatchKey.CompositeImplicitAutograd): _ctc_loss,
    (aten.max_pool3d_with_indices.default, DispatchKey.Autograd): _max_pool3d,
    (aten.avg_pool3d.default, DispatchKey.Autograd): _avg_pool3d,
    # A product's gradient without PyTorch's read of a value; index_reduce as a
    # scatter_reduce (its own gradient reads one too).
    (aten.scatter_reduce.two, DispatchKey.Autograd): _scatter_reduce_autograd,
    (aten.index_reduce.default, DispatchKey.Autograd): _index_reduce,
    # PyTorch's own decomposition (bilinear, nearest and bicubic sampling, every padding
    # mode), in gathers and arithmetic.
    (aten.grid_sampler_2d.default, DispatchKey.Autograd):
        _all_decompositions.get(aten.grid_sampler_2d.default),
}


@contextlib.contextmanager
def composite_decompositions() -> Iterator[None]:
    """Installs the rules of ``_ABOVE_AUTOGRAD`` for the Python dispatcher (which a
    recording enables), setting aside a Python rule PyTorch has for the same op and key
    (its LSTM's), and puts everything back after, so nothing outside a trace changes."""
    keys = [(op, key) for (op, key), rule in _ABOVE_AUTOGRAD.items() if rule is not None]
    set_aside = [(op, key, op.py_kernels.pop(key, None)) for op, key in keys]
    for op, key in keys:
        op.py_impl(key)(_ABOVE_AUTOGRAD[op, key])
    _clear_dispatch_caches(op for op, _ in keys)
    try:
        yield
    finally:
        for op, key, theirs in set_aside:
            op.py_kernels.pop(key, None)
            if theirs is not None:
                op.py_kernels[key] = theirs
        _clear_dispatch_caches(op for op, _ in keys)


def _clear_dispatch_caches(ops) -> None:
    for op in ops:
        cache = getattr(op, "_dispatch_cache", None)
        if cache is not None:
            cache.clear()

