"""``python -m salus.coverage [--json]``: which torchvision models lower to the IR.

Traces a training step (cross-entropy, SGD with momentum) of each model at a small input
and batch, lowers it, and reports whether every op is in the IR and which ops are not.
Tracing uses fake tensors (shapes only) by default, so large models take seconds;
``--tracing-mode real`` traces with real values. ``--save DIR`` also writes each lowered
graph to ``DIR/<model>.pb`` (for ``salus-bench plan``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import SalusError, UnsupportedOpError
from .models import image_batch
from .trace import trace_train_step


@dataclass(frozen=True)
class CoverageModel:
    name: str
    build: Callable[[], torch.nn.Module]
    image_size: int
    batch_size: int = 2


def _tv(name: str, **kwargs) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10, **kwargs)

    return build


# The smallest input each model accepts comfortably: 32 px for the CNNs (their last
# stage runs at 1x1; batch 2 keeps batch norm well defined); vit_b_16 is built for
# 32 px images (2x2 patches of 16 px) rather than 224.
COVERAGE_MODELS = [
    CoverageModel("resnet18", _tv("resnet18"), 32),
    CoverageModel("resnet50", _tv("resnet50"), 32),
    CoverageModel("mobilenet_v3_small", _tv("mobilenet_v3_small"), 32),
    CoverageModel("efficientnet_b0", _tv("efficientnet_b0"), 32),
    CoverageModel("vgg11", _tv("vgg11"), 32),
    CoverageModel("densenet121", _tv("densenet121"), 32),
    CoverageModel("vit_b_16", _tv("vit_b_16", image_size=32), 32),
]


def check_model(spec: CoverageModel, tracing_mode: str = "fake",
                save: Path | None = None) -> dict:
    """Traces and lowers one model; the result as JSON-ready data. With ``save``, writes
    the lowered graph to ``save/<model>.pb``."""
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = spec.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = image_batch(spec.batch_size, spec.image_size, 10)
    result = {"lowered": False, "missing_ops": [], "image_size": spec.image_size,
              "batch_size": spec.batch_size}
    try:
        traced = trace_train_step(model, F.cross_entropy, optimizer, batch,
                                  tracing_mode=tracing_mode)
        result["ops"] = traced.ops()
        graph = traced.to_graph()
        result.update(lowered=True, nodes=len(graph.nodes))
        if save is not None:
            save.mkdir(parents=True, exist_ok=True)
            (save / f"{spec.name}.pb").write_bytes(graph.SerializeToString())
    except UnsupportedOpError as e:
        result["missing_ops"] = e.ops
    except SalusError as e:
        result["error"] = str(e)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def run(names: list[str] | None = None, tracing_mode: str = "fake",
        save: Path | None = None) -> dict:
    chosen = [m for m in COVERAGE_MODELS if names is None or m.name in names]
    return {"models": {m.name: check_model(m, tracing_mode, save) for m in chosen}}


def _table(report: dict) -> str:
    lines = [f"{'model':20s} {'lowered':8s} {'nodes':>6s} {'ops':>4s}  missing ops"]
    for name, r in report["models"].items():
        missing = ", ".join(r["missing_ops"]) or r.get("error", "-")
        lines.append(f"{name:20s} {'yes' if r['lowered'] else 'NO':8s} "
                     f"{r.get('nodes', '-')!s:>6s} {len(r.get('ops', [])):>4d}  {missing}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--model", action="append", dest="models",
                        choices=[m.name for m in COVERAGE_MODELS],
                        help="check only this model (repeatable)")
    parser.add_argument("--tracing-mode", default="fake", choices=["fake", "real"])
    parser.add_argument("--save", type=Path, metavar="DIR",
                        help="write each lowered graph to DIR/<model>.pb")
    args = parser.parse_args(argv)
    report = run(args.models, args.tracing_mode, args.save)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0 if all(r["lowered"] for r in report["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
