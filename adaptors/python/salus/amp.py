"""Mixed precision: ``torch.autocast`` while tracing, and ``torch.amp.GradScaler`` as
session state.

**Autocast.** A step traced under CPU autocast (``TrainSession(..., autocast=dtype)``, or
the user's own ``with torch.autocast("cpu", dtype=...)`` inside ``loss_of``) records the
casts PyTorch's autocast inserts (``_to_copy`` to bf16 or f16 before a product or
convolution, back to f32 where an op promotes), so the graph computes what eager
autocast computes on the CPU; parameters, gradients and optimizer state stay f32.
:class:`AutocastTracing` is active while a step is recorded. It

- refuses autocast enabled for another device type (``torch.autocast("cuda")``) around
  ops on CPU tensors (what salus traces a CPU-resident model with): such a block does not
  cast them, so the graph would silently run in f32 where the user asked for 16 bits;
- runs ``scaled_dot_product_attention`` as autocast runs it (its floating inputs cast to
  the autocast dtype, then the op with autocast off). Under ``torch.func.grad`` PyTorch
  leaves autocast on inside the op's math fallback, whose backward then fails on mixed
  dtypes; outside the grad transform (eager) the two agree bit for bit.

A step that is already inside an enabled ``torch.autocast`` block when tracing starts is
refused: the optimizer's update would be traced under it too, which eager PyTorch never
does (pass ``autocast=`` instead). So is a ``loss_of`` that calls ``GradScaler.scale``
itself: the scale would be frozen into the graph and the gradients never unscaled (pass
``scaler=`` instead).

**GradScaler.** :class:`FunctionalScaler` is ``torch.amp.GradScaler``'s dynamic loss
scaling as tensor math the tracer records into the step: the loss is multiplied by the
scale before the backward, the gradients are unscaled and checked for inf/NaN
(``_amp_foreach_non_finite_check_and_unscale_``), the optimizer's update is discarded
(parameters and optimizer state, step counter included, keep their values) when one was
found, and the scale and its growth tracker change as ``_amp_update_scale_`` changes
them. The scale (f32) and the growth tracker (i32) are persistent state tensors of the
session, ``scaler.scale`` and ``scaler.growth_tracker``; ``growth_factor``,
``backoff_factor`` and ``growth_interval`` are part of the traced graph (numbers the
update multiplies by and compares with, in float64 as PyTorch's kernel does): changing
them afterwards (``set_growth_factor``) is refused at the next step, never ignored.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .errors import UnsupportedMixedPrecisionError

Tensors = dict[str, torch.Tensor]

#: The dtypes CPU autocast (and so a traced step) can compute in.
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

#: Device types whose autocast a trace refuses (salus traces with CPU tensors).
_OTHER_DEVICE_TYPES = ("cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia",
                       "privateuseone")

#: The scaler's persistent tensors.
SCALE = "scaler.scale"
GROWTH_TRACKER = "scaler.growth_tracker"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def autocast_dtype(value) -> torch.dtype | None:
    """The dtype of a session's ``autocast=`` argument (None: no autocast), refusing what
    CPU autocast cannot compute in."""
    if value is None or value is False:
        return None
    if value not in AUTOCAST_DTYPES:
        raise UnsupportedMixedPrecisionError(
            f"autocast={value!r} is not supported: salus traces CPU autocast, which "
            f"computes in {' or '.join(_name(d) for d in AUTOCAST_DTYPES)} "
            "(autocast=torch.bfloat16 or autocast=torch.float16)")
    return value


def autocast(dtype: torch.dtype | None):
    """``torch.autocast("cpu", dtype=dtype)``, or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def _enabled_elsewhere() -> list[str]:
    found = []
    for device in _OTHER_DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device):
                found.append(device)
        except RuntimeError:  # a device type this PyTorch does not know
            continue
    return found


def check_no_autocast_outside() -> None:
    """Refuses to start a trace inside an enabled ``torch.autocast`` block."""
    on = (["cpu"] if torch.is_autocast_enabled("cpu") else []) + _enabled_elsewhere()
    if on:
        raise UnsupportedMixedPrecisionError(
            f"the session is created inside torch.autocast({on[0]!r}): the whole step, "
            "optimizer update included, would be traced under it, which eager PyTorch "
            "never does. Create the session outside the autocast block and pass "
            "autocast=torch.bfloat16 (or torch.float16), or enter torch.autocast('cpu', "
            "...) inside loss_of")


class AutocastTracing(TorchFunctionMode):
    """Active while a step is recorded: refuses autocast of other device types, and runs
    ``scaled_dot_product_attention`` under CPU autocast as eager autocast does (see the
    module's docs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        elsewhere = _enabled_elsewhere()
        if elsewhere and any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                             and t.is_floating_point()
                             for t in pytree.tree_leaves((args, kwargs))):
            raise UnsupportedMixedPrecisionError(
                f"the step enables torch.autocast({elsewhere[0]!r}), but salus traces the "
                "step with CPU tensors, which that autocast does not cast: the graph would "
                "compute in float32. Use torch.autocast('cpu', dtype=...) (or the "
                "session's autocast= argument): its casts are recorded and run on every "
                "salus device")
        if func is F.scaled_dot_product_attention and torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")

            def cast(t):
                if (isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.dtype not in (torch.float64, dtype)):
                    return t.to(dtype)
                return t

            args, kwargs = pytree.tree_map(cast, (args, kwargs))
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# GradScaler


def _is_supported_scaler(scaler) -> bool:
    allowed = [torch.amp.GradScaler]
    for module in (getattr(torch, "cuda", None), getattr(torch, "cpu", None)):
        amp = getattr(module, "amp", None)
        cls = getattr(amp, "GradScaler", None)
        if isinstance(cls, type):
            allowed.append(cls)  # the deprecated aliases: same class, device preset
    return type(scaler) in allowed


class FunctionalScaler:
    """``torch.amp.GradScaler``'s decisions as traced tensor math (see the module docs).

    Built by :meth:`of`, which returns None for no scaler or a disabled one (a disabled
    GradScaler does nothing in eager PyTorch either)."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler
        self.options = self._options()

    @classmethod
    def of(cls, scaler, trained: Mapping[str, torch.Tensor]) -> "FunctionalScaler | None":
        """The functional form of ``scaler`` for the ``trained`` parameters (name ->
        tensor); None when there is nothing to scale. Raises
        :class:`UnsupportedMixedPrecisionError` naming what salus cannot follow."""
        if scaler is None:
            return None
        if not _is_supported_scaler(scaler):
            raise UnsupportedMixedPrecisionError(
                f"scaler: {type(scaler).__module__}.{type(scaler).__name__} is not "
                "supported by salus: it follows torch.amp.GradScaler itself (a subclass "
                "may change what scale, unscale_, step or update do)")
        if not scaler.is_enabled():
            return None
        stages = {str(s.get("stage")) for s in scaler._per_optimizer_states.values()}
        if any(not stage.endswith("READY") for stage in stages):
            raise UnsupportedMixedPrecisionError(
                "scaler: the GradScaler is in the middle of an iteration (unscale_ or step "
                "was called without update()): call scaler.update() before creating the "
                "session")
        half = sorted(n for n, p in trained.items() if p.dtype == torch.float16)
        if half:
            raise UnsupportedMixedPrecisionError(
                f"scaler: parameter {half[0]} is float16; GradScaler refuses to unscale "
                "float16 gradients (keep the parameters float32 and compute in float16 "
                "with autocast=torch.float16)")
        return cls(scaler)

    def _options(self) -> dict[str, float]:
        s = self.scaler
        options = {"growth_factor": float(s.get_growth_factor()),
                   "backoff_factor": float(s.get_backoff_factor()),
                   "growth_interval": int(s.get_growth_interval())}
        if options["growth_interval"] < 1:
            raise UnsupportedMixedPrecisionError(
                f"scaler: growth_interval={options['growth_interval']} is not supported by "
                "salus: it must be at least 1")
        return options

    def check(self) -> None:
        """Refuses a step after the torch scaler's options changed since tracing."""
        if not self.scaler.is_enabled():
            raise UnsupportedMixedPrecisionError(
                "scaler: the GradScaler was disabled after the session was traced; the "
                "traced step scales the loss: open a new session")
        now = self._options()
        if now != self.options:
            changed = "; ".join(f"{k}: {self.options[k]!r} -> {now[k]!r}"
                                for k in now if now[k] != self.options[k])
            raise UnsupportedMixedPrecisionError(
                f"scaler: the GradScaler's options changed since the session was traced "
                f"({changed}); they are part of the traced step: open a new session")

    # -- state --------------------------------------------------------------------------

    @staticmethod
    def state_names() -> list[str]:
        return [SCALE, GROWTH_TRACKER]

    def initial_state(self) -> Tensors:
        """The scale and growth tracker the torch scaler would use at its next
        ``scale()``: its current ones, or its initial ones before its first."""
        s = self.scaler
        scale = s._scale.item() if s._scale is not None else s._init_scale
        tracker = (s._growth_tracker.item() if s._growth_tracker is not None
                   else s._init_growth_tracker)
        return {SCALE: torch.tensor(scale, dtype=torch.float32),
                GROWTH_TRACKER: torch.tensor(tracker, dtype=torch.int32)}

    def give_back(self, values: Mapping[str, torch.Tensor]) -> None:
        """Writes the session's scale and growth tracker into the torch scaler, so eager
        training goes on with them."""
        state = self.scaler.state_dict()
        state["scale"] = float(values[SCALE].item())
        state["_growth_tracker"] = int(values[GROWTH_TRACKER].item())
        self.scaler.load_state_dict(state)

    def describe(self) -> dict:
        return {"kind": "GradScaler", **self.options}

    # -- the traced math ----------------------------------------------------------------

    @staticmethod
    def scale(loss: torch.Tensor, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``scaler.scale(loss)``."""
        return loss * state[SCALE]

    @staticmethod
    def unscale(grads: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
                ) -> tuple[Tensors, torch.Tensor]:
        """``scaler.unscale_``: every gradient times the inverse scale, and whether any
        holds an inf or a NaN (a bool 0-dim tensor). ``g * 0`` is NaN exactly where ``g``
        is not finite, and a sum of zeros is zero: the sum of those is NaN (not equal to
        0) iff some gradient element is inf or NaN."""
        inv_scale = torch.reciprocal(state[SCALE])
        nonfinite = None
        for g in grads.values():
            probe = torch.sum(g * 0)
            if probe.dtype != torch.float32:
                probe = probe.float()
            nonfinite = probe if nonfinite is None else nonfinite + probe
        found = (torch.ne(nonfinite, 0) if nonfinite is not None
                 else torch.zeros((), dtype=torch.bool))
        return {n: g * inv_scale for n, g in grads.items()}, found

    @staticmethod
    def skip(found: torch.Tensor, old: Mapping[str, torch.Tensor], new: Tensors) -> Tensors:
        """``scaler.step``: the new values where no inf/NaN was found, else the old."""
        return {n: torch.where(found, old[n], v) for n, v in new.items()}

    def update(self, found: torch.Tensor, state: Mapping[str, torch.Tensor]) -> Tensors:
        """``scaler.update()`` (``_amp_update_scale_``): on inf/NaN the scale backs off
        and the tracker restarts; else the tracker counts, and at ``growth_interval``
        the scale grows (unless that overflows) and the tracker restarts."""
        scale, tracker = state[SCALE], state[GROWTH_TRACKER]
        o = self.options
        successful = tracker + 1
        due = torch.eq(successful, o["growth_interval"])
        grown = scale * o["growth_factor"]
        finite = torch.eq(grown * 0, 0)
        kept = torch.where(torch.logical_and(due, finite), grown, scale)
        zero = torch.zeros_like(tracker)
        new_scale = torch.where(found, scale * o["backoff_factor"], kept)
        new_tracker = torch.where(found, zero, torch.where(due, zero, successful))
        return {SCALE: new_scale, GROWTH_TRACKER: new_tracker}


def _scale_in_step(self, outputs):
    raise UnsupportedMixedPrecisionError(
        "the step calls GradScaler.scale: the traced step would multiply the loss by the "
        "scale as a constant and never unscale the gradients. Return the unscaled loss "
        "and pass the scaler to the session instead (TrainSession(..., scaler=scaler))")


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """What recording a step needs for mixed precision: no enclosing autocast,
    :class:`AutocastTracing`, and ``GradScaler.scale`` refused inside the step (a loop's
    own scaling cannot be followed from inside a traced step)."""
    check_no_autocast_outside()
    original = torch.amp.GradScaler.scale
    torch.amp.GradScaler.scale = _scale_in_step  # type: ignore[method-assign]
    try:
        with AutocastTracing():
            yield
    finally:
        torch.amp.GradScaler.scale = original  # type: ignore[method-assign]
