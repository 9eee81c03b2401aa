"""salus: share one GPU between many deep-learning jobs.

The Python adaptor traces PyTorch training steps and forward passes into the salus graph
IR (``salus.v1.Graph``, see ``docs/ir.md``), and TensorFlow and JAX steps through XLA's
HLO (``docs/frontends.md``):

- :mod:`salus.trace`: ``trace_train_step`` / ``trace_inference`` -> :class:`TracedStep`;
- :mod:`salus.optim`: the stock ``torch.optim`` updates as functional tensor math;
- :mod:`salus.amp`: autocast while tracing, ``torch.amp.GradScaler`` as session state;
- :mod:`salus.decompositions` and :mod:`salus.rules`: what PyTorch ops become in IR ops;
  :mod:`salus.selections` (masks from the batch), :mod:`salus.positions` (their
  positions: a mixture of experts' routing), :mod:`salus.spectral` (Fourier
  transforms, complex values as two real tensors) and :mod:`salus.inner_gradients`
  (gradient penalties): what a step's Python does while it records;
- :mod:`salus.lower`: FX graph -> ``salus.v1.Graph``;
- :mod:`salus.models`: the target models and their example batches;
- :mod:`salus.coverage` and :mod:`salus.reference`: command-line tools;
- :mod:`salus.client`: the gRPC client of ``salusd`` (:class:`Client`, sessions, admin);
- :mod:`salus.torch`: ``TrainSession`` and ``InferenceSession``, PyTorch jobs on salusd
  (:mod:`salus.model_reads`: a session's model read through ``parameters()``);
- :mod:`salus.serving`: ``ServedModel``, a PyTorch model whose requests salusd batches;
- :mod:`salus.hlo`: XLA HLO text -> the same traced step (run with PyTorch ops);
- :mod:`salus.tf`: Keras 3 ``TrainSession``, ``InferenceSession`` and ``fit`` on salusd;
- :mod:`salus.jax`: a pure JAX step or forward function as a session on salusd.

``salus.Client`` is imported on first use, so tracing and the reference tools
(``salus.trace``, ``salus.reference``) work without gRPC (or with a grpcio the generated
stubs do not accept).
"""

from .errors import (AdmissionTimeoutError, BatchError, DaemonError, DaemonUnavailableError,
                     LoweringError, RequestDroppedError, SalusError, SessionClosedError,
                     SessionResumedError, TraceError, UnsupportedMixedPrecisionError,
                     UnsupportedOpError, UnsupportedOptimizerError)
from .trace import GradientRecipe, TracedStep, trace_inference, trace_train_step


def __getattr__(name: str):
    if name == "Client":
        from .client import Client
        return Client
    raise AttributeError(f"module 'salus' has no attribute {name!r}")


__all__ = [
    "AdmissionTimeoutError",
    "BatchError",
    "Client",
    "DaemonError",
    "DaemonUnavailableError",
    "GradientRecipe",
    "LoweringError",
    "RequestDroppedError",
    "SalusError",
    "SessionClosedError",
    "SessionResumedError",
    "TraceError",
    "TracedStep",
    "UnsupportedMixedPrecisionError",
    "UnsupportedOpError",
    "UnsupportedOptimizerError",
    "trace_inference",
    "trace_train_step",
]
