"""Helpers every rule uses: zeros, PyTorch's result type, a dtype's extremes."""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def _zeros(shape, dtype, device):
    return aten.full.default(list(shape), 0, dtype=dtype, device=device)


def _of_result_type(a, b):
    """``a`` and ``b`` (a tensor and a tensor or a number) as two tensors of PyTorch's
    result type for them: a number becomes a 0-dim tensor."""
    dtype = torch.result_type(a, b)
    device = (a if isinstance(a, torch.Tensor) else b).device
    return tuple((aten._to_copy.default(v, dtype=dtype) if v.dtype != dtype else v)
                 if isinstance(v, torch.Tensor)
                 else aten.scalar_tensor.default(v, dtype=dtype, device=device)
                 for v in (a, b))


def _extreme_of(dtype, largest: bool):
    """The largest (or smallest) value of ``dtype``: an infinity for floats."""
    if dtype == torch.bool:
        return largest
    if dtype.is_floating_point:
        return math.inf if largest else -math.inf
    info = torch.iinfo(dtype)
    return info.max if largest else info.min
