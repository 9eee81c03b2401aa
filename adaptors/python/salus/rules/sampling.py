"""Random draws in a step, from the session's generator: dropout, ``rand``, ``randn``,
``normal_``, ``uniform_``, ``exponential_``, ``randint``, ``randperm``, ``multinomial``
and ``RReLU``'s slopes."""

from __future__ import annotations

import math
from typing import Callable

import torch

from .common import _zeros

aten = torch.ops.aten


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


def _multinomial(probs, num_samples, replacement=False, *, generator=None):
    """``multinomial`` (``Categorical.sample``, a policy's actions) from the session's
    generator, for rows of non-negative weights: with replacement by the inverse of each
    row's running sum (a uniform draw counts the categories whose cumulative share is at
    most it, so a category of weight 0 is never drawn); without, as PyTorch's own kernel
    does it, the ``num_samples`` largest of ``weight / e`` for exponential draws ``e``.
    PyTorch's checks of the weights (finite, not negative, a positive sum) fail the
    iteration with its messages."""
    if generator is not None:
        return NotImplemented
    categories = probs.shape[-1]
    if not replacement and num_samples > categories:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           "replacement")
    weights = probs if probs.dtype == torch.float32 else probs.to(torch.float32)
    valid = ((weights >= 0) & (weights.abs() != math.inf)).all()  # NaN fails >= 0
    torch._assert_async(valid, "probability tensor contains either `inf`, `nan` or "
                               "element < 0")
    torch._assert_async((weights.sum(-1) > 0).all(),
                        "invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement:
        e = -torch.log1p(-torch.rand_like(weights))
        keys = weights / e
        return keys.topk(num_samples, -1).indices
    running = weights.cumsum(-1)
    shares = running / running[..., -1:]
    u = torch.rand(*weights.shape[:-1], num_samples, device=weights.device)
    return (shares.unsqueeze(-2) <= u.unsqueeze(-1)).sum(-1)
