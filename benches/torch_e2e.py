"""PyTorch training through salusd against eager PyTorch on the CPU, in the same run.

For each target model (``salus.models`` at benchmark size: batch 32, the CNN at 32 px,
with the optimizers of ``salus.reference``), measures

- ``torch_ms``: one eager training step (zero_grad, forward, loss, backward, optimizer
  step), PyTorch on every core;
- ``salus_ms``: one ``TrainSession.step`` through salusd's CPU device: serializing the
  batch, the gRPC round trip, the iteration, the loss back (what a training loop sees);
  ``device_ms``: the part the daemon reports as the iteration's time on the device;
- ``pipelined_ms``: one iteration of ``TrainSession.steps`` (RunStream, four in flight:
  no round trip between iterations);
- ``ratio``: ``salus_ms / torch_ms``; ``pipelined_ratio``: ``pipelined_ms / torch_ms``;
- ``open_session_ms``: constructing the ``TrainSession``: trace, lower, open and upload
  the parameters and optimizer state (``trace_ms``: the trace and lowering part); the
  median of three opens.

``--feeds`` measures instead what moving a batch costs: a step whose computation is
small next to its input (the mean of each 224 px image, then a linear layer) at several
batch sizes, through the gRPC byte stream and through a feed buffer, alternating in the
same run: ``overhead_ms`` is a step's time minus its device time.

Torch and salus steps alternate in rounds and each figure is the median over all rounds,
so a machine that gets busier during the run slows both alike. salusd is started from
``target/release/salusd`` (built if missing) on a temporary socket, or ``--address``
names a running one.

    python benches/torch_e2e.py [--json] [--models mlp,cnn,gpt] [--rounds 5] [--steps 10]
    python benches/torch_e2e.py --feeds [--batches 1,8,32,64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adaptors" / "python"))

import salus.torch as st  # noqa: E402
from salus import models  # noqa: E402
from salus.reference import reference_runs  # noqa: E402

BATCH = 32


def bench_runs() -> dict:
    specs = models.target_models(batch_size=BATCH, image_size=32, resnet_size=64,
                                 resnet_width=64)
    return {name: (specs[name], run.optimizer) for name, run in reference_runs().items()}


def start_daemon(binary: Path, directory: str, policy: str = "fifo"
                 ) -> tuple[subprocess.Popen, str]:
    if not binary.exists():
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "salusd"], cwd=ROOT,
                       check=True)
    socket = os.path.join(directory, "salusd.sock")
    log = open(os.path.join(directory, "salusd.log"), "wb")
    process = subprocess.Popen([str(binary), "--socket", socket, "--memory", "2GiB",
                                "--policy", policy], stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 30
    while not os.path.exists(socket):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("salusd did not start: "
                               + Path(directory, "salusd.log").read_text())
        time.sleep(0.02)
    return process, socket


def torch_times(spec, make_optimizer, steps: int) -> list[float]:
    model = spec.model(0)
    optimizer = make_optimizer(model.parameters())
    *inputs, target = spec.batch(0)
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = spec.loss_fn(model(*inputs), target)
        loss.backward()
        optimizer.step()
        loss.item()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def salus_times(session, batch, steps: int, device: list[float] | None = None
                ) -> list[float]:
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        session.step(*batch).item()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
            if device is not None:
                device.append(session.last_device_ms)
    return times


def pipelined_ms(session, batch, steps: int) -> float:
    start = time.perf_counter()
    for loss in session.steps(batch for _ in range(steps)):
        loss.item()
    return (time.perf_counter() - start) * 1e3 / steps


def bench_model(name: str, address: str, rounds: int, steps: int) -> dict:
    spec, make_optimizer = bench_runs()[name]
    model = spec.model(0)
    batch = spec.batch(0)
    opens, traces = [], []
    session = None
    for _ in range(3):
        if session is not None:
            session.close()
        session = st.TrainSession(model, spec.loss_fn, make_optimizer(model.parameters()),
                                  batch, address=address, name=f"bench-{name}",
                                  admission_timeout=30)
        opens.append(session.open_ms)
        traces.append(session.trace_ms)
    torch_ms, salus_ms, device_ms, piped = [], [], [], []
    with session:
        salus_times(session, batch, 3)  # warm-up: first iterations touch the lane
        for _ in range(rounds):
            torch_ms += torch_times(spec, make_optimizer, steps)
            salus_ms += salus_times(session, batch, steps, device_ms)
            piped.append(pipelined_ms(session, batch, 4 * steps))
    t, s = statistics.median(torch_ms), statistics.median(salus_ms)
    pm = statistics.median(piped)
    return {"torch_ms": round(t, 4), "salus_ms": round(s, 4), "ratio": round(s / t, 3),
            "device_ms": round(statistics.median(device_ms), 4),
            "pipelined_ms": round(pm, 4), "pipelined_ratio": round(pm / t, 3),
            "open_session_ms": round(statistics.median(opens), 1),
            "trace_ms": round(statistics.median(traces), 1),
            "persistent_bytes": session.session.persistent_bytes,
            "ephemeral_bytes": session.session.ephemeral_bytes}


class FeedProbe(torch.nn.Module):
    """Little computation per byte of input: each image's channel means, then a linear
    layer."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, 10)

    def forward(self, x):
        return self.head(x.mean(dim=(2, 3)))


def bench_feeds(address: str, batches: list[int], rounds: int, steps: int) -> dict:
    out = {}
    for n in batches:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, 3, 224, 224, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
        sessions, times, overheads = {}, {}, {}
        for feed_buffer in (False, True):
            model = FeedProbe()
            sessions[feed_buffer] = st.TrainSession(
                model, torch.nn.functional.cross_entropy,
                torch.optim.SGD(model.parameters(), lr=0.01), (x, y), address=address,
                name=f"feeds-{n}", feed_buffer=feed_buffer, admission_timeout=30)
            salus_times(sessions[feed_buffer], (x, y), 3)
            times[feed_buffer], overheads[feed_buffer] = [], []
        try:
            for _ in range(rounds):
                for feed_buffer, session in sessions.items():
                    device: list[float] = []
                    step = salus_times(session, (x, y), steps, device)
                    times[feed_buffer] += step
                    overheads[feed_buffer] += [t - d for t, d in zip(step, device)]
        finally:
            for session in sessions.values():
                session.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        over = {k: statistics.median(v) for k, v in overheads.items()}
        out[str(n)] = {"batch_mb": round(x.numel() * 4 / 2**20, 2),
                       "stream_ms": round(med[False], 3), "buffer_ms": round(med[True], 3),
                       "stream_overhead_ms": round(over[False], 3),
                       "buffer_overhead_ms": round(over[True], 3),
                       "overhead_ratio": round(over[True] / over[False], 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--models", default="mlp,cnn,gpt",
                        help="comma-separated, from mlp, cnn, gpt, resnet18")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round and side")
    parser.add_argument("--address", help="a running salusd (default: start one)")
    parser.add_argument("--salusd", type=Path, default=ROOT / "target" / "release" / "salusd")
    parser.add_argument("--feeds", action="store_true",
                        help="measure batch transport (byte stream vs feed buffer) instead")
    parser.add_argument("--batches", default="1,8,32,64",
                        help="batch sizes of 224 px images for --feeds")
    args = parser.parse_args(argv)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    result = {"threads": threads, "batch_size": BATCH, "torch": torch.__version__,
              "models": {}}
    with tempfile.TemporaryDirectory(prefix="salus-e2e-") as directory:
        process = None
        address = args.address
        if address is None:
            # Both transports' sessions stay open side by side under --feeds.
            process, address = start_daemon(args.salusd, directory,
                                            "pack" if args.feeds else "fifo")
        try:
            if args.feeds:
                result["feeds"] = bench_feeds(
                    address, [int(b) for b in args.batches.split(",")], args.rounds,
                    args.steps)
                if not args.json:
                    for n, m in result["feeds"].items():
                        print(f"batch {n:>3} ({m['batch_mb']:6.2f} MB)  stream "
                              f"{m['stream_ms']:8.3f} ms (overhead "
                              f"{m['stream_overhead_ms']:7.3f})  buffer {m['buffer_ms']:8.3f}"
                              f" ms (overhead {m['buffer_overhead_ms']:7.3f})  overhead "
                              f"ratio {m['overhead_ratio']:5.2f}", flush=True)
            for name in ([] if args.feeds else args.models.split(",")):
                result["models"][name] = bench_model(name, address, args.rounds, args.steps)
                if not args.json:
                    m = result["models"][name]
                    print(f"{name:9} torch {m['torch_ms']:8.3f} ms  salus {m['salus_ms']:8.3f} "
                          f"ms  ratio {m['ratio']:5.2f}  pipelined {m['pipelined_ms']:8.3f} ms "
                          f"({m['pipelined_ratio']:5.2f})"
                          f"  device {m['device_ms']:8.3f} ms  open {m['open_session_ms']:7.1f} ms",
                          flush=True)
        finally:
            if process is not None:
                process.terminate()
                process.wait(30)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
