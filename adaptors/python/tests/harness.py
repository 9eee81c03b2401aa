"""Shared helpers of the adaptor's tests: optimizers, eager reference runs, comparisons."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from salus.optim import STEP, functional_optimizer
from salus.reference import eager_steps  # noqa: F401  (re-exported for the tests)
from salus.v1 import graph_pb2 as pb

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum_wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                                 weight_decay=1e-3),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                              weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=1e-2),
}


def traced_steps(traced, batches):
    state, losses = dict(traced.initial_state), []
    for batch in batches:
        state, loss = traced.run(state, *batch)
        losses.append(loss.item())
    return state, losses


def torch_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state of an eager run, named as salus names
    them. SGD keeps no step counter, so ``optimizer.step`` is left out for SGD."""
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update({n: b.detach() for n, b in model.named_buffers()})
    opt_state = functional_optimizer(optimizer, dict(model.named_parameters())).initial_state()
    if isinstance(optimizer, torch.optim.SGD):
        opt_state.pop(STEP, None)
    state.update(opt_state)
    return state


def twin(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    m = copy.deepcopy(model)
    return m.to(dtype) if dtype is not None else m


def to_dtype(batch, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def assert_states_close(actual, expected, *, rtol, atol, label=""):
    assert set(expected) <= set(actual), set(expected) - set(actual)
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{label}{name}: {m}")


def check_graph_structure(graph: pb.Graph, ops: frozenset[str], *, kind: str,
                          updates: bool = False) -> None:
    """Structural invariants of a lowered graph (see docs/ir.md)."""
    assert graph.version == 1
    tensors = graph.tensors
    assert [t.id for t in tensors] == list(range(len(tensors)))
    persistent = {pb.TENSOR_ROLE_PARAMETER, pb.TENSOR_ROLE_STATE, pb.TENSOR_ROLE_CONSTANT}
    defined = {t.id for t in tensors if t.role in persistent or t.role == pb.TENSOR_ROLE_FEED}
    produced = set()
    names = set()
    for node in graph.nodes:
        assert node.op in ops, node.op
        assert node.name not in names, f"duplicate node name {node.name}"
        names.add(node.name)
        for i in node.inputs:
            assert i == -1 or (0 <= i < len(tensors) and i in defined), \
                f"{node.name} reads {i} before it is defined"
        for o in node.outputs:
            if o == -1:
                continue
            assert tensors[o].role == pb.TENSOR_ROLE_INTERMEDIATE, node.name
            assert o not in produced, f"{o} produced twice"
            produced.add(o)
            defined.add(o)
        for key, attr in node.attributes.items():
            assert attr.WhichOneof("value") is not None, (node.name, key)
    for t in tensors:
        assert all(d >= 0 for d in t.shape)
        assert t.dtype != pb.DTYPE_UNSPECIFIED and t.role != pb.TENSOR_ROLE_UNSPECIFIED
        if t.role == pb.TENSOR_ROLE_INTERMEDIATE:
            assert t.id in produced, f"intermediate {t.name} has no producer"
        if t.role == pb.TENSOR_ROLE_CONSTANT:
            assert len(t.data) > 0
        else:
            assert len(t.data) == 0
    targets = set()
    for update in graph.updates:
        target, value = tensors[update.target], tensors[update.value]
        assert target.role in (pb.TENSOR_ROLE_PARAMETER, pb.TENSOR_ROLE_STATE), target.name
        assert list(target.shape) == list(value.shape) and target.dtype == value.dtype, target.name
        assert update.value in defined
        assert update.target not in targets, f"{target.name} updated twice"
        targets.add(update.target)
    for f in graph.fetches:
        assert f in defined
    if kind == "train":
        assert len(graph.fetches) == 1
        loss = tensors[graph.fetches[0]]
        assert loss.name == "loss" and list(loss.shape) == [] and loss.dtype == pb.DTYPE_F32
        params = [t for t in tensors if t.role == pb.TENSOR_ROLE_PARAMETER]
        assert params and all(t.id in targets for t in params), "every parameter is updated"
    elif not updates:
        assert not graph.updates
