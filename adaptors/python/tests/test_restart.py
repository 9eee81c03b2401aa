"""A training loop through a restart of salusd (``--state-dir``): the session comes back
and the loop goes on by itself, bit for bit as if nothing happened; after a kill, it
resumes from the last snapshot and says from which iteration."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from daemon import Daemon

import salus.torch as st
from salus.reference import reference_runs

SPEC = reference_runs()["mlp"].spec


def _session(address, **kwargs):
    model = SPEC.model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return st.TrainSession(model, SPEC.loss_fn, optimizer, SPEC.batch(0), address=address,
                           admission_timeout=10, **kwargs)


def _restart_later(args, socket, delay=0.5):
    """Starts salusd again at ``socket`` after ``delay`` seconds, on another thread."""
    box = {}

    def start():
        time.sleep(delay)
        box["daemon"] = Daemon(*args, socket=socket)

    thread = threading.Thread(target=start)
    thread.start()
    return thread, box


def test_a_loop_goes_on_through_a_restart_bit_for_bit(tmp_path):
    batches = [SPEC.batch(k) for k in range(6)]
    with Daemon("--policy", "pack") as plain, _session(plain.address) as session:
        want = [session.step(*b).item() for b in batches]
        want_state = session.state_dict()

    socket = str(tmp_path / "salusd.sock")
    args = ("--policy", "pack", "--state-dir", str(tmp_path / "state"))
    first = Daemon(*args, socket=socket)
    session = _session(socket, reattach_timeout=30)
    losses = [session.step(*b).item() for b in batches[:3]]
    assert first.terminate() == 0  # salusd keeps the session and exits
    thread, box = _restart_later(args, socket)
    try:
        # The loop does not know: this step waits for salusd and runs on the session back.
        losses += [session.step(*b).item() for b in batches[3:]]
        assert losses == want
        state = session.state_dict()
        for name, value in want_state.items():
            assert torch.equal(state[name], value), name
        session.close()
    finally:
        thread.join()
        box["daemon"].stop()


def test_after_a_kill_the_session_says_where_it_resumes(tmp_path):
    batches = [SPEC.batch(k) for k in range(6)]
    with Daemon("--policy", "pack") as plain, _session(plain.address) as session:
        after = {}
        for k, batch in enumerate(batches, start=1):
            session.step(*batch)
            after[k] = session.state_dict()

    socket = str(tmp_path / "salusd.sock")
    args = ("--policy", "pack", "--state-dir", str(tmp_path / "state"),
            "--snapshot-every", "100ms")
    first = Daemon(*args, socket=socket)
    session = _session(socket, reattach_timeout=30)
    for batch in batches[:3]:
        session.step(*batch)
    time.sleep(0.5)  # a snapshot after the third step
    session.step(*batches[3])
    first.stop()  # SIGKILL: the fourth step is in a snapshot only if one came in time
    thread, box = _restart_later(args, socket)
    try:
        try:
            session.step(*batches[4])
            resumed = 4  # nothing was lost: the step ran on the session back
        except st.SessionResumedError as lost:
            resumed = lost.resumed_from
            assert resumed == 3 and "iterations 4..4 are lost" in str(lost)
            assert session.iterations == 3
            # The session holds the state after exactly those iterations; go on from there.
            state = session.state_dict()
            for name, value in after[3].items():
                assert torch.equal(state[name], value), name
            session.step(*batches[3])
            session.step(*batches[4])
        assert session.iterations == 5
        state = session.state_dict()
        for name, value in after[5].items():
            assert torch.equal(state[name], value), name
        session.close()
    finally:
        thread.join()
        box["daemon"].stop()
