"""A served model under open-loop load beside offline training, on a real salusd.

MuxFlow's experiment on one device, with real PyTorch models through real daemons:

- the online job is an ``InferenceSession`` (the CNN of ``salus.models``) in its own
  process, receiving requests at Poisson arrival times (a fixed seed) at ``--load`` times
  the rate one request's service time allows; a request waits for the one before it (one
  session runs one iteration at a time), so its latency is its queueing plus its service
  (the measuring threads of this script, which hold Python's lock for whole switch
  intervals, stay out of the served client's process);
- the offline jobs are ``--trainers`` training loops (``offline=True``) in their own
  processes;
- systems: ``online_only`` (the served model alone), ``salus`` (protection on, the
  default), ``no_protection`` (``--protection off``: offline sessions are scheduled like
  online ones), each on a fresh daemon; ``offline_alone`` measures the trainers' steps per
  second on an idle daemon.

Reported per system (JSON keys as the simulator's ``experiment muxflow``):
``online_mean_slowdown`` and ``online_p99_slowdown`` (latency against ``online_only``),
``offline_throughput_fraction`` (the trainers' steps per second against
``offline_alone``), ``utilization`` (the fraction of wall time in which any iteration
ran on the device, from salusd's event stream) and ``utilization_gain`` (against
``online_only``), ``offline_fraction_of_idle`` (the offline fraction against the
fraction of wall time ``online_only`` left without an iteration), and the protection's
state at the end. On the cpu device the served model's own client and salusd's gRPC
use the same cores outside any iteration: ``cpu_busy`` is the share of the host's cores
salusd and the jobs' client processes used while the requests ran (from
``/proc/PID/stat``), and ``offline_fraction_of_idle_cores`` the offline fraction against
the share ``online_only`` left unused. With ``--rounds N`` every
system runs N times in turn, each round's figures are against that round's
``online_only`` and ``offline_alone``, and the report gives their medians (each round's
under ``per_round``).

    python benches/online_offline.py [--json] [--seconds 10] [--load 0.3] [--trainers 1]
        [--device cpu] [--rounds 1] [--slo-ms MS | --slo-headroom 3]
        [--offline-compute-share S] [--trainer-idle] [--salusd PATH]

salusd is ``target/release/salusd`` (built if missing) unless ``--salusd`` names another.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adaptors" / "python"))

import salus.torch as st  # noqa: E402
from salus.client import Client  # noqa: E402
from salus.models import target_models  # noqa: E402
from salus.v1 import admin_pb2  # noqa: E402

TRAINER = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, sys.argv[2])
    import salus.torch as st
    from salus.models import target_models
    spec = target_models(batch_size=32, image_size=32)[sys.argv[3]]
    model = spec.model(int(sys.argv[4]))
    session = st.TrainSession(model, spec.loss_fn,
                              torch.optim.SGD(model.parameters(), lr=0.01),
                              spec.batch(0), address=sys.argv[1], name="trainer",
                              offline=True)
    batch = spec.batch(0)
    while True:
        session.step(*batch)
        print(time.monotonic(), flush=True)
""")


SERVER = textwrap.dedent("""
    import json, sys, time, torch
    sys.path.insert(0, sys.argv[2])
    import salus.torch as st
    from salus.models import target_models
    torch.set_num_threads(1)
    spec = target_models(batch_size=8, image_size=32)["cnn"]
    session = st.InferenceSession(spec.model(0), spec.batch(0)[0], address=sys.argv[1],
                                  name="served", slo_ms=float(sys.argv[3]))
    inputs = spec.batch(0)[0]
    for _ in range(5):
        session(inputs)
    print("ready", flush=True)
    arrivals = json.loads(sys.stdin.readline())
    # Each request at its arrival time, after the one before: latencies from arrival.
    start = time.monotonic()
    latencies = []
    for at in arrivals:
        wait = start + at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        session(inputs)
        latencies.append(time.monotonic() - (start + at))
    session.close()
    print(json.dumps(latencies), flush=True)
""")


class Daemon:
    def __init__(self, binary: Path, args: list[str]):
        self.dir = tempfile.TemporaryDirectory(prefix="salus-muxflow-")
        self.address = os.path.join(self.dir.name, "salusd.sock")
        log = open(os.environ.get("SALUSD_LOG", os.path.join(self.dir.name, "salusd.log")), "wb")
        self.process = subprocess.Popen([str(binary), "--socket", self.address, *args],
                                        stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.address):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("salusd did not start")
            time.sleep(0.02)

    def stop(self):
        self.process.kill()
        self.process.wait()
        self.dir.cleanup()


class Trainer:
    """An offline training loop in its own process; `steps` holds its step end times."""

    #: What the trainers' command starts with (``chrt --idle 0`` for ``--trainer-idle``).
    prefix: list[str] = []

    def __init__(self, address: str, model: str, seed: int):
        self.process = subprocess.Popen(
            [*self.prefix, sys.executable, "-c", TRAINER, address,
             str(ROOT / "adaptors" / "python"), model, str(seed)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.steps: list[float] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.steps.append(float(line))

    def wait_started(self, steps: int = 3, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while len(self.steps) < steps:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the trainer did not start")
            time.sleep(0.05)

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t <= end for t in self.steps) / (end - start)

    def stop(self):
        self.process.kill()
        self.process.wait()


class Busy:
    """The union of the intervals in which some iteration ran, and protection's changes of
    health with the metrics behind each, from the event stream."""

    def __init__(self, address: str):
        self.client = Client(address)
        self.watch = self.client.watch()
        self.intervals: list[tuple[float, float]] = []
        self.health: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        finished = admin_pb2.EVENT_KIND_ITERATION_FINISHED
        for event in self.watch:
            if event.kind == admin_pb2.EVENT_KIND_PROTECTION:
                self.health.append((time.monotonic(), event.detail))
            if event.kind == finished:
                end = event.time_us / 1e6
                self.intervals.append((end - event.duration_us / 1e6, end))

    def fraction(self) -> float:
        self.watch.cancel()
        self.thread.join(timeout=5)
        spans = sorted(self.intervals)
        if not spans:
            return 0.0
        # The window: from the first start to the last end the stream saw.
        first, last = spans[0][0], max(e for _, e in spans)
        busy, start, end = 0.0, spans[0][0], spans[0][1]
        for s, e in spans[1:]:
            if s > end:
                busy += end - start
                start, end = s, e
            else:
                end = max(end, e)
        busy += end - start
        return busy / (last - first) if last > first else 0.0


class Server:
    """The served model's client in its own process: ready once its session is open and
    warm; `serve` sends it the arrival times and returns its latencies."""

    def __init__(self, address: str, slo_ms: float):
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER, address, str(ROOT / "adaptors" / "python"),
             str(slo_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the served model's client did not start")

    def serve(self, arrivals: list[float]) -> list[float]:
        self.process.stdin.write(json.dumps(arrivals) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the served model's client failed")
        return json.loads(line)

    def stop(self):
        self.process.kill()
        self.process.wait()


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system, every thread) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def run_system(binary: Path, args: list[str], arrivals, trainers: int, slo_ms: float
               ) -> dict:
    daemon = Daemon(binary, args)
    running: list[Trainer] = []
    server = None
    try:
        server = Server(daemon.address, slo_ms)
        running = [Trainer(daemon.address, "cnn", seed + 1) for seed in range(trainers)]
        for t in running:
            t.wait_started()
        busy = Busy(daemon.address)
        pids = [daemon.process.pid, server.process.pid] + [t.process.pid for t in running]
        cpu_before = sum(cpu_seconds(p) for p in pids)
        start = time.monotonic()
        latencies = server.serve(arrivals)
        end = time.monotonic()
        cpu = sum(cpu_seconds(p) for p in pids) - cpu_before
        utilization = busy.fraction()
        # Seconds from the start of the requests (as this process saw the events).
        health_changes = [[round(t - start, 2), d] for t, d in busy.health]
        with Client(daemon.address) as client:
            protection = client.status().protection
        return {
            "latencies": latencies,
            "offline_rate": sum(t.rate(start, end) for t in running),
            "utilization": utilization,
            # The share of the host's cores that salusd and the jobs' clients used.
            "cpu_busy": cpu / ((end - start) * len(os.sched_getaffinity(0))),
            "health": protection.health if protection.enabled else "off",
            "offline_duty": protection.offline_duty,
            "offline_evictions": protection.offline_evictions,
            "health_changes": health_changes,
        }
    finally:
        for t in running:
            t.stop()
        if server is not None:
            server.stop()
        daemon.stop()


def offline_alone(binary: Path, args: list[str], trainers: int, seconds: float
                  ) -> tuple[float, float]:
    """The trainers' steps per second on an idle daemon, and the share of the host's
    cores salusd and the trainers' processes used meanwhile."""
    daemon = Daemon(binary, args)
    running = [Trainer(daemon.address, "cnn", seed + 1) for seed in range(trainers)]
    try:
        for t in running:
            t.wait_started()
        pids = [daemon.process.pid] + [t.process.pid for t in running]
        cpu_before = sum(cpu_seconds(p) for p in pids)
        start = time.monotonic()
        time.sleep(seconds)
        end = time.monotonic()
        cpu = sum(cpu_seconds(p) for p in pids) - cpu_before
        return (sum(t.rate(start, end) for t in running),
                cpu / ((end - start) * len(os.sched_getaffinity(0))))
    finally:
        for t in running:
            t.stop()
        daemon.stop()


def figures(systems: dict[str, dict], alone: float, alone_cpu: float) -> dict:
    """One round's figures: each system's latencies against ``online_only``'s, its
    offline rate against ``alone``, its utilization against ``online_only``'s."""
    base = systems["online_only"]
    base_mean = statistics.mean(base["latencies"])
    base_p99 = percentile(base["latencies"], 0.99)
    out = {"offline_alone_steps_per_s": alone, "offline_alone_cpu_busy": alone_cpu,
           "systems": {}}
    for name, r in systems.items():
        mean, p99 = statistics.mean(r["latencies"]), percentile(r["latencies"], 0.99)
        out["systems"][name] = {
            "online_mean_ms": mean * 1e3,
            "online_p99_ms": p99 * 1e3,
            "online_mean_slowdown": mean / base_mean,
            "online_p99_slowdown": p99 / base_p99,
            "offline_steps_per_s": r["offline_rate"],
            "offline_throughput_fraction": r["offline_rate"] / alone if alone else 0.0,
            "offline_fraction_of_idle": (r["offline_rate"] / alone)
            / max(1e-9, 1 - base["utilization"]) if alone else 0.0,
            "offline_fraction_of_idle_cores": (r["offline_rate"] / alone)
            / max(1e-9, 1 - base["cpu_busy"]) if alone else 0.0,
            "cpu_busy": r["cpu_busy"],
            "utilization": r["utilization"],
            "utilization_gain": r["utilization"] / base["utilization"],
            "health": r["health"],
            "offline_duty": r["offline_duty"],
            "offline_evictions": r["offline_evictions"],
            "health_changes": r["health_changes"],
        }
    return out


def median_of(rounds: list[dict]) -> dict:
    """One system's figures over rounds: the median of each number, the last round's
    health (its changes are in the rounds)."""
    out = {}
    for key, value in rounds[0].items():
        if key == "health_changes":
            continue
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in rounds)
        else:
            out[key] = rounds[-1][key]
    return out


def service_time(binary: Path, args: list[str], spec) -> float:
    """The served model's time per request alone on a fresh daemon: the median of 30,
    after 10 to warm up."""
    probe = Daemon(binary, args)
    try:
        session = st.InferenceSession(spec.model(0), spec.batch(0)[0],
                                      address=probe.address)
        inputs = spec.batch(0)[0]
        times = []
        for _ in range(40):
            t = time.monotonic()
            session(inputs)
            times.append(time.monotonic() - t)
        session.close()
        return statistics.median(times[10:])
    finally:
        probe.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.3,
                        help="the online arrival rate as a fraction of 1 / service time")
    parser.add_argument("--trainers", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every system this many times, in turn, and report "
                        "the median of each round's ratios")
    parser.add_argument("--slo-ms", type=float, default=0.0,
                        help="the online session's SLO [default: --slo-headroom x its p99 "
                        "alone]")
    parser.add_argument("--slo-headroom", type=float, default=3.0)
    parser.add_argument("--offline-compute-share", type=float, default=None,
                        help="salusd's --offline-compute-share for the salus system "
                        "[default: salusd's]")
    parser.add_argument("--salusd", type=Path, default=None,
                        help="the salusd binary [default: target/release/salusd]")
    parser.add_argument("--service-ms", type=float, default=None,
                        help="the service time the request rate and SLO are set from, "
                        "for runs to compare at the same rate [default: measured, the "
                        "median of 30 requests alone]")
    parser.add_argument("--trainer-idle", action="store_true",
                        help="start the trainers' processes in Linux's idle scheduling "
                        "class (chrt --idle 0), as an operator may on a CPU host")
    args = parser.parse_args(argv)
    if args.trainer_idle:
        Trainer.prefix = ["chrt", "--idle", "0"]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    binary = args.salusd or ROOT / "target" / "release" / "salusd"
    if args.salusd is None and not binary.exists():
        subprocess.run(["cargo", "build", "--release", "--locked", "-p", "salusd"], cwd=ROOT,
                       check=True)
    common = ["--device", args.device, "--memory", "2GiB", "--policy", "share"]
    torch.set_num_threads(1)
    spec = target_models(batch_size=8, image_size=32)["cnn"]

    # Service time alone sets the request rate and the SLO (measured unless given).
    service = None if args.service_ms is None else args.service_ms / 1e3
    if service is None:
        service = service_time(binary, common, spec)
    rate = args.load / service
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > args.seconds:
            break
        arrivals.append(t)
    share = ([] if args.offline_compute_share is None
             else ["--offline-compute-share", str(args.offline_compute_share)])
    # Each round measures every system once, in the same order, and its figures are
    # against that round's online-only run and offline-alone rate: the host's load, which
    # drifts over minutes on a shared machine, then weighs on both sides of each ratio.
    # The SLO: --slo-ms, else a multiple of the latency the service gets alone in the
    # first round (its p99 under the same arrivals): the headroom an operator would give.
    slo_ms, rounds = args.slo_ms, []
    for _ in range(args.rounds):
        systems = {"online_only": run_system(binary, common, arrivals, 0, 0.0)}
        slo_ms = slo_ms or args.slo_headroom * 1e3 * percentile(
            systems["online_only"]["latencies"], 0.99)
        systems |= {
            "salus": run_system(binary, common + share, arrivals, args.trainers, slo_ms),
            "no_protection": run_system(binary, [*common, "--protection", "off"], arrivals,
                                        args.trainers, slo_ms),
        }
        rounds.append(figures(systems, *offline_alone(binary, common, args.trainers,
                                                      args.seconds)))
    report = {"service_ms": service * 1e3, "rate_per_s": rate, "requests": len(arrivals),
              "slo_ms": slo_ms, "rounds": len(rounds),
              "offline_alone_steps_per_s": statistics.median(
                  r["offline_alone_steps_per_s"] for r in rounds),
              "offline_alone_cpu_busy": statistics.median(
                  r["offline_alone_cpu_busy"] for r in rounds),
              "systems": {name: median_of([r["systems"][name] for r in rounds])
                          for name in rounds[0]["systems"]}}
    if len(rounds) > 1:
        report["per_round"] = rounds
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"service {report['service_ms']:.2f} ms, {len(arrivals)} requests at "
          f"{rate:.1f}/s (load {args.load}), SLO {slo_ms:.1f} ms; offline alone "
          f"{report['offline_alone_steps_per_s']:.2f} steps/s "
          f"({report['offline_alone_cpu_busy']:.2f} of the cores busy)"
          + (f"; medians of {len(rounds)} rounds" if len(rounds) > 1 else ""))
    print(f"{'system':<15}{'mean ms':>9}{'p99 ms':>9}{'mean x':>8}{'p99 x':>8}"
          f"{'offline':>9}{'of idle':>9}{'of cores':>9}{'util':>7}{'gain':>7}  health")
    for name, r in report["systems"].items():
        print(f"{name:<15}{r['online_mean_ms']:>9.2f}{r['online_p99_ms']:>9.2f}"
              f"{r['online_mean_slowdown']:>8.2f}{r['online_p99_slowdown']:>8.2f}"
              f"{r['offline_throughput_fraction']:>9.2f}{r['offline_fraction_of_idle']:>9.2f}"
              f"{r['offline_fraction_of_idle_cores']:>9.2f}"
              f"{r['utilization']:>7.2f}{r['utilization_gain']:>7.2f}  {r['health']}"
              f" (duty {r['offline_duty']:.2f})")
    for k, one in enumerate(rounds, start=1):
        for name, r in one["systems"].items():
            for at, change in r["health_changes"]:
                print(f"{'' if len(rounds) == 1 else f'round {k}: '}{name}: {at:.2f} s: {change}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
