"""What a session checks of its PyTorch model before each iteration, cheaply.

salusd holds a session's parameters, buffers and traced step, so a change to the model's
own copy after the session last agreed with it would be lost without a word: a tensor
changed in place (weights clamped after a step, an eager optimizer's step, new weights
loaded into a served model), a parameter or module replaced, a module's train/eval mode
switched (dropout and batch norm run as traced). :class:`ModelWatch` lists the model's
modules and tensors once, when the session and the model agree, and compares each
iteration's reading of those lists (in-place change counts, identities, modes) with it:
a few list comprehensions, not a walk of the module tree per step.

A recorded step also keeps the plain Python values it read: a module's settings
(``dropout.p``, a temperature, a loss weight set as ``model.beta = ...``, a loss
module's ``label_smoothing``) and the numbers the loss function and the modules'
``forward`` read from globals or from their enclosing scope (a KL weight annealed in
the loop), and the tensors they read there (class weights, replaced by another tensor).
:class:`TracedValues` lists them when the step is traced and refuses an iteration once
one has changed: the graph holds the value it had then.
"""

from __future__ import annotations

import functools
import itertools
import operator
import types
from typing import Any, Callable, Iterable

import torch

from .errors import SalusError, TraceError, in_user_code


def modes_of(model: torch.nn.Module) -> dict[str, bool]:
    """Each module's ``training`` flag, by name."""
    return {name: m.training for name, m in model.named_modules()}


def _some(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"


_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    """A value a recording would bake in as it is: a number, a flag, a string, or a
    tuple of them."""
    return isinstance(value, _PLAIN) or (
        isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    """A function's code and the code of the functions, lambdas and comprehensions in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _function(f: Any) -> types.FunctionType | None:
    while isinstance(f, functools.partial):
        f = f.func
    f = getattr(f, "__func__", f)  # a bound method
    if isinstance(f, torch.nn.Module):
        f = type(f).forward
    return f if isinstance(f, types.FunctionType) else None


class TracedValues:
    """The plain Python values a traced step read (see the module's docs), as they were
    when it was traced."""

    def __init__(self, model: torch.nn.Module, functions: Iterable[Callable] = ()):
        functions = [f for f in functions if f is not None]
        # Per module: its name, its __dict__, its plain settings' keys, a reader of their
        # values (a tuple) and the values.
        self._settings: list[tuple[str, dict, tuple[str, ...], Callable, tuple]] = []
        self._noted: set[int] = set()
        self._note_settings(model, "model")
        for f in functions:  # a loss module's (nn.CrossEntropyLoss's label_smoothing)
            if isinstance(f, torch.nn.Module):
                self._note_settings(f, type(f).__name__)
        # Globals and enclosing variables the loss and the forwards read.
        self._reads: list[tuple[str, Callable[[], Any], Any]] = []
        seen: set = set()
        forwards = {type(m).forward for m in model.modules()}
        for f in (*functions, *forwards):
            f = _function(f)
            if f is None or f in seen or not in_user_code(f.__code__.co_filename):
                continue
            seen.add(f)
            self._note_reads(f)

    def _note_settings(self, root: torch.nn.Module, label: str) -> None:
        for name, module in root.named_modules():
            if id(module) in self._noted:
                continue
            self._noted.add(id(module))
            attributes = vars(module)
            keys = tuple(sorted(k for k, v in attributes.items()
                                if not k.startswith("_") and k != "training" and _plain(v)))
            if keys:
                read = _reader(keys)
                self._settings.append((f"{name}." if name else f"{label}.", attributes,
                                       keys, read, read(attributes)))

    def _note_reads(self, f: types.FunctionType) -> None:
        where = f.__qualname__
        names = {n for code in _codes(f.__code__) for n in code.co_names}
        for name in sorted(names):
            if name in f.__globals__:
                self._note_read(name, f"the global {name} (read by {where})",
                                functools.partial(f.__globals__.get, name))
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            self._note_read(name, f"{name} (which {where} reads from its enclosing scope)",
                            functools.partial(_cell, cell))

    def _note_read(self, name: str, what: str, read: Callable[[], Any]) -> None:
        """A value a function reads by ``name``: a module's settings (a loss module kept
        in a global), or a plain value or tensor to compare with ``read()`` later."""
        value = read()
        if isinstance(value, torch.nn.Module):
            self._note_settings(value, name)
        elif value is not _UNBOUND and (_plain(value) or isinstance(value, torch.Tensor)):
            self._reads.append((what, read, value))

    def changed(self) -> list[str]:
        """What differs from the traced values now: ``"what (then -> now)"``."""
        changed = []
        for name, attributes, keys, read, values in self._settings:
            try:
                now = read(attributes)
            except KeyError:  # one was deleted
                now = tuple(attributes.get(k, _UNBOUND) for k in keys)
            if now != values:
                changed += [f"{name}{key} ({old!r} -> {new!r})"
                            for key, old, new in zip(keys, values, now) if new != old]
        for what, read, value in self._reads:
            now = read()
            if isinstance(value, torch.Tensor):
                if now is not value:  # another tensor now (the graph holds the one read)
                    changed.append(f"{what} (another tensor now)")
            elif now != value:
                changed.append(f"{what} ({value!r} -> {now!r})")
        return changed

    def check(self) -> None:
        """Refuses an iteration once a value the step read when it was traced changed."""
        changed = self.changed()
        if changed:
            raise TraceError(
                f"{_some(changed)} changed since the step was traced, and the traced step "
                "holds the value it read then. Set it back, or open a new session with the "
                "new value; a value that changes from step to step (an annealed weight, a "
                "temperature) belongs in the batch, as a tensor the step reads")


class _Unbound:
    def __repr__(self) -> str:
        return "(unset)"


_UNBOUND = _Unbound()


def _reader(keys: tuple[str, ...]) -> Callable[[dict], tuple]:
    """Reads the values of ``keys`` in a module's ``__dict__`` as a tuple, at C speed
    (it runs for every module before every iteration)."""
    if len(keys) == 1:
        key = keys[0]
        return lambda attributes: (attributes[key],)
    return operator.itemgetter(*keys)


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a variable of the enclosing scope not bound (yet, or any more)
        return _UNBOUND


_TENSOR_HOOKS = operator.attrgetter("_backward_hooks")


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
                 *, fixed: bool = False, remedy: str | None = None,
                 functions: Iterable[Callable] = ()):
        self._model = model
        self._traced_modes = traced_modes
        self._fixed = fixed
        self._remedy = remedy
        self._list()
        # (taken when the step is traced: writing tensors does not change what it read)
        self._functions = tuple(functions)
        self._values = TracedValues(model, self._functions)
        self.note_hooks()

    def traced_again(self) -> None:
        """The step was traced again (for another batch shape), after
        :meth:`check_values` passed: what its forward changed while it recorded (a count
        of calls) is what the step has read."""
        self._values = TracedValues(self._model, self._functions)
        self.note_hooks()

    def _list(self) -> None:
        model = self._model
        modules = list(model.named_modules())
        self._modules = [m for _, m in modules]
        self._module_names = [n for n, _ in modules]
        # Each module keeps its hook dicts for good (what :meth:`_hooks_now` counts).
        self._hook_dicts = [d for m in self._modules for d in (
            m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)]
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

    def check_values(self) -> None:
        """Refuses an iteration once a plain Python value the step read when it was
        traced changed (:class:`TracedValues`), or a hook it ran (or did not) was added
        or removed (:meth:`_hooks_now`)."""
        self._values.check()
        if self._hooks_now() != self._hooks:
            raise TraceError(
                "a hook of the model (a forward or backward hook of a module, a gradient "
                "hook of a parameter) was added or removed since the step was traced, and "
                "the traced step runs the hooks it had then: remove (or register again) "
                "the hook, or open a new session with the hooks it should run")

    def note_hooks(self) -> None:
        """The hooks the step runs, as traced (and the session's own, once it has put
        them on)."""
        self._hooks = self._hooks_now()

    def _hooks_now(self) -> tuple[list[int], list[int]]:
        """How many hooks each module holds (the session's own included), and how many
        each parameter and buffer holds."""
        held = list(map(_TENSOR_HOOKS, self._tensors))
        return list(map(len, self._hook_dicts)), [len(h) if h else 0 for h in held]

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
