"""Four PyTorch training jobs of different sizes share one salusd at once.

Each job is its own process (as separate users' scripts would be) that opens a
TrainSession and trains; this script prints every job's progress as it goes, then
`salusctl status` while all four hold the device, and each job's iterations per second.

    salusd --policy fair &            # or any running salusd: SALUS_ADDRESS=...
    python examples/share_gpu.py [--steps 200] [--policy fair]

`--policy` switches the daemon's policy first (allowed to root and the daemon's user).
"""

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import time
from pathlib import Path

JOBS = [  # name, model, batch size
    ("mlp-small", "mlp", 16),
    ("cnn", "cnn", 16),
    ("gpt", "gpt", 8),
    ("mlp-large", "mlp", 256),
]


def job(name, model_name, batch_size, steps, events, start_together):
    import torch

    import salus.torch
    from salus.models import target_models

    spec = target_models(batch_size=batch_size, image_size=16)[model_name]
    model = spec.model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = salus.torch.TrainSession(model, spec.loss_fn, optimizer, spec.batch(0),
                                       name=name, total_iterations=steps)
    events.put((name, "open", session.id, session.open_ms))
    start_together.wait()  # tracing takes longer for bigger models: train side by side
    with session:
        start = time.perf_counter()
        for step in range(1, steps + 1):
            loss = session.step(*spec.batch(step % 8))
            if step % max(1, steps // 6) == 0 or step == steps:
                events.put((name, "step", step, loss.item()))
        rate = steps / (time.perf_counter() - start)
    events.put((name, "done", rate, None))


def salusctl():
    here = Path(__file__).resolve().parents[1] / "target"
    for candidate in (shutil.which("salusctl"), here / "release" / "salusctl",
                      here / "debug" / "salusctl"):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--policy",
                        help="set the daemon's policy first (share/pack/srtf/fair/fifo)")
    args = parser.parse_args()

    import salus
    with salus.Client() as client:
        if args.policy:
            client.policy(args.policy)
        print(f"salusd at {client.address}, policy {client.policy()}")

    ctx = mp.get_context("spawn")
    events, barrier = ctx.Queue(), ctx.Barrier(len(JOBS))
    procs = [ctx.Process(target=job, args=(*j, args.steps, events, barrier)) for j in JOBS]
    for p in procs:
        p.start()
    opened, done, shown = 0, {}, False
    while len(done) < len(JOBS):
        name, kind, a, b = events.get()
        if kind == "open":
            opened += 1
            print(f"[{name:9}] session {a} open ({b:.0f} ms: trace, lower, upload)", flush=True)
        elif kind == "step":
            print(f"[{name:9}] step {a:4d}  loss {b:.4f}", flush=True)
            if opened == len(JOBS) and not shown:
                shown = True
                ctl = salusctl()
                if ctl:
                    print("\n$ salusctl status", flush=True)
                    subprocess.run([ctl, "status"], env={**os.environ}, check=False)
                    print(flush=True)
        else:
            done[name] = a
            print(f"[{name:9}] done: {a:.1f} iterations/s", flush=True)
    for p in procs:
        p.join()
    failed = [p for p in procs if p.exitcode != 0]
    if failed:
        raise SystemExit(f"{len(failed)} job(s) failed")
    print("\niterations/s: " + ", ".join(f"{n} {r:.1f}" for n, r in done.items()))


if __name__ == "__main__":
    main()
