"""``python -m salus.coverage [--json]``: which torchvision classification models lower to
the IR.

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


# What a model needs beyond the defaults to train on a small input: the smallest image it
# accepts comfortably (32 px for most CNNs, whose last stage then runs at 1x1; batch 2
# keeps batch norm well defined) and constructor arguments. The vision transformers are
# built for the small image (2x2 patches); googlenet and inception_v3 leave out their
# auxiliary heads (a training step's loss here is over the main output only).
_SMALL_INPUT = {
    "alexnet": (64, {}),
    "googlenet": (32, {"aux_logits": False, "init_weights": False}),
    "inception_v3": (75, {"aux_logits": False, "init_weights": False}),
    "maxvit_t": (224, {}),
    "swin_t": (64, {}), "swin_s": (64, {}), "swin_b": (64, {}),
    "swin_v2_t": (64, {}), "swin_v2_s": (64, {}), "swin_v2_b": (64, {}),
    "vit_b_16": (32, {"image_size": 32}), "vit_b_32": (64, {"image_size": 64}),
    "vit_l_16": (32, {"image_size": 32}), "vit_l_32": (64, {"image_size": 64}),
    "vit_h_14": (28, {"image_size": 28}),
}


def coverage_models() -> list[CoverageModel]:
    """Every classification model of ``torchvision.models``, at a small input."""
    import torchvision

    out = []
    for name in torchvision.models.list_models(module=torchvision.models):
        size, kwargs = _SMALL_INPUT.get(name, (32, {}))
        out.append(CoverageModel(name, _tv(name, **kwargs), size))
    return out


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
    chosen = [m for m in coverage_models() if names is None or m.name in names]
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
                        metavar="NAME",
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
