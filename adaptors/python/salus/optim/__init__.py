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
unknown options, ``fused=True``, other optimizer classes (subclasses included: they may
change ``step``) and adding parameter groups.

Parameters the loss does not reach keep their values and state, as ``torch.optim``
skips a parameter whose ``.grad`` is None (:attr:`FunctionalOptimizer.without_grad`).
"""

from __future__ import annotations

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
    rule = RULES.get(type(optimizer))
    if rule is None:
        supported = ", ".join(sorted(c.__name__ for c in RULES))
        raise UnsupportedOptimizerError(
            f"optimizer {type(optimizer).__name__} is not supported by salus "
            f"(supported: {supported})")
    names = {id(t): n for n, t in named_parameters.items()}
    return rule(optimizer, names, list(named_parameters))
