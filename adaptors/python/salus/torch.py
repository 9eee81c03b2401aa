"""PyTorch training and inference on salusd: what a training script touches.

:class:`TrainSession` turns a model, a loss function and a ``torch.optim`` optimizer into
a salus session: it traces one training step (forward, loss, backward, optimizer update;
:func:`salus.trace_train_step`), lowers it to the graph IR, opens a session on salusd
uploading the parameters, buffers and optimizer state, and then runs one iteration per
:meth:`TrainSession.step`. The model's tensors live on the daemon while the session is
open; :meth:`TrainSession.state_dict` / :meth:`TrainSession.load_state_dict` move them
both ways and :meth:`TrainSession.update_model` writes them back into the user's model
(and optimizer) in place. :class:`InferenceSession` does the same for a forward pass;
:class:`ServedModel` (:mod:`salus.serving`) serves one request at a time, salusd batching
them.

Porting a training loop::

    model = Net(); optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with salus.torch.TrainSession(model, F.cross_entropy, optimizer, (x0, y0),
                                  name="net", total_iterations=1000) as session:
        for x, y in loader:
            loss = session.step(x, y)       # was: zero_grad, forward, backward, step
        session.update_model()              # the trained weights back in `model`

Shapes and dtypes are those of the example batch; :class:`~salus.errors.BatchError` says
when a batch does not match. The optimizer's hyperparameters follow its ``param_groups``
as in eager PyTorch: a ``torch.optim.lr_scheduler`` built on the same optimizer (or any
change to ``lr``, ``momentum``, ``betas``...) takes effect at the next step. Every failure
of the daemon is a :class:`~salus.errors.DaemonError` with the status code's name and
salusd's message.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from . import model_reads
from ._llvm import triton_first
from .client import Client, Iteration, Session
from .errors import (AdmissionTimeoutError, BatchError, DaemonError, DaemonUnavailableError,
                     RequestDroppedError, SalusError, SessionClosedError, SessionResumedError,
                     TraceError)
from .feeds import Layout, Slots, dtype_name, tensor_bytes, tensor_from_bytes
from .trace import (GradientRecipe, TracedStep, trace_inference, trace_train_step,
                    tracing_now)
from .watch import ModelWatch, modes_of

# ``torch.compiler.disable`` below imports torch._dynamo, which loads Triton: before
# TensorFlow or JAX does its LLVM, or not at all when one of them is loaded (salus._llvm).
triton_first()

__all__ = ["AdmissionTimeoutError", "BatchError", "DaemonError", "DaemonUnavailableError",
           "InferenceSession", "InferInfo", "RequestDroppedError", "SalusError",
           "ServedModel", "SessionClosedError", "SessionResumedError", "TrainSession",
           "Variant", "tensor_bytes", "tensor_from_bytes"]

@dataclass(frozen=True)
class _Program:
    """One of a session's programs: its number on salusd, its traced step, its feeds and
    fetches."""

    number: int
    traced: TracedStep
    layout: Layout


#: A session opened without ``name=`` takes this variable's value (``salus.tune`` sets it to
#: the trial's name in each trial), else the model's class name.
SESSION_NAME_ENV = "SALUS_SESSION_NAME"


def _default_name(fallback: str) -> str:
    return os.environ.get(SESSION_NAME_ENV) or fallback


def _shapes_key(leaves: Sequence[Any], spec) -> tuple:
    return (spec, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None
                        for t in leaves))


class _SalusSession:
    """What training and inference sessions share: the traced graph, the open session,
    its programs (one per distinct batch shape), reading and writing its tensors,
    closing."""

    kind = ""
    #: With ``feed_buffer=None``, batches of at least this many bytes travel through a
    #: feed buffer on a Unix socket.
    FEED_BUFFER_BYTES = 64 << 10

    def _open(self, traced: TracedStep, *, client: Client | None, address: str | None,
              name: str, priority: int, total_iterations: int, expected_iteration_ms: float,
              admission_timeout: float | None, started: float,
              feed_buffer: bool | None = None, reattach_timeout: float = 60.0,
              offline: bool = False, slo_ms: float = 0.0) -> None:
        self.traced = traced
        self.reattach_timeout = reattach_timeout
        self._reopen = dict(name=name, priority=priority, total_iterations=total_iterations,
                            expected_iteration_ms=expected_iteration_ms,
                            admission_timeout=admission_timeout, feed_buffer=feed_buffer,
                            reattach_timeout=reattach_timeout, offline=offline,
                            slo_ms=slo_ms)
        self._pipelining = False
        self._slots: Slots | None = None
        self.graph = traced.to_graph()
        self.trace_ms = (time.perf_counter() - started) * 1e3
        self.layout = Layout(self.graph, traced)
        self._programs: dict[tuple, _Program] = {}
        self.iterations = 0
        self._own_client = client is None
        self.client = client if client is not None else Client(address)
        self.session: Session | None = None
        try:
            # Made as the stream sends them: one tensor's bytes at a time, not a copy of
            # the whole state.
            initial = ((spec.id, tensor_bytes(traced.initial_state[n]))
                       for n, spec in self.layout.state.items())
            self.session = self.client.open(self.graph, initial, kind=self.kind, name=name,
                                            priority=priority,
                                            total_iterations=total_iterations,
                                            expected_iteration_ms=expected_iteration_ms,
                                            offline=offline, slo_ms=slo_ms)
            if admission_timeout is not None:
                self.session.wait_admitted(admission_timeout)
            unix = self.client.address.path is not None
            if feed_buffer and not unix:
                raise SalusError("feed_buffer=True needs salusd's Unix socket; "
                                 f"{self.client.address} is TCP")
            self._feed_buffer = unix and (feed_buffer if feed_buffer is not None else
                                          self.layout.feed_size() >= self.FEED_BUFFER_BYTES)
        except BaseException:
            self.close()
            raise
        # Trace, lower and upload: what opening cost this process.
        self.open_ms = (time.perf_counter() - started) * 1e3
        self._synced()

    # -- surviving a restart of salusd ----------------------------------------------------

    def _resumed(self, error: BaseException) -> bool:
        """After an iteration failed because salusd went away (or closed the session as
        it shut down): waits up to ``reattach_timeout`` seconds for salusd to come back
        with the session (``salusd --state-dir``) and takes it back. True when it resumes
        where this client left it (the failed iteration did not run: run it again);
        raises :class:`SessionResumedError` when it resumes from an earlier snapshot;
        False when there is nothing to take back (re-raise ``error``)."""
        session = self.session
        if (self.reattach_timeout <= 0 or session is None or not session.token
                or session._closing
                or not isinstance(error, (SessionClosedError, DaemonUnavailableError))):
            return False
        deadline = time.monotonic() + self.reattach_timeout
        while True:
            try:
                taken = self.client.reattach(session.id, session.token)
                break
            except DaemonError as e:
                if e.code not in ("UNAVAILABLE", "NOT_FOUND") or time.monotonic() > deadline:
                    error.args = (f"{error.args[0] if error.args else error} (salusd did not "
                                  f"give session {session.id} back within "
                                  f"{self.reattach_timeout:g} s; it keeps sessions across "
                                  "restarts only with --state-dir)",)
                    return False
                time.sleep(0.2)
        with contextlib.suppress(SalusError):
            session.close()
        self.session = taken
        self._slots = None  # a feed buffer is attached anew
        self._state_written()
        if taken.iterations == self.iterations:
            return True
        ran, self.iterations = self.iterations, taken.iterations
        raise SessionResumedError(
            f"salusd restarted and session {taken.id} resumes from its snapshot after "
            f"iteration {taken.iterations}; this client had run {ran}: iterations "
            f"{taken.iterations + 1}..{ran} are lost and must be run again",
            resumed_from=taken.iterations)

    # -- programs -----------------------------------------------------------------------

    def _trace_for(self, batch: tuple) -> TracedStep:
        """The step traced for a batch of other shapes (a subclass's own recipe)."""
        raise NotImplementedError

    def _first_program(self, spec) -> None:
        """Registers the program the session opened with under its batch shapes (its
        batch structured as ``spec`` when the trace does not say)."""
        if not self._programs:
            batch_feeds = self.layout.feeds[:self.traced.batch_feeds]
            example = self.traced.batch_spec
            self._programs[_shapes_key(
                [torch.empty(s.shape, dtype=s.torch_dtype) for s in batch_feeds],
                example if example is not None else spec)] = _Program(0, self.traced,
                                                                      self.layout)

    def _program_for(self, batch: Sequence[Any], what: str) -> tuple[_Program, list[Any]]:
        """The program for ``batch`` and its leaves: the first program when the shapes
        are those it was traced with; else one traced for these shapes on first use and
        added to the session (the same persistent tensors). A program that needs more
        scratch than the session was planned with (a batch larger than any before)
        re-opens the session planned for it (:meth:`_grow`)."""
        leaves, spec = pytree.tree_flatten(tuple(batch))
        key = _shapes_key(leaves, spec)
        batch_feeds = self.layout.feeds[:self.traced.batch_feeds]
        self._first_program(spec)
        program = self._programs.get(key)
        if program is not None:
            return program, leaves
        if self.traced.batch_spec is not None and spec != self.traced.batch_spec \
                and len(leaves) == len(batch_feeds):
            raise BatchError(f"{what}: the batch is structured as {spec}, but the session "
                             f"was traced with {self.traced.batch_spec}")
        if len(leaves) != len(batch_feeds) or any(
                not isinstance(v, torch.Tensor) or v.dtype != s.torch_dtype
                for v, s in zip(leaves, batch_feeds)):
            # Raises, naming what does not match.
            self.layout.check(leaves, what, count=len(batch_feeds))
        # Only shapes differ: the same step for these shapes.
        try:
            traced = self._trace_for(pytree.tree_unflatten(leaves, spec))
        except Exception as error:  # noqa: BLE001  (reported with the batch that caused it)
            index, value, s = next((i, v, s) for i, (v, s) in
                                   enumerate(zip(leaves, batch_feeds))
                                   if tuple(v.shape) != s.shape)
            raise BatchError(
                f"{what}: batch element {index} is {dtype_name(value.dtype)}"
                f"{list(value.shape)} but the session was traced with {s.describe()}, and "
                f"the step does not trace for these shapes: {error}") from error
        self._synced()  # as tracing left the model's tensors
        if self._watch is not None:
            self._watch.traced_again()
        if _captured_by(traced) != _captured_by(self.traced):
            raise BatchError(
                f"{what}: the step traced for these shapes reads other parameters from "
                "outside the model than the session's first program, whose values the "
                "session keeps: make those modules submodules of the model")
        graph = traced.to_graph()
        try:
            added = self._session().add_program(graph)
        except DaemonError as error:
            if error.code != "RESOURCE_EXHAUSTED" or "scratch (E)" not in error.details:
                raise
            self._grow(traced, spec, what)
            return self._programs[key], leaves
        program = _Program(added.program, traced, Layout(graph, traced))
        self._programs[key] = program
        return program, leaves

    def _grow(self, traced: TracedStep, spec, what: str) -> None:
        """Re-opens the session planned for ``traced``, a step that needs more scratch
        than any program before: the state moves over exactly (read, then written into
        the new session), the other programs are added again, and the old session is
        closed first, so the device never holds both. Its id changes. Should the new
        one fail to open, the error carries the state as ``error.state_dict``."""
        if self._pipelining:
            raise BatchError(
                f"{what}: this batch needs more scratch memory than the session was planned "
                "with, and the session cannot be re-opened for it while steps() has "
                "iterations in flight: run it with step(), or open the session with the "
                "largest batch")
        state = self.state_dict()
        others = [(k, p.traced) for k, p in self._programs.items()]
        iterations, own_client = self.iterations, self._own_client
        self.session.close()
        try:
            self._open(traced, client=self.client, address=None,
                       started=time.perf_counter(), **self._reopen)
        except SalusError as error:
            error.state_dict = state
            raise
        finally:
            self._own_client = own_client
        self.iterations = iterations
        self.load_state_dict(state)
        self._first_program(spec)
        for key, old in others:
            graph = old.to_graph()
            added = self._session().add_program(graph)
            self._programs[key] = _Program(added.program, old, Layout(graph, old))

    # -- feeds ----------------------------------------------------------------------------

    @property
    def feed_buffer(self) -> bool:
        """Whether batches travel through a feed buffer shared with salusd (a file on
        its host) rather than through the gRPC byte stream."""
        return self._feed_buffer

    def _ensure_slots(self, count: int) -> None:
        """A feed buffer with at least ``count`` slots (none in use: call it between
        iterations)."""
        if self._feed_buffer and (self._slots is None or self._slots.count < count):
            self._slots = Slots(self._session(), Slots.room(self.layout), count)

    def _submission(self, program: _Program, leaves: list[Any], what: str,
                    writes: Mapping[int, bytes] | None = None):
        """The iteration for ``leaves`` (checked) and what reading its answer needs."""
        layout = program.layout
        layout.check(leaves, what)
        if self._slots is not None and self._slots.fits(layout):
            placed = self._slots.put(layout, leaves)
            return (Iteration([], writes, program.number, placed.feed_ranges,
                              placed.fetch_ranges), (layout, placed))
        feeds = [tensor_bytes(value) for value in leaves]
        return Iteration(feeds, writes, program.number), (layout, None)

    def _outputs(self, response, answer) -> list[torch.Tensor]:
        layout, placed = answer
        if placed is None:
            return layout.fetch_tensors(response)
        return self._slots.fetch_tensors(layout, placed)

    # -- running ------------------------------------------------------------------------

    #: An iteration failed because salusd closed the session or went away, and it did not
    #: come back: its tensors are gone, as that error said.
    _lost = False

    def _lost_to(self, error: BaseException) -> None:
        self._lost |= isinstance(error, (SessionClosedError, DaemonUnavailableError))

    def _run_or_resume(self, iteration: Iteration):
        """The iteration's response; None when salusd restarted and gave the session back
        before the iteration ran (run it again)."""
        try:
            return self._session().run(iteration)
        except BaseException as error:
            self._iteration_failed()
            if self._resumed(error):
                return None
            self._lost_to(error)
            raise

    def _pipelined(self, batches: Iterable[Sequence[Any]], depth: int
                   ) -> Iterator[tuple[Any, Any]]:
        """``(response, answer)`` of one iteration per batch (a subclass's ``_iteration``),
        in order, keeping up to ``depth`` submitted ahead; after a restart of salusd,
        :class:`SessionResumedError` says which batches did not run."""
        answers: collections.deque = collections.deque()
        self._ensure_slots(depth + 2)
        self._pipelining = True

        def iterations():
            for batch in batches:
                iteration, answer = self._iteration(tuple(batch), "steps()")
                answers.append(answer)
                yield iteration
        session = self._session()
        session.ran_unread = 0
        stream = session.run_pipelined(iterations(), depth)
        try:
            for response in stream:
                yield response, answers.popleft()
        except BaseException as error:
            self._iteration_failed()
            if self._resumed(error):
                raise SessionResumedError(
                    f"salusd restarted; session {self.id} resumes after iteration "
                    f"{self.iterations}, the last one this loop received; the batches "
                    "submitted after it did not run: call steps() again with them",
                    resumed_from=self.iterations) from error
            self._lost_to(error)
            raise
        finally:
            stream.close()  # left early: waits for the iterations already sent
            self._pipelining = False
            if session.ran_unread:
                self._ran_unread(session.ran_unread)

    def _ran_unread(self, count: int) -> None:
        """``count`` iterations submitted ahead ran on salusd after the loop stopped
        reading :meth:`steps`: counted, and said, since the loop did not see them."""
        self.iterations += count
        warnings.warn(
            f"salus: the loop left steps() with {count} iteration(s) already submitted "
            f"(up to depth ahead); they ran on salusd, on batches the loop had not "
            f"received yet, and the session's state includes them. Leave a loop that must "
            f"stop at an exact step with step(), or give steps() only the batches to run",
            stacklevel=4)

    @property
    def programs(self) -> int:
        """How many programs the session holds (one per distinct batch shape used)."""
        return max(1, len(self._programs))

    # -- state --------------------------------------------------------------------------

    @property
    def state_names(self) -> list[str]:
        """Names of the session's persistent tensors: parameters and buffers as in
        ``model.named_parameters()``/``named_buffers()``, optimizer state as
        ``optimizer.<buffer>.<param>`` and ``optimizer.step``, hyperparameters as
        ``optimizer.param_groups.<group>.<name>`` (see :mod:`salus.optim`)."""
        return list(self.layout.state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor of the session as it is on salusd now (a checkpoint:
        ``torch.save`` it, and :meth:`load_state_dict` it into a new session)."""
        return self.read_state(self.layout.state)

    def read_state(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The persistent tensors ``names`` (see :attr:`state_names`) as they are on
        salusd now: part of :meth:`state_dict`, for a state too large to hold twice."""
        specs = {}
        for name in names:
            if name not in self.layout.state:
                raise SalusError(f"read_state: the session has no tensor {name!r} (see "
                                 f"state_names)")
            specs[name] = self.layout.state[name]
        if not specs:
            return {}
        values = self._session().read([s.id for s in specs.values()])
        return {name: tensor_from_bytes(values[spec.id], spec.dtype, spec.shape)
                for name, spec in specs.items()}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True
                        ) -> None:
        """Overwrites the session's tensors on salusd, all at once, from ``state_dict``: a
        dict from :meth:`state_dict`, or with ``strict=False`` any subset of it (e.g.
        ``model.state_dict()``). Names, shapes and dtypes must match the session's."""
        unknown = sorted(set(state_dict) - set(self.layout.state))
        missing = sorted(set(self.layout.state) - set(state_dict))
        if unknown or (strict and missing):
            parts = []
            if unknown:
                parts.append(f"unknown tensors: {', '.join(unknown)}")
            if strict and missing:
                parts.append(f"missing tensors: {', '.join(missing)}")
            raise SalusError(f"load_state_dict: {'; '.join(parts)} (the session holds "
                             f"{len(self.layout.state)} tensors: see state_names)")
        writes = {}
        for name, value in state_dict.items():
            spec = self.layout.state[name]
            value = torch.as_tensor(value)
            if tuple(value.shape) != spec.shape or value.dtype != spec.torch_dtype:
                raise SalusError(f"load_state_dict: {name} is "
                                 f"{dtype_name(value.dtype)}{list(value.shape)} but the "
                                 f"session's is {spec.describe()}")
            writes[spec.id] = tensor_bytes(value)
        if writes:
            self._session().write(writes)
        self._state_written()

    def _state_written(self) -> None:
        """Hook: the session's tensors were overwritten (with what the user chose)."""
        self._synced()
        # The captured parameters stay the truth: the next iteration writes them again.
        self.traced.resend_captures()

    def _iteration_failed(self) -> None:
        """Hook: an iteration failed, so what it carried (written hyperparameters,
        captured parameters) may not have reached salusd."""
        self.traced.resend_captures()

    def _captures_written(self) -> dict[int, bytes]:
        """The captured parameters (tensors of modules outside the model the step reads)
        changed since salusd last got them, as writes before the iteration. One that
        belongs to another training session's model, whose tensors are ahead on salusd
        (a GAN's discriminator in the generator's loss), is brought back first."""
        if not self.traced.captured:
            return {}
        _bring_back_owners(self.traced.captured, self)
        return {self.layout.state[n].id: tensor_bytes(v)
                for n, v in self.traced.changed_captures().items()}

    def update_model(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """Copies the parameters and buffers from salusd into ``model`` (default: the
        model the session was made from) in place; returns the model."""
        own = model is None or model is getattr(self, "model", None)
        model = self.model if model is None else model
        values = self.state_dict()
        with torch.no_grad():
            for name, tensor in (*model.named_parameters(), *model.named_buffers()):
                if name in values:
                    tensor.copy_(values[name])
        if own:
            self._synced()
        return model

    #: What the session checks of its PyTorch model before each iteration (None: a
    #: session without one, nothing to check).
    _watch: ModelWatch | None = None
    #: The train/eval modes the step was traced in (None: they do not matter).
    _traced_modes: dict[str, bool] | None = None
    #: The model's parameters and modules stay those it was traced with (a training
    #: session: its optimizer holds them); otherwise a replaced one is followed once
    #: written to the session.
    _model_fixed = False

    def _synced(self) -> None:
        """The model's tensors and the session's agree now (opened, written, read back,
        or traced for another shape)."""
        model = getattr(self, "model", None)
        if self._watch is not None:
            self._watch.agree()
        elif isinstance(model, torch.nn.Module):
            self._watch = ModelWatch(model, self._traced_modes, fixed=self._model_fixed,
                                     functions=(getattr(self, "_loss_fn", None),
                                                getattr(self, "_loss_of", None)))

    def _check_unedited(self) -> None:
        """Refuses to run after a parameter or buffer of the model was changed in place
        or replaced since the session last agreed with it (:class:`ModelWatch`)."""
        if self._watch is not None:
            self._watch.check_tensors()

    def _check_values(self) -> None:
        """Refuses an iteration once a plain Python value the step read when it was
        traced changed (:class:`~salus.watch.TracedValues`)."""
        if self._watch is not None:
            self._watch.check_values()

    # -- life ---------------------------------------------------------------------------

    def _session(self) -> Session:
        if self.session is None:
            raise SalusError("the session is not open")
        return self.session

    @property
    def id(self) -> int | None:
        return None if self.session is None else self.session.id

    def close(self) -> None:
        """Closes the session on salusd (its memory is freed). Idempotent."""
        try:
            if self.session is not None:
                self.session.close()
        finally:
            if self._own_client and getattr(self, "client", None) is not None:
                self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except SalusError:
            pass  # the exception in flight says more


class TrainSession(_SalusSession):
    """A training job on salusd.

    Traces one training step of ``model`` under ``loss_fn(model(*inputs), target)`` and
    ``optimizer`` (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta,
    Rprop, ASGD or Adafactor: :mod:`salus.optim`) with ``example_batch = (inputs...,
    target)``, opens a session on the daemon at ``address`` (or through ``client``;
    default: see :class:`salus.client.Client`) and uploads the parameters, buffers and
    optimizer state.
    Hints for the scheduler: ``name`` (shown by ``salusctl``), ``priority``,
    ``total_iterations`` (SRTF ranks by remaining work), ``expected_iteration_ms``.
    ``offline=True``: best effort, beside online sessions (serving): it runs only in what
    they leave, at most a share of the device's memory, and is suspended to host memory
    when they need its memory (its results are unchanged); ``slo_ms``: an online
    session's latency target, which salusd's protection watches
    (``docs/scheduling.md``, "Online and offline sessions").
    Instead of ``loss_fn``, ``loss_of(model, *batch)`` computes the loss of any batch
    (tensors, or tuples, lists and dicts of them) however the model's outputs give it
    (several outputs, auxiliary losses, a Hugging Face model's ``.loss``); pass
    ``loss_fn=None`` then. Either may return ``(loss, aux)``: ``aux``, tensors the step
    computes without a gradient (outputs for a metric, an RNN's hidden state for the
    next batch), comes back with the loss. Between backward and update, as a loop would:
    ``accumulate=k`` splits each batch along its first dimension into k micro-batches
    run in turn, accumulating the gradients of ``loss / k`` (memory for one
    micro-batch's activations); ``clip_grad_norm`` (with ``norm_type``) or
    ``clip_grad_value`` clip the gradients as ``torch.nn.utils.clip_grad_norm_`` /
    ``clip_grad_value_`` do.

    Mixed precision: ``autocast=torch.bfloat16`` (or ``torch.float16``) runs the forward
    and the loss under ``torch.autocast("cpu", dtype=...)`` (a ``loss_of`` may enter it
    itself instead); parameters and optimizer state stay float32. ``scaler``: a
    ``torch.amp.GradScaler`` whose dynamic loss scaling each step follows, its scale and
    growth tracker session state (``scaler.scale``, ``scaler.growth_tracker``;
    :mod:`salus.amp`). ``admission_timeout`` (seconds): wait at most that long for
    admission, then raise
    :class:`~salus.errors.AdmissionTimeoutError` naming why the session waits; ``None``
    does not wait (iterations queue until the session is admitted).

    ``feed_buffer``: batches travel through a file shared with salusd (one copy in, one
    out) instead of the gRPC byte stream; by default on salusd's Unix socket for batches
    of at least ``FEED_BUFFER_BYTES``.

    When salusd goes away under the session (a restart), a step waits up to
    ``reattach_timeout`` seconds (0: not at all) for it to come back with the session
    (``salusd --state-dir``), takes it back and runs the step there; if the daemon's
    snapshot is older than the last step, :class:`SessionResumedError` says which
    iteration the session resumes from.

    ``open_ms`` is what opening cost (trace, lower, upload); ``trace_ms`` the part spent
    tracing and lowering.
    """

    kind = "training"
    _model_fixed = True

    def __init__(self, model: torch.nn.Module,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer, example_batch: Sequence[Any], *,
                 loss_of: Callable[..., torch.Tensor] | None = None, accumulate: int = 1,
                 clip_grad_norm: float | None = None, norm_type: float = 2.0,
                 clip_grad_value: float | None = None,
                 address: str | None = None, client: Client | None = None,
                 name: str = "", priority: int = 0, total_iterations: int = 0,
                 expected_iteration_ms: float = 0.0, admission_timeout: float | None = None,
                 tracing_mode: str = "real", feed_buffer: bool | None = None,
                 reattach_timeout: float = 60.0, autocast: torch.dtype | None = None,
                 scaler: "torch.amp.GradScaler | None" = None, offline: bool = False,
                 slo_ms: float = 0.0):
        started = time.perf_counter()
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        gradients = GradientRecipe(accumulate, clip_grad_norm, norm_type, clip_grad_value)
        self._loss_fn, self._loss_of, self._gradients = loss_fn, loss_of, gradients
        self._tracing_mode, self._autocast = tracing_mode, autocast
        # The step is traced in the model's train/eval modes of now: a step is refused
        # while they differ (:meth:`ModelWatch.check_modes`).
        self._traced_modes = modes_of(model)
        traced = trace_train_step(model, loss_fn, optimizer, example_batch, loss_of=loss_of,
                                  gradients=gradients, tracing_mode=tracing_mode,
                                  autocast=autocast, scaler=scaler)
        self._open(traced, client=client, address=address,
                   name=name or _default_name(type(model).__name__), priority=priority,
                   total_iterations=total_iterations,
                   expected_iteration_ms=expected_iteration_ms,
                   admission_timeout=admission_timeout, started=started,
                   feed_buffer=feed_buffer, reattach_timeout=reattach_timeout,
                   offline=offline, slo_ms=slo_ms)
        self._follow_reads()

    def step(self, *batch: Any) -> torch.Tensor:
        """Runs one training iteration on salusd with ``batch`` shaped as the example
        batch (``(inputs..., target)`` with ``loss_fn``); returns the loss (a 0-dim
        tensor; with ``accumulate``, the mean over the micro-batches), or ``(loss, aux)``
        where the loss function returns ``aux`` beside it. Hyperparameters
        changed in the optimizer's ``param_groups`` since the last step (a scheduler's
        ``step()``) travel with it."""
        self._ensure_slots(2)
        iteration, answer = self._iteration(batch, "step()")
        response = self._run_or_resume(iteration)
        if response is None:
            return self.step(*batch)  # the iteration did not run: on the session back
        return self._stepped(response, answer)

    def _trace_for(self, batch: tuple) -> TracedStep:
        return trace_train_step(self.model, self._loss_fn, self.optimizer, batch,
                                loss_of=self._loss_of, gradients=self._gradients,
                                tracing_mode=self._tracing_mode, autocast=self._autocast,
                                scaler=self.scaler)

    def _iteration(self, batch: Sequence[Any], what: str):
        self._check_unedited()
        self._check_modes()
        self._check_values()
        if self.traced.scaler is not None:
            self.traced.scaler.check()
        changed = self.traced.rule.changed_hyperparameters()
        program, leaves = self._program_for(batch, what)
        program.traced.check_constants()
        writes = {self.layout.state[n].id: tensor_bytes(v) for n, v in changed.items()}
        writes.update(self._captures_written())
        return self._submission(program, leaves, what, writes)

    def _check_modes(self) -> None:
        if self._watch is not None:
            self._watch.check_modes()

    def _stepped(self, response, answer) -> torch.Tensor:
        self.iterations += 1
        self._model_behind = True
        self.last_device_ms = response.device_us / 1e3
        self.last_wait_ms = response.wait_us / 1e3
        self.traced.rule.mark_stepped()
        loss, *aux = self._outputs(response, answer)
        spec = answer[0].output_spec
        return loss if spec is None else (loss, pytree.tree_unflatten(aux, spec))

    def _state_written(self) -> None:
        # The optimizer's param_groups stay the truth for hyperparameters: the next step
        # writes them again.
        super()._state_written()
        self.traced.rule.resend()

    def _iteration_failed(self) -> None:
        super()._iteration_failed()
        self.traced.rule.resend()

    def _ran_unread(self, count: int) -> None:
        super()._ran_unread(count)
        self._model_behind = True
        self.traced.rule.mark_stepped()

    def steps(self, batches: Iterable[Sequence[torch.Tensor]], depth: int = 4
              ) -> Iterator[torch.Tensor]:
        """Pipelined training: runs one iteration per batch of ``batches`` and yields each
        loss in order, keeping up to ``depth`` iterations submitted ahead so that the
        session always has work waiting on salusd (no round trip between iterations;
        the policy always sees it ready). Batches, and the optimizer's hyperparameters,
        are read as iterations are submitted: a scheduler stepped once per loss yielded
        reaches the iteration submitted next, ``depth`` iterations later than in an
        unpipelined loop (use :meth:`step` where a schedule must act at once)."""
        for response, answer in self._pipelined(batches, depth):
            yield self._stepped(response, answer)

    def update_model(self, model: torch.nn.Module | None = None, *,
                     optimizer: bool = True) -> torch.nn.Module:
        """Copies parameters and buffers from salusd into the model in place and, with
        ``optimizer`` (when ``model`` is the session's own), the optimizer's state
        (momentum buffers; Adam's moments and step) into the torch optimizer, and the
        loss scale and growth tracker into the session's ``scaler``, so that eager
        training can go on where the session left off. Returns the model."""
        own = model is None or model is self.model
        model = self.model if model is None else model
        values = self.state_dict()
        with torch.no_grad():
            for name, tensor in (*model.named_parameters(), *model.named_buffers()):
                if name in values:
                    tensor.copy_(values[name])
        if optimizer and own:
            self._update_optimizer(values)
        if own:
            self._synced()
            self._model_behind = self._model_behind and not optimizer
        return model

    # -- the model and the optimizer keep up with the session ----------------------------

    #: Steps ran on salusd since the model and the optimizer last got the session's
    #: tensors (:meth:`update_model`).
    _model_behind = False
    _hooks: list = []
    _followed: list = []

    def _follow_reads(self) -> None:
        """Between steps the session's tensors are ahead of the model's and the
        optimizer's own. An eager forward pass of the model or of one of its modules (a
        validation pass), ``model.state_dict()`` or ``optimizer.state_dict()`` (a
        checkpoint) first brings them back (:meth:`update_model`), and so does
        :meth:`close`: they see what eager training would have left."""
        before = _BringBack(self)
        self._hooks = [m.register_forward_pre_hook(before) for m in self.model.modules()]
        self._hooks += [self.model.register_state_dict_pre_hook(before),
                        self.optimizer.register_state_dict_pre_hook(before)]
        # parameters() and buffers() (a weight average's update_parameters(model))
        self._followed = list(self.model.modules())
        for module in self._followed:
            model_reads.follow(module, before)
        _OPEN_TRAINING.add(self)
        _guard_gradient_clipping()
        if self._watch is not None:
            self._watch.note_hooks()  # the session's own hooks are not the user's

    def _bring_back(self) -> None:
        if not self._model_behind or tracing_now() or self.session is None or self._lost:
            return
        if self._pipelining:
            raise SalusError(
                "the model (or its optimizer) was read while steps() had iterations in "
                "flight, so its tensors would be those of an iteration not yet decided: "
                "read it after the steps() loop, or train with step() where each step "
                "must be seen")
        # A change to the model's stale tensors would be overwritten: said instead.
        self._check_unedited()
        self.update_model()

    def close(self) -> None:
        """Brings the session's tensors back into the model and the optimizer if steps
        ran since they last were (:meth:`update_model`), then closes the session on
        salusd (its memory is freed). Idempotent."""
        try:
            self._bring_back()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            if self._watch is not None:
                self._watch.note_hooks()  # (without the session's own)
            for module in self._followed:
                model_reads.unfollow(module)
            self._followed = []
            _OPEN_TRAINING.discard(self)
            super().close()

    def _update_optimizer(self, values: dict[str, torch.Tensor]) -> None:
        self.traced.rule.give_back(values, dict(self.model.named_parameters()))
        if self.traced.scaler is not None:
            self.traced.scaler.give_back(values)

    def __repr__(self) -> str:
        return (f"<salus.torch.TrainSession {type(self.model).__name__} session {self.id}, "
                f"{self.iterations} steps>")


def _captured_by(traced: TracedStep) -> list[tuple[str, int]]:
    return [(c.name, c.tensor.data_ptr()) for c in traced.captured]


#: Training sessions open in this process (whose models other steps may capture).
_OPEN_TRAINING: weakref.WeakSet = weakref.WeakSet()


def _training(tensors: Iterable[torch.Tensor]) -> list["TrainSession"]:
    """The open training sessions whose models hold one of ``tensors`` as a parameter."""
    pointers = {t.data_ptr() for t in tensors if isinstance(t, torch.Tensor)}
    return [s for s in list(_OPEN_TRAINING)
            if any(p.data_ptr() in pointers for p in s.model.parameters())]


def _bring_back_owners(captured, reader) -> None:
    """Brings back the tensors of every other open training session whose model holds
    one of ``captured`` and is behind its session."""
    for session in _training(c.tensor for c in captured):
        if session is not reader and session._model_behind:
            session._bring_back()


def _guard_gradient_clipping() -> None:
    """Makes ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` refuse the
    parameters of a model an open training session trains: they have no gradients on the
    client (salusd computes the gradients and the update in ``step``), so a clipping call
    left from an eager loop would clip nothing, silently. PyTorch exports each as a
    wrapper that turns gradients off around the function it holds: the guard goes in
    there, so references taken before the session opened (``from torch.nn.utils import
    clip_grad_norm_``) are guarded too; where a PyTorch wraps them otherwise, the names
    are replaced where they are looked up."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        exported = getattr(clip_grad, name, None)
        if exported is None:
            continue
        cells = dict(zip(exported.__code__.co_freevars, exported.__closure__ or ()))
        held = cells.get("func")
        if held is not None and callable(held.cell_contents):
            if not getattr(held.cell_contents, "_salus_guard", False):
                held.cell_contents = _refusing_trained(held.cell_contents, name)
            continue
        for owner in (utils, clip_grad):
            original = getattr(owner, name, None)
            if original is not None and not getattr(original, "_salus_guard", False):
                setattr(owner, name, _refusing_trained(original, name))


def _refusing_trained(original, name: str):
    option = "clip_grad_value" if "value" in name else "clip_grad_norm"

    @functools.wraps(original)
    def clip(parameters, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for session in _training(parameters):
            raise SalusError(
                f"torch.nn.utils.{name} is given the parameters of {session!r}, which "
                "have no gradients here: salusd computes the gradients and the update "
                f"in session.step(). Pass {option}=... to the TrainSession instead")
        return original(parameters, *args, **kwargs)

    clip._salus_guard = True  # type: ignore[attr-defined]
    return clip


class _BringBack:
    """The hook a training session leaves on its model and optimizer (see
    ``TrainSession._follow_reads``). It holds the session weakly, and a copy of it
    (``copy.deepcopy(model)``, ``torch.save(model)``) does nothing: the copy is not the
    session's model."""

    def __init__(self, session: TrainSession | None):
        self._session = weakref.ref(session) if session is not None else None

    def __call__(self, *_) -> None:
        session = self._session() if self._session is not None else None
        if session is not None and session._model_behind:
            _bring_back(session)

    def __reduce__(self):
        return (_BringBack, (None,))


@torch.compiler.disable  # a compiled model runs it as Python, not traced
def _bring_back(session: TrainSession) -> None:
    # Apart from the hook's check: calling a disabled function costs about 15 us, which
    # every module of an eager forward pass would pay.
    session._bring_back()


class InferenceSession(_SalusSession):
    """A serving job on salusd: ``session(*inputs)`` runs ``model``'s forward pass there.

    Traced in eval mode (``eval_mode=False`` keeps the model's own mode) with
    ``example_inputs`` (a tensor or a tuple), whose shapes and dtypes are fixed; outputs
    have the structure the model returns (a tensor, a tuple, a dict), in the dtypes the
    forward gives them (under ``autocast=torch.bfloat16``, a linear head's are bf16).
    Other arguments as :class:`TrainSession`.
    """

    kind = "inference"

    def __init__(self, model: torch.nn.Module,
                 example_inputs: Sequence[torch.Tensor] | torch.Tensor, *,
                 address: str | None = None, client: Client | None = None, name: str = "",
                 priority: int = 0, total_iterations: int = 0,
                 expected_iteration_ms: float = 0.0, admission_timeout: float | None = None,
                 eval_mode: bool = True, tracing_mode: str = "real",
                 feed_buffer: bool | None = None, reattach_timeout: float = 60.0,
                 autocast: torch.dtype | None = None, offline: bool = False,
                 slo_ms: float = 0.0):
        started = time.perf_counter()
        self.model = model
        self._eval_mode, self._tracing_mode = eval_mode, tracing_mode
        self._autocast = autocast
        traced = trace_inference(model, example_inputs, eval_mode=eval_mode,
                                 tracing_mode=tracing_mode, autocast=autocast)
        self._open(traced, client=client, address=address,
                   name=name or _default_name(f"{type(model).__name__} (inference)"),
                   priority=priority,
                   total_iterations=total_iterations,
                   expected_iteration_ms=expected_iteration_ms,
                   admission_timeout=admission_timeout, started=started,
                   feed_buffer=feed_buffer, reattach_timeout=reattach_timeout,
                   offline=offline, slo_ms=slo_ms)

    def _trace_for(self, batch: tuple) -> TracedStep:
        return trace_inference(self.model, batch, eval_mode=self._eval_mode,
                               tracing_mode=self._tracing_mode, autocast=self._autocast)

    def __call__(self, *inputs: torch.Tensor):
        """The model's output for ``inputs``, computed on salusd. Inputs of other shapes
        than the example's (another batch size) run a program traced for them on first
        use; salusd refuses one that needs more scratch than the example's."""
        what = "the inference session"
        self._check_unedited()
        self._check_values()
        self._ensure_slots(2)
        program, leaves = self._program_for(inputs, what)
        program.traced.check_constants()
        iteration, answer = self._submission(program, leaves, what,
                                             self._captures_written() or None)
        response = self._run_or_resume(iteration)
        if response is None:
            return self(*inputs)
        self.iterations += 1
        return pytree.tree_unflatten(self._outputs(response, answer),
                                     program.traced.output_spec)

    def __repr__(self) -> str:
        return f"<salus.torch.InferenceSession {type(self.model).__name__} session {self.id}>"


def __getattr__(name: str):
    # ServedModel and Variant live in salus.serving, which builds on this module.
    if name in ("ServedModel", "Variant", "InferInfo"):
        from . import serving
        return getattr(serving, name)
    raise AttributeError(f"module 'salus.torch' has no attribute {name!r}")
