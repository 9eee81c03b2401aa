"""Tensor math the update rules share, written as PyTorch's CPU kernels compute it."""

from __future__ import annotations

import torch


def lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor, small: bool
         ) -> torch.Tensor:
    """``start.lerp(end, weight)`` for a scalar weight, with the formula PyTorch's kernel
    picks: ``small`` says ``|weight| < 0.5`` (part of a group's traced structure)."""
    if small:
        return start + weight * (end - start)
    return end - (end - start) * (1 - weight)


def maximum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.maximum(a, b)`` (NaN wins), as the optimizers call it."""
    return torch.maximum(a, b)


def one_minus_power(log_beta: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``1 - beta ** t`` from ``log(beta)`` (taken in float64 by the caller) and the step
    ``t``, accurate to a few ulps of their dtype. The plain formula rounds ``beta ** t``
    and then cancels: in float32, ``1 - 0.999`` comes out 1.3e-5 off, which would move
    every Adam step by half that (eager PyTorch computes it in Python's float64). Here it
    is ``-expm1(y)``, ``y = t * log(beta)``: expm1 by its Taylor series (Horner, to
    y**8/8! in float32 and y**16/16! in float64, within an ulp for -1/2 < y <= 0) and by
    ``exp(y) - 1`` below -1/2, where nothing cancels. Only multiplications, additions,
    exp and a select: no branch that an engine evaluates can be inf or NaN."""
    t = t.to(torch.promote_types(log_beta.dtype, t.dtype))
    y = t * log_beta
    series = torch.ones_like(y)
    for k in range(16 if y.dtype == torch.float64 else 8, 0, -1):
        series = series * (y / k) + 1 if k > 1 else series * y
    # exp(y) - 1 written as -(1 - exp(y)), the same bits: subtracting a Python number
    # lifts it into a graph constant, and the step's persistent bytes stay the optimizer
    # state's alone
    expm1 = torch.where(torch.gt(y, -0.5), series, torch.neg(torch.neg(torch.exp(y)) + 1))
    return torch.neg(expm1)


def power(log_beta: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``beta ** t`` from ``log(beta)`` and ``t``."""
    return torch.exp(t.to(torch.promote_types(log_beta.dtype, t.dtype)) * log_beta)
