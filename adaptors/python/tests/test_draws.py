"""Branches on random draws that a recorded step decides (salus.draws): LayerDrop with
layerdrop 0 trains as eagerly, a branch that could go either way is refused naming it.
Python's and NumPy's draws in the step, which the recording would keep, are refused."""

from __future__ import annotations

import operator
import random

import numpy as np
import pytest
import torch
from harness import (assert_as_exact_as_pytorch, eager_steps, randomly_rounded, to_dtype,
                     torch_state, traced_steps, twin)
from torch import nn

import salus
from salus.draws import decide
from salus.models import vector_batch


@pytest.mark.parametrize("compare, low, high, c, expected", [
    (operator.lt, 0.0, 1.0, 0.0, False),   # LayerDrop's draw < layerdrop 0
    (operator.lt, 0.0, 1.0, 1.0, True),    # the range is open at 1
    (operator.lt, 0.0, 1.0, 0.5, None),
    (operator.le, 0.0, 1.0, 0.0, None),    # the draw may be 0
    (operator.le, 0.0, 1.0, -0.1, False),
    (operator.gt, 0.0, 1.0, -0.1, True),
    (operator.gt, 0.0, 1.0, 0.0, None),
    (operator.ge, 0.0, 1.0, 0.0, True),
    (operator.ge, 0.0, 1.0, 1.0, False),
    (operator.ge, 2.0, 3.0, 2.5, None),
])
def test_a_comparison_is_decided_only_when_every_draw_gives_the_same_answer(
        compare, low, high, c, expected):
    assert decide(compare, low, high, c) is expected


class _LayerDrop(nn.Module):
    """Layers skipped at random in training, as transformers' LayerDrop skips them."""

    def __init__(self, layerdrop: float):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
            self.head = nn.Linear(6, 3)
        self.layerdrop = layerdrop

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = torch.relu(layer(x))
        # Decided the other way round too: a draw is always below 1, and above -1.
        if torch.rand(()) < 1.0 and torch.empty(()).uniform_(2.0, 3.0) > -1:
            x = x * 2
        return self.head(x)


def test_layerdrop_of_zero_trains_as_eagerly():
    model = _LayerDrop(0.0)
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(3)]

    def reference(dtype):
        reference = twin(model, dtype)
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        eager_steps(reference, optimizer, nn.functional.cross_entropy,
                    [to_dtype(b, dtype) for b in batches])
        return torch_state(reference, optimizer)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    traced = salus.trace_train_step(
        model, nn.functional.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches[0])
    state, _ = traced_steps(traced, batches)
    assert_as_exact_as_pytorch(state, exact, eager, rounded)


def test_a_branch_on_a_draw_that_could_go_either_way_is_refused_naming_it():
    model = _LayerDrop(0.2)
    with pytest.raises(salus.TraceError, match=r"random draw \(uniform in \[0, 1\) < 0.2\) "
                                               r"at .*test_draws.py:\d+.*layerdrop to 0"):
        salus.trace_train_step(model, nn.functional.cross_entropy,
                               torch.optim.SGD(model.parameters(), lr=0.1),
                               vector_batch(4, 6, 3))


def test_a_value_read_inside_a_library_module_names_the_module():
    # A library module that reads a tensor's value in Python, in code that is not the
    # user's: the module is what the user can find.
    class Normalised(nn.Module):
        def forward(self, x):
            return x / float(x.abs().max())

    model = nn.Sequential(nn.Linear(6, 5), Normalised(), nn.Linear(5, 3))
    Normalised.forward.__code__ = Normalised.forward.__code__.replace(
        co_filename="/site-packages/torch/nn/modules/normalised.py")
    with pytest.raises(salus.TraceError, match=r"reads a tensor's value in Python .*\) in "
                                               r"module 1 \(Normalised\): salus traces"):
        salus.trace_train_step(model, nn.functional.cross_entropy,
                               torch.optim.SGD(model.parameters(), lr=0.1),
                               vector_batch(4, 6, 3))


def test_a_branch_on_other_values_is_still_refused():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            return self.fc(x) if torch.rand([]) * x.sum() < 0 else -self.fc(x)

    model = Branchy()
    with pytest.raises(salus.TraceError, match="reads a tensor's value in Python"):
        salus.trace_train_step(model, nn.functional.cross_entropy,
                               torch.optim.SGD(model.parameters(), lr=0.1),
                               vector_batch(4, 6, 3))


def _mixup_loss(model, x, y):
    # A mixup written inside the step: the weight would be drawn once, while recording.
    lam = float(np.random.beta(0.4, 0.4))
    mixed = lam * x + (1 - lam) * x.flip(0)
    out = model(mixed)
    ce = nn.functional.cross_entropy
    return lam * ce(out, y) + (1 - lam) * ce(out, y.flip(0))


def _teacher_forcing_loss(model, x, y):
    h = model[0](x)
    if random.random() < 0.5:  # the tutorial's teacher forcing, decided in Python
        h = h + 1
    return nn.functional.cross_entropy(model[2](torch.tanh(h)), y)


def _python_layerdrop_loss(model, x, y):
    h = model[0](x)
    if np.random.random() >= 0.0:  # wav2vec2's LayerDrop with layerdrop 0: never skips
        h = torch.tanh(h)
    if not random.uniform(0.2, 0.4) < 0.1:  # never below 0.2
        h = h * 2
    return nn.functional.cross_entropy(model[2](h), y)


def test_a_branch_on_a_python_draw_that_goes_one_way_for_every_draw_is_decided():
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = vector_batch(4, 6, 3)
    traced = salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                                    (x, y), loss_of=_python_layerdrop_loss)
    state = dict(traced.initial_state)
    state.update(traced.rule.changed_hyperparameters())
    got = traced.run(state, x, y)[1].item()

    def eager(dtype):
        with torch.no_grad():
            return [_python_layerdrop_loss(twin(model, dtype), x.to(dtype), y).item()]

    assert_as_exact_as_pytorch([got], eager(torch.float64), eager(torch.float32),
                               dtype=torch.float32)


def _arithmetic_on_a_draw(model, x, y):
    return nn.functional.cross_entropy(model(x * random.random()), y)


def _either_way(model, x, y):
    return nn.functional.cross_entropy(model(x if np.random.rand() < 0.5 else -x), y)


@pytest.mark.parametrize("loss_of, draw", [
    (_mixup_loss, "draws a random number with numpy.random.beta"),
    (_teacher_forcing_loss, r"branches on random.random\(\) \(uniform in \[0, 1\) < 0.5"),
    (_arithmetic_on_a_draw, r"uses random.random\(\) as a number"),
    (_either_way, r"branches on numpy.random.rand\(\)"),
])
def test_a_python_or_numpy_draw_in_the_step_is_refused_naming_it(loss_of, draw):
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with pytest.raises(salus.TraceError, match=rf"{draw}.* at .*test_draws.py:\d+ while it "
                                               "records.*pass it in the batch"):
        salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                               vector_batch(4, 6, 3), loss_of=loss_of)
    # Outside a recording, and after one, the draws are Python's and NumPy's own.
    assert 0 <= random.random() < 1 and 0 <= np.random.beta(0.4, 0.4) <= 1


def test_a_draw_passed_in_the_batch_trains():
    def mixup(model, x, y, lam):
        mixed = lam * x + (1 - lam) * x.flip(0)
        out = model(mixed)
        ce = nn.functional.cross_entropy
        return lam * ce(out, y) + (1 - lam) * ce(out, y.flip(0))

    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = vector_batch(4, 6, 3)
    traced = salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                                    (x, y, torch.tensor(0.3)), loss_of=mixup)
    state = dict(traced.initial_state)
    state.update(traced.rule.changed_hyperparameters())
    weights = (0.3, 0.9)  # each step its own
    losses = [traced.run(state, x, y, torch.tensor(lam))[1].item() for lam in weights]

    def eager(dtype):
        m = twin(model, dtype)
        with torch.no_grad():
            return [mixup(m, x.to(dtype), y, torch.tensor(lam, dtype=dtype)).item()
                    for lam in weights]

    assert losses[0] != losses[1]
    assert_as_exact_as_pytorch(losses, eager(torch.float64), eager(torch.float32),
                               dtype=torch.float32)
