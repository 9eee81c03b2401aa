"""Many served models on one salusd (Salus section 2.5: 42 models on one GPU).

``--models`` inference sessions of small models (the MLP, CNN and GPT-style decoder of
``salus.models``, each with its own weights, at batch sizes 1, 4 and 8) are opened on one
``salusd --policy pack``. Each receives requests at Poisson arrival times (its own seed)
at ``--rate`` per second; a request waits for the one before it of the same model, so its
latency is queueing plus service. First each model is served alone on the daemon for
``--alone-seconds``; then all of them at once for ``--seconds``, each with the same
arrival pattern. Reported: how many sessions were admitted side by side (lanes and
memory), each model's p99 latency alone and together and the difference, how many stay
within ``--slack-ms`` (5 ms) of their p99 alone, and the requests served per second.

    python benches/consolidation.py [--json] [--models 42] [--rate 5] [--seconds 10]
        [--alone-seconds 3] [--device cpu]

salusd is ``target/release/salusd`` (built if missing).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adaptors" / "python"))
sys.path.insert(0, str(ROOT / "benches"))

import salus.torch as st  # noqa: E402
from online_offline import Daemon, percentile  # noqa: E402
from salus.client import Client  # noqa: E402
from salus.models import target_models  # noqa: E402

KINDS = ["mlp", "cnn", "gpt"]
BATCHES = [1, 4, 8]


def model(i: int):
    """The i-th served model: its name, module and example inputs."""
    kind = KINDS[i % len(KINDS)]
    batch = BATCHES[(i // len(KINDS)) % len(BATCHES)]
    spec = target_models(batch_size=batch, image_size=16)[kind]
    torch.manual_seed(1000 + i)
    return f"{kind}-b{batch}-{i}", spec.model(i), spec.batch(i)[0]


def arrivals(seed: int, rate: float, seconds: float) -> list[float]:
    rng, out, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return out
        out.append(t)


def serve(session, inputs, times: list[float], start: float, out: list[float]):
    for at in times:
        wait = start + at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        session(inputs)
        out.append(time.monotonic() - (start + at))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--models", type=int, default=42)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--alone-seconds", type=float, default=3.0)
    parser.add_argument("--slack-ms", type=float, default=5.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    binary = ROOT / "target" / "release" / "salusd"
    if not binary.exists():
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "salusd"], cwd=ROOT,
                       check=True)
    torch.set_num_threads(1)
    daemon = Daemon(binary, ["--device", args.device, "--memory", "2GiB", "--policy", "pack"])
    rows = []
    try:
        models = [model(i) for i in range(args.models)]
        # Alone: each model the only session on the daemon.
        alone = []
        for i, (name, module, inputs) in enumerate(models):
            session = st.InferenceSession(module, inputs, address=daemon.address, name=name)
            for _ in range(3):
                session(inputs)
            latencies: list[float] = []
            serve(session, inputs, arrivals(i, args.rate, args.alone_seconds),
                  time.monotonic(), latencies)
            alone.append(latencies)
            session.close()
        # Together: every model at once, the same arrivals (longer).
        sessions = [st.InferenceSession(module, inputs, address=daemon.address, name=name,
                                        admission_timeout=60)
                    for name, module, inputs in models]
        for session, (_, _, inputs) in zip(sessions, models):
            session(inputs)
        with Client(daemon.address) as client:
            status = client.status()
            lanes = len(status.lanes)
            admitted = sum(1 for s in client.list_sessions() if s.state == 2)
            memory = status.memory
            used = memory.persistent_bytes + memory.lane_bytes
        together = [[] for _ in models]
        start = time.monotonic() + 0.5
        threads = [threading.Thread(target=serve, args=(
            session, inputs, arrivals(i, args.rate, args.seconds), start, together[i]))
            for i, (session, (_, _, inputs)) in enumerate(zip(sessions, models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - start
        for session in sessions:
            session.close()
    finally:
        daemon.stop()
    within = 0
    for (name, _, _), a, t in zip(models, alone, together):
        p99_alone, p99_together = percentile(a, 0.99) * 1e3, percentile(t, 0.99) * 1e3
        ok = p99_together - p99_alone <= args.slack_ms
        within += ok
        rows.append({"model": name, "requests": len(t), "p99_alone_ms": p99_alone,
                     "p99_together_ms": p99_together,
                     "delta_ms": p99_together - p99_alone, "within_slack": ok})
    report = {
        "models": args.models, "admitted_side_by_side": admitted, "lanes": lanes,
        "memory_used_bytes": used, "rate_per_model": args.rate,
        "requests_per_s": sum(len(t) for t in together) / wall,
        "within_slack": within, "slack_ms": args.slack_ms,
        "worst_delta_ms": max(r["delta_ms"] for r in rows), "per_model": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.models} models, {admitted} admitted side by side in {lanes} lanes "
          f"({used / 2**20:.1f} MiB); {report['requests_per_s']:.0f} requests/s in all")
    print(f"{within} of {args.models} within {args.slack_ms} ms of their p99 alone; worst "
          f"+{report['worst_delta_ms']:.2f} ms")
    print(f"{'model':<14}{'p99 alone':>11}{'together':>10}{'delta':>8}")
    for r in rows:
        print(f"{r['model']:<14}{r['p99_alone_ms']:>11.2f}{r['p99_together_ms']:>10.2f}"
              f"{r['delta_ms']:>+8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
