"""Helper of `salus-bench engine`: PyTorch's side of the engine benchmark.

Writes the four target models at benchmark size as reference runs (graph, initial state,
one batch; the format of ``salus.reference``) into OUT_DIR/<model>, times eager PyTorch
training steps of the same models on the CPU, and prints JSON:
``{"threads": n, "models": {"mlp": {"torch_ms": ...}, ...}}``.

    python benches/torch_engine.py OUT_DIR [--iterations N]
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
from salus.reference import ReferenceRun, reference_runs, write_model

BATCH = 32


def bench_runs() -> dict[str, ReferenceRun]:
    """The reference runs' models and optimizers, at benchmark size."""
    specs = models.target_models(batch_size=BATCH, image_size=32, resnet_size=64,
                                 resnet_width=64)
    return {name: ReferenceRun(specs[name], run.optimizer)
            for name, run in reference_runs().items()}


def torch_ms(run: ReferenceRun, iterations: int) -> float:
    spec = run.spec
    model = spec.model(0)
    optimizer = run.optimizer(model.parameters())
    *inputs, target = spec.batch(0)
    times = []
    for i in range(iterations + 3):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = spec.loss_fn(model(*inputs), target)
        loss.backward()
        optimizer.step()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args(argv)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    result = {"threads": threads, "batch_size": BATCH, "models": {}}
    for name, run in bench_runs().items():
        write_model(args.out / name, name, run, steps=1)
        result["models"][name] = {"torch_ms": torch_ms(run, args.iterations)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
