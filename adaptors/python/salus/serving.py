"""Serving a PyTorch model from salusd: requests come one at a time, salusd batches them.

:class:`ServedModel` traces ``model``'s forward pass (eval mode) once for each batch size
and variant, opens one inference session holding all of these programs and makes it a
served model (``Sessions.Serve``, ``docs/serving.md``). Each request is then one input,
without a batch dimension: salusd's request scheduler (ORLOJ by default) puts requests
together into batches, runs each batch as the session's program for its size, and
answers every request with its own rows::

    served = ServedModel(model, torch.randn(64), batch_sizes=(1, 2, 4, 8), slo_ms=20)
    logits = served.infer(x)                     # x: one input, shape [64]
    future = served.submit(x)                    # concurrent.futures.Future
    logits, info = served.infer(x, with_info=True)   # how the request ran

**Variants** (:class:`Variant`), cheapest first, are what a request may ask for: keyword
arguments of ``forward`` (an early exit ``depth=k``) and/or their own example shapes
(sequence-length buckets), each at least as large as the one before in every dimension.
A batch runs the costliest variant among its requests. ``variant_arg`` names a keyword
of ``forward`` that receives each row's variant index (an int64 tensor ``[batch]``), so
that a batch run at a costlier variant can still give each request its own (the exit of
its own depth).

**Decoding** (``decode_steps=N``): ``forward(*state)`` returns ``(next_state, done)``,
``next_state`` the next value of every input (the same shapes and dtypes, in input order)
and ``done`` one flag per row (a bool tensor ``[batch]``). salusd runs the model again on
its own results until every request of the batch is done, at most N steps; a request's
answer is its state at the step it became done.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from .client import Client, Session
from .errors import BatchError, SalusError, SessionClosedError
from .feeds import Layout, dtype_name, tensor_bytes, tensor_from_bytes
from .torch import _default_name, _SalusSession
from .trace import TracedStep, trace_inference
from .watch import ModelWatch
from .v1 import session_pb2

__all__ = ["InferInfo", "ServedModel", "Variant"]

Inputs = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """What a request may ask of a served model.

    ``kwargs``: keyword arguments the forward pass is traced with for this variant (e.g.
    ``{"depth": 2}``: an early exit). ``example``: one request's inputs at this variant's
    shapes, without the batch dimension (default: the served model's ``example``).
    ``name``: shown in salusd's errors (default: the keyword arguments)."""

    name: str = ""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    example: Inputs | None = None

    def label(self, index: int) -> str:
        if self.name:
            return self.name
        return ", ".join(f"{k}={v}" for k, v in self.kwargs.items()) or f"variant {index}"


@dataclass(frozen=True)
class InferInfo:
    """How one request ran (``infer(..., with_info=True)``): its ``variant``; from its
    arrival at salusd to its answer (``latency_ms``) and to its batch's start
    (``queue_ms``); its batch's size, the requests it held and the variant it ran;
    decoding steps it took (1 without decoding) and whether it was done within
    ``decode_steps``; whether it was answered by its deadline."""

    variant: int
    latency_ms: float
    queue_ms: float
    batch_size: int
    batch_requests: int
    batch_variant: int
    steps: int
    done: bool
    met_deadline: bool


@dataclass(frozen=True)
class _Row:
    """One feed's or fetch's row: its type without the batch dimension."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"

    def holds(self, value: torch.Tensor) -> bool:
        return (value.dtype == self.dtype and value.dim() == len(self.shape)
                and all(n <= m for n, m in zip(value.shape, self.shape)))


@dataclass(frozen=True)
class _VariantRows:
    """A variant as requests see it: its inputs' and outputs' rows, its output
    structure."""

    name: str
    feeds: list[_Row]
    fetches: list[_Row]
    fetch_dtypes: list[int]
    output_spec: pytree.TreeSpec


class _Bound(nn.Module):
    """``model`` with a variant's keyword arguments bound and the variant index (with
    ``variant_arg``) taken as its last positional input: a forward the tracer takes."""

    def __init__(self, model: nn.Module, kwargs: Mapping[str, Any], variant_arg: str | None):
        super().__init__()
        self.model = model
        self.kwargs = dict(kwargs)
        self.variant_arg = variant_arg

    def forward(self, *inputs):
        if self.variant_arg is None:
            return self.model(*inputs, **self.kwargs)
        *inputs, variant = inputs
        return self.model(*inputs, **self.kwargs, **{self.variant_arg: variant})


class _Opened(_SalusSession):
    """The served model's inference session, opened as the adaptor opens every session."""

    kind = "inference"

    def __init__(self, traced: TracedStep, *, client: Client | None, address: str | None,
                 name: str):
        self._open(traced, client=client, address=address, name=name, priority=0,
                   total_iterations=0, expected_iteration_ms=0.0, admission_timeout=None,
                   started=time.perf_counter(), feed_buffer=False)


def _as_inputs(example: Inputs, what: str) -> list[torch.Tensor]:
    inputs = [example] if isinstance(example, torch.Tensor) else list(example)
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise ValueError(f"{what} must be a tensor or a tuple of tensors (one request's "
                         "inputs, without the batch dimension)")
    return [x.detach() for x in inputs]


def _describe(structure: Any) -> str:
    return str(structure).replace("'", "")


def _then(future: concurrent.futures.Future, fn: Callable[[Any], Any]
          ) -> concurrent.futures.Future:
    """A future of ``fn(future's result)``; cancelling it cancels ``future``."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def settle(done: concurrent.futures.Future) -> None:
        try:
            if done.cancelled():
                out.cancel()
            elif done.exception() is not None:
                out.set_exception(done.exception())
            else:
                try:
                    result = fn(done.result())
                except BaseException as error:  # noqa: BLE001  (the caller's to see)
                    out.set_exception(error)
                else:
                    out.set_result(result)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled by its owner meanwhile

    out.add_done_callback(lambda f: f.cancelled() and future.cancel())
    future.add_done_callback(settle)
    return out


class ServedModel:
    """``model``'s forward pass served by salusd, which batches its requests.

    ``example``: one request's inputs (a tensor or a tuple of tensors) without the batch
    dimension. For every batch size of ``batch_sizes`` and every variant, the forward
    pass is traced in eval mode on inputs of shape ``[size, *row]``; the session opens
    with the largest batch of the last (costliest) variant, whose memory salusd plans,
    and holds the others as added programs. Every output of the model must have the
    batch as its first dimension.

    ``scheduler``: salusd's request scheduler (``orloj``, ``clockwork``, ``nexus``,
    ``clipper``, ``edf``, ``fifo``; ``docs/serving.md``). ``slo_ms``: a request's SLO when
    it gives none (0: no deadline). ``variants``: a list of :class:`Variant`, cheapest
    first (default: one, the model as it is). ``variant_arg``: the keyword of
    ``forward`` that receives each row's variant index (int64 ``[batch]``).
    ``decode_steps``: serve a decoding model (see the module's docstring), at most this
    many steps per request. ``address``, ``client``, ``name`` as for
    :class:`salus.torch.InferenceSession`.

    ``calibration`` holds what salusd measured of each program when serving began:
    milliseconds by ``(variant, batch size)``. Close it (or use it as a context manager)
    to end serving and free the session.
    """

    def __init__(self, model: nn.Module, example: Inputs | None = None, *,
                 batch_sizes: Sequence[int] = (1, 2, 4, 8), scheduler: str = "orloj",
                 slo_ms: float = 0.0, variants: Sequence[Variant] | None = None,
                 variant_arg: str | None = None, decode_steps: int | None = None,
                 address: str | None = None, client: Client | None = None, name: str = ""):
        started = time.perf_counter()
        sizes = sorted({int(b) for b in batch_sizes})
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive, at least one: {batch_sizes}")
        if decode_steps is not None and decode_steps < 1:
            raise ValueError(f"decode_steps must be at least 1, not {decode_steps}")
        variants = list(variants) if variants else [Variant()]
        if not all(isinstance(v, Variant) for v in variants):
            raise ValueError("variants must be a list of salus.serving.Variant")
        labels = [variant.label(v) for v, variant in enumerate(variants)]
        if len(set(labels)) != len(labels):
            raise ValueError(f"variants need distinct names: {labels}")
        examples = []
        for v, variant in enumerate(variants):
            chosen = variant.example if variant.example is not None else example
            if chosen is None:
                raise ValueError(f"variant {v} ({variant.label(v)}) has no example, and "
                                 "there is no example for all")
            examples.append(_as_inputs(chosen, f"the example of variant {v}"))
        self._check_examples(examples, variants)
        self.model = model
        self.batch_sizes = sizes
        self.decode_steps = decode_steps
        self._inputs = len(examples[0])

        # Trace every (variant, size) first: the model's errors come before a session.
        traced: dict[tuple[int, int], TracedStep] = {}
        graphs = {}
        rows: list[_VariantRows] = []
        for v, (variant, rows_v) in enumerate(zip(variants, examples)):
            bound = _Bound(model, variant.kwargs, variant_arg)
            for size in sizes:
                batch = [x.unsqueeze(0).expand(size, *x.shape).contiguous() for x in rows_v]
                if variant_arg is not None:
                    batch.append(torch.full((size,), v, dtype=torch.int64))
                step = trace_inference(bound, tuple(batch))
                traced[v, size] = step
                graphs[v, size] = step.to_graph()
            layout = Layout(graphs[v, sizes[0]], traced[v, sizes[0]])
            rows.append(self._rows(variant.label(v), layout, traced[v, sizes[0]]))
            if decode_steps is not None:
                self._check_decode(rows[-1], v)
        self._variants = rows

        last = (len(variants) - 1, sizes[-1])
        self._opened = _Opened(traced[last], client=client, address=address,
                               name=name or _default_name(f"{type(model).__name__} (served)"))
        try:
            session = self._opened.session
            numbers = {key: 0 if key == last else session.add_program(graph).program
                       for key, graph in graphs.items()}
            served = [session_pb2.ServedVariant(
                name=r.name, programs=[session_pb2.BatchProgram(batch_size=size,
                                                                program=numbers[v, size])
                                       for size in sizes])
                for v, r in enumerate(rows)]
            decode = None
            if decode_steps is not None:
                decode = session_pb2.Decode(
                    carry=[session_pb2.Carry(fetch=i, feed=i) for i in range(self._inputs)],
                    done=self._inputs, max_steps=decode_steps)
            response = session.serve(served, scheduler=scheduler, decode=decode,
                                     default_slo_ms=slo_ms,
                                     variant_feed=self._inputs if variant_arg else None)
        except BaseException:
            self._opened.close()
            raise
        self.calibration = {(t.variant, t.batch_size): t.ms for t in response.calibration}
        self._watch = ModelWatch(model, fixed=True,
                                 remedy="Serve the changed model anew (a new ServedModel)")
        self._traced = list(traced.values())
        #: What opening cost this process: tracing, lowering, uploading, calibration.
        self.open_ms = (time.perf_counter() - started) * 1e3

    def _check_captures(self) -> None:
        """Refuses a request after a tensor from outside the model that the forward pass
        reads (a parameter of another module, a captured tensor) changed in place: every
        program of the served model holds its value as it was when served."""
        for step in self._traced:
            step.check_constants()
        changed = [c for step in self._traced for c in step.captured if c.changed]
        if changed:
            shapes = ", ".join(str(list(c.tensor.shape)) for c in changed[:3])
            raise SalusError(
                f"a parameter the served model's forward pass reads from outside the model "
                f"(of shape {shapes}) changed in place since it was served, and salusd "
                "serves the value it had then: serve the model anew (a new ServedModel), "
                "or make the module holding it a submodule of the model")

    # -- construction ---------------------------------------------------------------------

    @staticmethod
    def _check_examples(examples: list[list[torch.Tensor]], variants: list[Variant]) -> None:
        """Every variant's example alike in count, dtypes and ranks, each at least as large
        as the one before in every dimension."""
        for v in range(1, len(examples)):
            before, now = examples[v - 1], examples[v]
            fits = len(before) == len(now) and all(
                _Row(n.dtype, tuple(n.shape)).holds(b) for b, n in zip(before, now))
            if not fits:
                shapes = lambda xs: ", ".join(  # noqa: E731
                    f"{dtype_name(x.dtype)}{list(x.shape)}" for x in xs)
                raise ValueError(
                    f"variant {v} ({variants[v].label(v)}) takes {shapes(now)}, which does "
                    f"not hold variant {v - 1}'s {shapes(before)} in every dimension: "
                    "variants go cheapest first, each example at least as large as the one "
                    "before, with the same dtypes")

    def _rows(self, name: str, layout: Layout, traced: TracedStep) -> _VariantRows:
        def row(spec) -> _Row:  # salusd's Serve checks that the batch comes first
            return _Row(spec.torch_dtype, spec.shape[1:])
        return _VariantRows(name, [row(s) for s in layout.feeds[:self._inputs]],
                            [row(s) for s in layout.fetches],
                            [s.dtype for s in layout.fetches], traced.output_spec)

    def _check_decode(self, rows: _VariantRows, v: int) -> None:
        """``forward(*state)`` returned ``(next_state, done)``: next_state's leaves are the
        inputs' next values, done one flag per row."""
        described = pytree.tree_unflatten([r.describe() for r in rows.fetches],
                                          rows.output_spec)
        shape = pytree.tree_unflatten(list(range(len(rows.fetches))), rows.output_spec)
        state = shape[0] if isinstance(shape, (tuple, list)) and len(shape) == 2 else None
        fits = (state is not None and isinstance(shape[1], int)
                and len(pytree.tree_leaves(state)) == self._inputs
                and rows.fetches[:self._inputs] == rows.feeds
                and rows.fetches[self._inputs].shape == ())
        if not fits:
            inputs = ", ".join(r.describe() for r in rows.feeds)
            raise SalusError(
                f"decode_steps: forward(*state) must return (next_state, done), next_state "
                f"the next value of each of the {self._inputs} input(s) ({inputs} per "
                f"request, in that order) and done one flag per request (a bool tensor "
                f"[batch]); variant {v} ({rows.name}) returns {_describe(described)} per "
                "request")

    # -- requests ---------------------------------------------------------------------------

    def _variant(self, variant: int | str | None, inputs: list[torch.Tensor]) -> int:
        if variant is None:
            for v, rows in enumerate(self._variants):
                if all(r.holds(x) for r, x in zip(rows.feeds, inputs)):
                    return v
            return len(self._variants) - 1  # refused by _request, naming what is too large
        if isinstance(variant, str):
            names = self.variants
            if variant not in names:
                raise ValueError(f"unknown variant {variant!r}: the served model has "
                                 f"{', '.join(map(repr, names))}")
            return names.index(variant)
        if not 0 <= variant < len(self._variants):
            raise ValueError(f"unknown variant {variant}: the served model has variants 0.."
                             f"{len(self._variants) - 1}")
        return variant

    def _request(self, inputs: tuple, slo_ms: float | None, app: int,
                 variant: int | str | None) -> tuple[session_pb2.InferRequest, int]:
        what = "the served model"
        self._watch.check_tensors()
        self._watch.check_values()
        self._check_captures()
        if len(inputs) != self._inputs:
            raise BatchError(f"{what} takes {self._inputs} input(s) per request, as its "
                             f"example, but got {len(inputs)}")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise BatchError(f"{what}: input {i} is a {type(x).__name__}, not a tensor")
        v = self._variant(variant, list(inputs))
        rows = self._variants[v]
        feeds = []
        for i, (x, row) in enumerate(zip(inputs, rows.feeds)):
            if not row.holds(x):
                got = f"{dtype_name(x.dtype)}{list(x.shape)}"
                where = (f"variant {v} ({rows.name}) takes" if variant is not None else
                         "the largest variant takes" if len(self._variants) > 1 else "it takes")
                raise BatchError(f"{what}: input {i} is {got} (one request, without the "
                                 f"batch dimension), but {where} {row.describe()}")
            if tuple(x.shape) != row.shape:
                padded = torch.zeros(row.shape, dtype=row.dtype)
                padded[tuple(slice(0, n) for n in x.shape)] = x
                x = padded
            feeds.append(tensor_bytes(x))
        request = session_pb2.InferRequest(session=self._session().id, feeds=feeds,
                                           variant=v, slo_ms=slo_ms or 0.0, app=app)
        return request, v

    def _answer(self, response: session_pb2.InferResponse, v: int, with_info: bool):
        rows = self._variants[v]
        fetches = [tensor_from_bytes(data, dtype, row.shape) for data, dtype, row in
                   zip(response.fetches, rows.fetch_dtypes, rows.fetches)]
        outputs = pytree.tree_unflatten(fetches, rows.output_spec)
        if self.decode_steps is not None:
            outputs = outputs[0]
        if not with_info:
            return outputs
        return outputs, InferInfo(
            variant=v, latency_ms=response.latency_us / 1e3, queue_ms=response.queue_us / 1e3,
            batch_size=response.batch_size, batch_requests=response.batch_requests,
            batch_variant=response.batch_variant, steps=response.steps, done=response.done,
            met_deadline=response.met_deadline)

    def submit(self, *inputs: torch.Tensor, slo_ms: float | None = None, app: int = 0,
               variant: int | str | None = None, with_info: bool = False
               ) -> concurrent.futures.Future:
        """:meth:`infer` without waiting: a ``concurrent.futures.Future`` of its result.
        Bad inputs raise here; what salusd answers (a dropped request too) is the
        future's."""
        session = self._session()
        if session.closed:
            raise SessionClosedError(f"cannot infer: the served model (session {session.id}) "
                                     "is closed", code="CANCELLED", details="closed",
                                     operation="infer", address=str(session.client.address))
        request, v = self._request(inputs, slo_ms, app, variant)
        return _then(session.client.infer_future(request),
                     lambda response: self._answer(response, v, with_info))

    def infer(self, *inputs: torch.Tensor, slo_ms: float | None = None, app: int = 0,
              variant: int | str | None = None, with_info: bool = False):
        """The model's outputs for one request: ``inputs`` without the batch dimension,
        as the example. Outputs have the model's structure, each without the batch
        dimension, at the shapes of the request's variant; a decoding model's are its
        final state (``next_state``'s structure).

        ``variant``: an index or a name. ``None`` takes the first variant whose example
        holds the inputs in every dimension (variant 0 when all are alike); inputs smaller
        than their variant's are zero-padded at the end of each dimension. ``slo_ms``: the
        request's SLO (default: the served model's). ``app``: the application it comes
        from (ORLOJ keeps execution times per application). ``with_info=True`` returns
        ``(outputs, InferInfo)``.

        Raises :class:`~salus.errors.BatchError` for inputs of other dtypes or ranks or
        larger than every variant, ``ValueError`` for an unknown variant and
        :class:`~salus.errors.RequestDroppedError` when salusd's scheduler dropped the
        request (it could no longer meet its deadline)."""
        return self.submit(*inputs, slo_ms=slo_ms, app=app, variant=variant,
                           with_info=with_info).result()

    # -- life ---------------------------------------------------------------------------

    def _session(self) -> Session:
        return self._opened._session()

    @property
    def variants(self) -> list[str]:
        """The variants' names, cheapest first (a request's ``variant`` is an index into
        this list, or one of its names)."""
        return [r.name for r in self._variants]

    @property
    def id(self) -> int | None:
        """The session's id on salusd."""
        return self._opened.id

    @property
    def client(self) -> Client:
        return self._opened.client

    def close(self) -> None:
        """Ends serving: closes the session (requests not yet answered fail). Idempotent."""
        self._opened.close()

    def __enter__(self) -> "ServedModel":
        return self

    def __exit__(self, *exc) -> None:
        self._opened.__exit__(*exc)

    def __repr__(self) -> str:
        names = ", ".join(self.variants)
        return (f"<salus.serving.ServedModel {type(self.model).__name__} session {self.id}, "
                f"batch sizes {self.batch_sizes}, variants: {names}>")
