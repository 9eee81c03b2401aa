"""Elementwise arithmetic and functions the IR has no op for: division and remainders of
integers and with numbers, comparisons and logic of two tensors, trigonometric and
hyperbolic functions, NaN-ignoring extremes, ``hypot``, ``addbmm``, ``addmv``, norms."""

from __future__ import annotations

import math

import torch

from .common import _of_result_type

aten = torch.ops.aten


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


def _isnan(x):
    # NaN is the one value not equal to itself.
    return aten.logical_not.default(aten.eq.Tensor(x, x))


def _hardtanh(x, min_val=-1.0, max_val=1.0):
    return aten.clamp.default(x, min_val, max_val)


def _hardtanh_backward(grad, x, min_val, max_val):
    # PyTorch's: the gradient where min_val < x < max_val, else 0.
    inside = aten.logical_and.default(aten.gt.Scalar(x, min_val), aten.lt.Scalar(x, max_val))
    return aten.where.self(inside, grad, aten.full_like.default(grad, 0))


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


# Trigonometric, hyperbolic and base-2/10 functions in the IR's sin, cos, atan, atan2,
# exp, expm1, log, log1p and pow: each as precise as its formula's few roundings allow.


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


def _signbit(x):
    """``signbit``: negative, or a negative zero (``1 / x`` is ``-inf``); of integers,
    negative. A NaN counts as positive: the IR's ops cannot read a NaN's sign bit."""
    if x.dtype == torch.bool:
        return aten.logical_and.default(x, aten.logical_not.default(x))
    negative = aten.lt.Scalar(x, 0)
    if not x.dtype.is_floating_point:
        return negative
    zero = aten.logical_and.default(aten.eq.Scalar(x, 0),
                                    aten.lt.Scalar(aten.reciprocal.default(x), 0))
    return aten.logical_or.default(negative, zero)


def _copysign(a, b):
    """``copysign``: ``|a|`` with ``b``'s sign (:func:`_signbit`), of PyTorch's result
    type (floats; integers become the default float type)."""
    dtype = torch.result_type(a, b)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    a, b = (aten._to_copy.default(v, dtype=dtype) if isinstance(v, torch.Tensor)
            and v.dtype != dtype else v for v in _of_result_type(a, b))
    magnitude = aten.abs.default(a)
    return aten.where.self(_signbit(b), aten.neg.default(magnitude), magnitude)


def _angle(x):
    """``angle`` of real numbers: pi for negative ones, 0 otherwise, NaN for NaN (as
    PyTorch's); of integers, as the default float type."""
    if not x.dtype.is_floating_point:
        x = aten._to_copy.default(x, dtype=torch.get_default_dtype())
    half_turns = aten.where.self(aten.lt.Scalar(x, 0), aten.full_like.default(x, math.pi),
                                 aten.full_like.default(x, 0))
    return aten.where.self(_isnan(x), x, half_turns)
