"""ASHA over an MLP classifier, twice: plain Ray Tune (eager PyTorch, a CPU per trial)
and salus.tune (the trials as sessions on salusd, Fluid's packing degree measured on them).
Prints, for each: wall time, time until a trial first reaches the target validation
accuracy, the best accuracy, and how busy the machine's CPUs were; for salus.tune also
the packing degree and how busy salusd's device was (its iterations' time over the run).

    salusd --device cpu &              # or any running salusd: SALUS_ADDRESS=...
    python examples/tune_asha.py [--samples 12] [--epochs 8] [--target 0.9] [--json]

The data set is synthetic (10 classes of 64 features around random centres, a fixed seed):
it needs no download and the same configurations reach the same accuracies both ways.
"""

import argparse
import json
import os
import tempfile
import threading
import time

import torch
import torch.nn.functional as F
from ray import tune
from ray.tune.schedulers import ASHAScheduler

CLASSES, FEATURES, BATCH = 10, 64, 64


def dataset():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(CLASSES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (4096,), generator=g)
    x = centres[y] + 1.6 * torch.randn(len(y), FEATURES, generator=g)
    return (x[:3072], y[:3072]), (x[3072:], y[3072:])


def train(config):
    """A function trainable: ``config["epochs"]`` epochs, a report of the validation
    accuracy after each; on salusd when ``config["salus"]``."""
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    (x, y), (vx, vy) = dataset()
    width = config["width"]
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    session = None
    if config["salus"]:
        import salus.torch
        session = salus.torch.TrainSession(model, F.cross_entropy, optimizer, batches[0],
                                           total_iterations=config["epochs"] * len(batches))

    def step(xb, yb):
        if session is not None:
            return session.step(xb, yb)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        return loss.detach()

    try:
        for _ in range(config["epochs"]):
            loss = sum(float(step(xb, yb)) for xb, yb in batches) / len(batches)
            if session is not None:
                session.update_model()
            with torch.no_grad():
                accuracy = float((model(vx).argmax(dim=1) == vy).float().mean())
            tune.report({"accuracy": accuracy, "loss": loss})
    finally:
        if session is not None:
            session.close()


def cpu_times():
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields), idle


def summarise(grid, started, ended, cpu_before, cpu_after, target):
    reports = []
    for result in grid:
        frame = result.metrics_dataframe
        if frame is not None:
            reports += list(zip(frame["timestamp"], frame["accuracy"]))
    reached = [t for t, a in reports if a >= target]
    total, idle = (a - b for a, b in zip(cpu_after, cpu_before))
    return {"wall_s": round(ended - started, 1),
            "time_to_target_s": round(min(reached) - started, 1) if reached else None,
            "best_accuracy": round(max(a for _, a in reports), 4),
            "trials": len(grid),
            "cpu_busy": round(1 - idle / total, 3) if total else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import ray

    import salus.tune
    from salus.client import Client, address_from_env
    from salus.v1 import admin_pb2

    address = address_from_env()
    here = os.path.dirname(os.path.abspath(__file__))
    salus.tune.init_ray([address], log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}})
    space = {"lr": tune.loguniform(1e-3, 0.3), "width": tune.choice([32, 64, 128]),
             "seed": 0, "epochs": args.epochs}
    storage = tempfile.mkdtemp(prefix="tune-asha-")

    def tune_config():
        return tune.TuneConfig(metric="accuracy", mode="max", num_samples=args.samples,
                               search_alg=tune.search.BasicVariantGenerator(random_state=0),
                               scheduler=ASHAScheduler(max_t=args.epochs, grace_period=1,
                                                       reduction_factor=2))

    out = {}
    cpu0, t0 = cpu_times(), time.time()
    grid = tune.Tuner(train, param_space={**space, "salus": False}, tune_config=tune_config(),
                      run_config=tune.RunConfig(storage_path=storage, name="eager",
                                                verbose=0)).fit()
    out["ray_tune"] = summarise(grid, t0, time.time(), cpu0, cpu_times(), args.target)

    client = Client(address)
    watch = client.watch()
    device_us = [0]

    def count():
        for event in watch:
            if event.kind == admin_pb2.EventKind.EVENT_KIND_ITERATION_FINISHED:
                device_us[0] += event.duration_us

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    cpu0, t0 = cpu_times(), time.time()
    tuner = salus.tune.Tuner(train, param_space={**space, "salus": True}, packing="auto",
                             devices=[address], tune_config=tune_config(),
                             run_config=tune.RunConfig(storage_path=storage, name="salus",
                                                       verbose=0))
    grid = tuner.fit()
    ended = time.time()
    watch.cancel()
    counter.join(timeout=5)
    client.close()
    out["salus_tune"] = {**summarise(grid, t0, ended, cpu0, cpu_times(), args.target),
                         "profile_s": round(tuner.profile_s, 1), "packing": tuner.packing,
                         "packing_decided": tuner.packing_decided,
                         "step_times_ms": [round(t * 1e3, 2) for t in tuner.packing_times],
                         "device_busy": round(device_us[0] / 1e6 / (ended - t0), 3)}
    ray.shutdown()
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"ASHA, {args.samples} trials, up to {args.epochs} epochs, target accuracy "
          f"{args.target}")
    print(f"{'':<12} {'wall s':>8} {'to target s':>12} {'best':>7} {'CPU busy':>9}")
    for name, r in out.items():
        print(f"{name:<12} {r['wall_s']:>8} {str(r['time_to_target_s']):>12} "
              f"{r['best_accuracy']:>7} {r['cpu_busy']:>9}")
    s = out["salus_tune"]
    how = (f"decided {s['profile_s']} s into tuning" if s["packing_decided"]
           else "not decided before tuning ended")
    print(f"salus.tune: packing c = {s['packing']} from times per step "
          f"{s['step_times_ms']} ms with 1, 2, ... trials on the device ({how}); "
          f"salusd's device busy {s['device_busy']:.0%} of the run")


if __name__ == "__main__":
    main()
