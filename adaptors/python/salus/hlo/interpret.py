"""Running an HLO module with PyTorch ops, so ``make_fx`` records it as Core ATen.

Each HLO instruction becomes the PyTorch ops that compute exactly what XLA's semantics
say (``docs/frontends.md`` lists them). Two kinds of values flow:

- **computed** values (torch tensors that depend on a parameter): their ops are traced;
- **constants** (:class:`Const`): instructions whose operands are all constants run at
  once outside the trace (shape arithmetic, iotas, masks), so the graph receives only
  their results. A constant whose elements are all equal (a broadcast scalar) reaches an
  elementwise op as a 0-dim tensor and broadcasts there, never as a full-size array.

Instructions nothing reads (TensorFlow leaves some) are not run.
"""

from __future__ import annotations

import re
from typing import Any, Collection, Sequence

import torch
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..errors import LoweringError, MissingOp, UnsupportedOpError
from . import indexing, order
from .ops import CONSTANT_RULES, WRAPPING, Const, torch_dtype
from .ops import RULES as OP_RULES
from .parse import Computation, Instruction, Module

aten = torch.ops.aten

# -- what the interpreter can run on computed values --------------------------------------

ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "power",
               "and", "or", "xor", "not", "negate", "abs", "sign", "exponential", "log",
               "sqrt", "rsqrt", "tanh", "logistic", "erf", "exponential-minus-one",
               "log-plus-one", "sine", "cosine", "tan", "atan2", "remainder", "floor", "ceil",
               "round-nearest-afz", "round-nearest-even", "is-finite", "compare", "select",
               "clamp", "convert"}
STRUCTURAL = {"parameter", "constant", "broadcast", "reshape", "transpose", "copy",
              "reverse", "slice", "concatenate", "pad", "iota", "tuple",
              "get-tuple-element", "call", "optimization-barrier", "bitcast"}
COMPUTE = {"dot", "convolution", "reduce", "reduce-window", "select-and-scatter", "gather",
           "scatter", "sort", "topk"}
RULES = {**OP_RULES, **indexing.RULES, **order.RULES}
SUPPORTED = ELEMENTWISE | STRUCTURAL | COMPUTE
# Run only on constants (their results fold into the graph); on computed values the IR has
# no op for them.
CONSTANT_ONLY = {"shift-left", "shift-right-logical", "shift-right-arithmetic"}
_HINTS = {
    "rng-bit-generator": "random bits from a seed that is not the step's state",
    "rng": "random numbers from XLA's own generator, not from a seed the step keeps",
    "custom-call": "an XLA custom call has no IR op",
    "while": "loops are not supported: unroll them, or keep them outside the step",
    "conditional": "branches on values are not supported: compute both sides and select",
    "dynamic-slice": "slices at computed offsets are not supported yet",
    "dynamic-update-slice": "updates at computed offsets are not supported yet",
}


_RANDOM = ("random numbers are supported only when drawn from a seed the step keeps as "
           "state (a Keras SeedGenerator, as Dropout's; a JAX PRNG key in the state): this "
           "one is not; pass random values in with the batch instead")
# Where the framework says an op came from, when that is its random number generator.
_RANDOM_SOURCE = re.compile(r"threefry|philox|random|rng|dropout|bernoulli", re.IGNORECASE)


def unsupported(module: Module, drawn: Collection[str] = ()) -> UnsupportedOpError | None:
    """Every instruction of ``module`` that cannot run on salusd, in one error (None when
    all can); constant-only ops are checked as the interpreter meets them. ``drawn``:
    entry instructions the client computes instead (:mod:`salus.hlo.draws`)."""
    missing = [MissingOp(f"HLO {i.opcode}", i.name,
                         i.source or f"computation {computation.name}", tuple(i.operands),
                         _RANDOM if _RANDOM_SOURCE.search(f"{i.source} {computation.name}")
                         else _HINTS.get(i.opcode, "no IR op"))
               for computation in _reachable(module, drawn) for i in computation.instructions
               if i.opcode not in SUPPORTED and i.opcode not in CONSTANT_ONLY
               and i.name not in drawn and not i.annotates]
    missing += [MissingOp(f"HLO {i.opcode} of a dynamic shape", i.name,
                          i.source or f"computation {computation.name}", tuple(i.operands),
                          f"{i.shape} is known only at run time; salus plans memory for "
                          "fixed shapes")
                for computation in _reachable(module, drawn) for i in computation.instructions
                if i.shape.dynamic and i.name not in drawn]
    return UnsupportedOpError(missing) if missing else None


def _reachable(module: Module, drawn: Collection[str] = ()) -> list[Computation]:
    """The entry computation and the computations it calls (not the reducers, which
    :func:`_reducer` reads by their root; not those the client runs, ``drawn``)."""
    seen, todo = [], [module.entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        for i in module.computations[name].instructions:
            if i.opcode == "call" and i.name not in drawn:
                todo.append(i.attributes["to_apply"].lstrip("%"))
    return [module.computations[n] for n in seen]


# -- running ------------------------------------------------------------------------------


class Interpreter:
    """Runs ``module``; ``given``: values of entry instructions known already (fed random
    numbers), which are not computed, nor what only they need."""

    def __init__(self, module: Module, given: dict[str, Any] | None = None):
        self.module = module
        self.given = given or {}

    def run(self, args: Sequence[Any]) -> Any:
        """The entry computation's result for ``args`` (torch tensors or :class:`Const`):
        a value or a tuple of values."""
        return self.computation(self.module.entry_computation, list(args))

    def computation(self, computation: Computation, args: list[Any]) -> Any:
        given = self.given if computation is self.module.entry_computation else {}
        needed = computation.needed([computation.root], given)
        values: dict[str, Any] = dict(given)
        for instruction in computation.instructions:
            if instruction.name not in needed or instruction.name in given:
                continue
            operands = [values[o] for o in instruction.operands]
            try:
                values[instruction.name] = self.instruction(instruction, operands, args)
            except LoweringError as error:
                raise LoweringError(f"{_where(instruction)}: {error}") from None
            except (RuntimeError, ValueError, IndexError, KeyError) as error:
                raise LoweringError(f"{_where(instruction)}: cannot run "
                                    f"{instruction.opcode}: {error}") from error
        return values[computation.root]

    def instruction(self, i: Instruction, operands: list[Any], args: list[Any]) -> Any:
        if i.opcode == "parameter":
            return args[int(i.literal)]
        if i.opcode == "tuple":
            return tuple(operands)
        if i.opcode == "get-tuple-element":
            return operands[0][int(i.attributes["index"])]
        if i.opcode in ("copy", "optimization-barrier") or i.annotates:
            return operands[0]
        if i.opcode == "call":
            callee = self.module.computations[i.attributes["to_apply"].lstrip("%")]
            return self.computation(callee, operands)
        # A constant's folded value is made outside the trace: only what uses it records
        # ops (a literal that is no splat as a captured tensor, an iota by its recipe).
        if i.opcode == "constant":
            with disable_proxy_modes_tracing():
                return Const(_literal(i))
        if i.opcode == "iota":
            with disable_proxy_modes_tracing():
                folded = _iota(i)
            return Const(folded, lambda: _iota(i))
        if i.shape.dtype == "u32" and i.opcode in WRAPPING:
            raise LoweringError(f"{i.opcode} of u32 wraps at 2^32, which no IR dtype does")
        rule = RULES.get(i.opcode)
        if rule is None:
            if i.opcode in CONSTANT_ONLY:
                if not all(isinstance(o, Const) for o in operands):
                    raise LoweringError(f"{i.opcode} of a computed value has no IR op")
                rule = CONSTANT_RULES[i.opcode]
            else:
                raise LoweringError(f"{i.opcode} is not supported"
                                    + (f": {_HINTS[i.opcode]}" if i.opcode in _HINTS else ""))
        if all(isinstance(o, Const) for o in operands):
            with disable_proxy_modes_tracing():
                folded = rule(self, i, [o.tensor for o in operands], True)
            return Const(folded, lambda: rule(self, i, operands, False))
        return rule(self, i, operands, False)

    def reducer(self, i: Instruction, attribute: str = "to_apply") -> str:
        """What the computation named by ``attribute`` of ``i`` computes: ``add``,
        ``maximum``, ``minimum``, ``multiply``, ``and``, ``or``, or ``compare-GE``..."""
        return _reducer(self.module.computations[i.attributes[attribute].lstrip("%")])


def _where(i: Instruction) -> str:
    return f"HLO {i.opcode} {i.name}" + (f" ({i.source})" if i.source else "")


def _reducer(computation: Computation) -> str:
    root = computation.by_name()[computation.root]
    params = {p.name for p in computation.parameters()}
    if len(computation.instructions) != 3 or set(root.operands) != params:
        ops = ", ".join(i.opcode for i in computation.instructions if i.opcode != "parameter")
        raise LoweringError(f"reducer {computation.name} computes {ops}: only a single add, "
                            "maximum, minimum, and, or or compare is supported")
    if root.opcode == "compare":
        return f"compare-{root.attributes['direction']}"
    return root.opcode


# -- values -------------------------------------------------------------------------------


def _literal(i: Instruction) -> torch.Tensor:
    dtype = torch_dtype(i.shape, i.name)
    values = i.literal_values()
    if dtype == torch.bool:
        return torch.tensor([bool(v) for v in values], dtype=dtype).reshape(i.shape.dims)
    work = torch.float64 if dtype.is_floating_point else torch.int64
    return torch.tensor(values, dtype=work).to(dtype).reshape(i.shape.dims)


def _iota(i: Instruction) -> torch.Tensor:
    dim = int(i.attributes["iota_dimension"])
    dims = i.shape.dims
    line = torch.arange(dims[dim], dtype=torch.int64)
    view = [1] * len(dims)
    view[dim] = dims[dim]
    return line.reshape(view).expand(dims).to(torch_dtype(i.shape, i.name)).contiguous()
