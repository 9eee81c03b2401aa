"""An HLO module as a :class:`salus.trace.TracedStep`: the front ends' common path.

A front end (``salus.tf``, ``salus.jax``) lowers one whole step of its framework to HLO
text and says what each entry parameter and each element of the result is (a persistent
tensor and its update, a feed, the loss, an output). :func:`trace_hlo` runs the module
with PyTorch ops under ``make_fx`` (:mod:`salus.hlo.interpret`), so the step becomes the
same Core ATen graph a PyTorch step does, and from there the same lowering, the same
sessions and the same checks serve every framework.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

import numpy as np

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from ..errors import LoweringError
from ..lower import MODULE_META
from ..trace import (FEED, InputSlot, OutputSlot, Scope, TracedStep, recording,
                     decomposition_table, tidy)
from .draws import find_draws
from .interpret import Interpreter, unsupported
from .ops import DTYPES, Const, dense
from .parse import Instruction, Module, parse_module


def trace_hlo(text: str | Module, inputs: Sequence[InputSlot], outputs: Sequence[OutputSlot],
              initial_state: dict[str, torch.Tensor], example_feeds: Sequence[torch.Tensor],
              kind: str, output_spec: Any = None, seeds: Collection[str] = ()) -> TracedStep:
    """The step whose HLO is ``text`` (or the module read from it): entry parameter ``k``
    is ``inputs[k]`` (its value a tensor of ``initial_state``, or the next of
    ``example_feeds`` for a feed), element ``k`` of the result (a tuple, or one value) is
    ``outputs[k]``. An update whose value is its own parameter, unchanged, is left
    out. ``output_spec``: how the front end structures a forward pass's outputs.

    ``seeds``: names of inputs that seed random numbers. The values computed from them
    alone are drawn on the client for each step (:mod:`salus.hlo.draws`) and reach the
    graph as feeds after the others (``random.<k>``); the seeds are neither inputs nor
    updates of the graph (the step's ``draws`` keeps them)."""
    module = parse_module(text) if isinstance(text, str) else text
    params = module.entry_computation.parameters()
    if len(params) != len(inputs):
        raise LoweringError(f"the HLO entry takes {len(params)} parameters, but the step "
                            f"has {len(inputs)} inputs")
    draws = find_draws(module, {k: slot.name for k, slot in enumerate(inputs)
                                if slot.name in seeds},
                       {k: slot.name for k, slot in enumerate(outputs) if slot.kind == "update"})
    missing = unsupported(module, draws.part if draws is not None else ())
    if missing is not None:
        raise missing
    feeds = iter(example_feeds)
    args = [next(feeds) if slot.role == FEED else initial_state[slot.name]
            for slot in inputs]
    for param, slot, value in zip(params, inputs, args):
        if slot.name in seeds:  # the client's alone (its unsigned types included)
            continue
        expect = DTYPES.get(param.shape.dtype)
        if expect != value.dtype or tuple(param.shape.dims) != tuple(value.shape):
            raise LoweringError(f"HLO parameter {int(param.literal)} is {param.shape}, but "
                                f"{slot.name} is {value.dtype}{list(value.shape)}")
    fed: list[str] = []
    traced_inputs = list(inputs)
    if draws is not None:
        drawn, _ = draws.draw({n: initial_state[n].numpy() for n in draws.seeds.values()})
        fed = draws.fed
        keep = [k for k, slot in enumerate(inputs) if slot.name not in seeds]
        traced_inputs = ([inputs[k] for k in keep]
                         + [InputSlot(f"random.{k}", FEED, "random") for k in range(len(fed))])
        args = [args[k] for k in keep] + [torch.from_numpy(np.ascontiguousarray(v))
                                          for v in drawn]
    kept: list[OutputSlot] = []

    def step(*values: torch.Tensor) -> list[torch.Tensor]:
        given = dict(zip(fed, values[len(values) - len(fed):]))
        by_name = {slot.name: value for slot, value in zip(traced_inputs, values)}
        # A seed is read only by the random part, which is not run here.
        entry_args = [None if slot.name in seeds else by_name[slot.name] for slot in inputs]
        if draws is not None:  # the seeds' new values: the client's to compute
            given.update({name: None for name in draws.advances.values() if name not in given})
        result = _Stamping(module, given).run(entry_args)
        flat = _flatten(result)
        if len(flat) != len(outputs):
            raise LoweringError(f"the HLO result has {len(flat)} elements, but the step "
                                f"has {len(outputs)} outputs")
        kept.clear()
        results = []
        for slot, value in zip(outputs, flat):
            if slot.kind == "update" and (slot.name in seeds
                                          or value is by_name.get(slot.name)):
                continue
            kept.append(slot)
            results.append(dense(value) if isinstance(value, Const) else value)
        return results

    with recording("real"):
        gm = make_fx(step, decomposition_table=decomposition_table(),
                     tracing_mode="real")(*args)
    state = {n: v for n, v in initial_state.items() if n not in seeds}
    return TracedStep(kind=kind, graph_module=tidy(gm), inputs=traced_inputs,
                      outputs=list(kept), initial_state=state, output_spec=output_spec,
                      draws=draws)


def _flatten(value) -> list:
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _flatten(v)]
    return [value]


class _Stamping(Interpreter):
    """Tags the FX nodes each instruction records with where it came from (the HLO op,
    and TensorFlow's op name or JAX's source line), which lowering errors show."""

    def __init__(self, module: Module, given: dict[str, Any] | None = None):
        super().__init__(module, given)
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
