"""Ways a model's code is written that change how eager PyTorch runs it, not what it
computes: activation checkpointing (both variants, and ``checkpoint_sequential``),
``torch.compile`` (the whole model, or a part), weight and spectral normalisation (as
hooks or parametrizations), modules that keep tensors on themselves, and batch norm's
cumulative average (``momentum=None``). Each traced step runs, step by step, as eager
PyTorch's uncheckpointed, uncompiled twin trains."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from harness import (assert_as_exact_as_pytorch, assert_trains_on_salusd_as_eagerly,
                     eager_steps, randomly_rounded, to_dtype, torch_state, traced_steps, twin)
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import salus
import salus.torch as st
from salus.models import vector_batch

CE = nn.functional.cross_entropy


class _Net(nn.Module):
    """Two hidden layers; ``wrap(name, layer, x)`` says how each runs."""

    def __init__(self, how: str = "plain"):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
            self.head = nn.Linear(16, 3)
        self.how = how

    def forward(self, x):
        if self.how == "checkpoint":
            h = checkpoint(self.body, x, use_reentrant=False)
        elif self.how == "checkpoint_sequential":
            h = checkpoint_sequential(self.body, 2, x, use_reentrant=False)
        elif self.how == "reentrant":
            # x needs no gradient: eager's reentrant checkpoint gives body none (it warns).
            h = checkpoint(self.body, x, use_reentrant=True)
        else:
            h = self.body(x)
        return self.head(h)


def _assert_trains_as(model, eager_model, batches, make=lambda p: torch.optim.AdamW(
        p, lr=0.05, weight_decay=0.1)):
    def reference(dtype):
        m = twin(eager_model, dtype)
        optimizer = make(m.parameters())
        eager_steps(m, optimizer, CE, [to_dtype(b, dtype) for b in batches])
        return torch_state(m, optimizer)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    traced = salus.trace_train_step(model, CE, make(model.parameters()), batches[0])
    state, _ = traced_steps(traced, batches)
    # A compiled module's parameters are named through its _orig_mod, as in its state_dict.
    assert_as_exact_as_pytorch({k.replace("_orig_mod.", ""): v for k, v in state.items()},
                               exact, eager, rounded)
    return state


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_sequential"])
def test_a_checkpointed_model_trains_as_without_checkpoints(how):
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(3)]
    _assert_trains_as(_Net(how), _Net("plain"), batches)


def test_a_reentrant_checkpoint_whose_inputs_need_no_gradient_trains_as_eagerly():
    """Eager PyTorch gives the region's parameters no gradient, so AdamW leaves them; the
    traced step does the same (and, unlike the plain model's, leaves body unchanged)."""
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(3)]
    model = _Net("reentrant")
    with pytest.warns(UserWarning, match="requires_grad"):
        state = _assert_trains_as(model, _Net("reentrant"), batches)
    assert torch.equal(state["body.0.weight"], model.body[0].weight.detach())
    assert not torch.equal(state["head.weight"], model.head.weight.detach())


def test_a_compiled_model_and_a_compiled_part_train_as_written():
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(3)]
    # backend="eager": nothing is compiled to machine code, dynamo's wrapper is the same.
    state = _assert_trains_as(torch.compile(_Net(), backend="eager"), _Net(), batches)
    assert "_orig_mod.head.weight" in state, "named as the compiled model's state_dict"
    part = _Net()
    part.body = torch.compile(part.body, backend="eager")
    assert "body._orig_mod.0.weight" in _assert_trains_as(part, _Net(), batches)


class _KeepsItsOutput(nn.Module):
    """Stores its last output on itself, as a module that shows its attention map does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 3)
        self.shown = None

    def forward(self, h):
        self.shown = self.fc(h)
        self.calls = getattr(self, "calls", []) + [self.shown]
        return self.shown


_NORMS = {
    # The hooks set the module's weight as a plain attribute before each forward.
    "weight_norm_hook": lambda m: nn.utils.weight_norm(m),
    "spectral_norm_hook": lambda m: nn.utils.spectral_norm(m),
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
}


def _normed(kind: str, dtype=torch.float32) -> nn.Module:
    wrap = _NORMS[kind]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the hooks are deprecated
        torch.manual_seed(0)
        model = nn.Sequential(wrap(nn.Conv1d(3, 4, 3)), nn.LeakyReLU(0.2), nn.Flatten(),
                              wrap(nn.Linear(16, 16)), nn.Tanh(), _KeepsItsOutput())
    return model.to(dtype)


@pytest.mark.parametrize("kind", list(_NORMS))
def test_normalised_weights_train_as_eagerly_and_the_model_stays_whole(kind, daemon):
    x = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 0, 1])

    def reference(dtype):
        # Built afresh: a model with weight_norm's hook cannot be deep-copied.
        m = _normed(kind, dtype)
        optimizer = torch.optim.Adam(m.parameters(), lr=1e-2)
        eager_steps(m, optimizer, CE, [to_dtype((x, y), dtype)] * 3)
        return torch_state(m, optimizer)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    model = _normed(kind)
    before = model[0].weight if kind.endswith("_hook") else None
    with st.TrainSession(model, CE, torch.optim.Adam(model.parameters(), lr=1e-2), (x, y),
                         address=daemon.address) as session:
        for _ in range(3):
            session.step(x, y)
        state = session.state_dict()
    assert_as_exact_as_pytorch(state, exact, eager, rounded, label=f"{kind}: ")
    # What the forward stored on the modules while the step recorded is not left there:
    # the tensors the modules held before are back, and the model saves and runs.
    assert model[-1].shown is None and not hasattr(model[-1], "calls")
    if before is not None:
        assert model[0].weight is before
        torch.save(model, io.BytesIO())  # (PyTorch saves parametrized modules by state)
    trained = model.state_dict()
    assert trained.keys() <= state.keys()
    assert all(torch.equal(trained[k], state[k]) for k in trained)
    assert model(x).shape == (5, 3)


class _CumulativeNorms(nn.Module):
    """Batch norms that average their running statistics over every batch
    (``momentum=None``), which PyTorch weighs by a count it reads in Python."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.conv = nn.Conv2d(3, 4, 3)
            self.norm2d = nn.BatchNorm2d(4, momentum=None)
            self.fc = nn.Linear(4 * 4 * 4, 6)
            self.norm1d = nn.BatchNorm1d(6, momentum=None)
            self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.norm2d(self.conv(x))).flatten(1)
        return self.head(torch.tanh(self.norm1d(self.fc(h))))


def test_batch_norms_with_a_cumulative_average_train_on_salusd_as_eagerly(daemon):
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(6, 3, 6, 6, generator=g), torch.randint(0, 3, (6,), generator=g))
    assert_trains_on_salusd_as_eagerly(_CumulativeNorms(), batch,
                                       lambda m, x, y: CE(m(x), y),
                                       lambda p: torch.optim.SGD(p, lr=0.1), daemon.address,
                                       steps=4)
