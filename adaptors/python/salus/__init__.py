"""salus: share one GPU between many deep-learning jobs.

The Python adaptor traces PyTorch training steps and forward passes into the salus graph
IR (``salus.v1.Graph``, see ``docs/ir.md``):

- :mod:`salus.trace`: ``trace_train_step`` / ``trace_inference`` -> :class:`TracedStep`;
- :mod:`salus.optim`: SGD, Adam and AdamW updates as functional tensor math;
- :mod:`salus.lower`: FX graph -> ``salus.v1.Graph``;
- :mod:`salus.models`: the target models and their example batches;
- :mod:`salus.coverage` and :mod:`salus.reference`: command-line tools.
"""

from .errors import (LoweringError, SalusError, TraceError, UnsupportedOpError,
                     UnsupportedOptimizerError)
from .trace import TracedStep, trace_inference, trace_train_step

__all__ = [
    "LoweringError",
    "SalusError",
    "TraceError",
    "TracedStep",
    "UnsupportedOpError",
    "UnsupportedOptimizerError",
    "trace_inference",
    "trace_train_step",
]
