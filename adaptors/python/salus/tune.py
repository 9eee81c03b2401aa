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

- **Packing degree c** (Eq. 3.1): measured by running 1, 2, ... copies of one trial side by
  side on a device for a few iterations (:func:`profile_packing`), or given
  (``packing=2``). Each trial then asks Ray for ``1/c`` of the custom resource
  ``salus_device`` (one unit per salusd on a node), so Ray Tune starts at most ``c`` trials
  per device and queues the rest, and each salusd packs its trials into lanes (PACK).
- **Device**: each trial's process gets ``SALUS_ADDRESS`` of a device of its node (the
  one with the fewest sessions) and ``SALUS_SESSION_NAME`` of its trial, so salusctl and
  the daemon's session list show trials by name.
- **DynamicFluid** is not applied: a trial whose neighbours finish gets the whole device
  from salusd at once (lanes run side by side), and salus.torch has no training across
  devices, so the scaling degree is 1.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .client import Client, address_from_env
from .errors import SalusError
from .fluid import packing_degree, packing_marginal_benefit
from .torch import SESSION_NAME_ENV

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


def _trial_name() -> str:
    _, tune = _ray()
    try:
        return tune.get_context().get_trial_name() or ""
    except Exception:  # noqa: BLE001 - outside a trial (a direct call): no name
        return ""


def with_salus(trainable: Callable[[dict], Any], *, packing: int,
               devices: Sequence[str] | None = None,
               cpus_per_trial: float | None = None) -> Any:
    """``trainable`` as a Ray Tune trainable whose trials take ``1/packing`` of a salusd
    device each (and ``cpus_per_trial`` CPUs, default ``1/packing``: the device work runs
    in salusd, not in the trial's process) and open their sessions on that device,
    named after the trial. For a ``ray.tune.Tuner`` built by hand."""
    _, tune = _ray()
    if packing < 1:
        raise ValueError(f"packing must be at least 1, not {packing}")
    addresses = local_devices(devices)

    @functools.wraps(trainable)
    def on_salus(config):
        os.environ["SALUS_ADDRESS"] = _pick_device(addresses)
        name = _trial_name()
        if name:
            os.environ[SESSION_NAME_ENV] = name
        return trainable(config)

    cpus = 1.0 / packing if cpus_per_trial is None else cpus_per_trial
    return tune.with_resources(on_salus, {"cpu": cpus, RESOURCE: 1.0 / packing})


def _fixed(space: Any) -> Any:
    """One configuration of a param space: grid searches' first value, a sample of each
    distribution, constants as they are."""
    if isinstance(space, Mapping):
        if set(space) == {"grid_search"}:
            return _fixed(list(space["grid_search"])[0])
        return {k: _fixed(v) for k, v in space.items()}
    if hasattr(space, "sample") and callable(space.sample):
        return space.sample()
    return space


def profile_packing(trainable: Callable[[dict], Any], config: Mapping[str, Any], *,
                    devices: Sequence[str] | None = None, iterations: int = 5,
                    max_packing: int = 4, threshold: float = PACKING_THRESHOLD,
                    cpus_per_trial: float | None = None,
                    storage_path: str | None = None) -> tuple[int, list[float]]:
    """Fluid's profiling: runs ``p = 1, 2, ...`` copies of ``trainable(config)`` side by
    side on one device for ``iterations`` reports each, measures the mean time between
    reports (after the first, which includes tracing and opening the session), and stops
    once Eq. 3.1's marginal benefit of the ``p``-th copy is at most ``threshold``. Returns
    ``(c, times)``."""
    ray, tune = _ray()
    if not ray.is_initialized():
        init_ray(devices)
    storage = storage_path or tempfile.mkdtemp(prefix="salus-tune-profile-")
    times: list[float] = []
    for p in range(1, max_packing + 1):
        copies = with_salus(trainable, packing=p, devices=devices[:1] if devices else None,
                            cpus_per_trial=cpus_per_trial)
        grid = tune.Tuner(copies, param_space=dict(config),
                          tune_config=tune.TuneConfig(num_samples=p),
                          run_config=tune.RunConfig(
                              name=f"salus-profile-{p}", storage_path=storage, verbose=0,
                              stop={"training_iteration": iterations})).fit()
        per_copy = []
        for result in grid:
            if result.error is not None:
                raise SalusError(f"profiling with {p} trials on a device failed: {result.error}")
            frame = result.metrics_dataframe
            steady = list(frame["time_this_iter_s"])[1:] if frame is not None else []
            if steady:
                per_copy.append(sum(steady) / len(steady))
        if not per_copy:
            raise SalusError("profiling measured nothing: the trainable must call "
                             f"tune.report at least twice (it ran {iterations} iterations)")
        times.append(sum(per_copy) / len(per_copy))
        if p > 1 and packing_marginal_benefit(times)[-1] <= threshold:
            break
    return packing_degree(times, threshold), times


class Tuner:
    """``ray.tune.Tuner`` with its trials as sessions on salusd, ``packing`` to a device.

    ``packing``: how many trials share a device; ``"auto"`` measures it first with
    :func:`profile_packing` on ``profile_config`` (default: one configuration drawn from
    ``param_space``). ``devices``: the salusd addresses of each node (default
    ``SALUS_ADDRESS`` or the default socket). ``policy``: set on this node's daemons before
    tuning (``pack`` runs every admitted trial in a lane of its own; ``None`` leaves the
    daemon's). ``ray_init``: arguments of ``ray.init`` when Ray is not running yet (then a
    local Ray starts with the ``salus_device`` resource). Everything else goes to
    ``ray.tune.Tuner`` unchanged; :meth:`fit` returns its ``ResultGrid``.
    """

    def __init__(self, trainable: Callable[[dict], Any], *, param_space: dict | None = None,
                 tune_config: Any = None, run_config: Any = None,
                 packing: int | str = "auto", devices: Sequence[str] | None = None,
                 policy: str | None = "pack", cpus_per_trial: float | None = None,
                 profile_config: Mapping[str, Any] | None = None, profile_iterations: int = 5,
                 max_packing: int = 4, threshold: float = PACKING_THRESHOLD,
                 ray_init: Mapping[str, Any] | None = None):
        if packing != "auto" and (not isinstance(packing, int) or packing < 1):
            raise ValueError(f"packing must be 'auto' or a positive int, not {packing!r}")
        self.trainable, self.param_space = trainable, param_space or {}
        self.tune_config, self.run_config = tune_config, run_config
        self.devices = local_devices(devices)
        self.policy, self.cpus_per_trial = policy, cpus_per_trial
        self.profile_config, self.profile_iterations = profile_config, profile_iterations
        self.max_packing, self.threshold = max_packing, threshold
        self.ray_init = dict(ray_init or {})
        #: The packing degree in force (measured by :meth:`fit` with ``"auto"``).
        self.packing: int | None = packing if isinstance(packing, int) else None
        #: Mean iteration times with 1, 2, ... trials on a device, when measured.
        self.packing_times: list[float] = []
        #: Seconds the profiling took.
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
        """Sets the policy, measures the packing degree if asked, and runs the tuning."""
        _, tune = _ray()
        self._ensure_ray()
        if self.policy:
            for address in self.devices:
                with Client(address) as client:
                    client.policy(self.policy)
        if self.packing is None:
            started = time.perf_counter()
            config = self.profile_config or _fixed(self.param_space)
            self.packing, self.packing_times = profile_packing(
                self.trainable, config, devices=self.devices,
                iterations=self.profile_iterations, max_packing=self.max_packing,
                threshold=self.threshold, cpus_per_trial=self.cpus_per_trial)
            self.profile_s = time.perf_counter() - started
        wrapped = with_salus(self.trainable, packing=self.packing, devices=self.devices,
                             cpus_per_trial=self.cpus_per_trial)
        kwargs = {"param_space": self.param_space}
        if self.tune_config is not None:
            kwargs["tune_config"] = self.tune_config
        if self.run_config is not None:
            kwargs["run_config"] = self.run_config
        return tune.Tuner(wrapped, **kwargs).fit()
