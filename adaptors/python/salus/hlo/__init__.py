"""XLA's HLO as a way into salus: TensorFlow and JAX steps lowered to the salus IR.

- :mod:`salus.hlo.parse`: HLO text -> :class:`~salus.hlo.parse.Module`;
- :mod:`salus.hlo.ops` and :mod:`salus.hlo.interpret`: the module run with PyTorch ops;
- :mod:`salus.hlo.step`: :func:`trace_hlo`, the module as a :class:`~salus.trace.TracedStep`
  (then lowered and run on salusd as any PyTorch step).
"""

from .step import trace_hlo

__all__ = ["trace_hlo"]
