"""How each HLO op runs with PyTorch ops: ``RULES[opcode](interpreter, instruction,
operands, constant)``.

``constant`` is True when every operand is known before the step runs: the rule then gets
plain tensors and may use any PyTorch op (the result folds into the graph). Otherwise
operands are traced tensors or :class:`Const` values, and the rule uses only ops whose
Core ATen form the IR has (``proto/salus/v1/ops.txt``), composing XLA's semantics from
them where the IR has no single op (``docs/frontends.md``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..errors import LoweringError
from .parse import Shape, WindowDim, int_list, split_top, window

aten = torch.ops.aten

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "f64": torch.float64, "s64": torch.int64, "s32": torch.int32, "s16": torch.int16,
          "s8": torch.int8, "u8": torch.uint8, "pred": torch.bool}

# Ops whose u32 results wrap at 2^32, which no IR dtype does.
WRAPPING = {"add", "subtract", "multiply", "negate", "power", "shift-left",
            "shift-right-logical", "shift-right-arithmetic", "not"}


@dataclass(frozen=True)
class Const:
    """A value known before the step runs (no parameter reaches it): its folded
    ``tensor``, and the ``recipe`` that computes it inside the graph (None for a literal).

    A constant reaches the graph as ops, never as a captured tensor, wherever it can: a
    splat as one ``full``, a computed one (an iota and what is built from it) by running
    its recipe. So a step traced for another batch size has the same persistent tensors
    as the first, which salusd requires of a session's programs."""

    tensor: torch.Tensor
    recipe: Callable[[], torch.Tensor] | None = field(default=None, compare=False)

    @functools.cached_property
    def splat(self) -> Any:
        """The one value of every element, or None (looked at once per constant)."""
        t = self.tensor
        if t.numel() == 0:
            return None
        with disable_proxy_modes_tracing():
            first = t.reshape(-1)[0]
            if t.numel() == 1 or bool((t == first).all()) or (
                    t.is_floating_point() and bool(torch.isnan(t).all())):
                return first.item()
        return None


def torch_dtype(shape: Shape, where: str) -> torch.dtype:
    if shape.dtype == "u32":
        # Positions (JAX's sort gradient permutes an iota of u32) inside the step: held as
        # i64, which keeps every u32 value; arithmetic that wraps at 2^32 is refused
        # (WRAPPING), and u32 parameters and random bits stay outside the graph.
        return torch.int64
    if shape.dtype not in DTYPES:
        raise LoweringError(f"{where}: element type {shape.dtype} is not supported")
    return DTYPES[shape.dtype]


# -- operands -----------------------------------------------------------------------------


def dense(value: Any) -> torch.Tensor:
    """A tensor of the value's full shape: a splat constant as one ``full``, another
    constant by its recipe (a literal as a captured tensor)."""
    if not isinstance(value, Const):
        return value
    splat = value.splat
    if splat is not None:
        return torch.full(tuple(value.tensor.shape), splat, dtype=value.tensor.dtype)
    return value.recipe() if value.recipe is not None else value.tensor


def _broadcastable(value: Any) -> torch.Tensor:
    """For elementwise ops: a splat constant as a 0-dim ``full``, broadcast by the op."""
    if isinstance(value, Const) and value.splat is not None:
        return torch.full((), value.splat, dtype=value.tensor.dtype)
    return dense(value)


def _splat(value: Any) -> Any:
    """The Python number of a splat constant, else None (a computed value)."""
    return value.splat if isinstance(value, Const) else None


def _scalar(value: Any, constant: bool, what: str) -> Any:
    """The number every element of ``value`` holds, which must be known before the step
    runs (``constant``: ``value`` is a plain tensor)."""
    number = value.reshape(-1)[0].item() if constant else _splat(value)
    if number is None:
        raise LoweringError(f"{what} must be a constant scalar")
    return number


def _dtype(i) -> torch.dtype:
    return torch_dtype(i.shape, i.name)


# -- elementwise --------------------------------------------------------------------------


def _binary(fn):
    def rule(_, i, operands, constant):
        a, b = (operands if constant else [_broadcastable(o) for o in operands])
        return fn(a, b, i)
    return rule


def _remainder(a, b, i):
    """XLA's remainder: C's fmod (the dividend's sign); an integer divisor of 0 leaves the
    dividend, as XLA defines it (PyTorch's ``fmod`` would fail the iteration)."""
    if _dtype(i).is_floating_point:
        return torch.fmod(a, b)
    zero = b == 0
    return torch.where(zero, a, torch.fmod(a, torch.where(zero, torch.ones_like(b), b)))


def _divide(a, b, i):
    if _dtype(i).is_floating_point:
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


def _power(_, i, operands, constant):
    base, exponent = operands
    if constant:
        return torch.pow(base, exponent)
    e, b = _splat(exponent), _splat(base)
    if e is not None:
        return torch.pow(base, e)
    if b is not None:
        return torch.pow(b, exponent)
    if _dtype(i).is_floating_point:
        return torch.pow(base, exponent)
    raise LoweringError("an integer power of two computed tensors has no IR op")


def _logical(kind):
    def rule(_, i, operands, constant):
        a, b = (operands if constant else [dense(o) for o in operands])
        if _dtype(i) != torch.bool:
            if constant:
                return {"and": torch.bitwise_and, "or": torch.bitwise_or,
                        "xor": torch.bitwise_xor}[kind](a, b)
            if kind != "and":
                raise LoweringError(f"integer {kind} has no IR op")
            return torch.bitwise_and(a, b)
        if kind == "and":
            return torch.logical_and(a, b)
        if kind == "or":
            return torch.logical_not(torch.logical_and(torch.logical_not(a),
                                                       torch.logical_not(b)))
        return torch.logical_not(torch.eq(a, b))
    return rule


def _not(_, i, operands, constant):
    (x,) = operands
    return torch.logical_not(x) if x.dtype == torch.bool else torch.bitwise_not(x)


def _unary(fn):
    return lambda _, i, operands, constant: fn(operands[0])


_FLIP = {"EQ": "EQ", "NE": "NE", "LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}
_SCALAR_COMPARE = {"EQ": torch.eq, "NE": torch.ne, "LT": torch.lt, "GT": torch.gt,
                   "LE": torch.le, "GE": torch.ge}


def _compare(_, i, operands, constant):
    direction = i.attributes["direction"]
    a, b = operands
    if constant:
        return _SCALAR_COMPARE[direction](a, b)
    if _splat(b) is not None and not isinstance(a, Const):
        return _SCALAR_COMPARE[direction](a, _splat(b))
    if _splat(a) is not None and not isinstance(b, Const):
        return _SCALAR_COMPARE[_FLIP[direction]](b, _splat(a))
    a, b = _broadcastable(a), _broadcastable(b)
    if direction == "EQ":
        return torch.eq(a, b)
    if direction == "NE":
        return torch.logical_not(torch.eq(a, b))
    if direction in ("LT", "GT"):
        return torch.lt(a, b) if direction == "LT" else torch.gt(a, b)
    strict = torch.lt(a, b) if direction == "LE" else torch.gt(a, b)
    # a <= b is a < b or a == b (false for NaN, as XLA's)
    return torch.logical_not(torch.logical_and(torch.logical_not(strict),
                                               torch.logical_not(torch.eq(a, b))))


def _select(_, i, operands, constant):
    pred, on_true, on_false = operands
    if not constant and isinstance(pred, Const) and pred.splat is not None:
        return dense(on_true if pred.splat else on_false)
    if constant:
        return torch.where(pred, on_true, on_false)
    return torch.where(dense(pred), _broadcastable(on_true), _broadcastable(on_false))


def _clamp(_, i, operands, constant):
    low, x, high = operands
    if constant:
        return torch.minimum(torch.maximum(x, low), high)
    lo, hi = _splat(low), _splat(high)
    if lo is not None and hi is not None:
        return torch.clamp(dense(x), lo, hi)
    return torch.minimum(torch.maximum(dense(x), _broadcastable(low)), _broadcastable(high))


def _convert(_, i, operands, constant):
    return operands[0].to(_dtype(i))


def _is_finite(_, i, operands, constant):
    return torch.lt(torch.abs(operands[0]), math.inf)


# -- structure ----------------------------------------------------------------------------


def _broadcast(_, i, operands, constant):
    x = operands[0] if constant else dense(operands[0])
    dims = int_list(i.attributes.get("dimensions", "{}"))
    order = sorted(range(len(dims)), key=lambda k: dims[k])
    if order != list(range(len(dims))):
        x = x.permute(order)
        dims = sorted(dims)
    view = [1] * len(i.shape.dims)
    for k, d in enumerate(dims):
        view[d] = x.shape[k]
    return x.reshape(view).expand(i.shape.dims)


def _reshape(_, i, operands, constant):
    x = operands[0] if constant else dense(operands[0])
    return x.reshape(i.shape.dims)


def _transpose(_, i, operands, constant):
    x = operands[0] if constant else dense(operands[0])
    return x.permute(int_list(i.attributes["dimensions"]))


def _reverse(_, i, operands, constant):
    return torch.flip(operands[0] if constant else dense(operands[0]),
                      int_list(i.attributes["dimensions"]))


def _slice(_, i, operands, constant):
    x = operands[0] if constant else dense(operands[0])
    index = []
    for part in split_top(i.attributes["slice"].strip()[1:-1]):
        bounds = [int(v) for v in part.strip("[]").split(":")]
        index.append(slice(bounds[0], bounds[1], bounds[2] if len(bounds) > 2 else 1))
    return x[tuple(index)]


def _concatenate(_, i, operands, constant):
    parts = operands if constant else [dense(o) for o in operands]
    return torch.cat(parts, dim=int_list(i.attributes["dimensions"])[0])


def pad(x: torch.Tensor, amounts: dict[int, tuple[int, int]], value: Any = 0):
    """``x`` padded (or cropped, by negative amounts) by ``{dim: (before, after)}``."""
    amounts = {d: p for d, p in amounts.items() if p != (0, 0)}
    if not amounts:
        return x
    flat: list[int] = []
    for d in range(x.dim() - 1, min(amounts) - 1, -1):
        flat.extend(amounts.get(d, (0, 0)))
    return torch.constant_pad_nd(x, flat, value)


def dilate(x: torch.Tensor, dim: int, factor: int, value: Any = 0) -> torch.Tensor:
    """``factor - 1`` elements of ``value`` between neighbours along ``dim``."""
    n = x.shape[dim]
    if factor == 1 or n == 0:
        return x
    spread = pad(x.unsqueeze(dim + 1), {dim + 1: (0, factor - 1)}, value)
    shape = list(x.shape)
    shape[dim] = n * factor
    return spread.reshape(shape).narrow(dim, 0, (n - 1) * factor + 1)


def _pad(_, i, operands, constant):
    x, value = operands
    value = _scalar(value, constant, "a pad's value")
    x = x if constant else dense(x)
    amounts = {}
    for d, part in enumerate(i.attributes["padding"].split("x")):
        numbers = [int(v) for v in part.split("_")]
        if len(numbers) > 2 and numbers[2]:
            x = dilate(x, d, numbers[2] + 1, value)
        amounts[d] = (numbers[0], numbers[1])
    return pad(x, amounts, value)


# -- compute ------------------------------------------------------------------------------


def _same_dtype(i, operands):
    """Operands in the result's dtype (a dot or convolution whose result is wider than
    its inputs, e.g. bf16 x bf16 -> f32, computes in the wider type: the products are
    exact there, as XLA's)."""
    dtype = _dtype(i)
    return [o if o.dtype == dtype else o.to(dtype) for o in operands]


def _dot(_, i, operands, constant):
    lhs, rhs = operands if constant else [dense(o) for o in operands]
    lhs, rhs = _same_dtype(i, [lhs, rhs])
    a = i.attributes
    lb, lc = int_list(a.get("lhs_batch_dims", "{}")), int_list(a.get("lhs_contracting_dims", "{}"))
    rb, rc = int_list(a.get("rhs_batch_dims", "{}")), int_list(a.get("rhs_contracting_dims", "{}"))
    lf = [d for d in range(lhs.dim()) if d not in lb + lc]
    rf = [d for d in range(rhs.dim()) if d not in rb + rc]
    size = lambda t, dims: math.prod(t.shape[d] for d in dims)  # noqa: E731
    left = _permuted(lhs, lb + lf + lc).reshape(size(lhs, lb), size(lhs, lf), size(lhs, lc))
    right = _permuted(rhs, rb + rc + rf).reshape(size(rhs, rb), size(rhs, rc), size(rhs, rf))
    if lb:
        out = torch.bmm(left, right)
    else:
        out = torch.mm(left[0], right[0])
    return out.reshape(i.shape.dims)


def _permuted(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    return x if order == list(range(x.dim())) else x.permute(order)


def _convolution(_, i, operands, constant):
    lhs, rhs = operands if constant else [dense(o) for o in operands]
    lhs, rhs = _same_dtype(i, [lhs, rhs])
    labels = i.attributes["dim_labels"]
    kernel_part, out_labels = labels.split("->")
    lhs_labels, rhs_labels = kernel_part.split("_")
    spatial = len(lhs_labels) - 2
    groups = int(i.attributes.get("feature_group_count", "1"))
    batch_groups = int(i.attributes.get("batch_group_count", "1"))
    dims = window(i.attributes.get("window", "{}"), spatial)
    x = _permuted(lhs, [lhs_labels.index("b"), lhs_labels.index("f")]
                  + [lhs_labels.index(str(k)) for k in range(spatial)])
    if batch_groups != 1:
        # The batch splits into batch_groups runs and the output features into as many
        # runs: output feature run g convolves batch run g. That is a convolution grouped
        # by features once batch run g becomes the g-th run of input features.
        x = _batch_groups_as_features(x, batch_groups)
        groups = batch_groups
    w = _permuted(rhs, [rhs_labels.index("o"), rhs_labels.index("i")]
                  + [rhs_labels.index(str(k)) for k in range(spatial)])
    where = {"b": 0, "f": 1, **{str(k): 2 + k for k in range(spatial)}}
    if batch_groups == 1:
        out = _as_transposed(x, w, dims, groups)
        if out is not None:
            return _permuted(out, [where[c] for c in out_labels])
    flips = [2 + k for k, d in enumerate(dims) if d.reversal]
    if flips:
        w = torch.flip(w, flips)
    for k, d in enumerate(dims):
        x = dilate(x, 2 + k, d.lhs_dilate)
    symmetric = all(d.pad_lo == d.pad_hi and d.pad_lo >= 0 for d in dims)
    if not symmetric:
        x = pad(x, {2 + k: (d.pad_lo, d.pad_hi) for k, d in enumerate(dims)})
    out = aten.convolution(x, w, None, [d.stride for d in dims],
                           [d.pad_lo if symmetric else 0 for d in dims],
                           [d.rhs_dilate for d in dims], False, [0] * spatial, groups)
    return _permuted(out, [where[c] for c in out_labels])


def _as_transposed(x: torch.Tensor, w: torch.Tensor, dims: list[WindowDim], groups: int
                   ) -> torch.Tensor | None:
    """A convolution over a zero-dilated input (``lhs_dilate``: XLA's input gradient of a
    strided convolution) as the transposed convolution it is, which never multiplies the
    inserted zeros; None when its window is not one (a stride, or padding beyond what a
    transposed convolution crops). ``x``: ``[batch, features, spatial...]``; ``w``:
    ``[out, in / groups, spatial...]``, before any window reversal.

    Output position ``y`` reads dilated position ``y + k d - lo``, which holds input ``a``
    when it is ``a s``: so ``y = a s - (d (K - 1) - lo) + k' d`` for the flipped tap
    ``k' = K - 1 - k``, a transposed convolution with padding ``d (K - 1) - lo``; its
    output padding is ``hi - lo`` (a negative one crops)."""
    if all(d.lhs_dilate == 1 for d in dims) or any(d.stride != 1 for d in dims):
        return None
    sizes = list(w.shape[2:])
    pads = [d.rhs_dilate * (k - 1) - d.pad_lo for d, k in zip(dims, sizes)]
    extra = [d.pad_hi - d.pad_lo for d in dims]
    if any(p < 0 for p in pads) or any(e >= d.lhs_dilate for e, d in zip(extra, dims)):
        return None
    out_features, in_per_group = w.shape[:2]
    # [out, in/g, K] as a transposed convolution's [in, out/g, K], each tap flipped (once
    # more where the window already reverses it).
    wt = (w.reshape(groups, out_features // groups, in_per_group, *sizes).transpose(1, 2)
          .reshape(groups * in_per_group, out_features // groups, *sizes))
    flips = [2 + k for k, d in enumerate(dims) if not d.reversal]
    if flips:
        wt = torch.flip(wt, flips)
    out = aten.convolution(x, wt, None, [d.lhs_dilate for d in dims], pads,
                           [d.rhs_dilate for d in dims], True, [max(e, 0) for e in extra],
                           groups)
    for k, e in enumerate(extra):
        if e < 0:
            out = out.narrow(2 + k, 0, out.shape[2 + k] + e)
    return out


def _batch_groups_as_features(x: torch.Tensor, count: int) -> torch.Tensor:
    """``x`` (``[batch, features, spatial...]``) with its batch cut into ``count`` runs
    laid side by side along the features: ``[batch / count, count * features, ...]``."""
    batch, features, *spatial = x.shape
    if batch % count:
        raise LoweringError(f"batch_group_count {count} does not divide the batch {batch}")
    x = x.reshape(count, batch // count, features, *spatial)
    x = x.permute(1, 0, *range(2, x.dim()))
    return x.reshape(batch // count, count * features, *spatial)


def _reduce(interpreter, i, operands, constant):
    if len(operands) != 2:  # two arrays: argmax and argmin (.order)
        raise LoweringError("reductions of more than two arrays at once have no IR op")
    x, init = operands
    x = x if constant else dense(x)
    dims = int_list(i.attributes["dimensions"])
    kind = interpreter.reducer(i)
    init_value = _scalar(init, constant, "a reduction's initial value")
    if not dims:
        return x
    if kind == "add":
        out = torch.sum(x, dims)
        return out if init_value == 0 else out + init_value
    if kind in ("maximum", "minimum"):
        sign = 1 if kind == "maximum" else -1
        out = torch.amax(x if sign == 1 else torch.neg(x), dims)
        out = out if sign == 1 else torch.neg(out)
        identity = -math.inf if sign == 1 else math.inf
        if float(init_value) != identity:
            bound = torch.full((), init_value, dtype=x.dtype)
            out = torch.maximum(out, bound) if sign == 1 else torch.minimum(out, bound)
        return out
    if kind in ("and", "or"):
        flipped = kind == "and"
        out = torch.logical_not(x) if flipped else x
        for d in sorted(dims, reverse=True):
            out = torch.any(out, d)
        return torch.logical_not(out) if flipped else out
    if kind == "multiply" and constant:
        out = x
        for d in sorted(dims, reverse=True):
            out = torch.prod(out, d)
        return out * init_value
    raise LoweringError(f"a reduction by {kind} has no IR op")


def _pooled(x: torch.Tensor, dims: list[WindowDim]):
    """``x`` as ``[rows, 1, h, w]`` with its windowed dimensions (at most two) last, the
    two windows, and how to put a result of that form back in ``x``'s order."""
    if any(w.lhs_dilate != 1 or w.rhs_dilate != 1 for w in dims):
        raise LoweringError("dilated windows are not supported")
    spatial = [d for d, w in enumerate(dims)
               if w.size > 1 or w.stride > 1 or w.pad_lo or w.pad_hi]
    if len(spatial) > 2:
        raise LoweringError(f"windows over {len(spatial)} dimensions are not supported")
    others = [d for d in range(len(dims)) if d not in spatial]
    order = others + spatial
    lead = [x.shape[d] for d in others]
    sizes = [x.shape[d] for d in spatial]
    wins = [dims[d] for d in spatial]
    while len(sizes) < 2:
        sizes.insert(0, 1)
        wins.insert(0, WindowDim())
    shaped = _permuted(x, order).reshape(math.prod(lead), 1, *sizes)
    inverse = [order.index(d) for d in range(len(dims))]
    kept = len(spatial)

    def back(result: torch.Tensor) -> torch.Tensor:
        out = list(result.shape[4 - kept:]) if kept else []
        return _permuted(result.reshape(*lead, *out), inverse)
    return shaped, wins, back


def _reduce_window(interpreter, i, operands, constant):
    x, init = operands
    x = x if constant else dense(x)
    init_value = _scalar(init, constant, "a window reduction's initial value")
    kind = interpreter.reducer(i)
    dims = window(i.attributes["window"], x.dim())
    shaped, wins, back = _pooled(x, dims)
    padded = pad(shaped, {2 + k: (w.pad_lo, w.pad_hi) for k, w in enumerate(wins)},
                 init_value)
    kernel, stride = [w.size for w in wins], [w.stride for w in wins]
    if kind == "maximum":
        out = aten.max_pool2d_with_indices(padded, kernel, stride)[0]
        if init_value != -math.inf:
            out = torch.maximum(out, torch.full((), init_value, dtype=x.dtype))
    elif kind == "add":
        out = aten.avg_pool2d(padded, kernel, stride, [0, 0], False, True, 1)
        if init_value != 0:
            out = out + init_value
    else:
        raise LoweringError(f"a window reduction by {kind} has no IR op")
    return back(out)


def _select_and_scatter(interpreter, i, operands, constant):
    x, source, init = operands if constant else [dense(o) for o in operands[:2]] + [
        operands[2]]
    if interpreter.reducer(i, "select") != "compare-GE" \
            or interpreter.reducer(i, "scatter") != "add":
        raise LoweringError("only the gradient of max pooling (select GE, scatter add) is "
                            "supported")
    init_value = _scalar(init, constant, "a scatter's initial value")
    dims = window(i.attributes["window"], x.dim())
    shaped, wins, back = _pooled(x, dims)
    grads, _, _ = _pooled(source, dims)
    padding = {2 + k: (w.pad_lo, w.pad_hi) for k, w in enumerate(wins)}
    padded = pad(shaped, padding, -math.inf)
    kernel, stride = [w.size for w in wins], [w.stride for w in wins]
    _, indices = aten.max_pool2d_with_indices(padded, kernel, stride)
    out = aten.max_pool2d_with_indices_backward(grads, padded, kernel, stride, [0, 0],
                                                [1, 1], False, indices)
    out = pad(out, {d: (-lo, -hi) for d, (lo, hi) in padding.items()})
    if init_value != 0:
        out = out + init_value
    return back(out)


def _round_half_away(x):
    """Rounding half away from zero, exactly: halves (where ``x - trunc(x)`` is exactly
    one half) go to ``trunc(x) + sign(x)``, the rest round to nearest (``floor(|x| +
    0.5)`` would round 0.49999997 up in float32)."""
    whole = torch.trunc(x)
    half = torch.abs(x - whole) == 0.5
    return torch.where(half, whole + torch.sign(x), torch.round(x))


RULES = {
    "add": _binary(lambda a, b, i: torch.add(a, b)),
    "subtract": _binary(lambda a, b, i: torch.sub(a, b)),
    "multiply": _binary(lambda a, b, i: torch.mul(a, b)),
    "divide": _binary(_divide),
    "maximum": _binary(lambda a, b, i: torch.maximum(a, b)),
    "atan2": _binary(lambda a, b, i: torch.atan2(a, b)),
    "remainder": _binary(_remainder),
    "minimum": _binary(lambda a, b, i: torch.minimum(a, b)),
    "power": _power,
    "and": _logical("and"),
    "or": _logical("or"),
    "xor": _logical("xor"),
    "not": _not,
    "negate": _unary(torch.neg),
    "abs": _unary(torch.abs),
    "sign": _unary(torch.sign),
    "exponential": _unary(torch.exp),
    "log": _unary(torch.log),
    "sqrt": _unary(torch.sqrt),
    "rsqrt": _unary(torch.rsqrt),
    "tanh": _unary(torch.tanh),
    "logistic": _unary(torch.sigmoid),
    "erf": _unary(torch.erf),
    "exponential-minus-one": _unary(torch.expm1),
    "log-plus-one": _unary(torch.log1p),
    "sine": _unary(torch.sin),
    "cosine": _unary(torch.cos),
    "tan": _unary(torch.tan),
    "floor": _unary(torch.floor),
    "ceil": _unary(torch.ceil),
    "round-nearest-afz": _unary(_round_half_away),
    "round-nearest-even": _unary(torch.round),
    "is-finite": _is_finite,
    "compare": _compare,
    "select": _select,
    "clamp": _clamp,
    "convert": _convert,
    "bitcast": _reshape,
    "broadcast": _broadcast,
    "reshape": _reshape,
    "transpose": _transpose,
    "reverse": _reverse,
    "slice": _slice,
    "concatenate": _concatenate,
    "pad": _pad,
    "dot": _dot,
    "convolution": _convolution,
    "reduce": _reduce,
    "reduce-window": _reduce_window,
    "select-and-scatter": _select_and_scatter,
}

CONSTANT_RULES = {
    "shift-left": _binary(lambda a, b, i: torch.bitwise_left_shift(a, b)),
    "shift-right-arithmetic": _binary(lambda a, b, i: torch.bitwise_right_shift(a, b)),
}
