"""Shared helpers of the adaptor's tests: optimizers, eager reference runs, comparisons."""

from __future__ import annotations

import copy
import os
from typing import Callable

import torch

import salus.torch as st
from salus.optim import STEP, functional_optimizer
from salus.reference import eager_steps  # noqa: F401  (re-exported for the tests)
from salus.rounding import RandomRounding
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


def traced_steps(traced, batches, after_step: Callable | None = None):
    """Runs the traced step once per batch, as a session does: before each step the
    optimizer's changed hyperparameters join the state; ``after_step(loss)`` (e.g. a
    learning-rate scheduler's step) runs after each."""
    state, losses = dict(traced.initial_state), []
    for batch in batches:
        state.update(traced.rule.changed_hyperparameters())
        state, loss = traced.run(state, *batch)
        traced.rule.mark_stepped()
        losses.append(loss.item())
        if after_step is not None:
            after_step(loss)
    return state, losses


def torch_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state of an eager run, named as salus names
    them. SGD keeps no step counter, so ``optimizer.step`` is left out for SGD."""
    state = {n: p.detach() for n, p in model.named_parameters()}
    # (a sparse buffer, a graph's adjacency, is a constant of the step, not state)
    state.update({n: b.detach() for n, b in model.named_buffers()
                  if b.layout == torch.strided})
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


def assert_trains_on_salusd_as_eagerly(model, batch, loss_of, optimizer, address: str, *,
                                       steps: int = 3, label: str = "", **session) -> None:
    """Trains a copy of ``model`` for ``steps`` on salusd at ``address`` (a
    ``salus.torch.TrainSession`` with ``loss_of`` and ``session``'s options) and judges
    its state by :func:`assert_as_exact_as_pytorch` against eager float64, eager float32
    and float64 rounded at random, each trained the same way (:func:`eager_state`)."""
    exact = eager_state(model, batch, loss_of, torch.float64, optimizer, steps)
    eager = eager_state(model, batch, loss_of, torch.float32, optimizer, steps)
    rounded = randomly_rounded(
        lambda: eager_state(model, batch, loss_of, torch.float64, optimizer, steps))
    m = twin(model)
    with st.TrainSession(m, None, optimizer(m.parameters()), batch, loss_of=loss_of,
                         address=address, **session) as s:
        for _ in range(steps):
            s.step(*batch)
        state = s.state_dict()
    assert_as_exact_as_pytorch(state, exact, eager, rounded, label=label)


def assert_built_model_trains_on_salusd_as_eagerly(build: Callable, address: str, *,
                                                   label: str = "") -> None:
    """``build()`` (torch seeded 0 first) gives ``(model, batch, loss_of)``; the model
    trains three Adam steps (lr 1e-2) on salusd as eagerly, by
    :func:`assert_trains_on_salusd_as_eagerly`."""
    torch.manual_seed(0)
    model, batch, loss_of = build()
    assert_trains_on_salusd_as_eagerly(model, batch, loss_of,
                                       lambda p: torch.optim.Adam(p, lr=1e-2), address,
                                       label=label)


def eager_state(model, batch, loss_of, dtype, optimizer, steps: int = 3):
    """A copy of ``model`` in ``dtype`` trained eagerly for ``steps`` on ``batch`` (its
    float tensors in ``dtype``) by ``loss_of(model, *batch)`` and ``optimizer(params)``:
    its state and the optimizer's (:func:`torch_state`)."""
    m = twin(model, dtype)
    opt = optimizer(m.parameters())
    batch = to_dtype(batch, dtype)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(m, *batch).backward()
        opt.step()
    return torch_state(m, opt)


# ---------------------------------------------------------------------------------------
# Numerical tolerances: how close is close enough, measured, not picked.
#
# A result of salus (the traced FX graph run by PyTorch, or salusd's engine) is checked
# against the same computation in float64 ("exact"). It is allowed the error that float32
# rounding makes in that computation, measured two ways on this machine:
#
# - ``pytorch``: PyTorch's own float32 run, whose largest error on the tensor says what
#   this CPU's kernels (their summation orders, vector widths, FMA) and the computation's
#   amplification of rounding do to it;
# - ``rounded``: float64 runs of the computation under :class:`RandomRounding`, which
#   perturbs every operand and result of every op by a random relative error of up to
#   half an epsilon of the precision under test, as an arithmetic that rounds differently
#   at each step would (Monte Carlo arithmetic). Their error says where the computation
#   turns rounding into large differences that no correct implementation controls, e.g.
#   Adam normalising a gradient that is zero in exact arithmetic into a step of size lr
#   (gpt's attention key biases, resnet18's last convolutions), or batch statistics that
#   cancel, even where PyTorch's kernels are luckier (some of its CPU reductions
#   accumulate in float64).
#
# Per tensor T:
#
#     max_i |actual_i - exact_i|  <=  NOISE_FACTOR * noise(T)  +  EPS_FACTOR * eps * scale(T)
#
#     noise(T) = max(max_i |pytorch_i - exact_i| * eps / eps(pytorch's dtype),
#                    max_k max_i |rounded_k,i - exact_i|)
#     scale(T) = max_i |exact_i|,   eps = the machine epsilon of actual's dtype
#
# The largest error is taken over the whole tensor, not element by element: where one
# rounding happens to land close to exact on one element says nothing about where another
# correct order of operations lands on it (ill-conditioned gradients scatter the error).
# NOISE_FACTOR allows for the spread of independent rounding errors of the same size (a
# maximum over one tensor of one run is a sample; the suite's largest ratio of error to
# measured noise is about 2, on resnet18's float64 losses, random rounding there being
# a little gentler than the traced graph's reordered reductions); the
# floor covers last-bit differences (a sum of n terms can differ by about log2(n) * eps of
# its magnitude) where both yardsticks happen to be (nearly) exact. A float64 result has
# no more exact run: ``exact`` is then eager float64, ``pytorch`` is left out and
# ``rounded`` rounds at float64's epsilon. Integer tensors (step counters,
# num_batches_tracked) must be equal.
#
# Nothing here depends on the CPU the numbers were tuned on: a CPU whose kernels round
# differently moves noise(T) with them. It stays a sharp test: where the computation is
# well conditioned the bound is about 1e-6 of a tensor's scale, so a kernel with a wrong
# formula, wrong by a sizeable fraction of the values, fails by orders of magnitude (and
# adding 1e-3 of a tensor's scale to one of its elements fails).
NOISE_FACTOR = 8.0
EPS_FACTOR = 16.0
# A float64 result is the traced graph against eager float64 on resnet18, whose first
# convolution's gradient amplifies rounding by about 1e7 in three steps: there the
# graph's differently ordered reductions (decomposed batch norm) end up about 10 times
# farther from eager than random rounding of every op at float64's epsilon does, so the
# float64 yardstick rounds at 16 epsilons. That is still 2**24 times finer than float32;
# a wrong formula misses by ten orders of magnitude more.
F64_ROUNDING = 16.0


def randomly_rounded(run: Callable, dtype: torch.dtype = torch.float32,
                     seeds: tuple[int, ...] = (0, 1)):
    """``run()`` (a float64 computation) once per seed under :class:`RandomRounding` at
    ``dtype``'s epsilon: the ``rounded`` yardstick of :func:`assert_as_exact_as_pytorch`.
    For float64, at 16 epsilons (see F64_ROUNDING)."""
    eps = torch.finfo(dtype).eps * (F64_ROUNDING if dtype == torch.float64 else 1)
    results = []
    for seed in seeds:
        with RandomRounding(eps, seed):
            results.append(run())
    return results


def tolerance(noise, scale: float, dtype: torch.dtype = torch.float32, *,
              against: str = "exact"):
    """The largest |difference| the rule allows: ``noise`` is the rounding error measured
    on the tensor in units of
    ``dtype``, ``scale`` the tensor's largest |exact| value. ``against="pytorch"``: the
    bound for comparing with PyTorch's float32 run instead of the exact one (when only
    that run and its error are known): one more ``noise``, by the triangle inequality."""
    extra = {"exact": 0.0, "pytorch": 1.0}[against]
    return ((NOISE_FACTOR + extra) * noise
            + EPS_FACTOR * torch.finfo(dtype).eps * scale)


def as_tensors(values) -> dict[str, torch.Tensor]:
    """A dict of tensors as it is; a list of losses (floats) as one tensor, ``losses``."""
    if isinstance(values, dict):
        return values
    return {"losses": torch.tensor(values, dtype=torch.float64)}


def assert_as_exact_as_pytorch(actual, exact, pytorch=None, rounded=(), *, label: str = "",
                               dtype: torch.dtype | None = None,
                               pytorch_dtype: torch.dtype = torch.float32) -> None:
    """Every tensor of ``exact`` (a float64 run) against ``actual`` (the results under
    test), by the rule above. ``pytorch``: PyTorch's run in float32 (left out for a
    float64 ``actual``); ``rounded``: results of :func:`randomly_rounded`. Each is a dict
    of tensors by name or a list of losses (Python floats). ``dtype``: the precision
    ``actual`` was computed in, by default its tensors' dtype (losses need it given)."""
    actual, exact = as_tensors(actual), as_tensors(exact)
    pytorch = None if pytorch is None else as_tensors(pytorch)
    rounded = [as_tensors(r) for r in rounded]
    assert set(exact) <= set(actual), set(exact) - set(actual)
    for name, want in exact.items():
        got = actual[name].detach()
        assert got.shape == want.shape, (label, name, got.shape, want.shape)
        if not want.is_floating_point():
            assert torch.equal(got, want.to(got.dtype)), f"{label}{name}: {got} != {want}"
            continue
        if want.numel() == 0:
            continue
        of = dtype or got.dtype
        want = want.detach().double()
        noise = 0.0
        if pytorch is not None:
            ref = pytorch[name].detach().double()
            assert ref.shape == want.shape, (label, name)
            noise = ((ref - want).abs().max().item()
                     * torch.finfo(of).eps / torch.finfo(pytorch_dtype).eps)
        for r in rounded:
            off = (r[name].detach().double() - want).abs()
            # A rounded run that is not finite where the exact one is measures nothing.
            assert not off[want.isfinite()].isnan().any(), (
                f"{label}{name}: the randomly rounded run is not finite")
            noise = max(noise, off.max().item())
        scale = want.abs().max().item()
        error = (got.double() - want).abs().max().item()
        bound = tolerance(noise, scale, of)
        if os.environ.get("SALUS_TOLERANCE_LOG"):
            with open(os.environ["SALUS_TOLERANCE_LOG"], "a") as log:
                print(f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}\t{label}"
                      f"{name}\t{error / bound if bound else error:.4g}\t{error:.4g}\t"
                      f"{noise:.4g}\t{scale:.4g}", file=log)
        assert error <= bound, (f"{label}{name}: error {error:.3g} > bound {bound:.3g} "
                                f"(rounding error measured {noise:.3g}, scale {scale:.3g})")


def f64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``model``: the exact reference of a float32 run."""
    return twin(model, torch.float64)


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
