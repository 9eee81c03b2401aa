"""Gradients a loss takes itself, while a step records: a gradient penalty (WGAN-GP's,
R1's) marks a tensor with ``requires_grad_()`` and differentiates through
``torch.autograd.grad(..., create_graph=True)``. salus records the step's own gradient
inside ``torch.func.grad``, where PyTorch refuses ``requires_grad_``; so while the loss
runs, ``requires_grad_()`` opens a gradient level of its own, one inside the step's, and
marks the tensor in it (as ``torch.func.grad`` marks its inputs); ``torch.autograd.grad``
then differentiates there, and the step's gradient differentiates through that (a
double backward). The loss's results leave the levels it opened, innermost first, as
they leave ``torch.func.grad``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.utils._pytree as pytree
from torch._C import _functorch

_OPEN: list[list[int]] = []


def _requires_grad_(original):
    def requires_grad_(self, requires_grad=True):
        if (not _OPEN or not requires_grad or _functorch.maybe_current_level() is None
                or _functorch.get_inplace_requires_grad_allowed()):
            return original(self, requires_grad)  # outside a transform, or torch.func's own
        level = _functorch._grad_increment_nesting()
        _OPEN[-1].append(level)
        wrapped = _functorch._wrap_for_grad(self, level)
        _functorch.set_inplace_requires_grad_allowed(True)
        try:
            original(wrapped, True)
        finally:
            _functorch.set_inplace_requires_grad_allowed(False)
        return wrapped
    return requires_grad_


def _grad(original):
    def grad(outputs, inputs, *args, **kwargs):
        create_graph = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
        if create_graph:
            return original(outputs, inputs, *args, **kwargs)
        # Eager PyTorch's gradient without create_graph is a constant: so at every level.
        with torch.no_grad():
            return original(outputs, inputs, *args, **kwargs)
    return grad


@contextlib.contextmanager
def inner_gradients() -> Iterator[list]:
    """While the loss runs: ``requires_grad_()`` as above, and ``torch.autograd.grad``
    without ``create_graph`` a constant at every level, as eagerly. Yields a list to put
    the loss's results in; they leave each level the loss opened (innermost first) on
    exit."""
    results: list = []
    _OPEN.append([])
    original, grad = torch.Tensor.requires_grad_, torch.autograd.grad
    torch.Tensor.requires_grad_ = _requires_grad_(original)
    torch.autograd.grad = _grad(grad)
    try:
        yield results
    finally:
        torch.Tensor.requires_grad_, torch.autograd.grad = original, grad
        levels = _OPEN.pop()
        for level in reversed(levels):
            results[:] = pytree.tree_map(
                lambda t: _functorch._unwrap_for_grad(t, level)
                if isinstance(t, torch.Tensor) else t, results)
            _functorch._grad_decrement_nesting()
