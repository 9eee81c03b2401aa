"""JAX jobs on salusd: a pure training step (or forward function) run as a session.

JAX code is already functional, so the session takes the user's own step::

    def train_step(state, x, y):          # state: any pytree (params, optimizer state)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        ...
        return new_state, loss              # new_state has state's structure

    session = salus.jax.TrainSession(train_step, state, (x, y))
    loss = session.step(x, y)

``jax.jit(train_step).lower(...)`` gives XLA's HLO, which :mod:`salus.hlo` lowers to the
salus IR: salusd runs exactly the computation JAX would, with ``state`` resident between
steps. ``session.state()`` reads it back with ``state``'s structure. Persistent tensors
are named by their pytree paths (``state['params']['w']``). A batch of other shapes runs
a step traced for them on first use (``jax.jit`` retraces the same way).

Random numbers come from PRNG keys in ``state`` (``jax.random.key``, or raw ``uint32``
keys): every ``uint32`` leaf and every key of the state is a seed, kept on the client,
which draws what the step computes from the seeds alone (:mod:`salus.hlo.draws`) and
sends it with the batch, exactly as XLA computes it. Not supported yet (refused before
anything is sent, naming the op): loops (``lax.scan``, ``fori_loop`` with a traced
bound); ``docs/frontends.md`` lists the rest.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from ._llvm import triton_first
from .client import Client
from .errors import LoweringError
from .hlo import trace_hlo
from .hlo.seeds import SeededSession
from .torch import _default_name, _SalusSession
from .trace import InputSlot, OutputSlot, TracedStep

triton_first()  # before TensorFlow and JAX: see salus._llvm

import jax  # noqa: E402

# salusd owns the GPU; JAX here only lowers steps. On a GPU it would preallocate most of
# the device's memory on first use, beside salusd's lanes: steps lower on the CPU.
try:
    jax.config.update("jax_platforms", "cpu")
except RuntimeError:  # JAX already chose its backends
    warnings.warn("salus.jax was imported after JAX started, which may hold GPU memory "
                  "beside salusd's: import salus.jax first", stacklevel=2)

__all__ = ["InferenceSession", "TrainSession"]


def _torch(value: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(_data(value), copy=True, order="C"))


def _is_key(value: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key)


def _data(value: Any) -> Any:
    """An array's values; a typed PRNG key's data (``uint32`` words)."""
    return jax.random.key_data(value) if _is_key(value) else value


def _is_seed(value: Any) -> bool:
    return _is_key(value) or np.dtype(getattr(value, "dtype", np.float32)) == np.uint32


def _paths(tree: Any, prefix: str) -> list[str]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [prefix + jax.tree_util.keystr(path) for path, _ in leaves]


def trace_jax(fn: Callable, state: Any, batch: Sequence[Any], kind: str) -> TracedStep:
    """``fn(state, *batch)`` as a :class:`TracedStep`: for ``kind="train"`` it returns
    ``(new_state, loss)`` with ``new_state`` structured as ``state``; for
    ``"inference"``, any pytree of arrays (``output.<k>``, in leaf order)."""
    lowered = jax.jit(fn, keep_unused=True).lower(state, *batch)
    text = lowered.as_text(dialect="hlo", debug_info=True)
    names = _paths(state, "state")
    leaves = jax.tree.leaves(state)
    batch_leaves = jax.tree.leaves(tuple(batch))
    inputs = ([InputSlot(n, "state", "state") for n in names]
              + [InputSlot(f"batch.{k}", "feed", "batch") for k in range(len(batch_leaves))])
    out_tree = lowered.out_info
    if kind == "train":
        if not (isinstance(out_tree, tuple) and len(out_tree) == 2):
            raise LoweringError("a training step returns (new_state, loss)")
        structure = jax.tree.structure(state)
        if jax.tree.structure(out_tree[0]) != structure:
            raise LoweringError(f"the step's new state is structured as "
                                f"{jax.tree.structure(out_tree[0])}, but the state as "
                                f"{structure}")
        if len(jax.tree.leaves(out_tree[1])) != 1:
            raise LoweringError("the step's loss must be one array")
        outputs = [OutputSlot("update", n) for n in names] + [OutputSlot("loss", "loss")]
    else:
        outputs = [OutputSlot("output", f"output.{k}")
                   for k in range(len(jax.tree.leaves(out_tree)))]
    initial = {n: _torch(v) for n, v in zip(names, leaves)}
    return trace_hlo(text, inputs, outputs, initial, [_torch(b) for b in batch_leaves], kind,
                     output_spec=jax.tree.structure(out_tree) if kind == "inference" else None,
                     seeds=[n for n, v in zip(names, leaves) if _is_seed(v)])


class _JaxSession(SeededSession, _SalusSession):
    def _keep_jax_seeds(self) -> None:
        names = _paths(self._state_like, "state")
        self._keep_seeds({n: np.asarray(_data(v)) for n, v in
                          zip(names, jax.tree.leaves(self._state_like)) if _is_seed(v)})

    def _numpy_batch(self, batch: Sequence[Any]) -> list[torch.Tensor]:
        leaves = jax.tree.leaves(tuple(batch))
        return [_torch(b) for b in leaves]

    def _submitted(self, batch: Sequence[Any], what: str):
        """The program for ``batch``, the iteration and what reading its answer needs."""
        self._batches = tuple(batch)
        program, leaves = self._program_for(self._numpy_batch(batch), what)
        leaves = leaves + self._drawn(program.traced)
        return (program, *self._submission(program, leaves, what))

    def _iteration(self, batch: Sequence[Any], what: str):
        return self._submitted(batch, what)[1:]

    def _run(self, batch: Sequence[Any], what: str) -> tuple[list[np.ndarray], Any]:
        """The outputs of one iteration on ``batch``, and its program."""
        self._ensure_slots(2)
        program, iteration, answer = self._submitted(batch, what)
        response = self._run_or_resume(iteration)
        if response is None:
            return self._run(batch, what)  # the iteration did not run: on the session back
        self.iterations += 1
        self.last_device_ms = response.device_us / 1e3
        return [t.numpy() for t in self._outputs(response, answer)], program

    def _trace_for(self, batch: tuple) -> TracedStep:
        # The batch the caller gave (its structure), not its flattened tensors.
        return trace_jax(self.fn, self._state_like, self._batches, self._traced_kind)

    def state(self) -> Any:
        """The session's state as it is on salusd now, structured as the ``state`` the
        session was made with (numpy arrays)."""
        values = {name: value.numpy() for name, value in self.state_dict().items()}
        names = _paths(self._state_like, "state")
        leaves = [jax.random.wrap_key_data(values[n], impl=jax.random.key_impl(like))
                  if _is_key(like) else values[n]
                  for n, like in zip(names, jax.tree.leaves(self._state_like))]
        return jax.tree.unflatten(jax.tree.structure(self._state_like), leaves)


class TrainSession(_JaxSession):
    """A JAX training job on salusd: ``step_fn(state, *batch) -> (new_state, loss)``, a
    pure function as one would ``jax.jit``, with ``state`` (any pytree of arrays: the
    parameters, the optimizer's state, a step counter) kept on salusd between steps.
    ``example_batch``: a tuple of arrays (or pytrees of them). Scheduling hints and
    connection options are those of :class:`salus.torch.TrainSession`."""

    kind = "training"
    _traced_kind = "train"

    def __init__(self, step_fn: Callable, state: Any, example_batch: Sequence[Any], *,
                 address: str | None = None, client: Client | None = None, name: str = "",
                 priority: int = 0, total_iterations: int = 0,
                 expected_iteration_ms: float = 0.0, admission_timeout: float | None = None,
                 feed_buffer: bool | None = None, reattach_timeout: float = 60.0,
                 offline: bool = False, slo_ms: float = 0.0):
        started = time.perf_counter()
        self.fn, self._state_like = step_fn, state
        traced = trace_jax(step_fn, state, tuple(example_batch), "train")
        self._keep_jax_seeds()
        self._open(traced, client=client, address=address,
                   name=name or _default_name(f"{getattr(step_fn, '__name__', 'step')} (jax)"),
                   priority=priority, total_iterations=total_iterations,
                   expected_iteration_ms=expected_iteration_ms,
                   admission_timeout=admission_timeout, started=started,
                   feed_buffer=feed_buffer, reattach_timeout=reattach_timeout,
                   offline=offline, slo_ms=slo_ms)

    def step(self, *batch: Any) -> np.ndarray:
        """Runs ``step_fn(state, *batch)`` on salusd; returns the loss."""
        return self._run(batch, "step()")[0][0]

    def steps(self, batches: Iterable[Sequence[Any]], depth: int = 4) -> Iterator[np.ndarray]:
        """Pipelined training, as :meth:`salus.torch.TrainSession.steps`: one iteration
        per batch, up to ``depth`` submitted ahead; yields each loss in order."""
        for response, answer in self._pipelined(batches, depth):
            self.iterations += 1
            yield self._outputs(response, answer)[0].numpy()

    def __repr__(self) -> str:
        return f"<salus.jax.TrainSession session {self.id}, {self.iterations} steps>"


class InferenceSession(_JaxSession):
    """``fn(params, *inputs)`` on salusd, ``params`` resident: ``session(*inputs)`` returns
    the outputs with the structure ``fn`` gives them (numpy arrays)."""

    kind = "inference"
    _traced_kind = "inference"

    def __init__(self, fn: Callable, params: Any, example_inputs: Sequence[Any], *,
                 address: str | None = None, client: Client | None = None, name: str = "",
                 priority: int = 0, admission_timeout: float | None = None,
                 feed_buffer: bool | None = None, reattach_timeout: float = 60.0,
                 offline: bool = False, slo_ms: float = 0.0):
        started = time.perf_counter()
        self.fn, self._state_like = fn, params
        example_inputs = tuple(example_inputs)
        traced = trace_jax(fn, params, example_inputs, "inference")
        self._keep_jax_seeds()
        self._open(traced, client=client, address=address,
                   name=name or _default_name(f"{getattr(fn, '__name__', 'fn')} (jax)"),
                   priority=priority, total_iterations=0, expected_iteration_ms=0.0,
                   admission_timeout=admission_timeout, started=started,
                   feed_buffer=feed_buffer, reattach_timeout=reattach_timeout,
                   offline=offline, slo_ms=slo_ms)

    def __call__(self, *inputs: Any):
        outputs, program = self._run(inputs, "the inference session")
        return jax.tree.unflatten(program.traced.output_spec, outputs)

    def __repr__(self) -> str:
        return f"<salus.jax.InferenceSession session {self.id}>"
