"""Rounding at random: the yardstick of how much rounding error a computation amplifies
(the test suite's tolerance rule, ``tests/harness.py``, and ``salus.coverage --train``)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# Integers up to this magnitude are exact in float16, bfloat16 (up to 256) and wider.
EXACT_INTEGERS = 256

# Ops that compute nothing to round: comparisons, and the selections that return some of
# their input's elements as they are (a maximum, a sorted line, a gather or index_select;
# a scatter or index_reduce of the largest or smallest, ``EXACT_SCATTERS``). Their
# operands and results are left alone; jittering ``x`` and ``amin(x)`` apart would make
# the gradient's ``x == amin(x)`` false everywhere, which no precision does.
EXACT_OPS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "amax", "amin", "max", "min",
                       "argmax", "argmin", "sort", "topk", "gather", "index_select"})
EXACT_SCATTERS = frozenset({"amax", "amin"})


class RandomRounding(TorchDispatchMode):
    """Runs PyTorch ops (forward, backward and the optimizer's) with every floating
    operand and result of more than zero dimensions multiplied by ``1 + u * eps / 2``,
    ``u`` uniform in [-1, 1] from a generator seeded with ``seed``: rounding at ``eps``
    (another precision's epsilon), but at random. Views and scalars (optimizers count
    their steps in float tensors) are left alone; in-place ops have their result
    perturbed in place. Small integers (masks, counts, ones) are exact in every precision
    and stay as they are: rounding makes no error on them, and jittered, ``1 - mask``
    would leave ``1e-8`` where it is 0, which ``finfo.min`` as a mask value then blows
    up to near infinity. Nor does rounding take a finite value past the largest one.
    Comparisons and selections (``EXACT_OPS``) compute nothing to round. Sparse and nested
    operands and results are left as they are (the dense results of their products are
    not)."""

    def __init__(self, eps: float, seed: int = 0):
        super().__init__()
        self.unit = eps / 2
        self.generator = torch.Generator().manual_seed(seed)

    def _jitter(self, t):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0
                and t.layout == torch.strided and not t.is_nested):
            return t
        u = torch.rand(t.shape, dtype=t.dtype, generator=self.generator) * 2 - 1
        out = t * (1 + self.unit * u)
        exact = (t == t.round()) & (t.abs() <= EXACT_INTEGERS)
        return torch.where(exact | out.isinf(), t, out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if (func.is_view or name in EXACT_OPS
                or name in ("scatter_reduce", "index_reduce") and args[4] in EXACT_SCATTERS):
            return func(*args, **kwargs)
        if func._schema.is_mutable:
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t.copy_(self._jitter(t))
            return out
        args, kwargs = pytree.tree_map(self._jitter, (args, kwargs))
        return pytree.tree_map(self._jitter, func(*args, **kwargs))
