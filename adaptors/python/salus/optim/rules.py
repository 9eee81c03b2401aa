"""The update rule of each stock ``torch.optim`` optimizer, mirroring PyTorch's
single-tensor implementation (the CPU default) operation by operation.

Each rule reads its hyperparameters from tensors (``hyper``: see :mod:`.base`), so a
learning-rate schedule changes them between steps. Where eager PyTorch computes a scalar
from the hyperparameters alone in Python (``1 - beta2``, ``1 - lr * weight_decay``), the
rule's :meth:`scalars` computes it the same way and the graph receives the rounded result,
as PyTorch's kernel does; where the scalar also depends on the step (bias corrections),
the graph computes it from the step counter, to a few ulps of eager's float64 value.
"""

from __future__ import annotations

import math

import torch

from .adafactor import Adafactor
from .base import FunctionalOptimizer, Tensors, log, scalar, state_name
from .math import lerp, maximum, one_minus_power, power


def _decay(group) -> bool:
    return scalar(group["weight_decay"]) != 0


def _grad(grad: torch.Tensor, param: torch.Tensor, s: dict, hyper: Tensors) -> torch.Tensor:
    """The gradient as the rule sees it: negated under ``maximize``, plus L2 decay."""
    if s.get("maximize"):
        grad = torch.neg(grad)
    if s.get("weight_decay") and not s.get("decoupled"):
        grad = grad + param * hyper["weight_decay"]
    return grad


def _decayed(param: torch.Tensor, s: dict, hyper: Tensors) -> torch.Tensor:
    """The parameter after decoupled weight decay (AdamW's ``p *= 1 - lr * wd``)."""
    if s.get("weight_decay") and s.get("decoupled"):
        return param * hyper["decay_factor"]
    return param


def _weight_decay_scalars(group, s: dict) -> dict[str, float]:
    if not s["weight_decay"]:
        return {}
    lr, wd = scalar(group["lr"]), scalar(group["weight_decay"])
    if s.get("decoupled"):
        return {"decay_factor": 1 - lr * wd}
    return {"weight_decay": wd}


def _betas(group) -> tuple[float, float]:
    beta1, beta2 = group["betas"]
    return scalar(beta1), scalar(beta2)


class SGD(FunctionalOptimizer):
    """``torch.optim.SGD``: lr, momentum, dampening, weight_decay, nesterov, maximize.
    The momentum buffer starts as the first gradient (no dampening on step 1): the
    update selects ``grad`` while the step counter is 0."""

    kind = "sgd"
    options = frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov",
                         "maximize"})

    def structure(self, group):
        return {"momentum": scalar(group["momentum"]) != 0,
                "weight_decay": _decay(group), "nesterov": bool(group["nesterov"]),
                "maximize": bool(group["maximize"])}

    def scalars(self, group, s):
        out = {"lr": scalar(group["lr"]), **_weight_decay_scalars(group, s)}
        if s["momentum"]:
            out.update(momentum=scalar(group["momentum"]),
                       one_minus_dampening=1 - scalar(group["dampening"]))
        return out

    @property
    def counts_steps(self) -> bool:  # type: ignore[override]
        # Only momentum needs to know the first step; torch's SGD keeps no counter.
        return any(g.structure["momentum"] for g in self.groups)

    def buffers(self, s):
        return ["momentum_buffer"] if s["momentum"] else []

    def _taken_steps(self, torch_state, structure):
        if not structure["momentum"]:
            return None
        return 1.0 if torch_state.get("momentum_buffer") is not None else 0.0

    def _give_step(self, state, step):
        pass

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            if s["momentum"]:
                buf = buffers[state_name("momentum_buffer", name)]
                running = buf * hyper["momentum"] + grad * hyper["one_minus_dampening"]
                buf = torch.where(first, grad, running)
                new_b[state_name("momentum_buffer", name)] = buf
                grad = grad + buf * hyper["momentum"] if s["nesterov"] else buf
            new_p[name] = param - grad * hyper["lr"]
        return new_p, new_b


class Adam(FunctionalOptimizer):
    """``torch.optim.Adam`` and ``torch.optim.AdamW``: lr, betas, eps, weight_decay
    (decoupled for AdamW or ``decoupled_weight_decay``), amsgrad, maximize."""

    kind = "adam"
    options = frozenset({"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay",
                         "amsgrad", "maximize"})

    def __init__(self, optimizer, names, order):
        if isinstance(optimizer, torch.optim.AdamW):
            self.kind = "adamw"
        super().__init__(optimizer, names, order)

    def structure(self, group):
        beta1, _ = _betas(group)
        return {"weight_decay": _decay(group),
                "decoupled": bool(group.get("decoupled_weight_decay", False)),
                "amsgrad": bool(group["amsgrad"]), "maximize": bool(group["maximize"]),
                "small_lerp": abs(1 - beta1) < 0.5}

    def scalars(self, group, s):
        beta1, beta2 = _betas(group)
        return {"lr": scalar(group["lr"]), "one_minus_beta1": 1 - beta1, "beta2": beta2,
                "one_minus_beta2": 1 - beta2, "log_beta1": log(beta1),
                "log_beta2": log(beta2), "eps": scalar(group["eps"]),
                **_weight_decay_scalars(group, s)}

    def buffers(self, s):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if s["amsgrad"] else [])

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        bias_correction1 = one_minus_power(hyper["log_beta1"], step)
        bias_correction2 = one_minus_power(hyper["log_beta2"], step)
        step_size = hyper["lr"] / bias_correction1
        bias_correction2_sqrt = torch.sqrt(bias_correction2)
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            param = _decayed(param, s, hyper)
            exp_avg = lerp(buffers[state_name("exp_avg", name)], grad,
                           hyper["one_minus_beta1"], s["small_lerp"])
            exp_avg_sq = (buffers[state_name("exp_avg_sq", name)] * hyper["beta2"]
                          + grad * hyper["one_minus_beta2"] * grad)
            second = exp_avg_sq
            if s["amsgrad"]:
                second = maximum(buffers[state_name("max_exp_avg_sq", name)], exp_avg_sq)
                new_b[state_name("max_exp_avg_sq", name)] = second
            denom = torch.sqrt(second) / bias_correction2_sqrt + hyper["eps"]
            new_p[name] = param - (exp_avg / denom) * step_size
            new_b[state_name("exp_avg", name)] = exp_avg
            new_b[state_name("exp_avg_sq", name)] = exp_avg_sq
        return new_p, new_b


class Adamax(FunctionalOptimizer):
    """``torch.optim.Adamax``: lr, betas, eps, weight_decay, maximize."""

    kind = "adamax"
    options = frozenset({"lr", "betas", "eps", "weight_decay", "maximize"})

    def structure(self, group):
        beta1, _ = _betas(group)
        return {"weight_decay": _decay(group), "maximize": bool(group["maximize"]),
                "small_lerp": abs(1 - beta1) < 0.5}

    def scalars(self, group, s):
        beta1, beta2 = _betas(group)
        return {"lr": scalar(group["lr"]), "one_minus_beta1": 1 - beta1, "beta2": beta2,
                "log_beta1": log(beta1), "eps": scalar(group["eps"]),
                **_weight_decay_scalars(group, s)}

    def buffers(self, s):
        return ["exp_avg", "exp_inf"]

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        clr = hyper["lr"] / one_minus_power(hyper["log_beta1"], step)
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            exp_avg = lerp(buffers[state_name("exp_avg", name)], grad,
                           hyper["one_minus_beta1"], s["small_lerp"])
            exp_inf = maximum(buffers[state_name("exp_inf", name)] * hyper["beta2"],
                              torch.abs(grad) + hyper["eps"])
            new_p[name] = param - (exp_avg / exp_inf) * clr
            new_b[state_name("exp_avg", name)] = exp_avg
            new_b[state_name("exp_inf", name)] = exp_inf
        return new_p, new_b


class NAdam(FunctionalOptimizer):
    """``torch.optim.NAdam``: lr, betas, eps, weight_decay (decoupled or not),
    momentum_decay, maximize. Each parameter keeps its momentum product, as in torch."""

    kind = "nadam"
    options = frozenset({"lr", "betas", "eps", "weight_decay", "momentum_decay",
                         "decoupled_weight_decay", "maximize"})

    def structure(self, group):
        beta1, _ = _betas(group)
        return {"weight_decay": _decay(group),
                "decoupled": bool(group.get("decoupled_weight_decay", False)),
                "maximize": bool(group["maximize"]), "small_lerp": abs(1 - beta1) < 0.5}

    def scalars(self, group, s):
        beta1, beta2 = _betas(group)
        return {"lr": scalar(group["lr"]), "beta1": beta1, "one_minus_beta1": 1 - beta1,
                "beta2": beta2, "one_minus_beta2": 1 - beta2, "log_beta2": log(beta2),
                "eps": scalar(group["eps"]),
                "mu_exponent": scalar(group["momentum_decay"]) * math.log(0.96),
                **_weight_decay_scalars(group, s)}

    def buffers(self, s):
        return ["exp_avg", "exp_avg_sq", "mu_product"]

    def init_buffer(self, key, param, group):
        if key == "mu_product":
            return torch.ones((), dtype=torch.float32)
        return super().init_buffer(key, param, group)

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        bias_correction2 = one_minus_power(hyper["log_beta2"], step)
        t = step.to(hyper["mu_exponent"].dtype)
        mu = hyper["beta1"] * (1 - 0.5 * torch.exp(t * hyper["mu_exponent"]))
        mu_next = hyper["beta1"] * (1 - 0.5 * torch.exp((t + 1) * hyper["mu_exponent"]))
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            param = _decayed(param, s, hyper)
            mu_product = buffers[state_name("mu_product", name)] * mu.to(torch.float32)
            exp_avg = lerp(buffers[state_name("exp_avg", name)], grad,
                           hyper["one_minus_beta1"], s["small_lerp"])
            exp_avg_sq = (buffers[state_name("exp_avg_sq", name)] * hyper["beta2"]
                          + grad * hyper["one_minus_beta2"] * grad)
            denom = torch.sqrt(exp_avg_sq / bias_correction2) + hyper["eps"]
            product = mu_product.to(mu.dtype)
            param = param + (grad / denom) * (-hyper["lr"] * (1 - mu) / (1 - product))
            param = param + (exp_avg / denom) * (
                -hyper["lr"] * mu_next / (1 - product * mu_next))
            new_p[name] = param
            new_b[state_name("exp_avg", name)] = exp_avg
            new_b[state_name("exp_avg_sq", name)] = exp_avg_sq
            new_b[state_name("mu_product", name)] = mu_product
        return new_p, new_b


class RAdam(FunctionalOptimizer):
    """``torch.optim.RAdam``: lr, betas, eps, weight_decay (decoupled or not),
    maximize. The rectified branch is chosen per step by a select."""

    kind = "radam"
    options = frozenset({"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay",
                         "maximize"})

    def structure(self, group):
        beta1, _ = _betas(group)
        return {"weight_decay": _decay(group),
                "decoupled": bool(group.get("decoupled_weight_decay", False)),
                "maximize": bool(group["maximize"]), "small_lerp": abs(1 - beta1) < 0.5}

    def scalars(self, group, s):
        beta1, beta2 = _betas(group)
        rho_inf = 2 / (1 - beta2) - 1
        return {"lr": scalar(group["lr"]), "one_minus_beta1": 1 - beta1, "beta2": beta2,
                "one_minus_beta2": 1 - beta2, "log_beta1": log(beta1),
                "log_beta2": log(beta2), "eps": scalar(group["eps"]), "rho_inf": rho_inf,
                "rect_scale": rho_inf / ((rho_inf - 4) * (rho_inf - 2)),
                **_weight_decay_scalars(group, s)}

    def buffers(self, s):
        return ["exp_avg", "exp_avg_sq"]

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        bias_correction1 = one_minus_power(hyper["log_beta1"], step)
        bias_correction2 = one_minus_power(hyper["log_beta2"], step)
        t = step.to(bias_correction2.dtype)
        rho_t = hyper["rho_inf"] - 2 * t * power(hyper["log_beta2"], step) / bias_correction2
        rectified = torch.gt(rho_t, 5.0)
        # Where rho_t <= 5 the rectification is unused (and may be NaN): keep it finite.
        safe_rho = torch.where(rectified, rho_t, torch.full_like(rho_t, 6.0))
        rect = torch.sqrt((safe_rho - 4) * (safe_rho - 2) * hyper["rect_scale"] / safe_rho)
        bias_correction2_sqrt = torch.sqrt(bias_correction2)
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            param = _decayed(param, s, hyper)
            exp_avg = lerp(buffers[state_name("exp_avg", name)], grad,
                           hyper["one_minus_beta1"], s["small_lerp"])
            exp_avg_sq = (buffers[state_name("exp_avg_sq", name)] * hyper["beta2"]
                          + grad * hyper["one_minus_beta2"] * grad)
            corrected = exp_avg / bias_correction1 * hyper["lr"]
            adaptive = bias_correction2_sqrt / (torch.sqrt(exp_avg_sq) + hyper["eps"])
            step_value = torch.where(rectified, corrected * adaptive * rect, corrected)
            new_p[name] = param - step_value
            new_b[state_name("exp_avg", name)] = exp_avg
            new_b[state_name("exp_avg_sq", name)] = exp_avg_sq
        return new_p, new_b


class RMSprop(FunctionalOptimizer):
    """``torch.optim.RMSprop``: lr, alpha, eps, weight_decay, momentum, centered,
    maximize."""

    kind = "rmsprop"
    options = frozenset({"lr", "alpha", "eps", "weight_decay", "momentum", "centered",
                         "maximize"})

    def structure(self, group):
        return {"weight_decay": _decay(group), "momentum": scalar(group["momentum"]) > 0,
                "centered": bool(group["centered"]), "maximize": bool(group["maximize"]),
                "small_lerp": abs(1 - scalar(group["alpha"])) < 0.5}

    def scalars(self, group, s):
        alpha = scalar(group["alpha"])
        out = {"lr": scalar(group["lr"]), "alpha": alpha, "one_minus_alpha": 1 - alpha,
               "eps": scalar(group["eps"]), **_weight_decay_scalars(group, s)}
        if s["momentum"]:
            out["momentum"] = scalar(group["momentum"])
        return out

    def buffers(self, s):
        return (["square_avg"] + (["momentum_buffer"] if s["momentum"] else [])
                + (["grad_avg"] if s["centered"] else []))

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            square_avg = (buffers[state_name("square_avg", name)] * hyper["alpha"]
                          + grad * hyper["one_minus_alpha"] * grad)
            new_b[state_name("square_avg", name)] = square_avg
            if s["centered"]:
                grad_avg = lerp(buffers[state_name("grad_avg", name)], grad,
                                hyper["one_minus_alpha"], s["small_lerp"])
                new_b[state_name("grad_avg", name)] = grad_avg
                avg = torch.sqrt(square_avg - grad_avg * grad_avg)
            else:
                avg = torch.sqrt(square_avg)
            avg = avg + hyper["eps"]
            if s["momentum"]:
                buf = buffers[state_name("momentum_buffer", name)] * hyper["momentum"] \
                    + grad / avg
                new_b[state_name("momentum_buffer", name)] = buf
                new_p[name] = param - buf * hyper["lr"]
            else:
                new_p[name] = param - (grad / avg) * hyper["lr"]
        return new_p, new_b


class Adagrad(FunctionalOptimizer):
    """``torch.optim.Adagrad``: lr, lr_decay, weight_decay, eps,
    initial_accumulator_value, maximize (dense gradients)."""

    kind = "adagrad"
    options = frozenset({"lr", "lr_decay", "weight_decay", "eps",
                         "initial_accumulator_value", "maximize"})

    def structure(self, group):
        return {"weight_decay": _decay(group), "maximize": bool(group["maximize"])}

    def scalars(self, group, s):
        return {"lr": scalar(group["lr"]), "lr_decay": scalar(group["lr_decay"]),
                "eps": scalar(group["eps"]), **_weight_decay_scalars(group, s)}

    def buffers(self, s):
        return ["sum"]

    def init_buffer(self, key, param, group):
        return torch.full_like(param, scalar(group["initial_accumulator_value"]),
                               memory_format=torch.preserve_format)

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        t = step.to(hyper["lr"].dtype)
        clr = hyper["lr"] / (1 + (t - 1) * hyper["lr_decay"])
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            total = buffers[state_name("sum", name)] + grad * grad
            std = torch.sqrt(total) + hyper["eps"]
            new_p[name] = param - (grad / std) * clr
            new_b[state_name("sum", name)] = total
        return new_p, new_b


class Adadelta(FunctionalOptimizer):
    """``torch.optim.Adadelta``: lr, rho, eps, weight_decay, maximize."""

    kind = "adadelta"
    options = frozenset({"lr", "rho", "eps", "weight_decay", "maximize"})

    def structure(self, group):
        return {"weight_decay": _decay(group), "maximize": bool(group["maximize"])}

    def scalars(self, group, s):
        rho = scalar(group["rho"])
        return {"lr": scalar(group["lr"]), "rho": rho, "one_minus_rho": 1 - rho,
                "eps": scalar(group["eps"]), **_weight_decay_scalars(group, s)}

    def buffers(self, s):
        return ["square_avg", "acc_delta"]

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            square_avg = (buffers[state_name("square_avg", name)] * hyper["rho"]
                          + grad * hyper["one_minus_rho"] * grad)
            std = torch.sqrt(square_avg + hyper["eps"])
            acc = buffers[state_name("acc_delta", name)]
            delta = torch.sqrt(acc + hyper["eps"]) / std * grad
            acc = acc * hyper["rho"] + delta * hyper["one_minus_rho"] * delta
            new_p[name] = param - delta * hyper["lr"]
            new_b[state_name("square_avg", name)] = square_avg
            new_b[state_name("acc_delta", name)] = acc
        return new_p, new_b


class Rprop(FunctionalOptimizer):
    """``torch.optim.Rprop``: lr (every element's first step size), etas, step_sizes,
    maximize. Each element keeps its own step size and the gradient it last used
    (``prev``): a step grows by ``etaplus`` while the gradient keeps its sign, shrinks by
    ``etaminus`` when it flips (and then skips that element's move), and moves the
    element by the step against the gradient's sign. As in torch, ``lr`` only sets the
    first step sizes: a schedule does not change later steps."""

    kind = "rprop"
    options = frozenset({"lr", "etas", "step_sizes", "maximize"})

    def structure(self, group):
        return {"maximize": bool(group["maximize"])}

    def scalars(self, group, s):
        etaminus, etaplus = group["etas"]
        smallest, largest = group["step_sizes"]
        return {"etaminus": scalar(etaminus), "etaplus": scalar(etaplus),
                "step_size_min": scalar(smallest), "step_size_max": scalar(largest)}

    def buffers(self, s):
        return ["prev", "step_size"]

    def init_buffer(self, key, param, group):
        if key == "step_size":
            return torch.full_like(param, scalar(group["lr"]),
                                   memory_format=torch.preserve_format)
        return super().init_buffer(key, param, group)

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            sign = torch.sign(grad * buffers[state_name("prev", name)])
            # torch's three masked writes: a NaN sign stays NaN
            factor = torch.where(torch.gt(sign, 0), hyper["etaplus"], torch.where(
                torch.lt(sign, 0), hyper["etaminus"],
                torch.where(torch.eq(sign, 0), torch.ones_like(sign), sign)))
            step_size = buffers[state_name("step_size", name)] * factor
            step_size = torch.minimum(torch.maximum(step_size, hyper["step_size_min"]),
                                      hyper["step_size_max"])
            grad = torch.where(torch.eq(factor, hyper["etaminus"]), torch.zeros_like(grad),
                               grad)
            new_p[name] = param - torch.sign(grad) * step_size
            new_b[state_name("prev", name)] = grad
            new_b[state_name("step_size", name)] = step_size
        return new_p, new_b


class ASGD(FunctionalOptimizer):
    """``torch.optim.ASGD``: lr, lambd, alpha, t0, weight_decay, maximize. Each parameter
    keeps its step size ``eta`` and averaging weight ``mu`` (float32 scalars, as in torch)
    and its running average ``ax``; the update uses the ``eta`` of the step before and
    then computes the next from ``lr``, so a schedule takes effect one step later, as in
    torch."""

    kind = "asgd"
    options = frozenset({"lr", "lambd", "alpha", "t0", "weight_decay", "maximize"})

    def structure(self, group):
        return {"weight_decay": _decay(group), "maximize": bool(group["maximize"])}

    def scalars(self, group, s):
        return {"lr": scalar(group["lr"]), "lambd": scalar(group["lambd"]),
                "alpha": scalar(group["alpha"]), "t0": scalar(group["t0"]),
                **_weight_decay_scalars(group, s)}

    def buffers(self, s):
        return ["eta", "mu", "ax"]

    def init_buffer(self, key, param, group):
        if key == "eta":
            return torch.tensor(scalar(group["lr"]), dtype=torch.float32)
        if key == "mu":
            return torch.ones((), dtype=torch.float32)
        return super().init_buffer(key, param, group)

    def update_group(self, info, params, grads, buffers, hyper, step, first):
        s = info.structure
        t = step.to(hyper["lr"].dtype)
        # lr / (1 + lambd * lr * t) ** alpha and 1 / max(1, t - t0), as float32 scalars
        eta_next = (hyper["lr"] / torch.exp(
            hyper["alpha"] * torch.log1p(hyper["lambd"] * hyper["lr"] * t))).to(torch.float32)
        mu_next = torch.reciprocal(torch.clamp(t - hyper["t0"], min=1)).to(torch.float32)
        new_p, new_b = {}, {}
        for name, param in params.items():
            grad = _grad(grads[name], param, s, hyper)
            eta = buffers[state_name("eta", name)].to(param.dtype)
            param = param * (1 - hyper["lambd"].to(param.dtype) * eta)
            param = param - grad * eta
            mu = buffers[state_name("mu", name)]
            ax = buffers[state_name("ax", name)]
            ax = torch.where(torch.eq(mu, 1), param, ax + (param - ax) * mu.to(param.dtype))
            new_p[name] = param
            new_b[state_name("eta", name)] = eta_next
            new_b[state_name("mu", name)] = mu_next
            new_b[state_name("ax", name)] = ax
        return new_p, new_b


#: The rule of each supported optimizer class (exactly these classes: a subclass may
#: change ``step``).
RULES: dict[type, type[FunctionalOptimizer]] = {
    torch.optim.SGD: SGD, torch.optim.Adam: Adam, torch.optim.AdamW: Adam,
    torch.optim.Adamax: Adamax, torch.optim.NAdam: NAdam, torch.optim.RAdam: RAdam,
    torch.optim.RMSprop: RMSprop, torch.optim.Adagrad: Adagrad,
    torch.optim.Adadelta: Adadelta, torch.optim.Rprop: Rprop, torch.optim.ASGD: ASGD,
    torch.optim.Adafactor: Adafactor,
}
