"""Branches on random draws that a recorded step can decide.

A step that branches in Python on a tensor's value cannot be recorded as one graph. One
such branch is common and goes the same way for every draw: LayerDrop (BART, OPT,
Whisper, M2M100, Pegasus and their kin in transformers) skips a layer in training when
``torch.rand([]) < layerdrop``, and with ``layerdrop = 0``, their default, no draw in
``[0, 1)`` is below it. While a step is recorded, :class:`DecidedDraws` follows the range
of each uniform draw (``torch.rand``, ``torch.rand_like``, ``Tensor.uniform_``) through
comparisons with plain numbers, and answers ``bool()`` or ``.item()`` of a comparison
that holds, or fails, for every value in the range, as eager PyTorch does for any draw.
A comparison that could go either way (``layerdrop = 0.1``) is refused naming the draw;
every other read of a value is refused by the tracer as before. Skipping the draw
changes nothing salus computes: salus draws its own random numbers on the device.
"""

from __future__ import annotations

import operator
import traceback

import torch
from torch.overrides import TorchFunctionMode

from .errors import TraceError, user_location

_DRAWS = {torch.rand, torch.rand_like}
_UNIFORM = {torch.Tensor.uniform_}
# Each comparison as a function of (x, c), with the draw x on the left.
_COMPARE = {
    torch.lt: operator.lt, torch.Tensor.lt: operator.lt, torch.Tensor.__lt__: operator.lt,
    torch.le: operator.le, torch.Tensor.le: operator.le, torch.Tensor.__le__: operator.le,
    torch.gt: operator.gt, torch.Tensor.gt: operator.gt, torch.Tensor.__gt__: operator.gt,
    torch.ge: operator.ge, torch.Tensor.ge: operator.ge, torch.Tensor.__ge__: operator.ge,
}
_READS = {torch.Tensor.__bool__, torch.Tensor.item}
_SYMBOL = {operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">="}


def decide(compare, low: float, high: float, c: float) -> bool | None:
    """``compare(x, c)`` for every ``x`` in ``[low, high)``, or None where it depends on
    ``x``."""
    if compare in (operator.lt, operator.le):
        if high <= c:
            return True
        if low > c or (compare is operator.lt and low >= c):
            return False
    else:
        if low > c or (compare is operator.ge and low >= c):
            return True
        if high <= c:
            return False
    return None


class DecidedDraws(TorchFunctionMode):
    """Active while a step is recorded (see the module's docs)."""

    def __init__(self):
        super().__init__()
        # By id: a tensor's == is elementwise. The tensors are kept until the mode ends,
        # so no id is reused meanwhile.
        self._ranges: dict[int, tuple[float, float]] = {}
        self._comparisons: dict[int, tuple[bool | None, str]] = {}
        self._kept: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS and args and id(args[0]) in self._comparisons:
            value, text = self._comparisons[id(args[0])]
            if value is None:
                raise TraceError(
                    f"the step branches on a random draw ({text}){_caller()}: it could go "
                    "either way, and salus records one graph for every step; where this "
                    "is LayerDrop, set the model's layerdrop to 0, or draw the choice "
                    "outside the step and pass it in")
            return value
        out = func(*args, **kwargs)
        if func in _DRAWS and isinstance(out, torch.Tensor) and out.is_floating_point():
            self._note_range(out, 0.0, 1.0)
        elif func in _UNIFORM and isinstance(out, torch.Tensor):
            low = kwargs.get("from", args[1] if len(args) > 1 else 0.0)
            high = kwargs.get("to", args[2] if len(args) > 2 else 1.0)
            self._note_range(out, float(low), float(high))
        elif func in _COMPARE and len(args) == 2 and isinstance(out, torch.Tensor):
            self._note_comparison(func, args, out)
        return out

    def _note_range(self, t: torch.Tensor, low: float, high: float) -> None:
        self._ranges[id(t)] = (low, high)
        self._kept.append(t)

    def _note_comparison(self, func, args, out: torch.Tensor) -> None:
        x, c = args
        if id(x) not in self._ranges or isinstance(c, bool) or not isinstance(c, (int, float)):
            return  # not a draw against a plain number
        compare = _COMPARE[func]
        low, high = self._ranges[id(x)]
        text = f"uniform in [{low:g}, {high:g}) {_SYMBOL[compare]} {c:g}"
        self._comparisons[id(out)] = (decide(compare, low, high, float(c)), text)
        self._kept.append(out)


def _caller() -> str:
    """' at FILE:LINE' of the innermost frame now running outside torch and salus."""
    return user_location((f.filename, f.lineno) for f in traceback.extract_stack())
