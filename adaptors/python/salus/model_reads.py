"""Reads of a training session's model through ``parameters()`` and ``buffers()`` (and
their ``named_`` forms) that bring the session's tensors back first.

Between steps a :class:`salus.torch.TrainSession` holds the trained tensors on salusd,
ahead of the model's own. Forward passes and ``state_dict()`` are followed by hooks
PyTorch offers; a loop that reads the tensors through ``model.parameters()`` (a weight
average's ``AveragedModel.update_parameters(model)``, an exponential moving average's
``zip(ema.parameters(), model.parameters())``) has no hook. So each module of the
session's model gets, while the session is open, a subclass of its own class that
overrides ``named_parameters`` and ``named_buffers`` (which ``parameters()`` and
``buffers()`` call) to run the session's hook first, as ``torch.nn.utils.parametrize``
gives a parametrized module a subclass. The subclass keeps the class's name and
module; a copy or a pickle of the module (``copy.deepcopy``, ``torch.save``) is of the
original class, and the original class comes back when the session closes.

Calls from salus itself (it reads the model while it traces and while it brings the
tensors back) do not run the hook: it looks at the first caller outside
``torch.nn.Module``'s own methods.
"""

from __future__ import annotations

import copyreg
import sys
import weakref
from typing import Callable

import torch

# Module -> the hook of the session that follows it.
_FOLLOWED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Class -> its following subclass, and back.
_SUBCLASS: dict[type, type] = {}
_ORIGINAL: dict[type, type] = {}

_MODULE_FILE = sys.modules[torch.nn.Module.__module__].__file__


def follow(module: torch.nn.Module, hook: Callable[[], None]) -> None:
    """Runs ``hook()`` before each ``named_parameters``/``named_buffers`` call on
    ``module`` from outside salus, until :func:`unfollow`. A module whose class cannot
    be subclassed (a scripted module) is left as it is."""
    cls = type(module)
    if cls not in _ORIGINAL:
        sub = _SUBCLASS.get(cls) or _following_class(cls)
        if sub is None:
            return
        module.__class__ = sub
    _FOLLOWED[module] = hook


def unfollow(module: torch.nn.Module) -> None:
    """Gives ``module`` its own class back."""
    _FOLLOWED.pop(module, None)
    original = _ORIGINAL.get(type(module))
    if original is not None:
        module.__class__ = original


def _before_read(module: torch.nn.Module) -> None:
    hook = _FOLLOWED.get(module)
    if hook is None:
        return
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == _MODULE_FILE:
        frame = frame.f_back
    caller = frame.f_globals.get("__name__", "") if frame is not None else ""
    if caller != "salus" and not caller.startswith("salus."):
        hook()


def _following_class(cls: type) -> type | None:
    def named_parameters(self, *args, **kwargs):
        _before_read(self)
        return cls.named_parameters(self, *args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        _before_read(self)
        return cls.named_buffers(self, *args, **kwargs)

    def __reduce_ex__(self, protocol):
        # A copy or a pickle is of the original class (this one is not importable), made
        # as pickle's protocols 0 and 1 make an object: the standard library's
        # reconstructor, then the state.
        _, _, *rest = cls.__reduce_ex__(self, max(protocol, 2))
        return (copyreg._reconstructor, (cls, object, None), *rest)

    namespace = {"named_parameters": named_parameters, "named_buffers": named_buffers,
                 "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__}
    try:
        sub = type(cls)(cls.__name__, (cls,), namespace)
    except TypeError:
        return None
    _SUBCLASS[cls], _ORIGINAL[sub] = sub, cls
    return sub
