"""Several PyTorch jobs on one salusd: FAIR shares, SRTF order.

On the ``sim`` device an iteration takes the time the session's ``expected_iteration_ms``
hint says and computes nothing, so shares depend on the policy alone, not on how busy
the machine is.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from daemon import Daemon

import salus.torch as st
from salus.client import Client
from salus.models import target_models

SPECS = target_models(batch_size=4, image_size=16)
# Shares are measured in wall time while the jobs run.
pytestmark = pytest.mark.solo


def _session(address, name, model_name, **hints):
    spec = SPECS[model_name]
    model = spec.model(0)
    return spec, st.TrainSession(model, spec.loss_fn,
                                 torch.optim.SGD(model.parameters(), lr=0.01),
                                 spec.batch(0), address=address, name=name,
                                 admission_timeout=10, **hints)


def _train(session, spec, stop: threading.Event, done: list, limit: int | None = None):
    """A training loop of synchronous steps (or, with a limit, pipelined ones)."""
    batch = spec.batch(0)
    if limit is None:
        while not stop.is_set():
            session.step(*batch)
    else:
        for _ in session.steps(batch for _ in range(limit)):
            pass
    done.append((session.hints_name, time.monotonic()))


def test_four_jobs_under_fair_get_equal_shares():
    """Four jobs of different models, each a training loop: within 10% of an equal share
    of the iterations per second (and of the device time) over a 2.5 s window."""
    with Daemon("--policy", "fair", "--device", "sim", "--memory", "1GiB") as daemon:
        sessions = []
        for i, model_name in enumerate(["mlp", "cnn", "gpt", "mlp"]):
            spec, session = _session(daemon.address, f"job{i}-{model_name}", model_name,
                                     expected_iteration_ms=8.0)
            session.hints_name = f"job{i}"
            sessions.append((spec, session))
        stop, done = threading.Event(), []
        threads = [threading.Thread(target=_train, args=(s, spec, stop, done))
                   for spec, s in sessions]
        for t in threads:
            t.start()
        with Client(daemon.address) as client:
            time.sleep(0.5)  # every loop is going

            def snapshot():
                return {i.id: (i.iterations, i.attained_service_ms)
                        for i in client.list_sessions()}

            before, t0 = snapshot(), time.monotonic()
            time.sleep(2.5)
            after, t1 = snapshot(), time.monotonic()
        stop.set()
        for t in threads:
            t.join()
        for _, s in sessions:
            s.close()
    ids = [s.id for _, s in sessions]
    rates = [(after[i][0] - before[i][0]) / (t1 - t0) for i in ids]
    service = [after[i][1] - before[i][1] for i in ids]
    mean_rate = sum(rates) / len(rates)
    mean_service = sum(service) / len(service)
    # One 8 ms iteration at a time: about 125 iterations/s in all.
    assert mean_rate > 15, rates
    for rate, served in zip(rates, service):
        assert abs(rate - mean_rate) <= 0.10 * mean_rate, f"iterations/s: {rates}"
        assert abs(served - mean_service) <= 0.10 * mean_service, f"service ms: {service}"


def test_srtf_finishes_the_short_job_first():
    """A long job (200 iterations) trains; a short one (10) opened after it finishes
    first, and the long one resumes and finishes. Both keep an iteration queued ahead
    (``steps``), so the policy always has both to choose from."""
    with Daemon("--policy", "srtf", "--device", "sim", "--memory", "1GiB") as daemon:
        long_spec, long_job = _session(daemon.address, "long", "cnn",
                                       expected_iteration_ms=5.0, total_iterations=200)
        long_job.hints_name = "long"
        stop, done = threading.Event(), []
        trainer = threading.Thread(target=_train, args=(long_job, long_spec, stop, done, 200))
        trainer.start()
        while long_job.iterations < 5:
            time.sleep(0.005)
        short_spec = SPECS["mlp"]
        model = short_spec.model(1)
        with st.TrainSession(model, short_spec.loss_fn,
                             torch.optim.SGD(model.parameters(), lr=0.01),
                             short_spec.batch(0), address=daemon.address, name="short",
                             total_iterations=10, expected_iteration_ms=5.0) as short:
            long_at_short_open = long_job.iterations
            losses = list(short.steps(short_spec.batch(k) for k in range(10)))
            short_done = time.monotonic()
            long_at_short_done = long_job.iterations
        trainer.join(timeout=30)
        assert not trainer.is_alive()
        long_job.close()
    assert long_at_short_done < 200, "the long job finished before the short one"
    # While the short job ran, the long one waited: at most the iteration running when
    # the short one's first arrived, and a few while a loaded machine kept the short
    # job's client from refilling its queue (10 iterations run alternately would let the
    # long job do 10).
    assert long_at_short_done - long_at_short_open <= 5, (long_at_short_open,
                                                          long_at_short_done)
    assert done and done[0][0] == "long" and done[0][1] > short_done
    assert long_job.iterations == 200
    assert len(losses) == 10 and all(loss.shape == () for loss in losses)
