"""Every stock optimizer, with its options and a learning-rate schedule, traced and run
step by step against eager PyTorch: the hyperparameters a scheduler changes reach the
graph before the next step, and each update rule computes what ``torch.optim`` does."""

from __future__ import annotations

import pytest
import torch
from harness import (assert_as_exact_as_pytorch, assert_trains_on_salusd_as_eagerly,
                     eager_steps, randomly_rounded, to_dtype, torch_state, traced_steps, twin)
from torch import nn
from torch.optim import lr_scheduler as sched

import salus
from salus.models import MLP, vector_batch

STEPS = 8
optim = torch.optim


def _model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MLP(6, (5,), 3)


def _warmup_then_cosine(o):
    return sched.SequentialLR(o, [sched.LinearLR(o, start_factor=0.25, total_iters=3),
                                  sched.CosineAnnealingLR(o, T_max=STEPS)], milestones=[3])


class _AdamWithReport(optim.Adam):
    """A subclass that leaves the update as it is (it adds a method): Adam's rule."""

    def report(self) -> str:
        return f"lr {self.param_groups[0]['lr']:.3g}"


# name: (optimizer, scheduler or None, whether the scheduler steps on the loss)
CASES = {
    "sgd_nesterov_steplr": (
        lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda o: sched.StepLR(o, step_size=2, gamma=0.5)),
    "sgd_maximize_plateau": (
        lambda p: optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.2, maximize=True),
        lambda o: sched.ReduceLROnPlateau(o, mode="max", factor=0.5, patience=0)),
    "adam_amsgrad_cosine": (
        lambda p: optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=1e-3),
        lambda o: sched.CosineAnnealingLR(o, T_max=STEPS)),
    "adamw_onecycle": (
        lambda p: optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
        lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=STEPS)),
    "adam_maximize_lambda": (
        lambda p: optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), maximize=True),
        lambda o: sched.LambdaLR(o, lambda k: 1 / (k + 1))),
    "adamax_exponential": (
        lambda p: optim.Adamax(p, lr=1e-2, weight_decay=1e-3),
        lambda o: sched.ExponentialLR(o, gamma=0.8)),
    "nadam_decoupled_warmup": (
        lambda p: optim.NAdam(p, lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True),
        _warmup_then_cosine),
    "nadam_l2": (
        lambda p: optim.NAdam(p, lr=1e-2, weight_decay=1e-3, momentum_decay=0.01), None),
    "radam_multistep": (
        lambda p: optim.RAdam(p, lr=1e-2, weight_decay=1e-3),
        lambda o: sched.MultiStepLR(o, milestones=[2, 5], gamma=0.3)),
    "radam_decoupled": (
        lambda p: optim.RAdam(p, lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True),
        None),
    "rmsprop_centered_momentum": (
        lambda p: optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True, weight_decay=1e-3),
        lambda o: sched.StepLR(o, step_size=3, gamma=0.5)),
    "rmsprop": (lambda p: optim.RMSprop(p, lr=1e-3), None),
    "adagrad_decay": (
        lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=1e-3,
                                initial_accumulator_value=0.1),
        lambda o: sched.ConstantLR(o, factor=0.5, total_iters=3)),
    "adadelta": (
        lambda p: optim.Adadelta(p, lr=1.0, rho=0.8, weight_decay=1e-3),
        lambda o: sched.PolynomialLR(o, total_iters=STEPS, power=2.0)),
    "rprop": (lambda p: optim.Rprop(p, lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-4, 0.02)),
              None),
    "rprop_maximize": (lambda p: optim.Rprop(p, lr=1e-3, maximize=True), None),
    "asgd_cosine": (
        lambda p: optim.ASGD(p, lr=0.05, lambd=1e-2, alpha=0.6, t0=3, weight_decay=1e-3),
        lambda o: sched.CosineAnnealingLR(o, T_max=STEPS)),
    "asgd_maximize": (lambda p: optim.ASGD(p, lr=0.02, maximize=True), None),
    "sgd_fused_nesterov": (
        lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3,
                            fused=True),
        lambda o: sched.StepLR(o, step_size=2, gamma=0.5)),
    "adamw_fused_amsgrad": (
        lambda p: optim.AdamW(p, lr=1e-2, amsgrad=True, weight_decay=1e-2, fused=True),
        lambda o: sched.CosineAnnealingLR(o, T_max=STEPS)),
    "adam_fused_maximize": (
        lambda p: optim.Adam(p, lr=1e-2, maximize=True, weight_decay=1e-3, fused=True), None),
    "adagrad_fused": (
        lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.01, fused=True), None),
    "adam_foreach": (lambda p: optim.Adam(p, lr=1e-2, foreach=True), None),
    "adam_subclass_steplr": (
        lambda p: _AdamWithReport(p, lr=1e-2, weight_decay=1e-3),
        lambda o: sched.StepLR(o, step_size=3, gamma=0.5)),
    "adafactor_decay_steplr": (
        lambda p: optim.Adafactor(p, lr=0.05, weight_decay=1e-2),
        lambda o: sched.StepLR(o, step_size=3, gamma=0.5)),
    "adafactor_eps_clip": (
        lambda p: optim.Adafactor(p, lr=0.5, beta2_decay=-0.5, eps=(1e-3, 1e-2), d=1.5,
                                  maximize=True), None),
}


class _ConvNet(nn.Module):
    """Weights of four, two and one dims: Adafactor factors the first two kinds."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("make", [
    lambda p: optim.Adafactor(p, lr=0.05, weight_decay=1e-2),
    lambda p: optim.ASGD(p, lr=0.05, t0=1),
    lambda p: optim.Rprop(p, lr=0.01),
], ids=["adafactor", "asgd", "rprop"])
def test_rprop_asgd_and_adafactor_train_on_salusd_as_eagerly(make, daemon):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 0])
    assert_trains_on_salusd_as_eagerly(_ConvNet(), (x, y),
                                       lambda m, x, y: nn.functional.cross_entropy(m(x), y),
                                       make, daemon.address, steps=4)


def _scheduler_step(scheduler, loss) -> None:
    if scheduler is None:
        return
    if isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step(float(loss))
    else:
        scheduler.step()


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_with_schedule_matches_eager(case):
    make, make_scheduler = CASES[case]
    model = _model()
    batches = [vector_batch(8, 6, 3, seed=s) for s in range(STEPS)]

    def reference(dtype):
        m = twin(model, dtype)
        o = make(m.parameters())
        s = make_scheduler(o) if make_scheduler else None
        for batch in batches:
            loss = eager_steps(m, o, nn.functional.cross_entropy, [to_dtype(batch, dtype)])
            _scheduler_step(s, loss[0])
        return torch_state(m, o)

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    optimizer = make(model.parameters())
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    traced = salus.trace_train_step(model, nn.functional.cross_entropy, optimizer,
                                    batches[0])
    state, _ = traced_steps(traced, batches, lambda loss: _scheduler_step(scheduler, loss))
    assert_as_exact_as_pytorch(state, exact, eager, rounded, label=f"{case}: ")


def test_a_schedule_changes_the_hyperparameters_the_session_holds():
    model = _model()
    optimizer = optim.SGD(model.parameters(), lr=0.1)
    scheduler = sched.StepLR(optimizer, step_size=1, gamma=0.5)
    traced = salus.trace_train_step(model, nn.functional.cross_entropy, optimizer,
                                    vector_batch(4, 6, 3))
    rule = traced.rule
    first = rule.changed_hyperparameters()
    assert first["optimizer.param_groups.0.lr"].item() == pytest.approx(0.1)
    assert rule.changed_hyperparameters() == {}  # nothing changed: nothing to write
    rule.mark_stepped()
    scheduler.step()
    assert rule.changed_hyperparameters()["optimizer.param_groups.0.lr"].item() == \
        pytest.approx(0.05)


@pytest.mark.parametrize("change, what", [
    (lambda o: o.param_groups[0].update(momentum=0.9), "momentum"),
    (lambda o: o.param_groups[0].update(nesterov=True), "nesterov"),
    (lambda o: o.add_param_group({"params": [nn.Parameter(torch.zeros(2))]}),
     "add_param_group"),
])
def test_a_change_the_traced_update_cannot_follow_is_refused(change, what):
    model = _model()
    optimizer = optim.SGD(model.parameters(), lr=0.1)
    traced = salus.trace_train_step(model, nn.functional.cross_entropy, optimizer,
                                    vector_batch(4, 6, 3))
    traced.rule.changed_hyperparameters()
    change(optimizer)
    with pytest.raises(salus.UnsupportedOptimizerError, match=what):
        traced.rule.changed_hyperparameters()
