"""Ray Tune trials as sessions on salusd, several to a device as Fluid decides.

A Ray Tune user's launch code changes in one place::

    import salus.tune
    tuner = salus.tune.Tuner(train_fn, param_space=space,            # was ray.tune.Tuner
                             tune_config=tune.TuneConfig(scheduler=ASHAScheduler(), ...))
    results = tuner.fit()

``train_fn`` is an ordinary function trainable whose training loop runs on salusd through
:class:`salus.torch.TrainSession` (opened without an address: each trial is pointed at its
device's salusd). Any search algorithm and scheduler of Ray Tune works: salus.tune only
decides how many trials share a device and which salusd each trial uses.

How Fluid's decisions map onto Ray Tune and salusd (``docs/tune.md``):

- **Packing degree c** (Eq. 3.1): given (``packing=2``), or ``"auto"``: measured on the
  trials themselves while they tune (:class:`PackingProbe`), one trial per device at
  first and one more while the last one still paid. Each trial asks Ray for ``1/c`` of
  the custom resource ``salus_device`` (one unit per salusd on a node), so Ray Tune starts
  at most ``c`` trials per device and queues the rest, and each salusd packs its trials
  into lanes (PACK). With ``"auto"`` each asks for ``1/(max_packing + 1)``, and a gate
  actor admits trials to devices up to the measured limit; the one more trial per device
  waits in its ``setup``, before Ray's clock of it starts.
- **Device**: each trial's process gets ``SALUS_ADDRESS`` of a device of its node (the
  one with the fewest sessions) and ``SALUS_SESSION_NAME`` of its trial, so salusctl and
  the daemon's session list show trials by name.
- **DynamicFluid** is not applied: a trial whose neighbours finish gets the whole device
  from salusd at once (lanes run side by side), and salus.torch has no training across
  devices, so the scaling degree is 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .client import Client, address_from_env
from .errors import SalusError
from .fluid import packing_degree, packing_marginal_benefit
from .torch import SESSION_NAME_ENV
from .v1 import admin_pb2

#: The custom Ray resource a node advertises, one unit per salusd device.
RESOURCE = "salus_device"
#: Eq. 3.1's threshold: one more trial on a device must save at least 10% of a trial's time.
PACKING_THRESHOLD = 0.1


def _ray():
    try:
        import ray
        from ray import tune
    except ImportError as e:  # pragma: no cover - exercised where Ray is missing
        raise SalusError("salus.tune needs Ray Tune: pip install 'salus[tune]'") from e
    return ray, tune


def local_devices(devices: Sequence[str] | None = None) -> list[str]:
    """The salusd addresses of this node: ``devices``, else ``SALUS_ADDRESS`` or the
    default socket."""
    return list(devices) if devices else [address_from_env()]


def init_ray(devices: Sequence[str] | None = None, **kwargs: Any) -> None:
    """``ray.init(**kwargs)`` for a local Ray whose node advertises one ``salus_device``
    per salusd in ``devices``. On a Ray cluster, start each node with ``ray start
    --resources='{"salus_device": N}'`` (N salusd devices) instead."""
    ray, _ = _ray()
    resources = {**kwargs.pop("resources", {}), RESOURCE: len(local_devices(devices))}
    kwargs.setdefault("include_dashboard", False)
    ray.init(resources=resources, **kwargs)


def _pick_device(devices: Sequence[str]) -> str:
    """The device of this node with the fewest open sessions (the first on a tie or when
    a daemon cannot be asked)."""
    if len(devices) == 1:
        return devices[0]
    load = []
    for i, address in enumerate(devices):
        try:
            with Client(address) as client:
                load.append((len(client.list_sessions()), i))
        except SalusError:
            load.append((math.inf, i))
    return devices[min(load)[1]]


def with_salus(trainable: Callable[[dict], Any], *, packing: int,
               devices: Sequence[str] | None = None,
               cpus_per_trial: float | None = None, gate: Any = None) -> Any:
    """``trainable`` as a Ray Tune trainable whose trials take ``1/packing`` of a salusd
    device each (and ``cpus_per_trial`` CPUs, default ``1/packing``: the device work runs
    in salusd, not in the trial's process) and open their sessions on that device,
    named after the trial. For a ``ray.tune.Tuner`` built by hand. ``gate``: a
    ``_Gate`` actor that admits trials to devices (what :class:`Tuner` uses while it
    measures the packing degree)."""
    _, tune = _ray()
    if packing < 1:
        raise ValueError(f"packing must be at least 1, not {packing}")

    @functools.wraps(trainable)
    def on_salus(config):
        return trainable(config)

    # Ray builds the trial's class from the function with these classes first in line:
    # the device is taken in the trial's setup, before Ray's clock of the trial starts.
    on_salus.__mixins__ = (_on_device(local_devices(devices), gate),
                           *getattr(trainable, "__mixins__", ()))
    cpus = 1.0 / packing if cpus_per_trial is None else cpus_per_trial
    return tune.with_resources(on_salus, {"cpu": cpus, RESOURCE: 1.0 / packing})


def _on_device(addresses: Sequence[str], gate: Any) -> type:
    """A mixin of the trainable class Ray builds around a trial's function: it points the
    trial at a salusd device of its node (``SALUS_ADDRESS``, and ``SALUS_SESSION_NAME``
    of the trial) in the trial's ``setup``, waiting there for ``gate`` to admit it, and
    gives the place back when the trial ends or the process is reused for another trial.
    Ray starts a trial's clock (its ``time_total_s``) after ``setup``, so a wait for a
    place is not counted as the trial's time."""
    ray, _ = _ray()
    addresses = list(addresses)

    class OnSalusDevice:
        def setup(self, config):
            self._salus_enter()
            super().setup(config)

        def reset_config(self, new_config):
            if not super().reset_config(new_config):
                return False  # Ray stops this process instead: cleanup leaves
            self._salus_leave()
            self._salus_enter()
            return True

        def cleanup(self):
            try:
                super().cleanup()
            finally:
                self._salus_leave()

        def _salus_enter(self):
            self._salus_trial = self.trial_id
            if gate is None:
                address = _pick_device(addresses)
            else:
                node = ray.get_runtime_context().get_node_id()
                while (address := ray.get(gate.enter.remote(
                        self._salus_trial, self.trial_name, node, os.getpid()))) is None:
                    time.sleep(0.05)
            os.environ["SALUS_ADDRESS"] = address
            os.environ[SESSION_NAME_ENV] = self.trial_name

        def _salus_leave(self):
            if gate is not None and getattr(self, "_salus_trial", None):
                ray.get(gate.leave.remote(self._salus_trial))
                self._salus_trial = None

    return OnSalusDevice


class PackingProbe:
    """Fluid's profiling on the trials themselves: the packing degree ``c`` (Eq. 3.1)
    measured in place, from the step rates of the trials one device runs, while tuning.

    The device admits ``limit`` trials, starting at 1. Once exactly ``limit`` trial
    sessions run there, each past ``warmup`` steps, a window opens; it closes when each
    has taken ``window`` more steps, and gives each trial its time per step ``t``. A
    trial that ends or starts mid-window starts a new one. With
    ``p = limit > 1``, the slowdown ``r = T^p / T^(p-1)`` is the mean of ``t^p / t^(p-1)``
    over the trials measured in both windows (or of the windows' means when no trial
    was: then different configurations are compared), and the marginal benefit is
    ``O^p = 1 - (p-1)/p * r``. While it is above ``threshold`` and ``p < max_packing``,
    the limit grows by one; then ``c`` is the last ``p`` above it and the limit is ``c``.

    :meth:`observe` is fed samples (the time, and each trial session's steps so far); it
    does no I/O, so the decisions are tested without Ray or a daemon.
    """

    def __init__(self, max_packing: int = 4, threshold: float = PACKING_THRESHOLD, *,
                 window: int = 20, warmup: int = 2):
        if max_packing < 1 or window < 1:
            raise ValueError("max_packing and window must be at least 1")
        self.max_packing, self.threshold = max_packing, threshold
        self.window, self.warmup = window, warmup
        #: Trials admitted to the device now.
        self.limit = 1
        #: ``T^1, T^2, ...``: time per step with 1, 2, ... trials, T^p chained from T^1
        #: by the measured slowdowns.
        self.times: list[float] = []
        #: Set once ``c`` is decided: the limit is then final.
        self.decided = False
        self._opened: tuple[float, dict[str, int]] | None = None
        self._previous: dict[str, float] = {}

    @property
    def benefits(self) -> list[float]:
        """Eq. 3.1's ``O^p`` for ``p = 2..len(times)``."""
        return packing_marginal_benefit(self.times)

    def observe(self, now: float, steps: Mapping[str, int]) -> int:
        """One sample: ``steps`` maps each trial session on the profiled device to the
        steps it has taken. Returns the limit in force after it."""
        if self.decided:
            return self.limit
        if len(steps) != self.limit or min(steps.values(), default=0) < self.warmup:
            self._opened = None
            return self.limit
        if self._opened is None or set(self._opened[1]) != set(steps):
            self._opened = (now, dict(steps))
            return self.limit
        opened_at, before = self._opened
        taken = {name: steps[name] - before[name] for name in steps}
        if min(taken.values()) < self.window:
            return self.limit
        per_step = {name: (now - opened_at) / n for name, n in taken.items()}
        self._close(per_step)
        return self.limit

    def _close(self, per_step: dict[str, float]) -> None:
        mean = sum(per_step.values()) / len(per_step)
        self._opened = None
        if not self.times:
            self.times.append(mean)
        else:
            both = [per_step[n] / self._previous[n] for n in per_step if n in self._previous]
            ratio = (sum(both) / len(both) if both
                     else mean / (sum(self._previous.values()) / len(self._previous)))
            self.times.append(self.times[-1] * ratio)
        self._previous = per_step
        p = len(self.times)
        benefit = self.benefits[-1] if p > 1 else math.inf
        if benefit > self.threshold and p < self.max_packing:
            self.limit = p + 1
        else:
            self.limit = packing_degree(self.times, self.threshold)
            self.decided = True


class _Gate:
    """A Ray actor: which trials (by id, with their names) run on which device of which
    node, at most ``limit`` per device. Trials over the limit wait to enter (their Ray
    resources are already held). A trial leaves when Ray stops its trainable or reuses
    its process for another trial (:func:`_on_device`), and in any case when Ray Tune
    reports it complete or failed (:func:`_leave_on_end`). A trial
    whose process died on this actor's node leaves at the next ``enter`` there, without
    waiting for Ray to notice (seconds)."""

    def __init__(self, devices: Sequence[str], limit: int):
        ray, _ = _ray()
        self.devices, self.limit = list(devices), limit
        self.node = ray.get_runtime_context().get_node_id()
        #: (node, device) -> trial -> (name, pid of its process)
        self.active: dict[tuple[str, str], dict[str, tuple[str, int]]] = {}

    def enter(self, trial: str, name: str, node: str, pid: int) -> str | None:
        """The device of ``node`` that ``trial`` (its process ``pid``) runs on (the one
        with the fewest trials), or None: wait."""
        keys = [(node, d) for d in self.devices]
        for key in keys:
            trials = self.active.setdefault(key, {})
            if node == self.node:
                for dead in [t for t, (_, p) in trials.items() if not _alive(p)]:
                    del trials[dead]
        key = min(keys, key=lambda k: len(self.active[k]))
        if len(self.active[key]) >= self.limit:
            return None
        self.active[key][trial] = (name, pid)
        return key[1]

    def leave(self, trial: str) -> None:
        for trials in self.active.values():
            trials.pop(trial, None)

    def set_limit(self, limit: int) -> None:
        self.limit = limit

    def on(self, node: str, device: str) -> list[str]:
        """The names of the trials on ``device`` of ``node``."""
        return sorted(name for name, _ in self.active.get((node, device), {}).values())


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _leave_on_end(gate: Any) -> Any:
    """A Ray Tune callback that takes each trial out of ``gate`` when it ends, however it
    ends: a trial a scheduler stops may never return from its function."""
    _, tune = _ray()

    class LeaveOnEnd(tune.Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            gate.leave.remote(trial.trial_id)

        def on_trial_error(self, iteration, trials, trial, **info):
            gate.leave.remote(trial.trial_id)

    return LeaveOnEnd()


class Tuner:
    """``ray.tune.Tuner`` with its trials as sessions on salusd, ``packing`` to a device.

    ``packing``: how many trials share a device; ``"auto"`` measures it on the trials
    themselves while they tune (:class:`PackingProbe`: one trial per device at first, one
    more each time Eq. 3.1's marginal benefit stays above ``threshold``, up to
    ``max_packing``; ``profile_steps`` steps per trial per measurement). ``devices``: the
    salusd addresses of each node (default ``SALUS_ADDRESS`` or the default socket).
    ``policy``: set on this node's daemons before tuning (``pack`` runs every admitted
    trial in a lane of its own; ``None`` leaves the daemon's). ``ray_init``: arguments of
    ``ray.init`` when Ray is not running yet (then a local Ray starts with the
    ``salus_device`` resource). Everything else goes to ``ray.tune.Tuner`` unchanged;
    :meth:`fit` returns its ``ResultGrid``.

    With ``"auto"``, a trial Ray has started may wait for its place on a device. It waits
    in its trainable's ``setup``, before Ray starts the trial's clock: ``time_total_s``
    counts the trial's own time only, so schedulers that stop trials by time judge them
    fairly.
    """

    def __init__(self, trainable: Callable[[dict], Any], *, param_space: dict | None = None,
                 tune_config: Any = None, run_config: Any = None,
                 packing: int | str = "auto", devices: Sequence[str] | None = None,
                 policy: str | None = "pack", cpus_per_trial: float | None = None,
                 max_packing: int = 4, threshold: float = PACKING_THRESHOLD,
                 profile_steps: int = 20, ray_init: Mapping[str, Any] | None = None):
        if packing != "auto" and (not isinstance(packing, int) or packing < 1):
            raise ValueError(f"packing must be 'auto' or a positive int, not {packing!r}")
        if max_packing < 1 or profile_steps < 1:
            raise ValueError("max_packing and profile_steps must be at least 1")
        self.trainable, self.param_space = trainable, param_space or {}
        self.tune_config, self.run_config = tune_config, run_config
        self.devices = local_devices(devices)
        self.policy, self.cpus_per_trial = policy, cpus_per_trial
        self.max_packing, self.threshold = max_packing, threshold
        self.profile_steps = profile_steps
        self.ray_init = dict(ray_init or {})
        self.auto = packing == "auto"
        #: The packing degree in force (with ``"auto"``: what :meth:`fit` measured, or
        #: the limit it had reached when tuning ended before the measurement did).
        self.packing: int | None = packing if isinstance(packing, int) else None
        #: Time per step with 1, 2, ... trials on a device, when measured.
        self.packing_times: list[float] = []
        #: Whether ``"auto"`` decided ``c`` before tuning ended.
        self.packing_decided = False
        #: Seconds from the start of tuning until ``c`` was decided (trials tune meanwhile).
        self.profile_s = 0.0

    def _ensure_ray(self) -> None:
        ray, _ = _ray()
        if not ray.is_initialized():
            init_ray(self.devices, **self.ray_init)
        if ray.cluster_resources().get(RESOURCE, 0) < 1:
            raise SalusError(
                f"the Ray cluster advertises no {RESOURCE!r} resource: start each node with "
                f"ray start --resources='{{\"{RESOURCE}\": N}}' (N = its salusd devices), or "
                "let salus.tune start a local Ray")

    def fit(self):
        """Sets the policy and runs the tuning, measuring the packing degree meanwhile
        with ``"auto"``."""
        ray, tune = _ray()
        self._ensure_ray()
        if self.policy:
            for address in self.devices:
                with Client(address) as client:
                    client.policy(self.policy)
        kwargs = {"param_space": self.param_space}
        if self.tune_config is not None:
            kwargs["tune_config"] = self.tune_config
        if self.run_config is not None:
            kwargs["run_config"] = self.run_config
        if not self.auto:
            wrapped = with_salus(self.trainable, packing=self.packing, devices=self.devices,
                                 cpus_per_trial=self.cpus_per_trial)
            return tune.Tuner(wrapped, **kwargs).fit()
        gate = ray.remote(num_cpus=0)(_Gate).remote(self.devices, 1)
        run_config = kwargs.get("run_config") or tune.RunConfig()
        kwargs["run_config"] = dataclasses.replace(
            run_config, callbacks=[*(run_config.callbacks or []), _leave_on_end(gate)])
        probe = PackingProbe(self.max_packing, self.threshold, window=self.profile_steps)
        client = Client(self.devices[0])
        watch = client.watch()
        prober = threading.Thread(target=self._probe,
                                  args=(probe, gate, watch, time.monotonic()), daemon=True,
                                  name="salus-packing-probe")
        # Ray starts one trial more per device than the gate can admit: it starts up
        # (Ray's worker, the imports) while the others run and waits at the gate, so a
        # place that frees, or a limit that grows, is taken at once, not after a
        # process start that can take longer than a short trial.
        wrapped = with_salus(self.trainable, packing=self.max_packing + 1,
                             devices=self.devices, cpus_per_trial=self.cpus_per_trial,
                             gate=gate)
        prober.start()
        try:
            return tune.Tuner(wrapped, **kwargs).fit()
        finally:
            watch.cancel()
            prober.join(timeout=10)
            client.close()
            self.packing, self.packing_times = probe.limit, list(probe.times)
            self.packing_decided = probe.decided
            ray.kill(gate)

    def _probe(self, probe: PackingProbe, gate: Any, watch: Any, started: float) -> None:
        """Feeds ``probe`` the steps of the trials on the first device of this node, at
        the daemon's time of each step (its event stream), and passes its limit to the
        gate, until it decides (``profile_s`` then counts from ``started``) or ``watch``
        is cancelled. On a cluster, the node tuning runs from must run trials too."""
        ray, _ = _ray()
        device = self.devices[0]
        node = ray.get_runtime_context().get_node_id()
        kinds = admin_pb2.EventKind
        names: dict[int, str] = {}      # the trials' open sessions on the device
        steps: dict[int, int] = {}
        limit = probe.limit
        try:
            for event in watch:
                if event.kind == kinds.EVENT_KIND_OPENED:
                    name = event.detail.rsplit(" (P ", 1)[0]
                    if name not in ray.get(gate.on.remote(node, device)):
                        continue  # a session of something else
                    names[event.session], steps[event.session] = name, 0
                elif event.kind == kinds.EVENT_KIND_CLOSED and event.session in names:
                    del names[event.session], steps[event.session]
                elif (event.kind == kinds.EVENT_KIND_ITERATION_FINISHED
                      and event.session in steps):
                    steps[event.session] += 1
                else:
                    continue
                seconds = event.time_us / 1e6
                if probe.observe(seconds, {names[s]: n for s, n in steps.items()}) != limit:
                    limit = probe.limit
                    ray.get(gate.set_limit.remote(limit))
                if probe.decided:
                    self.profile_s = time.monotonic() - started
                    return
        except (SalusError, ray.exceptions.RayError):
            return  # tuning ended (the watch cancelled) or the daemon went away
