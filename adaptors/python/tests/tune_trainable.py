"""The Ray Tune trainable of ``test_tune.py``: a small MLP on a fixed synthetic data set,
trained eagerly or through ``salus.torch.TrainSession`` (``config["salus"]``). It lives in
its own module so that Ray's worker processes can import it."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from ray import tune

BATCH = 16


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * BATCH, 12, generator=g)
    y = (x[:, :3].sum(dim=1) > 0).long()
    return x, y


def _rendezvous(sessions: int, timeout: float = 10.0) -> None:
    """Waits until the daemon has ``sessions`` sessions open (or ``timeout`` passed), so
    that trials Ray runs together also train together, however long each took to start."""
    if sessions < 2:
        return
    from salus.client import Client
    deadline = time.monotonic() + timeout
    with Client() as client:
        while len(client.list_sessions()) < sessions and time.monotonic() < deadline:
            time.sleep(0.02)


def train_mlp(config: dict) -> None:
    """Reports what :func:`reports` yields, in one thread, with ``trained_s`` (the seconds
    since this function started) and ``pid``. ``config["exit"]``: the process dies at
    once."""
    began = time.monotonic()
    if config.get("exit"):
        os._exit(3)  # a trial process that dies without returning or raising
    torch.set_num_threads(1)
    for report in reports(config):
        tune.report({**report, "trained_s": time.monotonic() - began, "pid": os.getpid()})


def reports(config: dict) -> Iterator[dict]:
    """``config["iterations"]`` reports of ``config["steps"]`` SGD steps each (or as many
    as ``config["seconds"]`` allow) of a small MLP, eagerly or as a salusd session
    (``config["salus"]``). ``config["report_s"]``: each report takes at least that long,
    in rounds of ``config["steps"]`` steps."""
    torch.manual_seed(config["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    x, y = data()
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    session = None
    if config["salus"]:
        import salus.torch
        session = salus.torch.TrainSession(model, F.cross_entropy, optimizer, batches[0],
                                           total_iterations=config.get("iterations", 0)
                                           * config["steps"])
        _rendezvous(config.get("rendezvous", 0))

    def step(xb, yb):
        if session is not None:
            return session.step(xb, yb)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        return loss.detach()

    k = 0
    # With "seconds": reports until that long after the first step, however many.
    deadline = time.monotonic() + config["seconds"] if "seconds" in config else None
    try:
        for i in itertools.count():
            if (i >= config["iterations"] if deadline is None
                    else i > 0 and time.monotonic() > deadline):
                break
            losses, began = [], time.monotonic()
            while not losses or time.monotonic() - began < config.get("report_s", 0):
                for _ in range(config["steps"]):
                    losses.append(float(step(*batches[k % len(batches)])))
                    k += 1
            yield {"loss": sum(losses) / len(losses), "steps": k}
    finally:
        if session is not None:
            session.close()
