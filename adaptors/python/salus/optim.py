"""Optimizer updates as plain functional tensor math.

This module owns the translation of a real ``torch.optim`` instance (SGD, Adam, AdamW)
into a pure function ``update(params, grads, state) -> (new_params, new_state)`` that the
tracer can record into the graph. Hyperparameters are read from the optimizer's
``param_groups`` and baked in as constants; the state is a flat ``name -> tensor`` dict
named as ``docs/ir.md`` says:

- ``optimizer.momentum_buffer.<param>`` (SGD with momentum),
- ``optimizer.exp_avg.<param>`` and ``optimizer.exp_avg_sq.<param>`` (Adam, AdamW),
- ``optimizer.step``: one f32 scalar shared by every parameter.

The math mirrors PyTorch's single-tensor (CPU default) implementations operation by
operation, so a traced step matches ``optimizer.step()`` to float rounding. Two points
keep the traced graph identical at every iteration:

- Adam's step counter is a tensor; the bias corrections are computed from it in the graph.
- SGD initialises its momentum buffer from the first gradient (no dampening on step 1).
  The buffer starts as zeros and ``optimizer.step`` counts the steps taken; the update
  selects ``grad`` while the counter is 0 and ``momentum * buf + (1 - dampening) * grad``
  afterwards (``torch.where``). When the torch optimizer already holds momentum buffers,
  they are taken over and the counter starts at 1.

Options without a functional equivalent here (``amsgrad``, ``maximize``, ``fused``, any
option this module does not know) are refused with :class:`UnsupportedOptimizerError`
naming the option. Learning-rate schedules are not followed: the lr at trace time is
baked into the graph.

Parameters the optimizer holds always receive an update, even when the loss does not
depend on them (their gradient is then zero, where ``torch.optim`` would skip them).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Mapping

import torch

from .errors import UnsupportedOptimizerError

Tensors = dict[str, torch.Tensor]

STEP = "optimizer.step"
_STEP_DTYPE = torch.float32

# Options every supported optimizer may carry without changing the math.
_HARMLESS = {"params", "foreach", "differentiable", "capturable", "initial_lr"}


def momentum_buffer_name(param: str) -> str:
    return f"optimizer.momentum_buffer.{param}"


def exp_avg_name(param: str) -> str:
    return f"optimizer.exp_avg.{param}"


def exp_avg_sq_name(param: str) -> str:
    return f"optimizer.exp_avg_sq.{param}"


def _scalar(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _refuse(optimizer: torch.optim.Optimizer, option: str, value) -> None:
    raise UnsupportedOptimizerError(
        f"{type(optimizer).__name__}({option}={value!r}) is not supported by salus: "
        f"only the plain update can be traced; remove the option '{option}'"
    )


def _check_group(optimizer, group: Mapping, allowed: set[str], must_be_false: set[str]):
    for key, value in group.items():
        if key in must_be_false:
            if value:
                _refuse(optimizer, key, value)
        elif key not in allowed and key not in _HARMLESS:
            _refuse(optimizer, key, value)


class FunctionalOptimizer:
    """The update rule of one torch optimizer over named parameters.

    ``params`` maps each trained parameter's qualified name to its hyperparameters (a
    per-group dataclass); iteration order follows the model's parameter order.
    """

    kind = "base"

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                 order: list[str]):
        self.optimizer = optimizer
        per_name = {}
        self._tensor_of: dict[str, torch.Tensor] = {}
        for group in optimizer.param_groups:
            hyper = self._hyper(group)
            for p in group["params"]:
                name = names.get(id(p))
                if name is None:
                    raise UnsupportedOptimizerError(
                        f"{type(optimizer).__name__} holds a tensor of shape "
                        f"{tuple(p.shape)} that is not a parameter of the model"
                    )
                if p.requires_grad:
                    per_name[name] = hyper
                    self._tensor_of[name] = p
        self.params = {n: per_name[n] for n in order if n in per_name}

    def _hyper(self, group: Mapping):
        raise NotImplementedError

    def state_names(self) -> list[str]:
        raise NotImplementedError

    def initial_state(self) -> Tensors:
        """The state before the next step: taken over from the torch optimizer if it has
        stepped already, fresh otherwise."""
        raise NotImplementedError

    def update(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
               state: Mapping[str, torch.Tensor]) -> tuple[Tensors, Tensors]:
        raise NotImplementedError

    def describe(self) -> dict:
        """Hyperparameters as plain data (for manifests and messages)."""
        groups = []
        for hyper in dict.fromkeys(self.params.values()):
            groups.append({"params": [n for n, h in self.params.items() if h == hyper],
                           **hyper.__dict__})
        return {"kind": self.kind, "groups": groups}

    def _torch_state(self, name: str) -> dict:
        return self.optimizer.state.get(self._tensor_of[name], {})


@dataclass(frozen=True)
class SGDHyper:
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool


class FunctionalSGD(FunctionalOptimizer):
    """``torch.optim.SGD``: lr, momentum, dampening, weight_decay, nesterov."""

    kind = "sgd"

    def _hyper(self, group):
        _check_group(self.optimizer, group,
                     {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
                     {"maximize", "fused"})
        return SGDHyper(_scalar(group["lr"]), _scalar(group["momentum"]),
                        _scalar(group["dampening"]), _scalar(group["weight_decay"]),
                        bool(group["nesterov"]))

    def _with_momentum(self) -> list[str]:
        return [n for n, h in self.params.items() if h.momentum != 0]

    def state_names(self) -> list[str]:
        with_momentum = self._with_momentum()
        if not with_momentum:
            return []
        return [momentum_buffer_name(n) for n in with_momentum] + [STEP]

    def initial_state(self) -> Tensors:
        with_momentum = self._with_momentum()
        if not with_momentum:
            return {}
        buffers = {n: self._torch_state(n).get("momentum_buffer") for n in with_momentum}
        started = [n for n, b in buffers.items() if b is not None]
        if started and len(started) != len(buffers):
            missing = sorted(set(buffers) - set(started))
            raise UnsupportedOptimizerError(
                "SGD has momentum buffers for some parameters but not for "
                f"{', '.join(missing)}: cannot take over a partly initialised state")
        state = {}
        for n, buf in buffers.items():
            p = self._tensor_of[n]
            state[momentum_buffer_name(n)] = (
                buf.detach().clone() if buf is not None else torch.zeros_like(p.detach()))
        state[STEP] = torch.tensor(1.0 if started else 0.0, dtype=_STEP_DTYPE)
        return state

    def update(self, params, grads, state):
        new_params: Tensors = {}
        new_state: Tensors = {}
        step = state.get(STEP)
        first = None if step is None else torch.eq(step, 0)
        for name, h in self.params.items():
            param, grad = params[name], grads[name]
            if h.weight_decay != 0:
                grad = torch.add(grad, param, alpha=h.weight_decay)
            if h.momentum != 0:
                buf = state[momentum_buffer_name(name)]
                running = torch.add(buf * h.momentum, grad, alpha=1 - h.dampening)
                buf = torch.where(first, grad, running)
                new_state[momentum_buffer_name(name)] = buf
                grad = torch.add(grad, buf, alpha=h.momentum) if h.nesterov else buf
            new_params[name] = torch.add(param, grad, alpha=-h.lr)
        if step is not None:
            new_state[STEP] = step + 1
        return new_params, new_state


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool


class FunctionalAdam(FunctionalOptimizer):
    """``torch.optim.Adam`` and ``torch.optim.AdamW`` (decoupled weight decay):
    lr, betas, eps, weight_decay; amsgrad must be False."""

    kind = "adam"

    def __init__(self, optimizer, names, order):
        if isinstance(optimizer, torch.optim.AdamW):
            self.kind = "adamw"
        super().__init__(optimizer, names, order)

    def _hyper(self, group):
        _check_group(self.optimizer, group,
                     {"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"},
                     {"amsgrad", "maximize", "fused"})
        beta1, beta2 = group["betas"]
        return AdamHyper(_scalar(group["lr"]), _scalar(beta1), _scalar(beta2),
                         _scalar(group["eps"]), _scalar(group["weight_decay"]),
                         bool(group.get("decoupled_weight_decay", False)))

    def state_names(self) -> list[str]:
        names = [f(n) for n in self.params for f in (exp_avg_name, exp_avg_sq_name)]
        return names + [STEP] if names else []

    def initial_state(self) -> Tensors:
        if not self.params:
            return {}
        state: Tensors = {}
        steps = set()
        for name in self.params:
            torch_state = self._torch_state(name)
            p = self._tensor_of[name].detach()
            steps.add(_scalar(torch_state["step"]) if "step" in torch_state else 0.0)
            for key, label in (("exp_avg", exp_avg_name), ("exp_avg_sq", exp_avg_sq_name)):
                value = torch_state.get(key)
                state[label(name)] = (value.detach().clone() if value is not None
                                      else torch.zeros_like(p))
        if len(steps) != 1:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} parameters are at different steps "
                f"({sorted(steps)}): salus keeps one step counter for all of them")
        state[STEP] = torch.tensor(steps.pop(), dtype=_STEP_DTYPE)
        return state

    def update(self, params, grads, state):
        new_params: Tensors = {}
        new_state: Tensors = {}
        if not self.params:
            return new_params, new_state
        step = state[STEP] + 1
        new_state[STEP] = step
        corrections: dict = {}
        for name, h in self.params.items():
            param, grad = params[name], grads[name]
            if h.weight_decay != 0:
                if h.decoupled_weight_decay:
                    param = param * (1 - h.lr * h.weight_decay)
                else:
                    grad = torch.add(grad, param, alpha=h.weight_decay)
            exp_avg = _lerp(state[exp_avg_name(name)], grad, 1 - h.beta1)
            exp_avg_sq = state[exp_avg_sq_name(name)] * h.beta2 + grad * (1 - h.beta2) * grad
            key = (h.beta1, h.beta2, param.dtype)
            if key not in corrections:
                corrections[key] = _bias_corrections(step, h, param.dtype)
            bias_correction1, bias_correction2 = corrections[key]
            denom = torch.sqrt(exp_avg_sq) / torch.sqrt(bias_correction2) + h.eps
            new_params[name] = param - (exp_avg / denom) * h.lr / bias_correction1
            new_state[exp_avg_name(name)] = exp_avg
            new_state[exp_avg_sq_name(name)] = exp_avg_sq
        return new_params, new_state


def _bias_corrections(step: torch.Tensor, h: AdamHyper, dtype: torch.dtype):
    """``(1 - beta1 ** step, 1 - beta2 ** step)`` from the step tensor, in at least f32
    (f64 for f64 parameters), to a few ulps (see :func:`_one_minus_power`)."""
    t = step.to(torch.promote_types(dtype, step.dtype))
    return _one_minus_power(h.beta1, t), _one_minus_power(h.beta2, t)


def _one_minus_power(beta: float, t: torch.Tensor) -> torch.Tensor:
    """``1 - beta ** t`` accurate to a few ulps of ``t``'s dtype. The plain formula in
    float32 rounds beta first and then cancels: 1 - 0.999 comes out 1.3e-5 off, which
    moves every Adam step by half that (eager PyTorch computes it in Python's float64).
    Here it is -expm1(y), y = t * log(beta) with log(beta) taken in float64: expm1 by its
    Taylor series (Horner, to y**8/8! in float32 and y**16/16! in float64, within an ulp
    for -1/2 < y <= 0) and by exp(y) - 1 below -1/2, where nothing cancels. Only
    multiplications, additions, exp and a select: no branch that an engine evaluates can
    be inf or NaN."""
    y = t * math.log(beta)
    series = torch.ones_like(y)
    for k in range(16 if y.dtype == torch.float64 else 8, 0, -1):
        series = series * (y / k) + 1 if k > 1 else series * y
    # exp(y) - 1 written as -(1 - exp(y)), the same bits: subtracting a Python number
    # lifts it into a graph constant, and the step's persistent bytes stay the optimizer
    # state's alone
    expm1 = torch.where(torch.gt(y, -0.5), series, torch.neg(torch.neg(torch.exp(y)) + 1))
    return torch.neg(expm1)


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """``start.lerp(end, weight)`` with a Python weight, as PyTorch's CPU kernel computes
    it (the formula depends on which side of 0.5 the weight lies)."""
    if abs(weight) < 0.5:
        return start + (end - start) * weight
    return end - (end - start) * (1 - weight)


_FUNCTIONAL = {
    torch.optim.SGD: FunctionalSGD,
    torch.optim.Adam: FunctionalAdam,
    torch.optim.AdamW: FunctionalAdam,
}


def functional_optimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Mapping[str, torch.Tensor]) -> FunctionalOptimizer:
    """The functional form of ``optimizer`` over the model's ``named_parameters``.

    Raises :class:`UnsupportedOptimizerError` for other optimizer classes (subclasses
    included: they may change ``step``) and for unsupported options.
    """
    cls = _FUNCTIONAL.get(type(optimizer))
    if cls is None:
        supported = ", ".join(sorted(c.__name__ for c in _FUNCTIONAL))
        raise UnsupportedOptimizerError(
            f"optimizer {type(optimizer).__name__} is not supported by salus "
            f"(supported: {supported})")
    names = {id(t): n for n, t in named_parameters.items()}
    return cls(optimizer, names, list(named_parameters))
