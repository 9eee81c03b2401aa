"""Hooks on the model: gradient hooks of parameters (``param.register_hook``, per
parameter clipping) run in the traced step on each micro-batch's gradient, as autograd
runs them; forward hooks are recorded with the forward. A hook added or removed after
the step was traced would silently not take effect: the next iteration is refused. What
salus cannot record (modules' backward hooks, hooks after gradient accumulation) is
refused by name."""

from __future__ import annotations

import pytest
import torch
from harness import assert_as_exact_as_pytorch, randomly_rounded, to_dtype, torch_state
from torch import nn

import salus
import salus.torch as st

CE = nn.functional.cross_entropy


def _model(dtype=torch.float32, hooked: bool = True) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    if hooked:
        for p in model.parameters():  # per-parameter clipping, PyTorch's documented idiom
            p.register_hook(lambda grad: torch.clamp(grad, -0.05, 0.05))
        model[2].weight.register_hook(lambda grad: None)  # observes only
        model[0].bias.register_hook(lambda grad: grad * 3)
    return model


def _batches(count: int = 3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(count)]


def test_gradient_hooks_run_on_each_micro_batch_as_eagerly(daemon):
    batches = _batches()

    def reference(dtype):
        m = _model(dtype)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
        for x, y in batches:
            optimizer.zero_grad()
            for part in (slice(0, 4), slice(4, 8)):  # accumulate=2: a backward each
                xs, ys = to_dtype((x[part], y[part]), dtype)
                (CE(m(xs), ys) / 2).backward()
            optimizer.step()
        return torch_state(m, optimizer)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    model = _model()
    with st.TrainSession(model, CE, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                         batches[0], accumulate=2, address=daemon.address) as session:
        for batch in batches:
            session.step(*batch)
        state = session.state_dict()
    assert_as_exact_as_pytorch(state, exact, eager, rounded)
    # The hooks are in the graph: a clamp of each gradient of each micro-batch.
    hooked = _model()
    traced = salus.trace_train_step(hooked, CE, torch.optim.SGD(hooked.parameters(), lr=0.5),
                                    batches[0], gradients=salus.GradientRecipe(accumulate=2))
    clamps = [n for n in traced.graph_module.graph.nodes
              if str(n.target).startswith("aten.clamp")]
    assert len(clamps) == 2 * 4, [str(n.target) for n in clamps]


@pytest.mark.parametrize("add", [
    lambda m: m[1].register_forward_hook(lambda mod, inputs, out: out * 2),
    lambda m: m[0].weight.register_hook(lambda grad: grad * 0),
], ids=["forward_hook", "gradient_hook"])
def test_a_hook_added_after_tracing_is_refused_until_removed(add, daemon):
    model = _model(hooked=False)
    batch = _batches(1)[0]
    with st.TrainSession(model, CE, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                         address=daemon.address) as session:
        session.step(*batch)
        handle = add(model)
        with pytest.raises(salus.TraceError, match="hook .* was added or removed since the "
                                                   "step was traced"):
            session.step(*batch)
        handle.remove()
        session.step(*batch)
        assert session.iterations == 2


def test_what_salus_cannot_record_is_refused_by_name():
    model = _model(hooked=False)
    model[0].register_full_backward_hook(lambda mod, grad_in, grad_out: None)
    with pytest.raises(salus.TraceError, match=r"module 0 \(Linear\) has a backward hook"):
        salus.trace_train_step(model, CE, torch.optim.SGD(model.parameters(), lr=0.1),
                               _batches(1)[0])
    model = _model(hooked=False)
    model[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(salus.TraceError, match="parameter 2.bias has a hook after gradient "
                                               "accumulation"):
        salus.trace_train_step(model, CE, torch.optim.SGD(model.parameters(), lr=0.1),
                               _batches(1)[0])
