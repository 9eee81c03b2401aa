"""The functional optimizers: refusals, state naming and taking over torch's state."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import (assert_as_exact_as_pytorch, eager_steps, f64_twin, randomly_rounded,
                     to_dtype, torch_state, traced_steps, twin)
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import salus
from salus.models import MLP, vector_batch
from salus.optim import functional_optimizer


def _model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP(6, (5,), 3)


def test_an_unknown_group_option_is_refused_by_name():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["trust_ratio"] = 0.02
    with pytest.raises(salus.UnsupportedOptimizerError, match="trust_ratio"):
        functional_optimizer(optimizer, dict(model.named_parameters()))


def test_unsupported_optimizer_is_refused():
    model = _model()

    class SignAdam(torch.optim.Adam):
        pass

    class ClippedSignAdam(SignAdam):
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = p.grad.sign()
            return super().step(closure)

    with pytest.raises(salus.UnsupportedOptimizerError,
                       match=r"ClippedSignAdam overrides step .*ClippedSignAdam"):
        functional_optimizer(ClippedSignAdam(model.parameters()),
                             dict(model.named_parameters()))
    with pytest.raises(salus.UnsupportedOptimizerError, match="LBFGS"):
        functional_optimizer(torch.optim.LBFGS(model.parameters()),
                             dict(model.named_parameters()))
    # A subclass that leaves step alone runs its stock class's rule.
    rule = functional_optimizer(SignAdam(model.parameters()), dict(model.named_parameters()))
    assert rule.kind == "adam"


def test_step_hooks_are_refused_because_they_would_not_run():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def log_lr(opt, args, kwargs):
        pass

    handle = optimizer.register_step_post_hook(log_lr)
    with pytest.raises(salus.UnsupportedOptimizerError,
                       match="register_step_post_hook: .*log_lr.*would not run"):
        salus.trace_train_step(model, nn.functional.cross_entropy, optimizer,
                               vector_batch(4, 6, 3))
    handle.remove()
    traced = salus.trace_train_step(model, nn.functional.cross_entropy, optimizer,
                                    vector_batch(4, 6, 3))
    traced.rule.changed_hyperparameters()
    # One registered on every optimizer after the session was traced: refused at the
    # next step.
    handle = register_optimizer_step_pre_hook(log_lr)
    try:
        with pytest.raises(salus.UnsupportedOptimizerError,
                           match="register_optimizer_step_pre_hook: .*log_lr"):
            traced.rule.changed_hyperparameters()
    finally:
        handle.remove()
    traced.rule.changed_hyperparameters()


def test_state_names_follow_the_ir_conventions():
    model = _model()
    names = list(dict(model.named_parameters()))
    sgd = functional_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               dict(model.named_parameters()))
    assert sgd.state_names() == [f"optimizer.momentum_buffer.{n}" for n in names] + [
        "optimizer.step"]
    plain = functional_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 dict(model.named_parameters()))
    assert plain.state_names() == []
    adam = functional_optimizer(torch.optim.AdamW(model.parameters()),
                                dict(model.named_parameters()))
    assert adam.state_names() == [f"optimizer.{k}.{n}" for n in names
                                  for k in ("exp_avg", "exp_avg_sq")] + ["optimizer.step"]
    assert adam.describe()["kind"] == "adamw"
    assert adam.hyper_names() == [f"optimizer.param_groups.0.{k}" for k in (
        "lr", "one_minus_beta1", "beta2", "one_minus_beta2", "log_beta1", "log_beta2", "eps",
        "decay_factor")]


def test_sgd_first_step_takes_the_gradient_as_momentum_buffer():
    model = _model()
    x, y = vector_batch(4, 6, 3)
    make = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5)  # noqa: E731
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    make(model.parameters()), (x, y))
    state, _ = traced.run(dict(traced.initial_state), x, y)
    assert state["optimizer.step"].item() == 1.0

    def grads(m, x):
        names = [f"optimizer.momentum_buffer.{n}" for n, _ in m.named_parameters()]
        return dict(zip(names, torch.autograd.grad(nn.functional.cross_entropy(m(x), y),
                                                   list(m.parameters()))))

    def exact():
        return grads(f64_twin(model), x.double())

    assert_as_exact_as_pytorch(state, exact(), grads(model, x), randomly_rounded(exact))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.Adafactor(p, lr=0.05, weight_decay=1e-2),
    lambda p: torch.optim.ASGD(p, lr=0.05, t0=2),
    lambda p: torch.optim.Rprop(p, lr=0.01),
], ids=["sgd", "adam", "adafactor", "asgd", "rprop"])
def test_tracing_takes_over_an_optimizer_that_already_stepped(make):
    model = _model()
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(4)]
    optimizer = make(model.parameters())
    eager_steps(model, optimizer, nn.functional.cross_entropy, batches[:2])
    def reference(dtype):
        reference = twin(model, dtype)
        reference_opt = make(reference.parameters())
        # a copy: Adam's load_state_dict keeps the step tensors, which the steps below
        # would advance in ``optimizer`` too
        reference_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        eager_steps(reference, reference_opt, nn.functional.cross_entropy,
                    [to_dtype(b, dtype) for b in batches[2:]])
        return torch_state(reference, reference_opt)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    traced = salus.trace_train_step(model, nn.functional.cross_entropy, optimizer, batches[2])
    state, _ = traced_steps(traced, batches[2:])
    assert_as_exact_as_pytorch(state, exact, eager, rounded)


def test_frozen_parameters_are_not_updated():
    model = _model()
    model.body[0].weight.requires_grad_(False)
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1),
                                    vector_batch(4, 6, 3))
    graph = traced.to_graph()
    updated = {graph.tensors[u.target].name for u in graph.updates}
    assert "body.0.weight" not in updated and "body.0.bias" in updated


def test_param_groups_keep_their_own_hyperparameters():
    model = _model()
    groups = [{"params": model.body.parameters(), "lr": 0.5},
              {"params": model.head.parameters(), "lr": 0.01, "momentum": 0.5}]
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(3)]

    def reference(dtype):
        reference = twin(model, dtype)
        ref_groups = [{"params": reference.body.parameters(), "lr": 0.5},
                      {"params": reference.head.parameters(), "lr": 0.01, "momentum": 0.5}]
        ref_opt = torch.optim.SGD(ref_groups, lr=0.1)
        eager_steps(reference, ref_opt, nn.functional.cross_entropy,
                    [to_dtype(b, dtype) for b in batches])
        return torch_state(reference, ref_opt)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(groups, lr=0.1), batches[0])
    assert "optimizer.momentum_buffer.body.0.weight" not in traced.state_names
    state, _ = traced_steps(traced, batches)
    assert_as_exact_as_pytorch(state, exact, eager, rounded)


class _WithUnused(nn.Module):
    """An MLP beside a parameter its loss reaches only when ``use_extra`` is set (as a
    mask token, or a head another task uses)."""

    def __init__(self):
        super().__init__()
        self.mlp = _model()
        self.extra = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.use_extra = False

    def forward(self, x):
        out = self.mlp(x)
        return out + self.extra if self.use_extra else out


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
], ids=["adamw", "sgd"])
def test_a_parameter_the_loss_does_not_reach_is_left_as_torch_leaves_it(make):
    """torch's optimizers skip a parameter whose gradient is None: no decay, no momentum,
    no state. ``torch.func`` gives it zeros, which the update would still decay."""
    model = _WithUnused()
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(3)]

    def reference(dtype):
        reference = twin(model, dtype)
        reference_opt = make(reference.parameters())
        eager_steps(reference, reference_opt, nn.functional.cross_entropy,
                    [to_dtype(b, dtype) for b in batches])
        assert reference.extra not in reference_opt.state
        return torch_state(reference, reference_opt)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    optimizer = make(model.parameters())
    traced = salus.trace_train_step(model, nn.functional.cross_entropy, optimizer, batches[0])
    state, _ = traced_steps(traced, batches)
    assert torch.equal(state["extra"], model.extra.detach())
    assert_as_exact_as_pytorch(state, exact, eager, rounded)
    traced.rule.give_back(state, dict(model.named_parameters()))
    assert model.extra not in optimizer.state and model.mlp.head.weight in optimizer.state


def test_an_optimizer_that_never_stepped_a_parameter_is_taken_over_while_the_loss_skips_it():
    model = _WithUnused()
    batches = [vector_batch(4, 6, 3, seed=s) for s in range(4)]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    eager_steps(model, optimizer, nn.functional.cross_entropy, batches[:2])
    reference = twin(model)
    reference_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    reference_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    eager_steps(reference, reference_opt, nn.functional.cross_entropy, batches[2:])
    traced = salus.trace_train_step(model, nn.functional.cross_entropy, optimizer, batches[2])
    state, _ = traced_steps(traced, batches[2:])
    assert state["optimizer.step"].item() == 4
    assert torch.equal(state["extra"], reference.extra.detach())

    # Reached now, after steps without it: torch would count its steps from 1.
    model.use_extra = True
    with pytest.raises(salus.UnsupportedOptimizerError, match="never extra, which the loss"):
        salus.trace_train_step(model, nn.functional.cross_entropy, optimizer, batches[2])
