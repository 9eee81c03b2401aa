"""HLO's ordering instructions as IR ops: a reduction of values and their positions
(``argmax``, ``argmin``), ``sort`` and ``topk``.

XLA has no argmax: JAX and TensorFlow reduce the values together with an iota of their
positions, by a comparator that keeps the larger (smaller) value and, among equal ones,
the lower position. Such a reduction becomes the IR's ``argmax`` (``argmin``) and a
gather of the value there. A ``sort`` by one key (its comparator a ``LT`` or ``GT``
compare of the first operand's two elements, whatever it normalises first: JAX orders
-0 as 0 and NaNs last, as the IR does) becomes a stable ``sort`` whose order permutes the
other operands. A comparator of any other form is refused by name: salus does not guess
what it orders by.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..errors import LoweringError
from .ops import RULES as OP_RULES
from .ops import Const, dense
from .parse import Computation, int_list


def _parameters_reaching(computation: Computation) -> dict[str, set[int]]:
    """For each instruction of ``computation``, the numbers of the parameters it reads."""
    reaching: dict[str, set[int]] = {}
    for i in computation.instructions:
        if i.opcode == "parameter":
            reaching[i.name] = {int(i.literal)}
        else:
            reaching[i.name] = set().union(*(reaching.get(o, set()) for o in i.operands))
    return reaching


def _compares(computation: Computation, params: set[int]) -> list[str]:
    """The directions of the compares of ``computation`` whose operands read exactly the
    parameters ``params`` (one operand each)."""
    reaching = _parameters_reaching(computation)
    found = []
    for i in computation.instructions:
        if i.opcode == "compare" and len(i.operands) == 2:
            sides = [reaching[o] for o in i.operands]
            if set().union(*sides) == params and all(len(s) == 1 for s in sides):
                found.append(i.attributes["direction"])
    return found


def arg_kind(computation: Computation) -> str:
    """``argmax`` or ``argmin`` for a two-array reducer (value, position) that keeps the
    larger (smaller) value, ties to the lower position; else a LoweringError."""
    values = _compares(computation, {0, 2})
    positions = _compares(computation, {1, 3})
    if "LT" in positions and ("GT" in values) != ("LT" in values):
        return "argmax" if "GT" in values else "argmin"
    raise LoweringError(f"a reduction of two arrays by {computation.name} is not an argmax "
                        "or argmin (the larger or smaller value, ties to the lower "
                        "position): it has no IR op")


def _positions(value, dim: int) -> bool:
    """Whether ``value`` holds each element's position along ``dim`` (an iota)."""
    if not isinstance(value, Const):
        return False
    t = value.tensor
    shape = [1] * t.dim()
    shape[dim] = t.shape[dim]
    with disable_proxy_modes_tracing():
        line = torch.arange(t.shape[dim], dtype=torch.int64).reshape(shape)
        return bool(torch.equal(t.to(torch.int64), line.expand(t.shape)))


def arg_reduce(interpreter, i, operands, constant):
    """A ``reduce`` of (values, positions) by an argmax or argmin comparator: the values
    at the extremes and their positions, in the positions' dtype."""
    x, positions = operands[0], operands[1]
    dims = int_list(i.attributes["dimensions"])
    kind = arg_kind(interpreter.module.computations[i.attributes["to_apply"].lstrip("%")])
    if len(dims) != 1:
        raise LoweringError(f"an {kind} over {len(dims)} dims at once has no IR op")
    dim = dims[0]
    if not _positions(positions, dim):
        raise LoweringError(f"an {kind} whose second array is not the positions along "
                            f"dim {dim} has no IR op")
    x = x if constant else dense(x)
    if x.shape[dim] == 0:
        raise LoweringError(f"an {kind} over an empty dim")
    index = (torch.argmax if kind == "argmax" else torch.argmin)(x, dim, keepdim=True)
    values = torch.gather(x, dim, index).squeeze(dim)
    return values, index.squeeze(dim).to(positions.tensor.dtype)


def sort_descending(computation: Computation) -> bool:
    """Whether a one-key sort comparator orders its first operand descending (``GT``) or
    ascending (``LT``); else a LoweringError."""
    root = computation.by_name()[computation.root]
    reaching = _parameters_reaching(computation)
    sides = [reaching[o] for o in root.operands] if root.opcode == "compare" else []
    if sides == [{0}, {1}] and root.attributes.get("direction") in ("LT", "GT"):
        return root.attributes["direction"] == "GT"
    if sides == [{1}, {0}] and root.attributes.get("direction") in ("LT", "GT"):
        return root.attributes["direction"] == "LT"
    raise LoweringError(f"sort comparator {computation.name} is not one compare of the "
                        "first operand's elements: sorting by several keys has no IR op")


def sort(interpreter, i, operands, constant):
    """``sort`` along its dim by the first operand, stably; the others permuted alike."""
    dim = int_list(i.attributes["dimensions"])[0]
    descending = sort_descending(
        interpreter.module.computations[i.attributes["to_apply"].lstrip("%")])
    keys = operands[0] if constant else dense(operands[0])
    values, order = torch.sort(keys, dim=dim, descending=descending, stable=True)
    results = [values]
    for other in operands[1:]:
        if _positions(other, dim):
            results.append(order.to(other.tensor.dtype))
        else:
            results.append(torch.gather(other if constant else dense(other), dim, order))
    return results[0] if len(results) == 1 else tuple(results)


def topk(interpreter, i, operands, constant):
    """``topk`` along the last dim: the ``k`` largest (or smallest) and their positions
    (int32), ties to the lower position."""
    k = int(i.attributes["k"])
    largest = i.attributes.get("largest", "true") == "true"
    x = operands[0] if constant else dense(operands[0])
    values, order = torch.topk(x, k, dim=-1, largest=largest, sorted=True)
    return values, order.to(torch.int32)


def reduce(interpreter, i, operands, constant):
    """``reduce``: of (values, positions), an argmax or argmin; of one array, as
    :mod:`.ops` reduces it."""
    if len(operands) == 4:
        return arg_reduce(interpreter, i, operands, constant)
    return OP_RULES["reduce"](interpreter, i, operands, constant)


RULES = {"reduce": reduce, "sort": sort, "topk": topk}
