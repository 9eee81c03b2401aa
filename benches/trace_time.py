"""How long tracing a training step takes (what opening a session waits for first):
``salus.trace_train_step`` as it records, with one fake tensor mode for the whole trace,
against ``make_fx``'s own way (a new fake tensor mode for every recorded value), the two
alternating in one process, the fastest of ``--repeats`` each.

    .venv/bin/python benches/trace_time.py [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

import salus
import salus.trace as trace
from salus import models


@contextlib.contextmanager
def _make_fx_own(tracing_mode: str):
    """The baseline: the trace lock alone, so ``make_fx`` builds its own fake modes."""
    with trace.TRACE_LOCK:
        yield


def _models() -> dict[str, models.TargetModel]:
    large = models.large_models(batch_size=8, image_size=64, num_classes=10, seq=64,
                                d_model=256, layers=4)
    return {**models.target_models(), "resnet50": large["resnet50"],
            "encoder": large["transformer_nodrop"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shared = trace.recording
    rows = []
    for name, spec in _models().items():
        model = spec.model(0)
        seconds = {"shared": [], "make_fx": []}
        for _ in range(args.repeats):
            for label, recording in (("make_fx", _make_fx_own), ("shared", shared)):
                trace.recording = recording
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                started = time.perf_counter()
                traced = salus.trace_train_step(model, spec.loss_fn, optimizer, spec.batch(0))
                seconds[label].append(time.perf_counter() - started)
        trace.recording = shared
        rows.append({"model": name, "nodes": len(traced.graph_module.graph.nodes),
                     "make_fx_s": min(seconds["make_fx"]), "shared_s": min(seconds["shared"])})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'model':12s} {'nodes':>6s} {'make_fx s':>10s} {'shared s':>9s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['model']:12s} {r['nodes']:6d} {r['make_fx_s']:10.2f} {r['shared_s']:9.2f} "
              f"{r['shared_s'] / r['make_fx_s']:6.2f}")


if __name__ == "__main__":
    main()
