"""A served model (online) beside training jobs (offline) on one salusd.

The training jobs are other processes, killed by SIGINT, SIGTERM or SIGKILL while they
run: the online session's answers stay the same, bit for bit, and salusd shows who is
online and who is offline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from daemon import Daemon

import salus.torch as st
from salus.client import Client
from salus.errors import SalusError
from salus.models import target_models
from salus.v1 import admin_pb2, session_pb2

SPECS = target_models(batch_size=4, image_size=16)

# An offline training loop in its own process: prints "step" after each step.
TRAINER = textwrap.dedent("""
    import faulthandler, signal, sys, torch
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, when stuck
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even where the suite's shell
    # started it in the background (which ignores SIGINT, and Python then never installs
    # its handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import salus.torch as st
    from salus.models import target_models
    spec = target_models(batch_size=8, image_size=16)["cnn"]
    model = spec.model(1)
    session = st.TrainSession(model, spec.loss_fn,
                              torch.optim.SGD(model.parameters(), lr=0.01),
                              spec.batch(0), address=sys.argv[1], name="trainer",
                              offline=True)
    while True:
        session.step(*spec.batch(0))
        print("step", flush=True)
""")


def _served(address):
    spec = SPECS["cnn"]
    model = spec.model(0)
    inputs = spec.batch(0)[0]
    return st.InferenceSession(model, inputs, address=address, name="served",
                               slo_ms=2000.0), inputs


def _trainer(address) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    process = subprocess.Popen([sys.executable, "-c", TRAINER, address], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(3):  # it trains
        line = process.stdout.readline()
        assert line.strip() == "step", process.stderr.read()
    return process


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
                         ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_killed_offline_trainers_leave_the_online_answers_unchanged(sig):
    with Daemon("--memory", "1GiB") as daemon:
        served, inputs = _served(daemon.address)
        alone = [served(inputs + i) for i in range(3)]
        trainer = _trainer(daemon.address)
        with Client(daemon.address) as client:
            infos = {s.name: s for s in client.list_sessions()}
            assert getattr(infos["trainer"], "class") == session_pb2.SESSION_CLASS_OFFLINE
            assert getattr(infos["served"], "class") == session_pb2.SESSION_CLASS_ONLINE
            assert infos["served"].slo_ms == 2000.0
            beside = [served(inputs + i) for i in range(3)]
            trainer.send_signal(sig)
            during = [served(inputs + i) for i in range(3)]
            try:
                trainer.wait(timeout=30)
            except subprocess.TimeoutExpired:
                trainer.send_signal(signal.SIGUSR1)
                time.sleep(1)
                trainer.kill()
                pytest.fail(f"the trainer did not exit on {sig!r}: {trainer.stderr.read()}")
            deadline = time.monotonic() + 10
            while any(s.name == "trainer" for s in client.list_sessions()):
                assert time.monotonic() < deadline, "the killed trainer's session stays"
                time.sleep(0.05)
            after = [served(inputs + i) for i in range(3)]
            status = client.status()
            assert status.protection.enabled
            assert status.protection.offline_bytes == 0
        for results in (beside, during, after):
            for got, want in zip(results, alone):
                assert torch.equal(got, want)
        served.close()


def test_an_offline_session_gives_its_memory_to_an_online_one_and_trains_on_exactly():
    """Memory for one model: the online session takes the offline one's, which waits in
    host memory and then trains on exactly as it would have."""
    spec = SPECS["mlp"]
    with Daemon("--memory", "1GiB") as probe:
        model = spec.model(0)
        session = st.TrainSession(model, spec.loss_fn,
                                  torch.optim.SGD(model.parameters(), lr=0.01),
                                  spec.batch(0), address=probe.address)
        with Client(probe.address) as client:
            info = client.list_sessions()[0]
            one = info.persistent_bytes + info.ephemeral_bytes
        session.close()
    memory = (one * 3 // 2 + 255) // 256 * 256
    with Daemon("--memory", str(memory), "--offline-share", "0.9") as daemon:
        torch.manual_seed(0)
        reference = spec.model(2)
        opt = torch.optim.SGD(reference.parameters(), lr=0.01)
        model = spec.model(2)
        offline = st.TrainSession(model, spec.loss_fn,
                                  torch.optim.SGD(model.parameters(), lr=0.01),
                                  spec.batch(0), address=daemon.address, name="offline",
                                  offline=True)
        losses = [offline.step(*spec.batch(i)) for i in range(2)]
        online_model = spec.model(3)
        online = st.TrainSession(online_model, spec.loss_fn,
                                 torch.optim.SGD(online_model.parameters(), lr=0.01),
                                 spec.batch(0), address=daemon.address, name="online",
                                 admission_timeout=10)
        with Client(daemon.address) as client:
            states = {s.name: s.state for s in client.list_sessions()}
            assert states["offline"] == admin_pb2.SESSION_STATE_SUSPENDED, states
        online.step(*spec.batch(0))
        online.close()
        losses += [offline.step(*spec.batch(i)) for i in range(2, 4)]
        offline.close()
        with Daemon("--memory", "1GiB") as alone_daemon:
            alone = st.TrainSession(reference, spec.loss_fn, opt, spec.batch(0),
                                    address=alone_daemon.address)
            expected = [alone.step(*spec.batch(i)) for i in range(4)]
            alone.close()
        for got, want in zip(losses, expected):
            assert torch.equal(got, want)


def test_the_switch_for_offline_work():
    with Daemon("--memory", "1GiB") as daemon, Client(daemon.address) as client:
        with pytest.raises(ValueError, match="slo_ms is for online sessions"):
            client.open(None, offline=True, slo_ms=5.0)
        assert client.offline() == "healthy"
        assert client.offline(False) == "disabled"
        assert "disabled" in daemon.salusctl("offline")
        assert "enabled" in daemon.salusctl("offline", "on")
        with pytest.raises(SalusError):
            Client(daemon.address).policy("nonsense")
