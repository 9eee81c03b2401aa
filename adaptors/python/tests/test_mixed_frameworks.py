"""A PyTorch job, a TensorFlow job and a JAX job sharing one salusd, under each policy:
each gets, bit for bit, what it gets alone on salusd (sharing changes when an iteration
runs, never what it computes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("tensorflow")
pytest.importorskip("jax")
import salus.jax as sj  # noqa: E402  (before JAX and TensorFlow: see salus.jax)
import salus.tf as stf  # noqa: E402
import salus.torch as st  # noqa: E402
import keras  # noqa: E402

from daemon import Daemon  # noqa: E402
from test_jax import batches as jax_batches  # noqa: E402
from test_jax import initial_state, train_step, MODELS  # noqa: E402
from test_tf import LOSS, batches as tf_batches, cnn  # noqa: E402

STEPS = 3


def torch_job(address: str) -> list[np.ndarray]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
            for _ in range(STEPS)]
    with st.TrainSession(model, torch.nn.functional.cross_entropy, optimizer, data[0],
                         address=address, name="torch job") as s:
        losses = [s.step(*b).numpy() for b in data]
        return losses + [v.numpy() for v in s.state_dict().values()]


def tf_job(address: str) -> list[np.ndarray]:
    model = cnn()
    data = tf_batches((4,) * STEPS)
    with stf.TrainSession(model, LOSS, keras.optimizers.Adam(0.01), data[0],
                          address=address, name="keras job") as s:
        losses = [s.step(*b) for b in data]
        return losses + list(s.state_dict().values())


def jax_job(address: str) -> list[np.ndarray]:
    data = jax_batches("encoder", (4,) * STEPS)
    with sj.TrainSession(train_step(MODELS["encoder"][0]), initial_state("encoder"), data[0],
                         address=address, name="jax job") as s:
        losses = [s.step(*b) for b in data]
        return losses + list(s.state_dict().values())


JOBS = {"torch": torch_job, "tf": tf_job, "jax": jax_job}


@pytest.fixture(scope="module")
def alone() -> dict[str, list[np.ndarray]]:
    with Daemon("--policy", "fifo", "--memory", "256MiB") as d:
        return {name: job(d.address) for name, job in JOBS.items()}


@pytest.mark.parametrize("policy", ["share", "pack", "srtf", "fair", "fifo"])
def test_three_frameworks_share_one_salusd_and_each_gets_its_own_results(alone, policy):
    results: dict[str, list[np.ndarray]] = {}
    errors: list[BaseException] = []
    with Daemon("--policy", policy, "--memory", "256MiB") as d:
        def run(name):
            try:
                results[name] = JOBS[name](d.address)
            except BaseException as error:  # noqa: BLE001  (re-raised below)
                errors.append(error)
        threads = [threading.Thread(target=run, args=(n,)) for n in JOBS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    for name in JOBS:
        assert len(results[name]) == len(alone[name]), name
        for got, want in zip(results[name], alone[name]):
            assert np.array_equal(np.asarray(got), np.asarray(want)), (policy, name)


def test_salus_imported_after_tensorflow_and_jax_traces_without_aborting():
    """TensorFlow, jaxlib and Triton each link LLVM, and a process that loads Triton after
    either aborts. salus.torch imports PyTorch's compiler stack (which loads Triton) when
    it is imported: after TensorFlow and JAX it must tell PyTorch that Triton is absent,
    and a step still traces (a fresh process: this one has loaded them in another
    order)."""
    script = textwrap.dedent("""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import tensorflow, jax
        import torch
        import salus, salus.torch, salus.tf, salus.jax
        model = torch.nn.Linear(3, 2)
        traced = salus.trace_train_step(model, torch.nn.functional.mse_loss,
                                        torch.optim.SGD(model.parameters(), lr=0.1),
                                        (torch.randn(4, 3), torch.randn(4, 2)))
        traced.to_graph()
        print("traced")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "traced" in run.stdout, run.stderr[-3000:]
