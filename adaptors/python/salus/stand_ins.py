"""What stands for a tensor while a step records (a selection by a mask from the batch,
a complex value): a Python object whose tensor methods and operators all reach its
``__torch_function__``, which decides what each computes or refuses it."""

from __future__ import annotations

import torch


class StandIn:
    """A tensor method called on a stand-in (``x.sum()``) goes to its class's
    ``__torch_function__`` as the ``torch.Tensor`` method; :func:`route` does the same
    for operators, which Python looks up on the class."""

    def __getattr__(self, name):
        if name.startswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(name)
        method = getattr(torch.Tensor, name)
        return lambda *args, **kwargs: type(self).__torch_function__(
            method, (type(self),), (self, *args), kwargs)


def route(cls: type, operators) -> None:
    """Sends each of ``operators`` (``"__add__"``, ...) of ``cls`` to its
    ``__torch_function__`` as the ``torch.Tensor`` operator."""
    for name in operators:
        method = getattr(torch.Tensor, name)
        setattr(cls, name, lambda self, *args, method=method: type(self).__torch_function__(
            method, (type(self),), (self, *args), {}))
