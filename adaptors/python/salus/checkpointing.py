"""Activation checkpointing (``torch.utils.checkpoint``) while a step records.

Checkpointing trades memory for compute: the region's activations are dropped after the
forward and recomputed in the backward; what the step computes is the same. salus plans
a step's memory itself (every activation in the lane's scratch, exactly), and
``torch.func``, through which a step records, runs neither variant: the non-reentrant one
uses saved-tensor hooks, the reentrant one a hand-written ``autograd.Function``. So while
a step records, :func:`plain_checkpoints` has both variants run the region as it is, once:

- non-reentrant (``use_reentrant=False``, what PyTorch recommends, and what transformers'
  ``gradient_checkpointing_enable()`` chooses by default): the region as written;
- reentrant (``use_reentrant=True``): the same, except where no tensor argument needs a
  gradient: then eager PyTorch's reentrant checkpoint gives the region's parameters no
  gradient at all (it warns "None of the inputs have requires_grad=True"), so the region
  runs without gradients here too, and the optimizer skips those parameters as torch's
  does.

The graph then holds the region's activations for the backward, and P + E count them:
a checkpointed model needs more device memory on salusd than eagerly. The random draws
that ``preserve_rng_state`` would replay are the session's own anyway.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.utils.checkpoint as checkpoint_module

# The non-reentrant variant's set-up and tear-down around the region (renamed in
# PyTorch 2.12; both names are patched where present).
_GENERATORS = ("_checkpoint_without_reentrant_generator",
               "_checkpoint_without_reentrant_generator_impl")


def _no_checkpoint_context(*args, **kwargs):
    """Stands in for the non-reentrant variant's generator: nothing before the region,
    nothing after."""
    yield


class _PlainReentrant:
    """Stands in for ``CheckpointFunction``: ``apply(function, preserve_rng_state,
    *args)`` runs the region once, without gradients where no argument needs one."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function(*args)
        with torch.no_grad():
            return function(*args)


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    """Inside, ``torch.utils.checkpoint.checkpoint`` (and ``checkpoint_sequential``) run
    their region once, as the module's docs say; everything is put back after. Where
    PyTorch's internals differ from these names, nothing changes (and ``torch.func``
    refuses the step as before)."""
    patched = [(name, getattr(checkpoint_module, name)) for name in _GENERATORS
               if hasattr(checkpoint_module, name)]
    reentrant = getattr(checkpoint_module, "CheckpointFunction", None)
    try:
        for name, _ in patched:
            setattr(checkpoint_module, name, _no_checkpoint_context)
        if reentrant is not None:
            checkpoint_module.CheckpointFunction = _PlainReentrant
        yield
    finally:
        for name, original in patched:
            setattr(checkpoint_module, name, original)
        if reentrant is not None:
            checkpoint_module.CheckpointFunction = reentrant
