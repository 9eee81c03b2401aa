"""Checks PyTorch makes in Python on a tensor's values, which a recording cannot answer,
moved into the graph while a step records: each becomes an ``_assert_async.msg`` that
fails the iteration with PyTorch's message where PyTorch would raise.

- ``F.one_hot`` checks that every class is within ``num_classes``.
- ``F.gaussian_nll_loss`` (and ``nn.GaussianNLLLoss``) checks that no variance is
  negative: while a step records it is a version whose check is in the graph, the rest
  as PyTorch computes it.
- ``torch.distributions`` checks (``validate_args``, on by default) that each parameter
  satisfies its constraint and that a value given to ``log_prob`` is within the support,
  through ``torch._is_all_true``: while a step records, that function puts the check in
  the graph, naming the parameter, the distribution and the constraint (not the values,
  which the recording does not have), and answers True. The symmetric and
  positive-definite constraints (``MultivariateNormal``'s covariance and precision)
  branch in Python on a check of their own; while a step records they compute the same
  answer in tensor ops.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Iterator

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def value_checks_in_the_graph() -> Iterator[None]:
    """While a step records: ``F.gaussian_nll_loss``, ``F.one_hot`` and
    ``torch._is_all_true`` with their checks in the graph; all put back after."""
    originals = F.gaussian_nll_loss, torch._is_all_true, F.one_hot
    F.one_hot = _one_hot_of(F.one_hot)
    constraints = torch.distributions.constraints
    checks = constraints._Symmetric.check, constraints._PositiveDefinite.check
    F.gaussian_nll_loss, torch._is_all_true = _gaussian_nll_loss, _all_true_in_the_graph
    constraints._Symmetric.check = _symmetric
    constraints._PositiveDefinite.check = _positive_definite
    try:
        yield
    finally:
        F.gaussian_nll_loss, torch._is_all_true, F.one_hot = originals
        constraints._Symmetric.check, constraints._PositiveDefinite.check = checks


def _one_hot_of(original):
    def one_hot(tensor: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
        """``F.one_hot`` as PyTorch 2.15 decomposes it, its range checks in the graph
        (PyTorch 2.11 reads the indices in Python). Without ``num_classes`` the width is
        the largest index's, a value: PyTorch's own, which the recording refuses."""
        if num_classes == -1 or not isinstance(tensor, torch.Tensor) or \
                tensor.dtype != torch.int64:
            return original(tensor, num_classes)
        torch._assert_async(torch.all(tensor >= 0),
                            "one_hot: Class values must be non-negative.")
        torch._assert_async(torch.all(tensor < num_classes),
                            "one_hot: Class values must be smaller than num_classes.")
        return torch.eq(tensor.unsqueeze(-1), torch.arange(
            num_classes, dtype=tensor.dtype, device=tensor.device)).to(torch.int64)
    return one_hot


def _symmetric(self, value):
    """``constraints.symmetric``'s answer without its Python branch: no matrix of a
    non-square shape is symmetric (a fact of the shape), else each is close to its
    transpose."""
    if value.shape[-2] != value.shape[-1]:
        return torch.zeros(value.shape[:-2], dtype=torch.bool, device=value.device)
    return torch.isclose(value, value.mT, atol=1e-6).all(-2).all(-1)


def _positive_definite(self, value):
    """``constraints.positive_definite``: symmetric, and its Cholesky factor found."""
    return _symmetric(self, value) & torch.linalg.cholesky_ex(value).info.eq(0)


def _gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    if isinstance(var, float):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = var * torch.ones_like(input)
    else:
        torch._assert_async(torch.logical_not(torch.any(var < 0)),
                            "var has negative entry/entries")
    if var.size() != input.size():
        if input.size()[:-1] == var.size():  # one dimension short: homoscedastic
            var = torch.unsqueeze(var, -1)
        elif not (input.ndim == var.ndim and sum(
                y for x, y in zip(input.size(), var.size()) if x != y) == 1):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def _all_true_in_the_graph(valid: torch.Tensor) -> bool:
    """``torch._is_all_true(valid)`` as the graph's check: an ``_assert_async`` that every
    element of ``valid`` is true, with the message of the ``torch.distributions`` check
    that asks (:func:`_what_is_checked`); True for the recording."""
    torch._assert_async(torch.all(valid), _what_is_checked(sys._getframe(1)))
    return True


def _what_is_checked(frame) -> str:
    """PyTorch's message for the ``torch.distributions`` check in ``frame`` or the frames
    that called it (its argument check in ``__init__``, its sample check in
    ``_validate_sample``), without the values; a plain one for any other caller."""
    for _ in range(4):
        if frame is None:
            break
        code, names = frame.f_code, frame.f_locals
        if code.co_filename.endswith("distribution.py") and "self" in names:
            kind = type(names["self"]).__name__
            value = names.get("value")
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
            described = f"{type(value).__name__} of shape {shape}"
            if code.co_name == "__init__" and "param" in names:
                return (f"Expected parameter {names['param']} ({described}) of distribution "
                        f"{kind} to satisfy the constraint {names.get('constraint')!r}, but "
                        "found invalid values")
            if code.co_name == "_validate_sample" and "support" in names:
                return (f"Expected value argument ({described}) to be within the support "
                        f"({names['support']!r}) of the distribution {kind}, but found "
                        "invalid values")
        frame = frame.f_back
    return "torch._is_all_true: an element is false"
