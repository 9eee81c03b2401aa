"""What every functional optimizer shares: parameter groups, state naming, hyperparameters
as session state, and taking over (and giving back) a torch optimizer's state.

A rule (one subclass per torch optimizer) says four things about a parameter group:

- :meth:`~FunctionalOptimizer.structure`: what the traced graph's shape depends on (flags
  such as ``nesterov``, and whether ``momentum`` or ``weight_decay`` is zero). It is fixed
  when the step is traced; a change afterwards is refused, never ignored.
- :meth:`~FunctionalOptimizer.scalars`: the group's hyperparameters in the form the update
  multiplies by (``lr``, ``1 - beta1``, ``log(beta2)``...), computed in Python floats
  (float64) as eager PyTorch computes them and rounded to the parameters' dtype as
  PyTorch's kernels round a Python scalar. They are persistent tensors of the session,
  ``optimizer.param_groups.<g>.<name>``, read by the graph: a learning-rate schedule
  changes them between steps.
- :meth:`~FunctionalOptimizer.buffers`: the per-parameter state it keeps, under torch's
  own keys (``exp_avg``...), named ``optimizer.<key>.<param>`` in the session.
- :meth:`~FunctionalOptimizer.update_group`: the update itself, tensor math only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
from torch.optim import optimizer as _optimizer

from ..errors import UnsupportedOptimizerError

Tensors = dict[str, torch.Tensor]

#: One f32 step counter shared by every parameter (torch keeps one per parameter).
STEP = "optimizer.step"
_STEP_DTYPE = torch.float32

# Keys a group may carry that do not change the math: implementation choices (PyTorch's
# fused and foreach kernels compute its single-tensor formula; torch itself refuses
# ``fused=True`` for an optimizer without such kernels), and the bookkeeping
# learning-rate schedulers add to the groups they drive.
_HARMLESS = {"params", "foreach", "fused", "differentiable", "capturable", "initial_lr",
             "max_lr", "min_lr", "max_momentum", "base_momentum", "name"}


def state_name(key: str, param: str) -> str:
    """The session's name for torch state ``key`` of parameter ``param``."""
    return f"optimizer.{key}.{param}"


def hyper_name(group: int, key: str) -> str:
    """The session's name for hyperparameter ``key`` of parameter group ``group``."""
    return f"optimizer.param_groups.{group}.{key}"


def scalar(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def log(value: float) -> float:
    """``math.log`` that keeps -inf for 0 (a beta of 0 is allowed)."""
    return math.log(value) if value > 0 else -math.inf


@dataclass
class Group:
    """One parameter group as traced: its index, trained parameters (model order), the
    structure the graph was traced with, and the dtype its hyperparameters are kept in."""

    index: int
    params: list[str]
    structure: dict
    dtype: torch.dtype
    #: The names of its hyperparameter tensors (the keys of ``scalars``), in order.
    keys: list[str]


class FunctionalOptimizer:
    """The update rule of one torch optimizer over named parameters."""

    #: Name in manifests and messages.
    kind = "base"
    #: Group keys this rule reads (besides the harmless ones).
    options: frozenset[str] = frozenset()
    #: Whether the rule keeps the shared step counter.
    counts_steps = True

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                 order: list[str]):
        self.optimizer = optimizer
        self._name_of = dict(names)
        self._tensor_of: dict[str, torch.Tensor] = {}
        self.group_of: dict[str, Group] = {}
        self.groups: list[Group] = []
        position = {n: i for i, n in enumerate(order)}
        self._check_hooks()
        for index, group in enumerate(optimizer.param_groups):
            self._check_keys(group)
            trained = []
            for p in group["params"]:
                name = names.get(id(p))
                if name is None:
                    raise UnsupportedOptimizerError(
                        f"{type(optimizer).__name__} holds a tensor of shape "
                        f"{tuple(p.shape)} that is not a parameter of the model")
                if p.requires_grad:
                    trained.append(name)
                    self._tensor_of[name] = p
            dtype = (torch.float64 if any(self._tensor_of[n].dtype == torch.float64
                                          for n in trained) else torch.float32)
            structure = self.structure(group)
            info = Group(index, sorted(trained, key=position.__getitem__), structure, dtype,
                         list(self.scalars(group, structure)))
            self.groups.append(info)
            for name in trained:
                self.group_of[name] = info
        #: Trained parameters in model order.
        self.params = [n for n in order if n in self.group_of]
        # Each group's trained tensors, as traced (:meth:`_check_trained`).
        self._trained_ids = [frozenset(id(self._tensor_of[n]) for n in g.params)
                             for g in self.groups]
        #: Trained parameters the traced loss does not reach: torch's optimizers skip a
        #: parameter whose ``.grad`` is None, so the update leaves them and their state
        #: as they are (:meth:`update`), and they get no torch state back (set by the
        #: tracer).
        self.without_grad: frozenset[str] = frozenset()
        # Parameters with no torch state yet, and the steps the others have taken, when
        # the session took the optimizer over (:meth:`initial_state`).
        self._unstepped: list[str] = []
        self._taken = 0.0
        self._sent: list[dict | None] = [None] * len(self.groups)

    # -- what a rule says ---------------------------------------------------------------

    def structure(self, group: Mapping) -> dict:
        """What the graph's shape depends on; fixed once traced."""
        raise NotImplementedError

    def scalars(self, group: Mapping, structure: dict) -> dict[str, float]:
        """The group's hyperparameters as the update multiplies by them (Python floats)."""
        raise NotImplementedError

    def buffers(self, structure: dict) -> list[str]:
        """The per-parameter state kept for a group of this structure (torch's keys)."""
        return []

    def param_buffers(self, name: str) -> list[str]:
        """The state kept for parameter ``name``: its group's :meth:`buffers`, unless the
        rule keeps other state for parameters of some shapes (Adafactor)."""
        return self.buffers(self.group_of[name].structure)

    def init_buffer(self, key: str, param: torch.Tensor, group: Mapping) -> torch.Tensor:
        """A buffer's value before the first step (torch's lazy initialisation)."""
        return torch.zeros_like(param, memory_format=torch.preserve_format)

    def update_group(self, group: Group, params: Tensors, grads: Tensors, buffers: Tensors,
                     hyper: Tensors, step: torch.Tensor | None, first: torch.Tensor | None
                     ) -> tuple[Tensors, Tensors]:
        """The new parameters and buffers of one group. ``buffers`` and the result map
        ``(key, param)`` names (:func:`state_name`); ``hyper`` maps the scalars' keys to
        0-dim tensors; ``step`` is the step being taken (1 for the first), ``first``
        whether it is the first."""
        raise NotImplementedError

    # -- checks -------------------------------------------------------------------------

    def _check_keys(self, group: Mapping) -> None:
        for key, value in group.items():
            if key not in self.options and key not in _HARMLESS:
                self._refuse(key, value)

    def _check_hooks(self) -> None:
        """Refuses step hooks (``register_step_pre_hook``/``register_step_post_hook``, on
        this optimizer or on every one): salusd runs the update, so ``step()`` and its
        hooks never run, and what they do (logging, a moving average) would silently not
        happen. PyTorch's own global hooks (the profiler's step counter) are left."""
        o = self.optimizer
        hooks = [("register_step_pre_hook", getattr(o, "_optimizer_step_pre_hooks", {})),
                 ("register_step_post_hook", getattr(o, "_optimizer_step_post_hooks", {})),
                 ("register_optimizer_step_pre_hook", _optimizer._global_optimizer_pre_hooks),
                 ("register_optimizer_step_post_hook",
                  _optimizer._global_optimizer_post_hooks)]
        for register, registered in hooks:
            users = [h for h in registered.values()
                     if not getattr(h, "__module__", "").startswith("torch.")]
            if users:
                names = ", ".join(getattr(h, "__qualname__", repr(h)) for h in users)
                raise UnsupportedOptimizerError(
                    f"{type(o).__name__} has step hooks ({register}: {names}), which would "
                    "not run: salusd runs the update, not optimizer.step(). Remove them "
                    "and do their work in the training loop after each session.step()")

    def _refuse(self, option: str, value) -> None:
        raise UnsupportedOptimizerError(
            f"{type(self.optimizer).__name__}({option}={value!r}) is not supported by "
            f"salus: remove the option '{option}'")

    # -- state --------------------------------------------------------------------------

    def state_names(self) -> list[str]:
        """Buffers (per parameter, in model order), then the step counter: the state the
        update advances."""
        names = [state_name(k, n) for n in self.params for k in self.param_buffers(n)]
        return names + [STEP] if self.counts_steps and self.params else names

    def hyper_names(self) -> list[str]:
        """The hyperparameter tensors' names, group by group."""
        return [hyper_name(g.index, k) for g in self.groups for k in g.keys]

    def hyperparameters(self) -> Tensors:
        """Every group's hyperparameter tensors, from the torch optimizer's
        ``param_groups`` now. Raises :class:`UnsupportedOptimizerError` when a group's
        structure or membership changed since tracing."""
        return {name: value for g in self.groups for name, value in self._group_hyper(g).items()}

    def changed_hyperparameters(self) -> Tensors:
        """The hyperparameter tensors whose values differ from those last returned by
        this method (all of them the first time): what a session must write before its
        next step."""
        changed: Tensors = {}
        self._check_hooks()
        groups = self.optimizer.param_groups
        if len(groups) != len(self.groups):
            raise UnsupportedOptimizerError(
                f"the optimizer has {len(groups)} parameter groups, it had "
                f"{len(self.groups)} when the session was traced: open a new session "
                "after add_param_group")
        for info in self.groups:
            self._check_trained(info)
            values = self._checked_scalars(info)
            if values != self._sent[info.index]:
                self._sent[info.index] = values
                changed.update(self._tensors(info, values))
        return changed

    def _check_trained(self, info: Group) -> None:
        """Refuses a group whose parameters were frozen or unfrozen (``requires_grad``)
        since the session was traced: its graph updates the parameters that trained then."""
        now = {id(p) for p in self.optimizer.param_groups[info.index]["params"]
               if p.requires_grad}
        then = self._trained_ids[info.index]
        if now == then:
            return
        changed = sorted(self._name_of.get(i, "a new tensor") for i in now ^ then)
        raise UnsupportedOptimizerError(
            f"parameter group {info.index}: {', '.join(changed[:3])}"
            f"{' ...' if len(changed) > 3 else ''} changed requires_grad since the session "
            "was traced, and the traced step updates the parameters that trained then: "
            "open a new session after freezing or unfreezing parameters")

    def resend(self) -> None:
        """Forgets what :meth:`changed_hyperparameters` returned: the next call returns
        every hyperparameter (after a failed step, or after the session's tensors were
        overwritten)."""
        self._sent = [None] * len(self.groups)

    def mark_stepped(self) -> None:
        """Tells the torch optimizer's learning-rate schedulers that a step was taken
        (as ``optimizer.step()`` would, through the wrapper schedulers install), so they
        do not warn that ``scheduler.step()`` came first."""
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _group_hyper(self, info: Group) -> Tensors:
        return self._tensors(info, self._checked_scalars(info))

    def _tensors(self, info: Group, values: dict[str, float]) -> Tensors:
        return {hyper_name(info.index, k): torch.tensor(v, dtype=info.dtype)
                for k, v in values.items()}

    def _checked_scalars(self, info: Group) -> dict[str, float]:
        group = self.optimizer.param_groups[info.index]
        structure = self.structure(group)
        if structure != info.structure:
            changed = [f"{k}: {info.structure[k]!r} -> {structure[k]!r}"
                       for k in structure if structure[k] != info.structure.get(k)]
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} parameter group {info.index} changed "
                f"what its update computes since the session was traced "
                f"({'; '.join(changed)}); salus follows changed values of "
                "hyperparameters, not a different update: open a new session")
        return self.scalars(group, structure)

    def initial_state(self) -> Tensors:
        """The buffers and step counter before the next step: taken over from the torch
        optimizer if it has stepped already, fresh otherwise."""
        state: Tensors = {}
        steps = set()
        for name in self.params:
            info = self.group_of[name]
            group = self.optimizer.param_groups[info.index]
            torch_state = self.optimizer.state.get(self._tensor_of[name], {})
            p = self._tensor_of[name].detach()
            for key in self.param_buffers(name):
                value = torch_state.get(key)
                # (SGD's momentum of an embedding with sparse gradients is sparse)
                state[state_name(key, name)] = (
                    value.detach().to_dense() if value is not None and value.is_sparse
                    else value.detach().clone() if value is not None
                    else self.init_buffer(key, p, group))
            if not torch_state:
                # Never stepped (a parameter the loss has not reached so far): it counts
                # only if the traced loss reaches it (check_reached).
                self._unstepped.append(name)
                continue
            taken = self._taken_steps(torch_state, info.structure)
            if taken is not None:
                steps.add(taken)
        if len(steps) > 1:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} parameters are at different steps "
                f"({sorted(steps)}): salus keeps one step counter for all of them")
        self._taken = steps.pop() if steps else 0.0
        if self.counts_steps and self.params:
            state[STEP] = torch.tensor(self._taken, dtype=_STEP_DTYPE)
        return state

    def check_reached(self, reached: set[str]) -> None:
        """Records which trained parameters the traced loss reaches (the others are
        :attr:`without_grad`); refuses a parameter it reaches that has taken no step
        while the others have: torch starts that parameter's own count at 1, salus has
        one count for all."""
        self.without_grad = frozenset(n for n in self.params if n not in reached)
        late = [n for n in self._unstepped if n in reached]
        if late and self._taken > 0 and self.counts_steps:
            raise UnsupportedOptimizerError(
                f"{type(self.optimizer).__name__} has stepped its other parameters but "
                f"never {', '.join(late[:3])}{' ...' if len(late) > 3 else ''}, which the "
                "loss reaches now: torch would start their own count of steps, salus keeps "
                "one for all parameters. Open the session before the first step, or give "
                "those parameters an optimizer of their own")

    def _taken_steps(self, torch_state: Mapping, structure: dict) -> float | None:
        """How many steps torch's state of one parameter has taken (None: it does not
        tell)."""
        return scalar(torch_state["step"]) if "step" in torch_state else 0.0

    def give_back(self, values: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
                  ) -> None:
        """Writes the session's optimizer state (``values``, named as
        :meth:`state_names`) into the torch optimizer's ``state`` for ``params`` (the
        model's parameters by name), so eager training can go on from it."""
        step = values.get(STEP)
        for name in self.params:
            if (step is not None and step.item() == 0) or name in self.without_grad:
                continue
            state = self.optimizer.state[params[name]]
            for key in self.param_buffers(name):
                state[key] = values[state_name(key, name)].clone()
            if step is not None:
                self._give_step(state, step)

    def _give_step(self, state: dict, step: torch.Tensor) -> None:
        state["step"] = step.clone()

    def update(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
               state: Mapping[str, torch.Tensor]) -> tuple[Tensors, Tensors]:
        """``(new_params, new_state)``: one step of every trained parameter but those
        :attr:`without_grad` (absent from both: they keep their values and state);
        ``state`` holds :meth:`state_names` and :meth:`hyper_names`."""
        new_params: Tensors = {}
        new_state: Tensors = {}
        if not self.params:
            return new_params, new_state
        step = first = None
        if self.counts_steps:
            first = torch.eq(state[STEP], 0)
            step = state[STEP] + 1
            new_state[STEP] = step
        for info in self.groups:
            if not info.params:
                continue
            names = [n for n in info.params if n not in self.without_grad]
            if not names:
                continue
            hyper = {k: state[hyper_name(info.index, k)] for k in info.keys}
            p = {n: params[n] for n in names}
            g = {n: grads[n] for n in names}
            b = {state_name(k, n): state[state_name(k, n)] for n in names
                 for k in self.param_buffers(n)}
            new_p, new_b = self.update_group(info, p, g, b, hyper, step, first)
            new_params.update(new_p)
            new_state.update(new_b)
        return new_params, new_state

    def describe(self) -> dict:
        """The rule and its groups as plain data (for manifests and messages)."""
        return {"kind": self.kind,
                "groups": [{"params": g.params, **g.structure,
                            **self.scalars(self.optimizer.param_groups[g.index], g.structure)}
                           for g in self.groups]}
