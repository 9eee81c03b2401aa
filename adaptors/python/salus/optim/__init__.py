"""Optimizer updates as functional tensor math, with hyperparameters as session state.

This package owns the translation of a real ``torch.optim`` optimizer (SGD, Adam, AdamW,
Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, Rprop, ASGD, Adafactor, with their
options) into a pure
function ``update(params, grads, state) -> (new_params, new_state)`` that the tracer
records into the graph (:mod:`.rules`: one rule per optimizer, mirroring PyTorch's
single-tensor implementation). The state is a flat ``name -> tensor`` dict named as
``docs/ir.md`` says:

- ``optimizer.<key>.<param>``: per-parameter buffers under torch's own keys
  (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``exp_inf``,
  ``mu_product``, ``square_avg``, ``grad_avg``, ``acc_delta``, ``sum``, ``prev``,
  ``step_size``, ``eta``, ``mu``, ``ax``, ``row_var``, ``col_var``, ``variance``);
- ``optimizer.step``: one f32 step counter shared by every parameter;
- ``optimizer.param_groups.<g>.<name>``: group ``g``'s hyperparameters (``lr``,
  ``beta2``, ``one_minus_beta1``, ``eps``...), 0-dim tensors the graph reads. Sessions
  rewrite them before a step whenever the torch optimizer's ``param_groups`` changed,
  so a ``torch.optim.lr_scheduler`` (or any change a user makes) takes effect at the
  next step, as in eager PyTorch.

Why the update is written here rather than traced from ``torch.optim``'s own code:
PyTorch's implementations turn hyperparameters into Python numbers (``add_(alpha=-lr)``,
``addcmul_(value=1 - beta2)``, branches on their values), so tracing them would freeze
the hyperparameters into the graph: exactly the behaviour that made schedules silently
ineffective. Each rule therefore mirrors the single-tensor implementation operation by
operation (the formula PyTorch's kernel uses, the same roundings of Python scalars), and
the test suite checks each against eager PyTorch, with schedules, over several steps.

What a group's graph depends on (``nesterov``, ``amsgrad``, ``centered``, ``maximize``,
whether ``momentum`` or ``weight_decay`` is zero: its *structure*) is fixed when the step
is traced; a later change is refused with :class:`UnsupportedOptimizerError`, as are
unknown options, other optimizer classes, subclasses that override ``step``, step hooks
(they would not run) and adding parameter groups. ``fused=True`` and ``foreach`` are
implementation choices: PyTorch's fused and multi-tensor kernels compute the same update.

Parameters the loss does not reach keep their values and state, as ``torch.optim``
skips a parameter whose ``.grad`` is None (:attr:`FunctionalOptimizer.without_grad`).
"""

from __future__ import annotations

import inspect
from typing import Mapping

import torch

from ..errors import UnsupportedOptimizerError
from .base import STEP, FunctionalOptimizer, hyper_name, state_name
from .rules import RULES

__all__ = ["FunctionalOptimizer", "STEP", "functional_optimizer", "hyper_name",
           "state_name"]


def functional_optimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Mapping[str, torch.Tensor]) -> FunctionalOptimizer:
    """The functional form of ``optimizer`` over the model's ``named_parameters``.

    Raises :class:`UnsupportedOptimizerError` for other optimizer classes and for
    unsupported options.
    """
    names = {id(t): n for n, t in named_parameters.items()}
    return _rule_of(type(optimizer))(optimizer, names, list(named_parameters))


def _rule_of(cls: type) -> type[FunctionalOptimizer]:
    """The rule of a stock optimizer class, or of a subclass that leaves its update as it
    is (a subclass that adds a method, or sets defaults). A subclass that overrides
    ``step`` (or ``_init_group``, where PyTorch's gather their state) computes something
    salus cannot see, and is refused."""
    stock = next((c for c in cls.__mro__ if c in RULES), None)
    if stock is None:
        supported = ", ".join(sorted(c.__name__ for c in RULES))
        raise UnsupportedOptimizerError(
            f"optimizer {cls.__name__} is not supported by salus (supported: {supported}, "
            "and their subclasses that do not override step)")
    for method in ("step", "_init_group"):
        # torch.optim wraps each class's step in its profiling hook when the first
        # instance is made, so a subclass holds a wrapper of the inherited step: compare
        # what the wrappers wrap.
        if inspect.unwrap(getattr(cls, method)) is not inspect.unwrap(getattr(stock, method)):
            where = next(c for c in cls.__mro__ if method in vars(c))
            raise UnsupportedOptimizerError(
                f"optimizer {cls.__name__} overrides {method} (in {where.__qualname__}), "
                f"so its update may not be {stock.__name__}'s, which is what salus runs: "
                f"use torch.optim.{stock.__name__}, or a subclass that leaves {method} "
                "alone")
    return RULES[stock]
