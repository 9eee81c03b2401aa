"""``torch.optim.Adafactor``'s update: second moments factored into a row and a column
mean for every parameter of two or more dims, a full one for vectors and scalars.

Its state differs by the parameter's shape (``row_var`` and ``col_var``, or
``variance``), so the rule names each parameter's buffers itself
(:meth:`Adafactor.param_buffers`). What torch computes in Python from ``.item()``
values (the relative step size from the parameter's norm, the clipping denominator from
the update's norm, the decay of the second moments from the step) is tensor math here,
so every step of one traced graph computes it from that step's values.
"""

from __future__ import annotations

import math

import torch

from .base import FunctionalOptimizer, scalar, state_name


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``start.lerp(end, weight)`` for a scalar weight that changes from step to step:
    PyTorch's kernel picks its formula by ``|weight| < 0.5`` for each call, so the graph
    selects between the two (``weight`` 1, the first step, gives ``end`` exactly)."""
    small = start + weight * (end - start)
    large = end - (end - start) * (1 - weight)
    return torch.where(torch.lt(torch.abs(weight), 0.5), small, large)


def _mean_square(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.sum(x * x, dim=dim, keepdim=True) / x.shape[dim]


def _at_least(x: torch.Tensor, floor: float | torch.Tensor) -> torch.Tensor:
    """``x.clamp(min=floor)`` for a number or a 0-dim tensor (NaN stays NaN)."""
    if isinstance(floor, torch.Tensor):
        return torch.maximum(x, floor.to(x.dtype))
    return torch.clamp(x, min=floor)


def _rms(x: torch.Tensor) -> torch.Tensor:
    """``x.norm(2) / x.numel() ** 0.5``."""
    return torch.sqrt(torch.sum(x * x)) / math.sqrt(max(x.numel(), 1))


class Adafactor(FunctionalOptimizer):
    """``torch.optim.Adafactor``: lr, beta2_decay, eps (``eps1`` None: the parameters'
    dtype's epsilon), d, weight_decay, maximize."""

    kind = "adafactor"
    options = frozenset({"lr", "beta2_decay", "eps", "d", "weight_decay", "maximize"})

    def structure(self, group):
        return {"weight_decay": scalar(group["weight_decay"]) != 0,
                "maximize": bool(group["maximize"]),
                "dtype_epsilon": group["eps"][0] is None}

    def scalars(self, group, s):
        eps1, eps2 = group["eps"]
        out = {"lr": scalar(group["lr"]), "beta2_decay": scalar(group["beta2_decay"]),
               "eps2": scalar(eps2), "d": scalar(group["d"])}
        if not s["dtype_epsilon"]:
            out.update(eps1=scalar(eps1), eps1_squared=scalar(eps1) * scalar(eps1))
        if s["weight_decay"]:
            out["decay_factor"] = 1 - scalar(group["lr"]) * scalar(group["weight_decay"])
        return out

    def param_buffers(self, name):
        if self._tensor_of[name].dim() > 1:
            return ["row_var", "col_var"]
        return ["variance"]

    def init_buffer(self, key, param, group):
        if key in ("row_var", "col_var"):
            shape = list(param.shape)
            shape[-1 if key == "row_var" else -2] = 1
            return param.new_zeros(shape)
        return super().init_buffer(key, param, group)

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        t = step.to(hyper["lr"].dtype)
        one_minus_beta2 = torch.exp(hyper["beta2_decay"] * torch.log(t))
        rho = torch.minimum(hyper["lr"], torch.rsqrt(t))
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = torch.neg(grads[name]) if s["maximize"] else grads[name]
            weight = one_minus_beta2.to(param.dtype)
            if s["dtype_epsilon"]:
                eps1 = torch.finfo(param.dtype).eps
                eps1_squared: float | torch.Tensor = eps1 * eps1
                floor: float | torch.Tensor = eps1
            else:
                eps1_squared, floor = hyper["eps1_squared"], hyper["eps1"]
            alpha = torch.maximum(hyper["eps2"], _rms(param).to(rho.dtype)) * rho
            if s["weight_decay"]:
                param = param * hyper["decay_factor"]
            if grad.dim() > 1:
                row = _lerp(buffers[state_name("row_var", name)], _mean_square(grad, -1),
                            weight)
                col = _lerp(buffers[state_name("col_var", name)], _mean_square(grad, -2),
                            weight)
                new_b[state_name("row_var", name)] = row
                new_b[state_name("col_var", name)] = col
                estimate = row * col / _at_least(torch.mean(row, dim=-2, keepdim=True),
                                                 floor)
            else:
                estimate = _lerp(buffers[state_name("variance", name)], grad * grad, weight)
                new_b[state_name("variance", name)] = estimate
            update = torch.rsqrt(_at_least(estimate, eps1_squared)) * grad
            denom = torch.clamp(_rms(update).to(rho.dtype) / hyper["d"], min=1.0)
            new_p[name] = param - update * (alpha / denom).to(param.dtype)
        return new_p, new_b
