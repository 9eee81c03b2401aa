"""Tracing a PyTorch training step or forward pass into a Core ATen FX graph.

This module owns the recipe that turns a model, a loss function and a ``torch.optim``
optimizer into one pure function ``step(params, buffers, opt_state, *batch) ->
(new_params, new_buffers, new_opt_state, loss)`` and records it, with every mutation
removed and every op decomposed to Core ATen, as an FX graph:

- the model runs through ``torch.func.functional_call`` with the buffers cloned inside the
  loss function (batch norm writes to them) and returned as auxiliary output;
- gradients come from ``torch.func.grad_and_value(..., has_aux=True)``;
- the optimizer update is the plain tensor math of :mod:`salus.optim`;
- ``make_fx(functionalize(step, remove="mutations"), decomposition_table=...)`` records it
  inside the python dispatcher (so batch norm's hidden running-stat mutation is seen) and
  with scaled-dot-product attention kept whole as one fused op each way (PyTorch's flash
  CPU op without dropout, its efficient op with dropout: :mod:`salus.attention`), else on
  the MATH backend;
- every module's ``inplace`` flag is off while tracing, and dead code is removed after;
- forward hooks (and autograd pre-hooks for the backward) record which module each node
  comes from, for error messages and ``Node.source``;
- under CPU autocast (``autocast=``, or the user's own block in ``loss_of``) the casts
  autocast inserts are recorded like any op, and a ``torch.amp.GradScaler``'s loss scaling
  becomes part of the step (:mod:`salus.amp`).

A forward pass (:func:`trace_inference`) is recorded the same way, under ``vjp`` so that
modules updating buffers are functionalized as in a training step.

The result, :class:`TracedStep`, keeps the FX graph together with what each flat input
and output is (parameter, buffer, optimizer state, batch element; update, loss, model
output) and the initial values of the persistent tensors. ``TracedStep.run`` executes the
graph itself (for parity tests); ``TracedStep.to_graph`` lowers it with
:mod:`salus.lower`. Shapes and dtypes are those of the example batch and fixed in the
graph; the optimizer's hyperparameters are persistent tensors the graph reads (see
:mod:`salus.optim`).
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import math
import operator
import re
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import amp
from .amp import FunctionalScaler
from .attention import efficient_attention_on_cpu
from .checks import value_checks_in_the_graph
from .rules.recurrent import packed_sequences_in_the_graph
from .inner_gradients import inner_gradients
from .selections import selections_in_the_graph
from .sparse import SparseUse, check_sparse_gradients, is_sparse, sparse_products_in_the_graph
from .spectral import spectra_in_the_graph
from .batch_norm import cumulative_averages
from .checkpointing import plain_checkpoints
from .decompositions import composite_decompositions, decomposition_table
from .draws import DecidedDraws, python_draws_refused
from .inference_paths import inference_paths
from .errors import SalusError, TraceError, in_user_code, user_location
from .lower import MODULE_META, RANDOM_OPS, graph_ops, lower, op_name
from .optim import FunctionalOptimizer, functional_optimizer

aten = torch.ops.aten

# Roles of flat graph inputs, as the IR names them.
PARAMETER = "parameter"
STATE = "state"
FEED = "feed"

#: The persistent tensor holding a session's random generator state, present when the
#: step draws random numbers (dropout): an i64 scalar the step advances by one, so every
#: iteration draws new values and a checkpoint captures the generator.
GENERATOR = "salus.generator"

#: Held while ``make_fx`` records a step: it patches process-wide state, so two threads
#: tracing at once (sessions opened from several threads) would corrupt each other.
TRACE_LOCK = threading.RLock()


_TRACING = threading.local()


def tracing_now() -> bool:
    """Whether this thread is tracing a step (the model's forward may run for it)."""
    return getattr(_TRACING, "depth", 0) > 0


def _traces(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _TRACING.depth -= 1
    return traced


@contextlib.contextmanager
def recording(tracing_mode: str) -> Iterator[None]:
    """What ``make_fx`` records a step under: :data:`TRACE_LOCK`, and in real mode one
    fake tensor mode for the whole trace. ``make_fx`` describes each recorded real value by
    a fake tensor and, finding no fake mode about, builds a new one for every value (a
    third of a large real trace's time); one shared mode describes them the same way."""
    with TRACE_LOCK:
        if tracing_mode != "real":
            yield
            return
        shared = TracingContext(FakeTensorMode(allow_fallback_kernels=True))
        with tracing(shared):
            yield


#: The ``group`` of the optimizer's hyperparameter tensors: persistent, read by the step,
#: never updated by it (the session writes them when the torch optimizer's change).
HYPERPARAMETER = "hyperparameter"


@dataclass(frozen=True)
class InputSlot:
    """What one placeholder of the graph is.

    ``group`` says where the value lives on the PyTorch side: ``"param"``, ``"buffer"``,
    ``"optimizer"`` (state), ``"hyperparameter"`` (a ``param_groups`` value) or
    ``"batch"``; ``role`` is the IR role (parameter, state, feed).
    """

    name: str
    role: str
    group: str


@dataclass(frozen=True)
class OutputSlot:
    """What one output of the graph is: ``"update"`` of the persistent tensor ``name``,
    the ``"loss"``, or a model ``"output"`` (``name`` = ``output.<i>``)."""

    kind: str
    name: str


def float32_precision() -> dict[str, bool]:
    """Whether PyTorch would run f32 convolutions and matrix products on TF32 tensor cores
    now: ``torch.backends.cudnn.allow_tf32`` (default True) and
    ``torch.backends.cuda.matmul.allow_tf32``, which ``torch.set_float32_matmul_precision``
    also sets (default "highest": False). The graph carries both, and salusd's GPU
    computes f32 with TF32 exactly where PyTorch would."""
    with warnings.catch_warnings():
        # Newer PyTorch steers toward `fp32_precision`; the flags still tell.
        warnings.simplefilter("ignore")
        conv = bool(torch.backends.cudnn.allow_tf32)
        matmul = bool(torch.backends.cuda.matmul.allow_tf32
                      or torch.get_float32_matmul_precision() != "highest")
    return {"conv_allow_tf32": conv, "matmul_allow_tf32": matmul}


@dataclass
class TracedStep:
    """A traced training step (``kind == "train"``) or forward pass (``"inference"``)."""

    kind: str
    graph_module: torch.fx.GraphModule
    inputs: list[InputSlot]
    outputs: list[OutputSlot]
    initial_state: dict[str, torch.Tensor]
    optimizer: dict | None = None
    # The optimizer's update rule (a training step): what the session asks for the
    # hyperparameters before each step and how state goes back to the torch optimizer.
    rule: FunctionalOptimizer | None = field(default=None, repr=False)
    # The GradScaler's loss scaling (a training step with a scaler): checked before each
    # step, its state given back to the torch scaler.
    scaler: FunctionalScaler | None = field(default=None, repr=False)
    # The dtype the forward was traced under CPU autocast with (None: none).
    autocast: torch.dtype | None = None
    output_spec: pytree.TreeSpec | None = field(default=None, repr=False)
    # Random numbers the client draws for each step from seeds it keeps
    # (:class:`salus.hlo.draws.Draws`), fed after the batch (``random.<k>``).
    draws: Any = field(default=None, repr=False)
    # The structure of a batch (a training step): feeds are its leaves, in pytree order.
    batch_spec: pytree.TreeSpec | None = field(default=None, repr=False)
    # Whether f32 convolutions and matrix products may use TF32, as PyTorch was set when
    # the step was traced (see :func:`float32_precision`).
    precision: dict[str, bool] = field(default_factory=lambda: float32_precision())
    # Parameters of modules outside the model that the step reads, kept as session
    # state (see :func:`_captured_parameters_as_state`).
    captured: list["Captured"] = field(default_factory=list, repr=False)

    def check_constants(self) -> None:
        """Refuses to go on after a tensor the step captured as a constant (a plain
        tensor of the user's, not a parameter) was changed in place: the graph holds its
        value as traced."""
        changed = [t for t, version in
                   self.graph_module.meta.get("salus_constants", {}).values()
                   if t._version != version]
        if changed:
            shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                               for t in changed[:3])
            raise SalusError(
                f"a tensor the step captures from outside the model ({shapes}) changed in "
                "place since the step was traced, and the traced graph holds the value it "
                "had then: register it as a buffer of the model (module.register_buffer), "
                "make it an nn.Parameter of a module (followed as it changes), or pass it "
                "in the batch")

    def changed_captures(self) -> dict[str, torch.Tensor]:
        """The captured parameters changed in place since their values were last taken
        (traced, or returned here): their new values, which the session writes before
        the step, as eager PyTorch would read them."""
        changed = {}
        for capture in self.captured:
            if capture.changed:
                capture.taken = capture.tensor._version
                changed[capture.name] = capture.tensor.detach().clone()
        return changed

    def resend_captures(self) -> None:
        """The next :meth:`changed_captures` returns every captured parameter (after the
        session's tensors were overwritten)."""
        for capture in self.captured:
            capture.taken = None

    @property
    def state_names(self) -> list[str]:
        """Names of the persistent tensors (parameters, buffers, optimizer state)."""
        return [s.name for s in self.inputs if s.role != FEED]

    @property
    def feed_names(self) -> list[str]:
        return [s.name for s in self.inputs if s.role == FEED]

    @property
    def batch_feeds(self) -> int:
        """How many feeds come from the batch (the first ones; drawn random numbers
        follow them)."""
        return len(self.feed_names) - (len(self.draws.fed) if self.draws is not None else 0)

    def ops(self) -> list[str]:
        """The distinct ops of the graph, named as the lowering emits them."""
        return graph_ops(self.graph_module)

    def run(self, state: dict[str, torch.Tensor], *batch: torch.Tensor):
        """Executes the FX graph once: ``(new_state, loss)`` for a training step,
        ``(new_state, output)`` for a forward pass. ``state`` maps every name of
        :attr:`state_names` to a tensor; entries without an update carry over."""
        feeds = self.feed_names
        if self.batch_spec is not None:
            batch = tuple(pytree.tree_leaves(tuple(batch)))
        if len(batch) != len(feeds):
            raise ValueError(f"expected {len(feeds)} batch tensors, got {len(batch)}")
        given = dict(zip(feeds, batch))
        missing = [n for n in self.state_names if n not in state]
        if missing:
            raise KeyError(f"state lacks {', '.join(missing)}")
        args = [state[s.name] if s.role != FEED else given[s.name] for s in self.inputs]
        with torch.no_grad(), efficient_attention_on_cpu():
            results = self.graph_module(*args)
        new_state = {n: state[n] for n in self.state_names}
        loss, outputs = None, []
        for slot, value in zip(self.outputs, results):
            if slot.kind == "update":
                new_state[slot.name] = value
            elif slot.kind == "loss":
                loss = value
            else:
                outputs.append(value)
        if self.kind == "train":
            if self.output_spec is not None:  # the loss function's auxiliary outputs
                return new_state, (loss, pytree.tree_unflatten(outputs, self.output_spec))
            return new_state, loss
        return new_state, pytree.tree_unflatten(outputs, self.output_spec)

    def to_graph(self):
        """Lowers the graph to a ``salus.v1.Graph`` message (see :mod:`salus.lower`)."""
        return lower(self)


# ---------------------------------------------------------------------------------------
# Tracing


@contextlib.contextmanager
def _inplace_off(model: torch.nn.Module) -> Iterator[None]:
    switched = [m for m in model.modules() if getattr(m, "inplace", None) is True]
    for m in switched:
        m.inplace = False
    try:
        yield
    finally:
        for m in switched:
            m.inplace = True


def _holds_tensors(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, dict) and any(isinstance(v, torch.Tensor)
                                           for v in value.values())


@contextlib.contextmanager
def _plain_attributes_kept(model: torch.nn.Module) -> Iterator[None]:
    """Gives each module back the plain attributes (neither parameters nor buffers) that
    hold tensors as they were before the step recorded. A forward that stores a tensor on
    its module (the weight ``torch.nn.utils.weight_norm``'s hook computes, a cache, the
    last attention map) stores one of the recording's, which is of no use outside it:
    ``torch.save(model)`` fails on it and the next recording would read it."""
    before = [(m, dict(vars(m))) for m in model.modules()]
    try:
        yield
    finally:
        missing = object()
        for module, attributes in before:
            for key, value in list(vars(module).items()):
                old = attributes.get(key, missing)
                if value is old or not _holds_tensors(value):
                    continue
                if old is missing:
                    delattr(module, key)
                else:
                    setattr(module, key, old)


@contextlib.contextmanager
def _training_mode(model: torch.nn.Module, training: bool | None) -> Iterator[None]:
    if training is None:
        yield
        return
    saved = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@dataclass(frozen=True)
class Scope:
    """Where in the model a node comes from: the innermost module's path and type, and
    whether the node belongs to that module's backward pass. ``path == ""`` with an
    empty type is outside the model (loss, optimizer)."""

    path: str = ""
    type_name: str = ""
    backward: bool = False


OUTSIDE = Scope()


class _ModuleScopes:
    """Tags every FX node with the :class:`Scope` it was recorded in
    (``node.meta[MODULE_META]``), which :func:`salus.lower.node_source` reads.

    Forward hooks on the model's modules keep a stack of scopes; at each push and pop the
    nodes recorded since the previous event get the scope on top of the stack. When a
    module returns, the autograd nodes of its output (back to its inputs) get a pre-hook
    that makes the module the current scope while autograd runs them, so the backward
    ops are attributed to the module too. :meth:`label` names what runs outside the
    model (the loss, then the optimizer update).
    """

    active: "_ModuleScopes | None" = None

    def __init__(self, model: torch.nn.Module):
        self._paths = {m: Scope(path, type(m).__name__) for path, m in model.named_modules()}
        self._stack: list[Scope] = [OUTSIDE]
        self._backward: Scope | None = None
        self._tagged_grad_fns: set = set()
        self._last: torch.fx.Node | None = None
        self._handles: list = []
        #: The last exception that left a module while the step recorded, and the
        #: innermost module it left (named in what the tracer reports of it).
        self.failure: tuple[BaseException, Scope] | None = None

    def __enter__(self) -> "_ModuleScopes":
        for module in self._paths:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        _ModuleScopes.active = self
        return self

    def __exit__(self, *exc) -> None:
        _ModuleScopes.active = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._tagged_grad_fns.clear()

    @classmethod
    def label(cls, scope: Scope) -> None:
        """From now on, nodes recorded outside the model's modules get ``scope`` (the
        loss function, the optimizer)."""
        if cls.active is not None:
            cls.active._flush()
            cls.active._backward = None
            cls.active._stack[0] = scope

    def _enter(self, module, args):
        self._flush()
        self._stack.append(self._paths[module])

    def _exit(self, module, args, output):
        error = sys.exc_info()[1]
        if error is not None and (self.failure is None or self.failure[0] is not error):
            self.failure = (error, self._paths[module])  # (the innermost's hook runs first)
        self._flush()
        self._tag_backward(self._paths[module], args, output)
        self._stack.pop()

    def _tag_backward(self, scope: Scope, args, output) -> None:
        backward = Scope(scope.path, scope.type_name, backward=True)
        inputs = {t.grad_fn for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}
        pending = [t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        seen = set()
        while pending:
            fn = pending.pop()
            if fn is None or fn in inputs or fn in seen:
                continue
            seen.add(fn)
            if fn not in self._tagged_grad_fns:  # else an inner module's: keep its scope
                self._tagged_grad_fns.add(fn)
                self._handles.append(fn.register_prehook(
                    lambda grad_outputs, scope=backward: self._enter_backward(scope)))
            pending.extend(next_fn for next_fn, _ in fn.next_functions)

    def _enter_backward(self, scope: Scope) -> None:
        self._flush()
        self._backward = scope

    def _flush(self) -> None:
        mode = get_proxy_mode()
        if mode is None:
            return
        graph = mode.tracer.graph
        node = self._last.next if self._last is not None else graph._root.next
        scope = self._backward or self._stack[-1]
        while node.op != "root":
            node.meta.setdefault(MODULE_META, scope)
            self._last = node
            node = node.next


class _SavedContext:
    """What an old-style ``Function.forward(ctx, ...)`` leaves on its ``ctx``: saved
    tensors, attributes and non-differentiable outputs, replayed onto the real context
    by ``setup_context``."""

    _OWN = ("saved", "non_differentiable", "materialize", "outputs")

    def __init__(self):
        self.saved: tuple = ()
        self.non_differentiable: tuple = ()
        self.materialize: bool | None = None
        self.outputs: tuple = ()

    def save_for_backward(self, *tensors):
        self.saved = tensors

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable = tensors

    def mark_dirty(self, *tensors):
        raise TraceError("a custom torch.autograd.Function that changes its inputs in place "
                         "(ctx.mark_dirty) cannot be traced: return new tensors instead")

    def set_materialize_grads(self, value):
        self.materialize = value

    def replay(self, ctx, output) -> None:
        for name, value in vars(self).items():
            if name not in self._OWN:
                setattr(ctx, name, value)
        ctx.save_for_backward(*self.saved)
        if self.non_differentiable:
            marked = {id(t) for t in self.non_differentiable}
            ctx.mark_non_differentiable(*[o for o, raw in zip(_as_tuple(output), self.outputs)
                                          if id(raw) in marked])
        if self.materialize is not None:
            ctx.set_materialize_grads(self.materialize)


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


#: Old-style Functions' adapted twins, made once each.
_ADAPTED: dict[type, type] = {}


def _adapted(function: type) -> type:
    """A ``torch.func``-ready twin of an old-style ``torch.autograd.Function`` (one
    without ``setup_context``): its ``forward`` runs the original's on a recording
    context, which ``setup_context`` replays onto the real one (the two run in turn for
    each call, so a stack pairs them); ``backward`` is the original's."""
    if function in _ADAPTED:
        return _ADAPTED[function]
    pending: list[_SavedContext] = []

    def forward(*args):
        ctx = _SavedContext()
        out = function.forward(ctx, *args)
        ctx.outputs = _as_tuple(out)
        pending.append(ctx)
        return out

    def setup_context(ctx, inputs, output):
        pending.pop().replay(ctx, output)

    def backward(ctx, *grads):
        return function.backward(ctx, *grads)

    _ADAPTED[function] = type(function.__name__, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward), "__module__": function.__module__,
        "__qualname__": function.__qualname__})
    return _ADAPTED[function]


def _compiling() -> bool:
    return True


@contextlib.contextmanager
def _libraries_see_a_compiler() -> Iterator[None]:
    """Tells libraries that take trace-friendly paths under a compiler that one is
    tracing: Hugging Face transformers asks ``is_torchdynamo_compiling()`` before it reads
    a mask's values in Python (to drop an all-ones padding mask, to warn about padding),
    and under a compiler keeps the mask as tensor ops instead, which mean the same. While a
    step records, that function answers True in every transformers module that holds it,
    so its models trace with their default attention (SDPA, fused); the functions are put
    back after. Nothing changes where transformers is not imported."""
    patched = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "transformers" or name.startswith("transformers.")):
            continue
        original = getattr(module, "is_torchdynamo_compiling", None)
        if callable(original) and original is not _compiling:
            patched.append((module, original))
            module.is_torchdynamo_compiling = _compiling
    try:
        yield
    finally:
        for module, original in patched:
            module.is_torchdynamo_compiling = original


@contextlib.contextmanager
def _compiled_code_as_written() -> Iterator[None]:
    """Lets modules and functions wrapped by ``torch.compile`` record as the code they
    wrap: compiling is how eager PyTorch would run them, not what they compute, and
    salus plans and runs the step itself. (A compiled model's parameters keep their
    ``_orig_mod.`` names, as its ``state_dict`` has them.)"""
    try:
        from torch._dynamo import config
        patch = config.patch(error_on_nested_fx_trace=False)
    except (ImportError, AttributeError, RuntimeError):
        patch = contextlib.nullcontext()
    with patch:
        yield


@contextlib.contextmanager
def _custom_functions() -> Iterator[None]:
    """Lets the step's custom ``torch.autograd.Function``s trace: their backward is the
    user's, recorded when the gradient is taken. ``torch.func``'s functionalization has
    no rule for them; under it a Function's ``forward`` runs as the ops it is (the grad
    transform above has already set up the backward). An old-style Function (``forward(ctx,
    ...)``, no ``setup_context``) is applied as its adapted twin (``_adapted``). Where
    PyTorch's internals differ from these, nothing changes and such a Function is refused
    by name (``_custom_function``)."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.autograd_function import custom_function_call
        table = custom_function_call.functorch_table
        rule = table[TransformType.Functionalize]
        original = torch.autograd.Function.__dict__["apply"]
        base_setup = torch.autograd.function._SingleLevelFunction.setup_context
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def functionalized(interpreter, autograd_function, *operands, **kwargs):
        return autograd_function.forward(*operands, **kwargs)

    def apply(cls, *args, **kwargs):
        if (torch._C._are_functorch_transforms_active()
                and cls.setup_context is base_setup
                and not cls.__module__.startswith("torch.")):
            cls = _adapted(cls)
        return original.__get__(None, cls)(*args, **kwargs)

    table[TransformType.Functionalize] = functionalized
    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original
        table[TransformType.Functionalize] = rule


_READS_A_VALUE = "the step reads a tensor's value in Python"


def _record(fn: Callable, args: Sequence[torch.Tensor], model: torch.nn.Module,
            tracing_mode: str) -> torch.fx.GraphModule:
    # In fake mode, tensors the model captures (not parameters or buffers) stay real
    # and become constants of the graph.
    try:
        gm = _record_once(fn, args, model, tracing_mode, contextlib.nullcontext())
    except TraceError as error:
        if not str(error).startswith(_READS_A_VALUE):
            raise
        # Perhaps the positions of a mask from the batch, iterated or counted (a mixture
        # of experts routing tokens): recorded again with them kept as every position
        # and the mask (salus.positions), which refuses what it cannot follow.
        try:
            return _record_once(fn, args, model, tracing_mode, selections_in_the_graph())
        except TraceError as again:
            if str(again).startswith(_READS_A_VALUE):
                raise error from None
            raise
        except Exception:  # what the positions did not cover: the first error says it
            raise error from None
    from .lower import _selects_by_mask
    if any(_selects_by_mask(n) for n in gm.graph.nodes):
        # A selection by a mask from the batch: recorded again with the selection kept
        # as all rows and the mask (salus.selections), which refuses what it cannot follow.
        gm = _record_once(fn, args, model, tracing_mode, selections_in_the_graph())
    return gm


def _record_once(fn: Callable, args: Sequence[torch.Tensor], model: torch.nn.Module,
                 tracing_mode: str, selections) -> torch.fx.GraphModule:
    traced = make_fx(torch.func.functionalize(fn, remove="mutations"),
                     decomposition_table=decomposition_table(), tracing_mode=tracing_mode,
                     _allow_non_fake_inputs=tracing_mode == "fake", record_stack_traces=True)
    with (recording(tracing_mode), _custom_functions(), _libraries_see_a_compiler(),
          _inplace_off(model), _plain_attributes_kept(model),
          _ModuleScopes(model), enable_python_dispatcher(), composite_decompositions(),
          efficient_attention_on_cpu(),
          sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]), amp.tracing(),
          DecidedDraws(), python_draws_refused(), plain_checkpoints(),
          cumulative_averages(), _compiled_code_as_written(),
          _stand_ins(selections) as sparse):
        try:
            gm = traced(*args)
        except RuntimeError as error:
            function = _custom_function(error)
            if function is not None:
                raise TraceError(
                    f"the step calls a custom torch.autograd.Function, {function}"
                    f"{_user_frame(error.__traceback__)}: salus records the step and its "
                    "backward through torch.func, which cannot run a hand-written backward "
                    "here; write the forward with tensor ops and let autograd derive the "
                    "gradient (a straight-through estimator is x + (f(x) - x).detach(), a "
                    "gradient reversal by a is (1 + a) * x.detach() - a * x)") from None
            if "mutating a non-functional tensor with a functional tensor" in str(error):
                raise TraceError(
                    "the step gives a tensor it captures from outside (a global, or a "
                    "plain attribute that is neither a parameter nor a buffer) to an op "
                    "that changes an intermediate of it in place"
                    f"{_user_frame(error.__traceback__)}, which PyTorch's functionalization "
                    "cannot record; register the tensor as a buffer "
                    "(module.register_buffer), or pass it in the batch") from None
            if "salus.spectral.Complex" in str(error):
                from .spectral import _refuse as refuse_complex
                refuse_complex("returns (or gives PyTorch's internals)")
            if "salus.selections.Selection" in str(error):
                from .selections import _refuse
                _refuse("returns (or gives PyTorch's internals)")
            if "being transformed by a functorch transform" in str(error):
                raise TraceError(
                    "the step uses autograd inside the loss in a way salus cannot follow"
                    f"{_user_frame(error.__traceback__)}: salus records the step's own "
                    "gradient with torch.func, inside which PyTorch does not allow it "
                    "(torch.autograd.functional, ...). A gradient penalty's "
                    "x = x.requires_grad_() and torch.autograd.grad(..., create_graph=True) "
                    "are followed; or take the inner gradient with torch.func: "
                    "grad = torch.func.grad(lambda x: critic(x).sum())(x_hat)") from None
            if "would mutate a captured Tensor" in str(error):
                raise TraceError(
                    "the step changes in place a tensor it does not train (a frozen "
                    "parameter, a buffer outside the model's, a global)"
                    f"{_user_frame(error.__traceback__)}, which PyTorch's gradient "
                    "transform cannot record (an nn.Embedding with max_norm rescales its "
                    "weight so: train the weight, or drop max_norm)") from None
            if "_local_scalar_dense" not in str(error) and "tolist()" not in str(error):
                raise
            raise TraceError(
                f"{_READS_A_VALUE} (data-dependent control flow or "
                f"a .item()/bool()/.tolist() of a tensor){_user_frame(error.__traceback__)}"
                f"{_failed_module(error)}: salus "
                "traces one fixed graph per batch shape and cannot follow a branch taken on "
                "values; compute it with tensor ops (torch.where), or pass the value in") from None
    _kernel_dtypes(gm)
    # Captured tensors as recorded, before folding computes new constants from them.
    gm.meta["salus_constants"] = {
        id(value): (value, value._version) for node in gm.graph.nodes
        if node.op == "get_attr" and not _captured_parameter(node)
        for value in [_attribute(gm, node)]
        if isinstance(value, torch.Tensor)}
    gm.meta["salus_constants"].update((id(t), (t, t._version)) for t in sparse.captured)
    gm.meta["salus_sparse_gradients"] = sparse.sparse_gradients
    return tidy(gm)


@contextlib.contextmanager
def _stand_ins(selections) -> Iterator[SparseUse]:
    """While a step records, what PyTorch computes from values (checks, packed sequences'
    lengths, selections by masks) is kept in the graph, and complex and sparse tensors by
    their dense parts. Yields what the step met of sparse tensors."""
    with (value_checks_in_the_graph(), packed_sequences_in_the_graph(), selections,
          spectra_in_the_graph(), sparse_products_in_the_graph() as sparse):
        yield sparse


def _kernel_dtypes(gm: torch.fx.GraphModule) -> None:
    """Makes recorded values carry the dtypes the kernels give where PyTorch's meta
    kernels (what fake tensors run) differ: training-mode batch norm with a 16-bit input
    and f32 per-channel tensors (as under autocast) saves its statistics in f32 on every
    device, but its meta kernel gives them the input's dtype."""
    for node in gm.graph.nodes:
        if node.target is not aten._native_batch_norm_legit_functional.default:
            continue
        stats = node.args[3].meta["val"].dtype  # running_mean: always there when whole
        values = list(node.meta["val"])
        if all(values[i].dtype == stats for i in (1, 2)):
            continue
        for i in (1, 2):
            values[i] = values[i].to(stats)
        node.meta["val"] = tuple(values)
        for user in node.users:
            if user.target is operator.getitem and user.args[1] in (1, 2):
                user.meta["val"] = values[user.args[1]]


def tidy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A recorded graph made ready to lower: layout-only ops rewritten, dead nodes gone,
    input-free computations folded into constants; raises :class:`TraceError` if a
    mutation survived."""
    _drop_layouts(gm)
    _drop_legacy_empty_cat_inputs(gm)
    gm.graph.eliminate_dead_code()
    _fold_constants(gm)
    _constant_masks_as_positions(gm)
    gm.graph.eliminate_dead_code()
    _drop_write_backs(gm)
    gm.recompile()
    _check_no_mutation(gm)
    return gm


def _constant_masks_as_positions(gm: torch.fx.GraphModule) -> None:
    """A selection by a boolean mask computed from constants of the graph alone (a node
    mask the step captures, as a graph network's ``out[train_mask]``, or its complement),
    in ``index.Tensor`` and its gradient's ``index_put``, becomes the selection of the
    mask's true positions, found once at trace time: the same elements in the same order,
    a fixed shape. A mask computed from the batch stays, and the lowering refuses it."""
    graph = gm.graph
    constants, evaluate = _constant_nodes(graph), _evaluator(gm)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.index.Tensor,
                                                             aten.index_put.default):
            continue
        with torch.no_grad():
            masks = [evaluate(i) if _is_mask(i) and constants.get(i) else None
                     for i in node.args[1]]
        if all(m is None for m in masks):
            continue
        replaced = []
        for index, mask in zip(node.args[1], masks):
            if mask is None:
                replaced.append(index)
                continue
            for positions in mask.nonzero(as_tuple=True):
                name = f"_mask_positions_{len(list(gm.buffers()))}"
                gm.register_buffer(name, positions.clone())
                with graph.inserting_before(node):
                    constant = graph.get_attr(name)
                constant.meta["val"] = positions
                replaced.append(constant)
        node.args = (node.args[0], replaced, *node.args[2:])


def _is_mask(index) -> bool:
    return (isinstance(index, torch.fx.Node)
            and getattr(index.meta.get("val"), "dtype", None) == torch.bool)


def _drop_write_backs(gm: torch.fx.GraphModule) -> None:
    """Removes functionalization's write-backs into the graph's inputs (``copy_`` of a
    changed value into a placeholder, used by nothing): a step that changes a parameter
    in place (``nn.Embedding(max_norm=...)`` rescaling the rows it looks up) reads the
    changed value from then on, and its update output, computed after, carries it; a
    changed batch is the caller's, which salus does not give back."""
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is aten.copy_.default
                and node.args[0].op == "placeholder" and not node.users):
            gm.graph.erase_node(node)


def _custom_function(error: RuntimeError) -> str | None:
    """The user's ``torch.autograd.Function`` whose ``apply`` raised ``error`` under the
    step's transforms (old-style ones, without ``setup_context``, and new-style ones
    alike) as ``module.Class``, or None for any other error. ``apply`` is C++ in recent
    PyTorch, so the class is read off the innermost user line's ``X.apply(``."""
    text = str(error)
    if "setup_context" not in text and "custom_function_call" not in text:
        return None
    frames = [(f, line) for f, line in traceback.walk_tb(error.__traceback__)
              if in_user_code(f.f_code.co_filename)]
    if not frames:
        return "(unnamed)"
    frame, line = frames[-1]
    source = linecache.getline(frame.f_code.co_filename, line)
    for dotted in re.findall(r"([A-Za-z_][\w.]*)\.apply\(", source):
        head, *rest = dotted.split(".")
        obj = frame.f_locals.get(head, frame.f_globals.get(head))
        for part in rest:
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            return f"{obj.__module__}.{obj.__qualname__}"
    return "(unnamed)"


def _failed_module(error: BaseException) -> str:
    """' in module PATH (TYPE)' of the innermost module ``error`` left while the step
    recorded, if any: where a library's code (torch's own modules) failed."""
    failure = _ModuleScopes.active.failure if _ModuleScopes.active is not None else None
    if failure is None or failure[0] is not error:
        return ""
    scope = failure[1]
    return f" in module {scope.path or '(the model)'} ({scope.type_name})"


def _user_frame(tb) -> str:
    """' at FILE:LINE' of the innermost frame of ``tb`` outside torch and salus, if any."""
    return user_location((f.f_code.co_filename, line) for f, line in traceback.walk_tb(tb))


def _drop_legacy_empty_cat_inputs(gm: torch.fx.GraphModule) -> None:
    """``torch.cat`` skips 1-d empty tensors among tensors of higher rank (a legacy rule
    caches rely on: a key-value cache starts as ``torch.tensor([])``); the IR's ``cat``
    takes tensors of one rank, so they leave the graph here."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        tensors = node.args[0]
        shapes = [getattr(t.meta.get("val"), "shape", None) for t in tensors]
        if not any(shape is not None and len(shape) > 1 for shape in shapes):
            continue
        kept = [t for t, shape in zip(tensors, shapes)
                if not (shape is not None and tuple(shape) == (0,))]
        if kept and len(kept) < len(tensors):
            node.args = (kept, *node.args[1:])


#: The largest result (elements) a constant computation is folded into a constant of.
_FOLD_LIMIT = 1 << 20


def _fold_constants(gm: torch.fx.GraphModule) -> None:
    """Evaluates once, at trace time, the computations that depend on no input and use an
    op the IR lacks (masks and index tables built from shapes alone, e.g. shifted-window
    attention's), and makes their results constants of the graph. They are the same at
    every iteration, so nothing is lost; computations that depend on an input, draw
    random numbers, or give more than ``_FOLD_LIMIT`` elements stay, and the lowering
    names an op the IR lacks. A dtype the IR lacks counts as such an op."""
    from .lower import DTYPES, LoweringError, _ir_op, _unsupported_reason

    def unsupported(node: torch.fx.Node) -> bool:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype not in DTYPES:
            return True  # torch.eye's index ranges in uint8 (PyTorch 2.15)
        try:
            name, overload = _ir_op(node)
        except LoweringError:
            return True
        return _unsupported_reason(name, overload or node.target) is not None

    graph = gm.graph
    constant = _constant_nodes(graph)
    roots = [n for n in graph.nodes if constant.get(n) and n.op == "call_function"
             and any(not constant.get(u, False) for u in n.users)]
    evaluate = _evaluator(gm)

    for index, root in enumerate(roots):
        ancestors, stack = set(), [root]
        while stack:
            n = stack.pop()
            if n not in ancestors and n.op == "call_function":
                ancestors.add(n)
                stack.extend(n.all_input_nodes)
        if not any(unsupported(n) for n in ancestors):
            continue
        try:
            with torch.no_grad():
                value = evaluate(root)
        except Exception:  # noqa: BLE001  (left for the lowering to name)
            continue
        if not isinstance(value, torch.Tensor) or value.numel() > _FOLD_LIMIT:
            continue
        name = f"_folded_{index}"
        gm.register_buffer(name, value.detach().clone())
        with graph.inserting_before(root):
            folded = graph.get_attr(name)
        folded.meta["val"] = root.meta.get("val")
        root.replace_all_uses_with(folded)


def _constant_nodes(graph: torch.fx.Graph) -> dict[torch.fx.Node, bool]:
    """Whether each node depends on constants of the graph alone: no input, no random
    draw, no op that changes its input."""
    constant: dict[torch.fx.Node, bool] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            constant[node] = not _captured_parameter(node)
        elif node.op == "call_function":
            inputs = node.all_input_nodes
            constant[node] = (all(constant.get(n, False) for n in inputs)
                              and not node.target._schema.is_mutable
                              if isinstance(node.target, torch._ops.OpOverload)
                              else all(constant.get(n, False) for n in inputs))
            if node.target is aten.bernoulli.p or "rand" in str(node.target):
                constant[node] = False
        else:
            constant[node] = False
    return constant


def _attribute(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """The module attribute a ``get_attr`` node reads (a dotted path)."""
    return functools.reduce(getattr, str(node.target).split("."), gm)


def _evaluator(gm: torch.fx.GraphModule) -> Callable[[torch.fx.Node], object]:
    """Computes a constant node's value now (remembering each node's)."""
    values: dict[torch.fx.Node, object] = {}

    def evaluate(node: torch.fx.Node):
        if node in values:
            return values[node]
        if node.op == "get_attr":
            value = _attribute(gm, node)
        else:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), evaluate)
            value = node.target(*args, **kwargs)
        values[node] = value
        return value
    return evaluate


def _dense_in_order(shape, stride) -> bool:
    """Whether a strided view of ``shape`` with ``stride`` (offset 0) reads its elements
    in row-major order from a dense block: strides of dimensions longer than 1 are the
    contiguous ones. Such a view only relabels memory layout, which the IR has not."""
    expected = 1
    for size, step in reversed(list(zip(shape, stride))):
        if size > 1 and step != expected:
            return False
        expected *= size
    return True


def _row_major(node: torch.fx.Node) -> bool:
    """Whether the traced tensor of ``node`` is row-major from the start of its storage,
    so that a strided view's offsets into its storage are offsets into the IR's tensor."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous() and val.storage_offset() == 0


def _call(graph: torch.fx.Graph, op, args: tuple, val: torch.Tensor) -> torch.fx.Node:
    new = graph.call_function(op, args)
    new.meta["val"] = val
    return new


def _as_block(graph: torch.fx.Graph, node: torch.fx.Node, source: torch.fx.Node,
              offset: int) -> None:
    """``as_strided`` reading a dense block of a row-major tensor (``qkv_bias[n:2 * n]``
    written through a view) as a slice of the flattened tensor, viewed to the shape."""
    val, whole = node.meta["val"], source.meta["val"]
    if not _row_major(source) or offset + val.numel() > whole.numel():
        return
    with graph.inserting_before(node):
        flat = _call(graph, aten.view.default, (source, [whole.numel()]), whole.reshape(-1))
        part = _call(graph, aten.slice.Tensor, (flat, 0, offset, offset + val.numel()),
                     whole.reshape(-1)[offset:offset + val.numel()])
        view = _call(graph, aten.view.default, (part, list(val.shape)), val)
    node.replace_all_uses_with(view)


def _as_block_scatter(graph: torch.fx.Graph, node: torch.fx.Node, base: torch.fx.Node,
                      src: torch.fx.Node, offset: int) -> None:
    """``as_strided_scatter`` writing a dense block of a row-major tensor: the flattened
    tensor's elements before the block, the block's, and those after it, concatenated."""
    val, whole, block = node.meta["val"], base.meta["val"], src.meta["val"]
    n, total = block.numel(), whole.numel()
    if not _row_major(base) or block.dtype != whole.dtype or offset + n > total:
        return
    flat_val = whole.reshape(-1)
    with graph.inserting_before(node):
        flat = _call(graph, aten.view.default, (base, [total]), flat_val)
        pieces = []
        if offset > 0:
            pieces.append(_call(graph, aten.slice.Tensor, (flat, 0, 0, offset),
                                flat_val[:offset]))
        pieces.append(_call(graph, aten.view.default, (src, [n]), block.reshape(-1)))
        if offset + n < total:
            pieces.append(_call(graph, aten.slice.Tensor, (flat, 0, offset + n, total),
                                flat_val[offset + n:]))
        joined = pieces[0] if len(pieces) == 1 else _call(graph, aten.cat.default,
                                                           (pieces, 0), flat_val)
        view = _call(graph, aten.view.default, (joined, list(val.shape)), val)
    node.replace_all_uses_with(view)


def _drop_layouts(gm: torch.fx.GraphModule) -> None:
    """Rewrites the layout-only ops functionalization leaves (a composite that restrides
    its result for channels-last memory, and that view's update in the backward) into
    what they compute on row-major tensors: ``as_strided`` and ``as_strided_scatter`` of
    a whole tensor in row-major order become a ``view``, of a dense block of a row-major
    tensor a slice and a concatenation (:func:`_as_block`), ``copy`` the source cast and
    expanded to the destination, ``alias`` and ``lift_fresh_copy`` their input. Anything
    else stays, and the lowering names it."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        target = node.target
        if target in (aten.alias.default, aten.lift_fresh_copy.default):
            # A copy of a constant (a tensor made from numbers in the step): the graph's
            # values are never changed in place, so the constant itself.
            node.replace_all_uses_with(node.args[0])
            continue
        if target is aten.as_strided.default:
            source, size, stride = node.args[:3]
            offset = node.args[3] if len(node.args) > 3 else 0
            whole = source.meta["val"].numel() == val.numel()
            if not _dense_in_order(size, stride):
                continue
            if offset or not whole:
                _as_block(graph, node, source, offset)
                continue
            replacement = (source, size)
        elif target is aten.as_strided_scatter.default:
            base, src, size, stride = node.args[:4]
            offset = node.args[4] if len(node.args) > 4 else 0
            if not _dense_in_order(size, stride):
                continue
            if offset or base.meta["val"].numel() != src.meta["val"].numel():
                _as_block_scatter(graph, node, base, src, offset)
                continue
            replacement = (src, list(val.shape))
        elif target is aten.copy.default:
            dst, src = node.args[:2]
            with graph.inserting_before(node):
                value = src
                if src.meta["val"].dtype != val.dtype:
                    value = graph.call_function(aten._to_copy.default, (src,),
                                                {"dtype": val.dtype})
                    value.meta["val"] = src.meta["val"].to(val.dtype)
                if tuple(src.meta["val"].shape) != tuple(val.shape):
                    value = graph.call_function(aten.expand.default,
                                                (value, list(val.shape)))
                    value.meta["val"] = val
            node.replace_all_uses_with(value)
            continue
        else:
            continue
        source, shape = replacement
        if tuple(source.meta["val"].shape) == tuple(shape):
            node.replace_all_uses_with(source)
            continue
        with graph.inserting_before(node):
            view = graph.call_function(aten.view.default, (source, list(shape)))
        view.meta["val"] = val
        node.replace_all_uses_with(view)


def _check_no_mutation(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target._schema.is_mutable:
                raise TraceError(
                    f"node {node.name} ({node.target}) still mutates its input after "
                    "functionalization; the traced graph would be wrong")


def _detached(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in tensors.items()}


def _thread_generator(gm: torch.fx.GraphModule, inputs: list[InputSlot],
                      outputs: list[OutputSlot], initial: dict[str, torch.Tensor]) -> None:
    """Gives a step that draws random numbers its own generator state.

    The ops that draw (:data:`salus.lower.RANDOM_OPS`: ``bernoulli.p``, ``rand_like``,
    attention with dropout) read PyTorch's global generator when PyTorch runs them; salus
    devices draw from the session's generator instead (see ``docs/ops.md``). This adds that state
    as a persistent input (after the other persistent inputs), its update ``state + 1`` as
    an output, and seeds it from PyTorch's generator, so ``torch.manual_seed`` makes
    traces reproducible. The lowering passes the state to every node that draws.
    The FX graph still runs eagerly, drawing from PyTorch's generator as before.
    """
    graph = gm.graph
    if not any(n.op == "call_function" and op_name(n.target) in RANDOM_OPS
               for n in graph.nodes):
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    at = sum(1 for s in inputs if s.role != FEED)
    anchor = placeholders[at] if at < len(placeholders) else None
    example = torch.zeros((), dtype=torch.int64)
    with graph.inserting_before(anchor) if anchor is not None else graph.inserting_after(
            placeholders[-1]):
        state = graph.placeholder("salus_generator")
    state.meta["val"] = example
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        advanced = graph.call_function(torch.ops.aten.add.Scalar, (state, 1))
    advanced.meta["val"] = example
    results = list(output.args[0])
    updates = sum(1 for o in outputs if o.kind == "update")
    results.insert(updates, advanced)
    output.args = (tuple(results),)
    gm.recompile()
    inputs.insert(at, InputSlot(GENERATOR, STATE, "generator"))
    outputs.insert(updates, OutputSlot("update", GENERATOR))
    # Below 2**52: devices add integers through f64 arithmetic, exact only up to 2**53.
    initial[GENERATOR] = torch.randint(0, 2**52, (), dtype=torch.int64)


@dataclass(frozen=True)
class GradientRecipe:
    """What happens between the loss and the optimizer's update in one iteration.

    ``accumulate = k``: the batch is split along its first dimension into k micro-batches
    run one after another, each contributing the gradient of ``loss / k`` (as
    ``(loss / k).backward()`` per micro-batch in eager PyTorch); buffers (batch norm
    statistics) update after each. The iteration's loss is the mean of the k losses.
    ``clip_grad_norm``: then scale the gradients as
    ``torch.nn.utils.clip_grad_norm_(params, clip_grad_norm, norm_type)`` does;
    ``clip_grad_value``: clamp them as ``clip_grad_value_`` does (not both).
    """

    accumulate: int = 1
    clip_grad_norm: float | None = None
    norm_type: float = 2.0
    clip_grad_value: float | None = None

    def __post_init__(self):
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate must be a positive integer, not {self.accumulate!r}")
        if self.clip_grad_norm is not None and self.clip_grad_value is not None:
            raise ValueError("give clip_grad_norm or clip_grad_value, not both: the order "
                             "in which a loop applies them changes the result")
        for name in ("clip_grad_norm", "clip_grad_value"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")

    def micro_batches(self, batch: tuple, spec) -> list[tuple]:
        """The batch's k micro-batches (slices of every leaf's first dimension)."""
        k = self.accumulate
        if k == 1:
            return [batch]
        leaves, _ = pytree.tree_flatten(batch)
        for index, leaf in enumerate(leaves):
            if leaf.dim() == 0 or leaf.shape[0] % k:
                raise TraceError(
                    f"accumulate={k}: batch element {index} has shape {list(leaf.shape)}, "
                    f"whose first dimension does not split into {k} equal micro-batches")
        return [pytree.tree_unflatten(
                    [leaf[i * (leaf.shape[0] // k):(i + 1) * (leaf.shape[0] // k)]
                     for leaf in leaves], spec)
                for i in range(k)]

    def treat(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients after clipping."""
        if self.clip_grad_value is not None:
            v = float(self.clip_grad_value)
            return {n: torch.clamp(g, min=-v, max=v) for n, g in grads.items()}
        if self.clip_grad_norm is not None and grads:
            total = torch.nn.utils.get_total_norm(list(grads.values()), self.norm_type,
                                                  foreach=False)
            coef = torch.clamp(float(self.clip_grad_norm) / (total + 1e-6), max=1.0)
            return {n: g * coef for n, g in grads.items()}
        return grads


@_traces
def trace_train_step(model: torch.nn.Module,
                     loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                     optimizer: torch.optim.Optimizer, example_batch: Sequence[Any],
                     *, loss_of: Callable[..., torch.Tensor] | None = None,
                     gradients: GradientRecipe = GradientRecipe(),
                     tracing_mode: str = "real", autocast: torch.dtype | None = None,
                     scaler: "torch.amp.GradScaler | None" = None) -> TracedStep:
    """Traces one training iteration: forward and loss, backward, what ``gradients``
    says (accumulation, clipping), and ``optimizer``'s update.

    ``autocast`` (torch.bfloat16 or torch.float16): the forward and the loss run under
    ``torch.autocast("cpu", dtype=autocast)``, as a mixed-precision loop writes them; a
    ``loss_of`` may also enter CPU autocast itself. ``scaler``: a
    ``torch.amp.GradScaler`` whose dynamic loss scaling the step follows (the loss
    scaled before the backward, gradients unscaled and checked before clipping, the
    update skipped on inf/NaN, the scale updated; :mod:`salus.amp`).

    The loss is ``loss_fn(model(*inputs), target)`` with ``example_batch = (inputs...,
    target)``; or, with ``loss_fn=None``, ``loss_of(model, *example_batch)`` for any
    batch (tensors, or tuples, lists and dicts of them: a Hugging Face batch dict) and
    any loss the model's outputs give (several heads, auxiliary losses, ``.loss``).
    Either may return ``(loss, aux)`` instead, as ``torch.func.grad(has_aux=True)``
    takes it: ``aux`` (tensors, in tuples, lists and dicts) is computed by the step
    without a gradient and fetched with the loss (outputs for a metric, the hidden state
    truncated backpropagation through time carries to the next batch); with
    ``accumulate=k``, each of its tensors is stacked over the micro-batches.
    Shapes and dtypes of the batch are fixed in the graph. The model is traced in its
    current train/eval mode. The model, the optimizer and the batch are left unchanged.
    ``tracing_mode="fake"`` records with fake tensors (shapes only: faster for large
    models; the graph is the same).
    """
    batch = tuple(example_batch)
    if (loss_fn is None) == (loss_of is None):
        raise ValueError("give loss_fn (called as loss_fn(model(*inputs), target)) or "
                         "loss_of (called as loss_of(model, *batch)), not both")
    if loss_fn is not None and len(batch) < 2:
        raise ValueError("example_batch must be (inputs..., target): at least two tensors")
    leaves, batch_spec = pytree.tree_flatten(batch)
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TraceError(f"batch element {index} is a {type(leaf).__name__}, not a "
                             "tensor: a batch holds tensors (in tuples, lists or dicts)")
    autocast = amp.autocast_dtype(autocast)
    params = dict(model.named_parameters())
    buffers = _dense_buffers(model)
    opt = functional_optimizer(optimizer, params)
    scaling = FunctionalScaler.of(scaler, {n: params[n] for n in opt.params})
    opt_state = {**opt.initial_state(), **opt.hyperparameters(),
                 **(scaling.initial_state() if scaling else {})}
    opt_names = opt.state_names()
    hyper_names = opt.hyper_names()
    scaler_names = scaling.state_names() if scaling else []
    frozen = {n: t for n, t in params.items() if n not in opt.params}

    inputs = ([InputSlot(n, PARAMETER, "param") for n in params]
              + [InputSlot(n, STATE, "buffer") for n in buffers]
              + [InputSlot(n, STATE, "optimizer") for n in opt_names]
              + [InputSlot(n, STATE, HYPERPARAMETER) for n in hyper_names]
              + [InputSlot(n, STATE, "scaler") for n in scaler_names]
              + [InputSlot(f"input.{i}", FEED, "batch") for i in range(len(leaves))])
    outputs = ([OutputSlot("update", s.name) for s in inputs
                if s.role != FEED and s.group != HYPERPARAMETER]
               + [OutputSlot("loss", "loss")])
    counts = (len(params), len(buffers), len(opt_names) + len(hyper_names) + len(scaler_names))
    loss_name = loss_fn if loss_fn is not None else loss_of
    loss_scope = Scope("loss", getattr(loss_name, "__name__", type(loss_name).__name__))
    optimizer_scope = Scope("optimizer", type(optimizer).__name__)
    k = gradients.accumulate
    aux_spec: list = [None]  # the auxiliary outputs' structure, once recorded
    hooks = _gradient_hooks(model, {n: params[n] for n in opt.params})

    def step(*flat):
        p, b, o, data = _split(flat, counts,
                               (params, buffers, opt_names + hyper_names + scaler_names))
        trained = {n: p[n] for n in opt.params}
        fixed = {n: p[n] for n in frozen}
        micro = gradients.micro_batches(pytree.tree_unflatten(list(data), batch_spec),
                                        batch_spec)
        total, losses, auxes, current, reached = None, [], [], b, set()
        for part in micro:
            def loss_and_buffers(trained_params, part=part, current=current):
                new_buffers = {n: t.clone() for n, t in current.items()}
                state = (trained_params, fixed, new_buffers)
                with amp.autocast(autocast), inner_gradients() as results:
                    if loss_fn is not None:
                        *xs, target = part
                        out = torch.func.functional_call(model, state, tuple(xs))
                        _ModuleScopes.label(loss_scope)
                        # a loss_fn that reads the model (a penalty on its weights) reads
                        # the traced tensors, as eager PyTorch's reads the trained ones
                        with _functional_model(model, state):
                            loss = loss_fn(out, target)
                    else:
                        with _functional_model(model, state):
                            loss = loss_of(model, *part)
                        _ModuleScopes.label(loss_scope)
                    results[:] = [loss, new_buffers]
                loss, new_buffers = results
                loss, aux = _loss_and_aux(loss, "loss_fn" if loss_fn else "loss_of")
                objective = loss / k if k > 1 else loss
                if scaling is not None:
                    objective = scaling.scale(objective, o)
                reached.update(_reached(objective, trained_params))
                return objective, (loss, new_buffers, aux)

            grads, (loss, current, aux) = torch.func.grad(loss_and_buffers,
                                                          has_aux=True)(trained)
            grads = _through_gradient_hooks(grads, hooks)
            total = grads if total is None else {n: total[n] + grads[n] for n in total}
            losses.append(loss)
            auxes.append(aux)
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        aux_leaves = _aux_leaves(auxes, aux_spec)
        opt.check_reached(reached)
        _ModuleScopes.label(optimizer_scope)
        new_scaler = {}
        if scaling is not None:
            total, found_inf = scaling.unscale(total, o)
        new_trained, new_opt = opt.update(trained, gradients.treat(total), o)
        if scaling is not None:
            new_trained = scaling.skip(found_inf, trained, new_trained)
            new_opt = scaling.skip(found_inf, o, new_opt)
            new_scaler = scaling.update(found_inf, o)
        _ModuleScopes.label(OUTSIDE)  # tags the update's nodes
        return (*[new_trained.get(n, p[n]) for n in params],
                *[current[n] for n in buffers],
                *[new_opt.get(n, o[n]) for n in opt_names],
                *[new_scaler[n] for n in scaler_names], loss, *aux_leaves)

    initial = {**_detached(params), **_detached(buffers), **opt_state}
    args = [initial[s.name] for s in inputs if s.role != FEED] + list(leaves)
    gm = _record(step, args, model, tracing_mode)
    check_sparse_gradients(gm.meta["salus_sparse_gradients"], optimizer, opt.kind)
    if aux_spec[0] is not None:
        outputs += [OutputSlot("output", f"output.{i}") for i in range(aux_spec[0].num_leaves)]
    captured = _captured_parameters_as_state(gm, inputs, initial)
    _refuse_own_captures(captured, {**params, **buffers})
    _thread_generator(gm, inputs, outputs, initial)
    return TracedStep("train", gm, inputs, outputs, initial, optimizer=opt.describe(),
                      rule=opt, batch_spec=batch_spec, scaler=scaling, autocast=autocast,
                      captured=captured, output_spec=aux_spec[0])


def _gradient_hooks(model: torch.nn.Module, trained: dict[str, torch.Tensor]
                    ) -> dict[str, list[Callable]]:
    """The hooks on the trained parameters' gradients (``param.register_hook``: per
    parameter clipping or scaling), which the step runs on each gradient as autograd
    would. Refuses what it cannot run: hooks after accumulation
    (``register_post_accumulate_grad_hook``), and modules' backward hooks."""
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            raise TraceError(
                f"module {name or '(the model)'} ({type(module).__name__}) has a backward "
                "hook (register_full_backward_hook or register_full_backward_pre_hook), "
                "which salus cannot record (PyTorch runs it through an autograd Function "
                "torch.func does not take): hook the gradients of its parameters "
                "(param.register_hook) or of its output tensor inside forward instead")
    hooks = {}
    for name, param in trained.items():
        if getattr(param, "_post_accumulate_grad_hooks", None):
            raise TraceError(
                f"parameter {name} has a hook after gradient accumulation "
                "(register_post_accumulate_grad_hook), which would run on .grad: salusd "
                "computes the gradients and the update, so it would never run")
        if param._backward_hooks:
            hooks[name] = list(param._backward_hooks.values())
    return hooks


def _through_gradient_hooks(grads: dict[str, torch.Tensor], hooks: dict[str, list[Callable]]
                            ) -> dict[str, torch.Tensor]:
    """Each gradient passed through its parameter's hooks in order, as autograd passes it
    (a hook that returns None leaves it as it is)."""
    if not hooks:
        return grads
    grads = dict(grads)
    for name, chain in hooks.items():
        for hook in chain:
            out = hook(grads[name])
            if out is not None:
                grads[name] = out
    return grads


def _loss_and_aux(returned, what: str) -> tuple[torch.Tensor, Any]:
    """The loss and the auxiliary outputs (``()``: none) of what the loss function
    returned: a 0-dim tensor, or ``(loss, aux)`` with ``aux`` a structure of tensors."""
    loss, aux = returned, ()
    if isinstance(returned, tuple) and len(returned) == 2 \
            and isinstance(returned[0], torch.Tensor):
        loss, aux = returned
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TraceError(f"{what} must return a scalar (0-dim) tensor, or (loss, aux) with "
                         "aux tensors in tuples, lists and dicts")
    if not _no_aux(aux):
        leaves, _ = pytree.tree_flatten(aux)
        bad = [type(v).__name__ for v in leaves if not isinstance(v, torch.Tensor)]
        if bad or not leaves:
            raise TraceError(f"{what} returned (loss, aux), and aux must hold tensors (in "
                             "tuples, lists and dicts)"
                             + (f", not {', '.join(sorted(set(bad)))}" if bad else
                                ": it holds none"))
    return loss, aux


def _no_aux(aux) -> bool:
    return isinstance(aux, tuple) and not aux


def _aux_leaves(auxes: list, spec_box: list) -> list[torch.Tensor]:
    """The auxiliary outputs of each micro-batch as the step's output tensors (each
    stacked over the micro-batches when there are several), their structure kept in
    ``spec_box[0]``."""
    if _no_aux(auxes[0]):
        spec_box[0] = None
        return []
    flat = [pytree.tree_flatten(a) for a in auxes]
    spec_box[0] = flat[0][1]
    if any(f[1] != spec_box[0] for f in flat):
        raise TraceError("the loss function returned aux of another structure for another "
                         "micro-batch")
    if len(flat) == 1:
        return [t.detach() for t in flat[0][0]]
    return [torch.stack([f[0][i] for f in flat]).detach() for i in range(len(flat[0][0]))]


def _dense_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers the session keeps as state: all but sparse ones (a graph's
    adjacency matrix), which the step captures as constants (:mod:`salus.sparse`)."""
    return {n: b for n, b in model.named_buffers() if not is_sparse(b)}


def _reached(loss: torch.Tensor, params: dict[str, torch.Tensor]) -> set[str]:
    """The names of ``params`` whose gradient ``loss`` has: those its autograd graph
    reaches (in eager PyTorch, the others keep ``.grad`` None). ``torch.func.grad`` gives
    the others zeros, which an optimizer would still decay and count."""
    names = {id(t): n for n, t in params.items()}
    found: set[str] = set()
    seen: set = set()
    pending = [loss.grad_fn]
    while pending:
        fn = pending.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf's
        if variable is not None and id(variable) in names:
            found.add(names[id(variable)])
        pending.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


@contextlib.contextmanager
def _functional_model(model: torch.nn.Module, state: tuple) -> Iterator[None]:
    """Inside, calling ``model`` (or any of its submodules) runs with ``state``'s tensors
    in place of its parameters and buffers, as ``torch.func.functional_call`` does for
    one call: what lets a user's ``loss_of(model, ...)`` call the model as usual."""
    from torch.nn.utils.stateless import _reparametrize_module

    merged: dict[str, torch.Tensor] = {}
    for part in state:
        merged.update(part)
    with _reparametrize_module(model, merged, tie_weights=True):
        yield


@_traces
def trace_inference(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor] | torch.Tensor,
                    *, eval_mode: bool = True, tracing_mode: str = "real",
                    autocast: torch.dtype | None = None) -> TracedStep:
    """Traces the forward pass ``model(*example_inputs)`` (under
    ``torch.autocast("cpu", dtype=autocast)`` when ``autocast`` is given).

    With ``eval_mode`` (the default) the model is traced as after ``model.eval()``; its
    train/eval flags are restored afterwards. Buffers are state; the outputs (flattened
    in pytree order) are fetches named ``output.<i>``.
    """
    xs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    autocast = amp.autocast_dtype(autocast)
    params = dict(model.named_parameters())
    buffers = _dense_buffers(model)
    inputs = ([InputSlot(n, PARAMETER, "param") for n in params]
              + [InputSlot(n, STATE, "buffer") for n in buffers]
              + [InputSlot(f"input.{i}", FEED, "batch") for i in range(len(xs))])
    counts = (len(params), len(buffers), 0)
    spec_box: list[pytree.TreeSpec] = []

    def forward_pass(*flat):
        p, b, _, data = _split(flat, counts, (params, buffers, []))

        def run_model(params_):
            new_buffers = {n: t.clone() for n, t in b.items()}
            with amp.autocast(autocast):
                out = torch.func.functional_call(model, (params_, new_buffers), tuple(data))
            return torch.zeros(()), (out, new_buffers)

        # The forward runs under a grad transform, as in a training step, so a module
        # that updates buffers (batch norm in training mode) is functionalized the same
        # way; nothing of the backward is recorded.
        _, _, (out, new_buffers) = torch.func.vjp(run_model, p, has_aux=True)
        leaves, spec = pytree.tree_flatten(out)
        spec_box[:] = [spec]
        return (*[new_buffers[n] for n in buffers], *leaves)

    initial = {**_detached(params), **_detached(buffers)}
    args = [initial[s.name] for s in inputs if s.role != FEED] + list(xs)
    with _training_mode(model, False if eval_mode else None), inference_paths():
        gm = _record(forward_pass, args, model, tracing_mode)
    n_out = spec_box[0].num_leaves
    outputs = ([OutputSlot("update", n) for n in buffers]
               + [OutputSlot("output", f"output.{i}") for i in range(n_out)])
    captured = _captured_parameters_as_state(gm, inputs, initial)
    _thread_generator(gm, inputs, outputs, initial)
    return TracedStep("inference", gm, inputs, outputs, initial, output_spec=spec_box[0],
                      autocast=autocast, captured=captured)


#: The session state a parameter the step captures from outside is kept as
#: (``captured.<k>``).
CAPTURED = "captured"


@dataclass
class Captured:
    """A parameter of a module outside the model that the step reads: its state name,
    the user's tensor, and its version counter when its value was last taken."""

    name: str
    tensor: torch.Tensor
    taken: int | None

    @property
    def changed(self) -> bool:
        """Whether the tensor changed in place since its value was last taken."""
        return self.tensor._version != self.taken


def _captured_parameter(node: torch.fx.Node) -> bool:
    # make_fx names the nn.Parameters a function captures so; other constants (tensors
    # made while the step records, or captured plain tensors) are ``_tensor_constant``.
    return node.op == "get_attr" and str(node.target).startswith("_param_constant")


def _captured_parameters_as_state(gm: torch.fx.GraphModule, inputs: list[InputSlot],
                                  initial: dict[str, torch.Tensor]) -> list[Captured]:
    """Parameters of modules outside the model that the step reads (a DQN's target
    network, a GAN's discriminator in the generator's loss, a teacher that follows the
    student by a moving average) become persistent inputs ``captured.<k>`` (after the
    other persistent inputs, in the order the graph first reads them) instead of
    constants: the user may change them between steps (``load_state_dict``, an
    optimizer of their own), and the session then writes their new values before the
    next step (:meth:`TracedStep.changed_captures`), so the step reads what eager
    PyTorch would."""
    graph = gm.graph
    nodes = [n for n in graph.nodes if _captured_parameter(n)]
    if not nodes:
        return []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    at = sum(1 for s in inputs if s.role != FEED)
    anchor = placeholders[at] if at < len(placeholders) else None
    last = placeholders[-1]
    captured = []
    for k, node in enumerate(nodes):
        value = _attribute(gm, node)
        name = f"{CAPTURED}.{k}"
        with (graph.inserting_before(anchor) if anchor is not None
              else graph.inserting_after(last)):
            placeholder = graph.placeholder(f"captured_{k}")
        last = placeholder
        placeholder.meta.update(node.meta)
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        inputs.insert(at + k, InputSlot(name, STATE, CAPTURED))
        initial[name] = value.detach().clone()
        captured.append(Captured(name, value, value._version))
    gm.recompile()
    return captured


def _refuse_own_captures(captured: list[Captured], own: dict[str, torch.Tensor]) -> None:
    """A step that reads one of the model's own tensors other than through the model (a
    closure over another reference to it) would read a copy that neither trains nor
    follows the training: refused, naming it."""
    pointers = {t.data_ptr(): n for n, t in own.items() if t.numel()}
    for capture in captured:
        name = pointers.get(capture.tensor.data_ptr())
        if name is not None:
            raise TraceError(
                f"the step reads the model's {name} other than through the model it is "
                "given (a closure over the model, or over the tensor): salus traces the "
                "model's tensors where the step reaches them through the model, so that one "
                "would be a copy that neither trains nor follows training. Read it from "
                "the model the step is given: loss_of=lambda m, *batch: ... m.<name> ...")


def _split(flat, counts, names):
    n_p, n_b, n_o = counts
    p = dict(zip(names[0], flat[:n_p]))
    b = dict(zip(names[1], flat[n_p:n_p + n_b]))
    o = dict(zip(names[2], flat[n_p + n_b:n_p + n_b + n_o]))
    return p, b, o, flat[n_p + n_b + n_o:]
