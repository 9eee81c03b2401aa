"""salus.tune: a small Ray Tune search (ASHA over four learning rates) whose trials run as
salusd sessions, two to the device, against the same search run eagerly."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune")

import torch  # noqa: E402
from daemon import Daemon  # noqa: E402
from ray.tune.schedulers import ASHAScheduler  # noqa: E402
from tune_trainable import train_mlp  # noqa: E402

import salus.tune  # noqa: E402
from salus.client import Client  # noqa: E402
from salus.v1 import admin_pb2  # noqa: E402

TESTS = Path(__file__).resolve().parent
SPACE = {"lr": tune.grid_search([0.5, 0.2, 0.05, 0.01]), "seed": 0, "iterations": 4,
         "steps": 5}


def _asha_config():
    return tune.TuneConfig(metric="loss", mode="min",
                           scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2))


def _history(grid) -> dict[float, list[float]]:
    out = {}
    for result in grid:
        assert result.error is None, result.error
        out[result.config["lr"]] = list(result.metrics_dataframe["loss"])
    return out


def test_asha_trials_run_as_salusd_sessions_two_to_a_device(tmp_path):
    with Daemon("--device", "cpu") as daemon:
        # Ray first: its processes start while no gRPC thread runs in this one.
        path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
        salus.tune.init_ray([daemon.address], num_cpus=2, log_to_driver=False,
                            runtime_env={"env_vars": {"PYTHONPATH": path}})
        client = Client(daemon.address)
        watch = client.watch()
        events: list[admin_pb2.Event] = []
        collector = threading.Thread(target=lambda: events.extend(watch), daemon=True)
        collector.start()
        try:
            tuner = salus.tune.Tuner(train_mlp,
                                     param_space={**SPACE, "salus": True, "rendezvous": 2},
                                     packing=2, devices=[daemon.address],
                                     tune_config=_asha_config(),
                                     run_config=tune.RunConfig(storage_path=str(tmp_path),
                                                               name="salus", verbose=0))
            on_salus = tuner.fit()
            eager = tune.Tuner(train_mlp, param_space={**SPACE, "salus": False},
                               tune_config=_asha_config(),
                               run_config=tune.RunConfig(storage_path=str(tmp_path),
                                                         name="eager", verbose=0)).fit()
        finally:
            ray.shutdown()
            assert client.policy() == "pack"
            watch.cancel()
            collector.join(timeout=10)
            client.close()

    # Every trial was a salusd session named after it, and ran every step it reported.
    kinds = admin_pb2.EventKind
    names = {e.session: e.detail.split(" (P ")[0] for e in events if e.kind == kinds.EVENT_KIND_OPENED}
    finished = {s: sum(1 for e in events if e.kind == kinds.EVENT_KIND_ITERATION_FINISHED
                       and e.session == s) for s in names}
    assert len(on_salus) == 4
    for result in on_salus:
        trial_id = result.metrics["trial_id"]
        sessions = [s for s, n in names.items() if trial_id in n]
        assert len(sessions) == 1, (trial_id, names)
        assert finished[sessions[0]] == result.metrics["steps"]
    # Two trials shared the device at a time, never more (packing=2).
    open_now, most = set(), 0
    for e in events:
        if e.kind == kinds.EVENT_KIND_OPENED:
            open_now.add(e.session)
        elif e.kind == kinds.EVENT_KIND_CLOSED:
            open_now.discard(e.session)
        most = max(most, len(open_now))
    assert most == 2
    # ASHA stopped some trials early, and each trial's losses are PyTorch's.
    salus_losses, eager_losses = _history(on_salus), _history(eager)
    assert min(len(v) for v in salus_losses.values()) < 4
    for lr, losses in salus_losses.items():
        common = min(len(losses), len(eager_losses[lr]))
        torch.testing.assert_close(torch.tensor(losses[:common]),
                                   torch.tensor(eager_losses[lr][:common]),
                                   rtol=1e-4, atol=1e-5)


def test_one_configuration_of_a_param_space():
    space = {"lr": tune.grid_search([0.1, 0.2]), "layers": tune.choice([2]), "seed": 3,
             "nested": {"width": tune.grid_search([8, 16])}}
    assert salus.tune._fixed(space) == {"lr": 0.1, "layers": 2, "seed": 3,
                                        "nested": {"width": 8}}
    with pytest.raises(ValueError, match="packing"):
        salus.tune.Tuner(train_mlp, packing=0)
