"""An HLO module as a :class:`salus.trace.TracedStep`: the front ends' common path.

A front end (``salus.tf``, ``salus.jax``) lowers one whole step of its framework to HLO
text and says what each entry parameter and each element of the result is (a persistent
tensor and its update, a feed, the loss, an output). :func:`trace_hlo` runs the module
with PyTorch ops under ``make_fx`` (:mod:`salus.hlo.interpret`), so the step becomes the
same Core ATen graph a PyTorch step does, and from there the same lowering, the same
sessions and the same checks serve every framework.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from ..errors import LoweringError
from ..lower import MODULE_META
from ..trace import (FEED, TRACE_LOCK, InputSlot, OutputSlot, Scope, TracedStep,
                     decomposition_table, tidy)
from .interpret import Interpreter, unsupported
from .ops import DTYPES, Const, dense
from .parse import Instruction, Module, parse_module


def trace_hlo(text: str | Module, inputs: Sequence[InputSlot], outputs: Sequence[OutputSlot],
              initial_state: dict[str, torch.Tensor], example_feeds: Sequence[torch.Tensor],
              kind: str, output_spec: Any = None) -> TracedStep:
    """The step whose HLO is ``text`` (or the module read from it): entry parameter ``k``
    is ``inputs[k]`` (its value a tensor of ``initial_state``, or the next of
    ``example_feeds`` for a feed), element ``k`` of the result (a tuple, or one value) is
    ``outputs[k]``. An update whose value is its own parameter, unchanged, is left
    out. ``output_spec``: how the front end structures a forward pass's outputs."""
    module = parse_module(text) if isinstance(text, str) else text
    missing = unsupported(module)
    if missing is not None:
        raise missing
    params = module.entry_computation.parameters()
    if len(params) != len(inputs):
        raise LoweringError(f"the HLO entry takes {len(params)} parameters, but the step "
                            f"has {len(inputs)} inputs")
    feeds = iter(example_feeds)
    args = [next(feeds) if slot.role == FEED else initial_state[slot.name]
            for slot in inputs]
    for param, slot, value in zip(params, inputs, args):
        expect = DTYPES.get(param.shape.dtype)
        if expect != value.dtype or tuple(param.shape.dims) != tuple(value.shape):
            raise LoweringError(f"HLO parameter {int(param.literal)} is {param.shape}, but "
                                f"{slot.name} is {value.dtype}{list(value.shape)}")
    kept: list[OutputSlot] = []

    def step(*values: torch.Tensor) -> list[torch.Tensor]:
        result = _Stamping(module).run(values)
        flat = _flatten(result)
        if len(flat) != len(outputs):
            raise LoweringError(f"the HLO result has {len(flat)} elements, but the step "
                                f"has {len(outputs)} outputs")
        by_name = {slot.name: value for slot, value in zip(inputs, values)}
        kept.clear()
        results = []
        for slot, value in zip(outputs, flat):
            if slot.kind == "update" and value is by_name.get(slot.name):
                continue
            kept.append(slot)
            results.append(dense(value) if isinstance(value, Const) else value)
        return results

    with TRACE_LOCK:
        gm = make_fx(step, decomposition_table=decomposition_table(),
                     tracing_mode="real")(*args)
    return TracedStep(kind=kind, graph_module=tidy(gm), inputs=list(inputs),
                      outputs=list(kept), initial_state=dict(initial_state),
                      output_spec=output_spec)


def _flatten(value) -> list:
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _flatten(v)]
    return [value]


class _Stamping(Interpreter):
    """Tags the FX nodes each instruction records with where it came from (the HLO op,
    and TensorFlow's op name or JAX's source line), which lowering errors show."""

    def __init__(self, module: Module):
        super().__init__(module)
        self._last = None

    def instruction(self, i: Instruction, operands, args):
        value = super().instruction(i, operands, args)
        mode = get_proxy_mode()
        if mode is not None:
            graph = mode.tracer.graph
            node = self._last.next if self._last is not None else graph._root.next
            while node.op != "root":
                node.meta.setdefault(MODULE_META, Scope(i.source, f"HLO {i.opcode}"))
                self._last = node
                node = node.next
        return value
