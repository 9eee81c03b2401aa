"""Helper of `salus-bench engine`: PyTorch's side of the engine benchmark.

Writes the four target models at benchmark size as reference runs (graph, initial state,
one batch; the format of ``salus.reference``) into OUT_DIR/<model>, times eager PyTorch
training steps of the same models on the CPU (or with ``--device cuda`` on GPU 0), and
prints JSON: ``{"threads": n, "device": ..., "models": {"mlp": {"torch_ms": ...}, ...}}``.

    python benches/torch_engine.py OUT_DIR [--iterations N] [--device cpu|cuda]
        [--model NAME ...] [--amp bf16|f16]

``--model`` (repeatable) picks models among the four and the large ones of
``salus.reference.large_runs`` (written unchecked: traced with fake tensors, no steps).

``--amp`` makes both sides mixed-precision steps: the graph is traced under
``torch.autocast("cpu", dtype)`` (salus' autocast, whose casts run on every salus device)
and eager PyTorch trains under ``torch.autocast(device, dtype)``, as a user's loop on
that device would; f16 adds a ``GradScaler`` to both. The two place their casts by their
own device's autocast lists, which agree on the products and convolutions that carry
the time. A model written with ``--amp`` is written unchecked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from salus import models
from salus.reference import ReferenceRun, large_runs, reference_runs, write_model

BATCH = 32
AMP = {"bf16": torch.bfloat16, "f16": torch.float16}


def bench_runs() -> dict[str, ReferenceRun]:
    """The reference runs' models and optimizers, at benchmark size."""
    specs = models.target_models(batch_size=BATCH, image_size=32, resnet_size=64,
                                 resnet_width=64)
    return {name: ReferenceRun(specs[name], run.optimizer)
            for name, run in reference_runs().items()}


def torch_ms(run: ReferenceRun, iterations: int, device: str = "cpu",
             amp: torch.dtype | None = None) -> float:
    """The median time of eager PyTorch's training step on ``device``, under autocast
    to ``amp`` when given (with a ``GradScaler`` for float16)."""
    spec = run.spec
    model = spec.model(0).to(device)
    optimizer = run.optimizer(model.parameters())
    scaler = torch.amp.GradScaler(device) if amp == torch.float16 else None
    *inputs, target = (t.to(device) for t in spec.batch(0))
    times = []
    for i in range(iterations + 3):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast(device, dtype=amp or torch.float32, enabled=amp is not None):
            loss = spec.loss_fn(model(*inputs), target)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        if device != "cpu":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", action="append", dest="models")
    parser.add_argument("--amp", choices=sorted(AMP), help="mixed precision on both sides")
    args = parser.parse_args(argv)
    amp = AMP.get(args.amp)
    small, large = bench_runs(), large_runs()
    names = args.models or list(small)
    unknown = [n for n in names if n not in small and n not in large]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {[*small, *large]}")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = {"threads": threads, "batch_size": BATCH, "device": device_name,
              "amp": args.amp, "models": {}}
    for name in dict.fromkeys(names):
        run = small.get(name) or large[name]
        write_model(args.out / name, name, run, steps=1, check=name in small and amp is None,
                    autocast=amp)
        result["models"][name] = {"torch_ms": torch_ms(run, args.iterations, args.device, amp)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
