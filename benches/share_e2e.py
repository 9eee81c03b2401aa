"""Four training jobs through one salusd against the same four as plain PyTorch processes.

Two phases on the same device, one after the other, in one run:

1. **salus**: a real ``salusd`` (its default policy unless ``--policy``) owns the device;
   four separate Python processes each open a ``salus.torch.TrainSession`` and train
   through it with pipelined steps (``session.steps``, ``--depth`` iterations in flight).
2. **plain**: salusd is stopped; the same four jobs run as four plain PyTorch processes on
   the same device at the same time (eager steps: zero_grad, forward, loss, backward,
   optimizer step; the batch copied from host memory every step, as from a data loader).

Every job process builds its model, opens its session (salus) or moves the model to the
device (plain), waits at a barrier for the other three, warms up (``--warmup`` steps: the
first launches, kernel compilation), waits again, then trains for ``--seconds`` of wall
time, so the four windows overlap. Reported per job: iterations and samples per second in each
phase and the ratio salus / plain; in aggregate: the sum of the four jobs' iterations per
second in each phase, its ratio, and the geometric mean of the per-job ratios.

Jobs (``--size``): ``full`` (GPU): two torchvision resnet18 at 32 px, batch 128, and two
``nn.TransformerEncoder`` classifiers (d 256 / 4 layers, batch 32; d 128 / 2 layers,
batch 64; 64 tokens); ``small``: the same shapes scaled down for CPUs; ``tiny``: the test
suite's smoke run (a small residual CNN in place of resnet18, tiny encoders). Job
processes start with ``spawn`` unless ``--start-method`` says otherwise (``forkserver``
imports torch once for all of them: quicker to start, used by the smoke test).

    python benches/share_e2e.py --salusd target/release/salusd --device cuda --json
    python benches/share_e2e.py --salusd target/debug/salusd --device cpu --size tiny --seconds 2
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adaptors" / "python"))

# name, kind, config. resnet, cnn: (width, image size, batch); encoder: (d_model, heads, layers,
# feed-forward, tokens, batch).
JOBS = {
    "full": [
        ("resnet18-a", "resnet", (64, 32, 128)),
        ("resnet18-b", "resnet", (64, 32, 128)),
        ("encoder-256", "encoder", (256, 4, 4, 1024, 64, 32)),
        ("encoder-128", "encoder", (128, 4, 2, 512, 64, 64)),
    ],
    "small": [
        ("resnet18-a", "resnet", (16, 32, 16)),
        ("resnet18-b", "resnet", (16, 32, 16)),
        ("encoder-64", "encoder", (64, 2, 2, 128, 32, 16)),
        ("encoder-32", "encoder", (32, 2, 1, 64, 32, 16)),
    ],
    "tiny": [  # a small residual CNN in place of resnet18, whose trace takes seconds
        ("cnn-a", "cnn", (4, 8, 2)),
        ("cnn-b", "cnn", (4, 8, 2)),
        ("encoder-16", "encoder", (16, 2, 1, 32, 8, 4)),
        ("encoder-8", "encoder", (8, 2, 1, 16, 8, 4)),
    ],
}
VOCAB = 1000
CLASSES = 10
BATCHES = 4  # distinct batches each job cycles through


def build(kind: str, config: tuple, seed: int):
    """``(model, loss_fn, batches, batch_size)`` on the CPU."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from salus import models

    torch.manual_seed(seed)
    if kind in ("resnet", "cnn"):
        width, size, batch = config
        model = (models.resnet18(CLASSES, width) if kind == "resnet"
                 else models.SmallCNN(3, width, CLASSES))
        batches = [models.image_batch(batch, size, CLASSES, seed=seed * 100 + i)
                   for i in range(BATCHES)]
        return model, F.cross_entropy, batches, batch

    d_model, heads, layers, ff, tokens, batch = config

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d_model)
            layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0,
                                               batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, CLASSES)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)).mean(dim=1))

    model = Encoder()
    generator = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, VOCAB, (batch, tokens), generator=generator),
                torch.randint(0, CLASSES, (batch,), generator=generator))
               for _ in range(BATCHES)]
    return model, F.cross_entropy, batches, batch


def _threads(device: str, jobs: int) -> None:
    import torch

    if device == "cpu":  # four processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // jobs))


def salus_job(index, job, args, address, barrier, results):
    """One job through salusd: open a TrainSession, train for ``args.seconds``."""
    try:
        import torch

        import salus.torch as st

        name, kind, config = job
        _threads("cpu", 4)  # tracing runs on the host whatever the device
        model, loss_fn, batches, batch = build(kind, config, seed=index + 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        session = st.TrainSession(model, loss_fn, optimizer, batches[0], address=address,
                                  name=name)
        barrier.wait(timeout=args.barrier_timeout)
        with session:
            for loss in session.steps((batches[i % BATCHES] for i in range(args.warmup)),
                                      depth=args.depth):
                pass
            barrier.wait(timeout=args.barrier_timeout)  # all four warm: time together
            stop = False

            def feed():
                i = 0
                while not stop:
                    yield batches[i % BATCHES]
                    i += 1

            count, start = 0, time.perf_counter()
            end = start + args.seconds
            last = start
            for loss in session.steps(feed(), depth=args.depth):
                count += 1
                last = time.perf_counter()
                if last >= end:
                    stop = True
            final = float(loss)
        results.put({"name": name, "phase": "salus", "iterations": count,
                     "seconds": last - start, "batch": batch, "loss": final,
                     "open_ms": session.open_ms})
    except BaseException as e:  # reported by the parent
        barrier.abort()
        results.put({"name": job[0], "phase": "salus", "error": f"{type(e).__name__}: {e}"})


def plain_job(index, job, args, barrier, results):
    """One job as a plain PyTorch process on ``args.device``."""
    try:
        import torch

        name, kind, config = job
        _threads(args.device, 4)
        model, loss_fn, batches, batch = build(kind, config, seed=index + 1)
        device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
        model = model.to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def step(i):
            x, y = (t.to(device) for t in batches[i % BATCHES])
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            return loss

        barrier.wait(timeout=args.barrier_timeout)
        for i in range(args.warmup):
            step(i)
        sync()
        barrier.wait(timeout=args.barrier_timeout)  # all four warm: time together
        count, start = 0, time.perf_counter()
        end = start + args.seconds
        while True:
            loss = step(count)
            count += 1
            # Check the clock without waiting for the device every step.
            if count % 8 == 0 and time.perf_counter() >= end:
                break
        sync()
        elapsed = time.perf_counter() - start
        results.put({"name": name, "phase": "plain", "iterations": count, "seconds": elapsed,
                     "batch": batch, "loss": float(loss.detach())})
    except BaseException as e:
        barrier.abort()
        results.put({"name": job[0], "phase": "plain", "error": f"{type(e).__name__}: {e}"})


def start_daemon(args, directory: str) -> tuple[subprocess.Popen, str]:
    socket = os.path.join(directory, "salusd.sock")
    device = args.salusd_device or ("cuda:0" if args.device == "cuda" else "cpu")
    command = [str(args.salusd), "--socket", socket, "--device", device]
    if args.memory:
        command += ["--memory", args.memory]
    if args.policy:
        command += ["--policy", args.policy]
    log_path = os.path.join(directory, "salusd.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 60
    while not os.path.exists(socket):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("salusd did not start: " + Path(log_path).read_text())
        time.sleep(0.02)
    return process, socket


def run_phase(ctx, target, jobs, extra, args) -> dict[str, dict]:
    results = ctx.Queue()
    barrier = ctx.Barrier(len(jobs))
    procs = [ctx.Process(target=target, args=(i, job, args, *extra, barrier, results))
             for i, job in enumerate(jobs)]
    for p in procs:
        p.start()
    out: dict[str, dict] = {}
    deadline = time.monotonic() + args.barrier_timeout + args.seconds + 120
    while len(out) < len(jobs):
        try:
            r = results.get(timeout=1)
        except queue.Empty:
            if time.monotonic() > deadline or all(p.exitcode is not None for p in procs):
                break
            continue
        out[r["name"]] = r
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    missing = [j[0] for j in jobs if j[0] not in out]
    errors = {n: r["error"] for n, r in out.items() if "error" in r}
    if missing or errors:
        raise RuntimeError(f"phase {target.__name__}: missing {missing}, errors {errors}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--salusd", type=Path, default=ROOT / "target" / "release" / "salusd",
                        help="the salusd binary (default: target/release/salusd)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=sorted(JOBS), default=None,
                        help="job sizes (default: full on cuda, small on cpu)")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="wall time each phase trains for, after warm-up")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing")
    parser.add_argument("--depth", type=int, default=4,
                        help="iterations each salus job keeps in flight")
    parser.add_argument("--memory", default=None,
                        help="salusd --memory (default: 16GiB on cuda, 1GiB on cpu)")
    parser.add_argument("--policy", default=None, help="salusd --policy (default: its own)")
    parser.add_argument("--salusd-device", default=None,
                        help="salusd --device (default: cuda:0 or cpu after --device; "
                             "sim checks the full-size jobs' graphs without a GPU)")
    parser.add_argument("--only", choices=["salus", "plain"], default=None,
                        help="run one phase only")
    parser.add_argument("--barrier-timeout", type=float, default=300.0,
                        help="seconds to wait for all four jobs to be ready")
    parser.add_argument("--start-method", choices=["spawn", "forkserver"], default="spawn",
                        help="how job processes start")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    args.size = args.size or ("full" if args.device == "cuda" else "small")
    if args.memory is None:
        args.memory = "16GiB" if args.device == "cuda" else "1GiB"
    jobs = JOBS[args.size]
    ctx = mp.get_context(args.start_method)
    if args.start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "salus.torch", "salus.models"])

    import torch

    report: dict = {
        "device": args.device, "size": args.size, "seconds": args.seconds,
        "depth": args.depth, "torch": torch.__version__, "python": platform.python_version(),
        "jobs": [], "aggregate": {},
    }
    salus_results: dict = {}
    plain_results: dict = {}
    if args.only in (None, "salus"):
        with tempfile.TemporaryDirectory(prefix="salus-share-") as directory:
            daemon, socket = start_daemon(args, directory)
            try:
                import salus
                with salus.Client(socket) as client:
                    report["policy"] = client.policy()
                salus_results = run_phase(ctx, salus_job, jobs, (socket,), args)
            except BaseException:
                print(Path(directory, "salusd.log").read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                daemon.terminate()  # salusd shuts down cleanly on SIGTERM
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
    if args.only in (None, "plain"):
        plain_results = run_phase(ctx, plain_job, jobs, (), args)

    if args.device == "cuda":  # asked only now: the parent holds no context while jobs run
        report["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        report["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
        report["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    ratios = []
    totals = {"salus": 0.0, "plain": 0.0}
    for name, kind, config in jobs:
        row: dict = {"name": name, "model": kind, "config": list(config)}
        for phase, results in (("salus", salus_results), ("plain", plain_results)):
            r = results.get(name)
            if r is None:
                continue
            rate = r["iterations"] / r["seconds"] if r["seconds"] > 0 else 0.0
            row.update({f"{phase}_iterations": r["iterations"], f"{phase}_seconds": r["seconds"],
                        f"{phase}_it_s": rate, f"{phase}_samples_s": rate * r["batch"],
                        f"{phase}_loss": r["loss"]})
            row["batch"] = r["batch"]
            if "open_ms" in r:
                row["open_ms"] = r["open_ms"]
            totals[phase] += rate
        if row.get("salus_it_s") and row.get("plain_it_s"):
            row["ratio"] = row["salus_it_s"] / row["plain_it_s"]
            ratios.append(row["ratio"])
        report["jobs"].append(row)
    report["aggregate"] = {"salus_it_s": totals["salus"], "plain_it_s": totals["plain"]}
    if totals["salus"] and totals["plain"]:
        report["aggregate"]["ratio"] = totals["salus"] / totals["plain"]
    if len(ratios) == len(jobs):
        report["aggregate"]["geomean_ratio"] = math.exp(
            sum(math.log(r) for r in ratios) / len(ratios))

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


def print_table(report: dict) -> None:
    print(f"{report['device']} ({report.get('gpu') or report['size']}), policy "
          f"{report.get('policy', '-')}, {report['seconds']:.0f} s per phase, torch "
          f"{report['torch']}")
    print(f"{'job':<13} {'batch':>5} {'salus it/s':>11} {'plain it/s':>11} {'salus/plain':>12}")

    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    for j in report["jobs"]:
        print(f"{j['name']:<13} {j.get('batch', 0):>5} {f(j.get('salus_it_s'), '11.2f')} "
              f"{f(j.get('plain_it_s'), '11.2f')} {f(j.get('ratio'), '12.2f')}")
    a = report["aggregate"]
    print(f"{'all four':<13} {'':>5} {f(a.get('salus_it_s'), '11.2f')} "
          f"{f(a.get('plain_it_s'), '11.2f')} {f(a.get('ratio'), '12.2f')}")
    if "geomean_ratio" in a:
        print(f"geometric mean of the per-job ratios: {a['geomean_ratio']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
