"""What a session checks of its PyTorch model before each iteration, cheaply.

salusd holds a session's parameters, buffers and traced step, so a change to the model's
own copy after the session last agreed with it would be lost without a word: a tensor
changed in place (weights clamped after a step, an eager optimizer's step, new weights
loaded into a served model), a parameter or module replaced, a module's train/eval mode
switched (dropout and batch norm run as traced). :class:`ModelWatch` lists the model's
modules and tensors once, when the session and the model agree, and compares each
iteration's reading of those lists (in-place change counts, identities, modes) with it:
a few list comprehensions, not a walk of the module tree per step.
"""

from __future__ import annotations

import itertools

import torch

from .errors import SalusError, TraceError


def modes_of(model: torch.nn.Module) -> dict[str, bool]:
    """Each module's ``training`` flag, by name."""
    return {name: m.training for name, m in model.named_modules()}


def _some(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"


class ModelWatch:
    """A model as its session last agreed with it. ``traced_modes`` (by module name) are
    the train/eval modes the step was traced in; None where modes do not matter (an
    inference session runs its own traced mode whatever the model's). ``fixed``: the
    model's parameters and modules are those of the session's opening for good (a
    training session's step and optimizer update those tensors); otherwise replacing one
    is followed once the session is written (a served model given new modules).
    ``remedy``: what the error tells the user to do, where the session's own advice does
    not apply."""

    def __init__(self, model: torch.nn.Module, traced_modes: dict[str, bool] | None = None,
                 *, fixed: bool = False, remedy: str | None = None):
        self._model = model
        self._traced_modes = traced_modes
        self._fixed = fixed
        self._remedy = remedy
        self._list()

    def _list(self) -> None:
        model = self._model
        modules = list(model.named_modules())
        self._modules = [m for _, m in modules]
        self._module_names = [n for n, _ in modules]
        # What each listed module holds, as live views: replacing a parameter, buffer or
        # submodule changes an identity in them. (The watch keeps the listed tensors and
        # modules alive, so no identity of theirs is reused meanwhile.)
        self._held = [d.values() for m in self._modules
                      for d in (m._parameters, m._buffers, m._modules)]
        named = [*model.named_parameters(), *model.named_buffers()]
        self._names = [n for n, _ in named]
        self._tensors = [t for _, t in named]
        self._ids = {n: id(t) for n, t in named}
        self._structure = self._structure_now()
        if self._traced_modes is not None:
            self._modes = [self._traced_modes.get(n, m.training)
                           for n, m in zip(self._module_names, self._modules)]
        self._versions = self._versions_now()

    def agree(self) -> None:
        """The session and the model agree now (opened, written, read back, or traced for
        another shape)."""
        if self._fixed:
            self._versions = self._versions_now()
        else:
            self._list()

    def _versions_now(self) -> list[int]:
        return [t._version for t in self._tensors]

    def _structure_now(self) -> list[int]:
        return list(map(id, itertools.chain.from_iterable(self._held)))

    def _replaced(self) -> list[str]:
        model = self._model
        now = dict((*model.named_parameters(), *model.named_buffers()))
        names = [n for n in dict.fromkeys((*self._ids, *now))
                 if id(now.get(n)) != self._ids.get(n)]
        listed = set(map(id, self._modules))
        return names or [n or type(model).__name__ for n, m in model.named_modules()
                         if id(m) not in listed]

    def check_tensors(self) -> None:
        """Refuses an iteration after a parameter or buffer was changed in place or
        replaced since the session last agreed with the model: the iteration would not
        see the change."""
        replaced = self._structure_now() != self._structure
        if not replaced and self._versions_now() == self._versions:
            return
        if replaced:
            names, how = self._replaced(), "replaced"
        else:
            names = [n for n, t, v in zip(self._names, self._tensors, self._versions)
                     if t._version != v]
            how = "changed in place"
        if self._remedy is not None:
            remedy = self._remedy
        elif replaced and self._fixed:
            remedy = ("A training session's traced update and its optimizer hold the "
                      "tensors of its opening: open a new session (update_model() first, "
                      "to carry the weights over)")
        else:
            remedy = ("Write them to the session (session.load_state_dict("
                      "model.state_dict(), strict=False); after update_model(), to start "
                      "from the session's), or take the session's back (update_model())")
        raise SalusError(
            f"{_some(names)} {how} since the session last had the model's tensors: "
            f"salusd holds them, and the next iteration would not see the change. {remedy}")

    def check_modes(self) -> None:
        """Refuses an iteration while a module's train/eval mode differs from the traced
        one: dropout and batch norm run as traced, and eager PyTorch would now run them
        the other way (a validation pass's ``model.eval()`` not undone)."""
        if self._traced_modes is None or [m.training for m in self._modules] == self._modes:
            return
        root = type(self._model).__name__
        changed = [name or root for name, m, was
                   in zip(self._module_names, self._modules, self._modes) if m.training != was]
        was = "train" if self._traced_modes.get("", True) else "eval"
        raise TraceError(
            f"{_some(changed)} changed train/eval mode since the session was traced (the "
            f"model in {was} mode): the traced step runs dropout and batch norm as then. "
            "Call model.train() (or eval()) as it was before the next step, or open a "
            "session for the new modes")
