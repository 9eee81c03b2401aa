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

A draw of Python's ``random`` or NumPy's ``numpy.random`` in the step (a mixup's
``np.random.beta``, teacher forcing's ``random.random() < ratio``) is a number the
recording would keep: every iteration would use the one drawn while the step recorded,
where eager PyTorch draws anew. While a step records, those functions called from the
user's code give a :class:`PythonDraw` for a single uniform number (``random.random()``,
``random.uniform(a, b)``, ``np.random.random()``, ``np.random.rand()``,
``np.random.uniform(a, b)``), which answers a comparison with a plain number that holds,
or fails, for every value of its range (wav2vec2's LayerDrop, ``np.random.random() <
layerdrop`` with ``layerdrop = 0``) and refuses every other use; any other draw is
refused at once (:func:`python_draws_refused`).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import random
import sys
import traceback
from typing import Iterator

import numpy
import torch
from torch.overrides import TorchFunctionMode

from .errors import TraceError, in_user_code, user_location

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


# The module-level draws of Python's random and numpy.random, looked up where they are
# called (``random.random()``, ``np.random.beta(...)``).
_PYTHON_DRAWS = {
    random: ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle",
             "sample", "gauss", "normalvariate", "lognormvariate", "betavariate",
             "expovariate", "gammavariate", "triangular", "vonmisesvariate",
             "paretovariate", "weibullvariate", "getrandbits", "randbytes", "binomialvariate"),
    numpy.random: ("rand", "randn", "random", "random_sample", "ranf", "sample", "randint",
                   "random_integers", "uniform", "normal", "standard_normal", "beta",
                   "gamma", "exponential", "binomial", "poisson", "choice", "permutation",
                   "shuffle", "dirichlet", "multinomial", "laplace", "lognormal"),
}


def _refuse_python_draw(what: str) -> None:
    raise TraceError(
        f"the step {what}{_caller()} while it records: "
        "salus records the step once and runs that graph at every iteration, so every "
        "iteration would use this one draw (and the branch or the value taken from it), "
        "where eager PyTorch draws anew. Draw it outside the step and pass it in the batch "
        "as a tensor (a mixup's weight; a choice such as teacher forcing then applied "
        "with torch.where), or draw it with torch.rand inside the step, which salus draws "
        "anew at every iteration")


class PythonDraw:
    """A uniform number from ``random`` or ``numpy.random`` drawn while a step records:
    it answers comparisons with plain numbers decided for its whole range (as
    :func:`decide` does for a torch draw) and refuses every other use."""

    def __init__(self, what: str, low: float, high: float):
        self._what, self._low, self._high = what, low, high

    def _compare(self, compare, c):
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            _refuse_python_draw(f"compares {self._what} with {type(c).__name__}")
        answer = decide(compare, self._low, self._high, float(c))
        if answer is None:
            _refuse_python_draw(
                f"branches on {self._what} (uniform in [{self._low:g}, {self._high:g}) "
                f"{_SYMBOL[compare]} {c:g}, which could go either way)")
        return answer

    def __lt__(self, c):
        return self._compare(operator.lt, c)

    def __le__(self, c):
        return self._compare(operator.le, c)

    def __gt__(self, c):
        return self._compare(operator.gt, c)

    def __ge__(self, c):
        return self._compare(operator.ge, c)

    def _used(self, *_):
        _refuse_python_draw(f"uses {self._what} as a number")

    __eq__ = __ne__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __pow__ = __rpow__ = _used
    __mod__ = __neg__ = __abs__ = __float__ = __int__ = __index__ = __bool__ = _used
    __round__ = __format__ = __array__ = _used
    __hash__ = None  # type: ignore[assignment]


# The single uniform draws a step may compare (their range from the call's arguments).
_UNIFORM_DRAWS = {("random", "random"), ("random", "uniform"), ("numpy.random", "random"),
                  ("numpy.random", "random_sample"), ("numpy.random", "rand"),
                  ("numpy.random", "uniform")}


def _range(module_name: str, name: str, args, kwargs) -> tuple[float, float] | None:
    """The range of a single uniform draw, None for any other call."""
    if (module_name, name) not in _UNIFORM_DRAWS:
        return None
    if name == "uniform":
        keys = ("a", "b") if module_name == "random" else ("low", "high")
        values = dict(zip(keys, args)) | {k: v for k, v in kwargs.items() if k in keys}
        if len(args) + len(kwargs) > 2 or "size" in kwargs:
            return None
        low, high = values.get(keys[0], 0.0), values.get(keys[1], 1.0)
        if not all(isinstance(v, (int, float)) for v in (low, high)):
            return None
        return (float(min(low, high)), float(max(low, high)))
    if args or kwargs:  # a size: an array of draws
        return None
    return (0.0, 1.0)


def _refusing(module_name: str, name: str, draw):
    @functools.wraps(draw)
    def refusing(*args, **kwargs):
        caller = sys._getframe(1)
        if not in_user_code(caller.f_code.co_filename):
            return draw(*args, **kwargs)
        what = f"{module_name}.{name}()"
        span = _range(module_name, name, args, kwargs)
        if span is None:
            _refuse_python_draw(f"draws a random number with {module_name}.{name}")
        return PythonDraw(what, *span)
    return refusing


@contextlib.contextmanager
def python_draws_refused() -> Iterator[None]:
    """While a step records, the draws of ``random`` and ``numpy.random`` called from the
    user's code raise :class:`TraceError` (see the module's docs); PyTorch's and salus'
    own calls draw as usual."""
    replaced = [(module, name, getattr(module, name)) for module, names in _PYTHON_DRAWS.items()
                for name in names if hasattr(module, name)]
    for module, name, draw in replaced:
        setattr(module, name, _refusing(module.__name__, name, draw))
    try:
        yield
    finally:
        for module, name, draw in replaced:
            setattr(module, name, draw)
