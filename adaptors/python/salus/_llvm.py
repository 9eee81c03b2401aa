"""Load order of the libraries that carry their own LLVM.

TensorFlow's XLA, jaxlib and Triton (which PyTorch's compiler stack imports when
``make_fx`` first runs) each link LLVM; a process that loads Triton after TensorFlow or
jaxlib aborts ("Option ... registered more than once"). Triton first is fine. So before
TensorFlow or JAX is imported, :func:`triton_first` loads Triton; when one of them is
already loaded, it tells PyTorch that Triton is absent in this process (salus never needs
it to trace).
"""

from __future__ import annotations

import sys

_CARRY_LLVM = ("tensorflow", "jax", "jaxlib")


def triton_first() -> None:
    if "triton" in sys.modules:
        return
    if any(name in sys.modules for name in _CARRY_LLVM):
        sys.modules["triton"] = None  # type: ignore[assignment]
        return
    import torch._dynamo  # noqa: F401  (imports Triton where it is installed)
