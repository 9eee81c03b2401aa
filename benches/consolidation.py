"""Many served models on one salusd (Salus section 2.5: 42 models on one GPU).

``--models`` small models (the MLP, CNN at 16 px and GPT-style decoder of ``salus.models``
in turn, each with its own weights) are served from one ``salusd --policy pack`` through
salusd's serving path, ``salus.serving.ServedModel``: each request is one input without a
batch dimension, and the model's request scheduler (``--scheduler``, default ORLOJ) puts
requests together into batches of 1, 2, 4 or 8. All models are opened first (each traced
once per batch size; the time is reported). Each model gets Poisson requests (its own
seed) at ``--rate`` per second, sent open loop: ``submit`` futures at their arrival times
from a few sender threads, a request never waiting for the one before it. First each
model is served alone for ``--alone-seconds`` (the others open but idle); then all of them
at once for ``--seconds``, each with the same arrival pattern.

Latency is salusd's (``InferInfo.latency_ms``: from the request's arrival at salusd to
its answer); the client's (from the arrival time the request was due to be sent to its
answer in Python: sender lag, gRPC and the adaptor included) is reported beside it. p99s
are over answered requests; dropped ones are counted apart. Each model's SLO
(``--slo-ms``): by default 3x its p99 alone (``Nx``: N times; the middle of the 1.5-5x range
of the ORLOJ experiment), or a number of milliseconds for every model. Requests carry it as
their deadline together; alone they carry none, and their finish rate is the share
answered within it. Reported: how many sessions were admitted side by side (lanes and
memory), each model's p99 alone and together and the difference, how many stay within
``--slack-ms`` (5 ms) of their p99 alone, the finish rates under the SLO, drops, requests
served per second, the opening time and the load average.

    python benches/consolidation.py [--json] [--models 42] [--rate 5] [--seconds 10]
        [--alone-seconds 3] [--slo-ms 3x] [--scheduler orloj] [--device cpu]

salusd is ``$SALUSD``, else ``target/release/salusd`` (built if missing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adaptors" / "python"))
sys.path.insert(0, str(ROOT / "benches"))

from online_offline import Daemon, percentile  # noqa: E402
from salus.client import Client  # noqa: E402
from salus.errors import RequestDroppedError  # noqa: E402
from salus.models import target_models  # noqa: E402
from salus.serving import ServedModel  # noqa: E402

KINDS = ["mlp", "cnn", "gpt"]
BATCH_SIZES = (1, 2, 4, 8)
SENDERS = 4


def model(i: int):
    """The i-th served model: its name, module and eight requests' inputs (rows)."""
    kind = KINDS[i % len(KINDS)]
    spec = target_models(batch_size=8, image_size=16)[kind]
    return f"{kind}-{i}", spec.model(i), list(spec.batch(i)[0])


def arrivals(seed: int, rate: float, seconds: float) -> list[float]:
    rng, out, t = random.Random(seed), [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return out
        out.append(t)


def send(served, rows, events, slo_ms) -> tuple[list[tuple], float]:
    """Submits every ``(time, model)`` of ``events`` at its time, open loop, from
    ``SENDERS`` threads. Returns, per request, ``(model, salusd ms or None, client ms,
    requests in its batch, error)`` (None and the error when it was not answered), and
    the seconds from the start to the last answer."""
    results: list = [None] * len(events)
    answered = threading.Semaphore(0)
    start = time.monotonic() + 0.2

    def done(n: int, i: int, due: float, future) -> None:
        ended = time.monotonic()
        try:
            _, info = future.result()
            results[n] = (i, info.latency_ms, (ended - due) * 1e3, info.batch_requests,
                          None, ended)
        except Exception as error:  # noqa: BLE001  (a drop, or counted as an error)
            results[n] = (i, None, (ended - due) * 1e3, 0, error, ended)
        answered.release()

    def sender(k: int) -> None:
        for n in range(k, len(events), SENDERS):
            at, i = events[n]
            due = start + at
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            try:
                future = served[i].submit(rows[i][n % len(rows[i])], slo_ms=slo_ms[i],
                                          with_info=True)
            except Exception as error:  # noqa: BLE001  (counted as an error)
                results[n] = (i, None, 0.0, 0, error, time.monotonic())
                answered.release()
                continue
            future.add_done_callback(lambda f, n=n, i=i, due=due: done(n, i, due, f))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(SENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in events:
        answered.acquire()
    last = max((r[5] for r in results), default=start)
    return [r[:5] for r in results], last - start


def p99(values: list[float]) -> float:
    return percentile(values, 0.99) if values else math.nan


def summary(records: list[tuple], slo: float) -> dict:
    """One model's requests in one phase: p99s, finish rate under ``slo``, drops."""
    daemon = [r[1] for r in records if r[1] is not None]
    return {"requests": len(records), "p99_ms": p99(daemon),
            "client_p99_ms": p99([r[2] for r in records if r[1] is not None]),
            "finish_rate": sum(d <= slo for d in daemon) / len(records) if records else 1.0,
            "dropped": sum(isinstance(r[4], RequestDroppedError) for r in records),
            "errors": [r[4] for r in records if r[1] is None
                       and not isinstance(r[4], RequestDroppedError)],
            "batched": sum(r[3] for r in records if r[1] is not None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--models", type=int, default=42)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--alone-seconds", type=float, default=3.0)
    parser.add_argument("--slack-ms", type=float, default=5.0)
    parser.add_argument("--slo-ms", default="3x",
                        help="Nx: N times each model's p99 alone; a number: ms for all")
    parser.add_argument("--scheduler", default="orloj")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    factor = float(args.slo_ms[:-1]) if args.slo_ms.endswith("x") else None
    binary = Path(os.environ.get("SALUSD") or ROOT / "target" / "release" / "salusd")
    if not binary.exists() and not os.environ.get("SALUSD"):
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "salusd"], cwd=ROOT,
                       check=True)
    torch.set_num_threads(1)
    daemon = Daemon(binary, ["--device", args.device, "--memory", "2GiB", "--policy", "pack"])
    models = [model(i) for i in range(args.models)]
    rows = [r for _, _, r in models]
    served: list[ServedModel] = []
    client = Client(daemon.address)
    try:
        opening = time.monotonic()
        for name, module, inputs in models:
            served.append(ServedModel(module, inputs[0], batch_sizes=BATCH_SIZES,
                                      scheduler=args.scheduler, client=client, name=name))
        open_s = time.monotonic() - opening
        for s, inputs in zip(served, rows):
            for x in inputs[:3]:
                s.infer(x)
        status = client.status()
        lanes = len(status.lanes)
        admitted = sum(1 for s in client.list_sessions() if s.state == 2)
        used = status.memory.persistent_bytes + status.memory.lane_bytes
        # Alone: each model the only one with requests, without deadlines.
        no_slo = [0.0] * len(models)
        alone = [send(served, rows, [(t, i) for t in arrivals(i, args.rate,
                                                               args.alone_seconds)],
                      no_slo)[0] for i in range(len(models))]
        alone_p99 = [p99([r[1] for r in a if r[1] is not None]) for a in alone]
        slo = [factor * p if factor is not None else float(args.slo_ms) for p in alone_p99]
        # Together: every model at once, the same arrivals (longer), with deadlines.
        events = sorted((t, i) for i in range(len(models))
                        for t in arrivals(i, args.rate, args.seconds))
        records, wall = send(served, rows, events,
                             [s if s == s else 0.0 for s in slo])  # nan: no deadline
        load = os.getloadavg()
    finally:
        for s in served:
            s.close()
        client.close()
        daemon.stop()
    together = [[r for r in records if r[0] == i] for i in range(len(models))]
    rows_out, errors = [], []
    for i, (name, _, _) in enumerate(models):
        a, t = summary(alone[i], slo[i]), summary(together[i], slo[i])
        errors += a.pop("errors") + t.pop("errors")
        delta = t["p99_ms"] - a["p99_ms"]
        rows_out.append({
            "model": name, "open_ms": served[i].open_ms, "slo_ms": slo[i],
            "requests_alone": a["requests"], "requests": t["requests"],
            "p99_alone_ms": a["p99_ms"], "p99_together_ms": t["p99_ms"], "delta_ms": delta,
            "within_slack": delta <= args.slack_ms,
            "client_p99_alone_ms": a["client_p99_ms"],
            "client_p99_together_ms": t["client_p99_ms"],
            "finish_rate_alone": a["finish_rate"], "finish_rate_together": t["finish_rate"],
            "dropped_alone": a["dropped"], "dropped": t["dropped"],
            "answered": t["requests"] - t["dropped"], "batched": t["batched"]})

    def spread(key: str) -> dict:
        values = [r[key] for r in rows_out if r[key] == r[key]]
        return {"worst": max(values, default=math.nan),
                "median": statistics.median(values) if values else math.nan,
                "best": min(values, default=math.nan)}

    sent = sum(r["requests"] for r in rows_out)
    answered = sum(r["answered"] for r in rows_out)
    finished = sum(r["finish_rate_together"] * r["requests"] for r in rows_out)
    report = {
        "models": args.models, "admitted_side_by_side": admitted, "lanes": lanes,
        "memory_used_bytes": used, "scheduler": args.scheduler, "rate_per_model": args.rate,
        "batch_sizes": list(BATCH_SIZES), "slo": args.slo_ms, "slack_ms": args.slack_ms,
        "open_s": open_s, "open_ms_per_model": spread("open_ms"),
        "requests_sent": sent, "requests_answered": answered,
        "requests_per_s": answered / wall, "dropped": sent - answered - len(errors),
        "dropped_alone": sum(r["dropped_alone"] for r in rows_out), "errors": len(errors),
        "finish_rate_together": finished / sent if sent else 1.0,
        "finish_rate_together_per_model": spread("finish_rate_together"),
        "finish_rate_alone_per_model": spread("finish_rate_alone"),
        "batch_requests_mean": sum(r["batched"] for r in rows_out) / max(1, answered),
        "within_slack": sum(r["within_slack"] for r in rows_out),
        "delta_ms": spread("delta_ms"), "p99_alone_ms": spread("p99_alone_ms"),
        "p99_together_ms": spread("p99_together_ms"),
        "client_p99_alone_ms": spread("client_p99_alone_ms"),
        "client_p99_together_ms": spread("client_p99_together_ms"),
        "load_average": list(load), "cpus": os.cpu_count(), "per_model": rows_out,
    }
    if errors:
        print(f"{len(errors)} requests failed; the first: {errors[0]}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    d, c = report["delta_ms"], report["client_p99_together_ms"]
    print(f"{args.models} models ({args.scheduler}, batch sizes {BATCH_SIZES}) opened in "
          f"{open_s:.1f} s; {admitted} admitted side by side in {lanes} lanes "
          f"({used / 2**20:.1f} MiB); {report['requests_per_s']:.0f} requests/s served, "
          f"{report['batch_requests_mean']:.2f} requests in a request's batch on average")
    print(f"{report['within_slack']} of {args.models} within {args.slack_ms} ms of their "
          f"p99 alone (salusd's latency); worst {d['worst']:+.2f} ms, median "
          f"{d['median']:+.2f} ms; client p99 together worst {c['worst']:.2f} ms, median "
          f"{c['median']:.2f} ms")
    print(f"finish rate under the SLO ({args.slo_ms}) together "
          f"{report['finish_rate_together']:.4f} (worst model "
          f"{report['finish_rate_together_per_model']['best']:.4f}); {report['dropped']} "
          f"dropped of {sent}; load average {load[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'model':<8}{'slo':>7}{'p99 alone':>11}{'together':>10}{'delta':>8}"
          f"{'client alone':>14}{'together':>10}{'finish':>8}{'dropped':>9}")
    for r in rows_out:
        print(f"{r['model']:<8}{r['slo_ms']:>7.2f}{r['p99_alone_ms']:>11.2f}"
              f"{r['p99_together_ms']:>10.2f}{r['delta_ms']:>+8.2f}"
              f"{r['client_p99_alone_ms']:>14.2f}{r['client_p99_together_ms']:>10.2f}"
              f"{r['finish_rate_together']:>8.3f}{r['dropped']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
