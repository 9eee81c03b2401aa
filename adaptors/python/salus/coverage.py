"""``python -m salus.coverage [--json]``: which torchvision classification models lower to
the IR.

Traces a training step (cross-entropy, SGD with momentum) of each model at a small input
and batch, lowers it, and reports whether every op is in the IR and which ops are not.
Tracing uses fake tensors (shapes only) by default, so large models take seconds;
``--tracing-mode real`` traces with real values. ``--save DIR`` also writes each lowered
graph to ``DIR/<model>.pb`` (for ``salus-bench plan``).

``--train ADDRESS`` also trains each model that lowers (up to ``--max-params``
parameters) for three steps (batch 8, SGD at lr 1e-3 with momentum) on the salusd at
ADDRESS and checks every parameter, buffer
and momentum against a float64 run of the same steps: salus' largest error on each tensor
may be at most 8 times eager float32's plus 16 epsilons of the tensor's scale, or, where
that is exceeded, 8 times the largest error of float64 runs rounded at random at
float32's epsilon (the rule of the test suite) and of eager float32 on one thread (the
spread of PyTorch's own runs: another order of each sum). Dropout and stochastic depth are
turned off for it (salus draws its own random numbers, so masks would differ).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .errors import SalusError, UnsupportedOpError
from .models import image_batch
from .optim import STEP, functional_optimizer
from .reference import eager_steps
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


def _no_randomness(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0
        if hasattr(m, "stochastic_depth_prob"):
            m.stochastic_depth_prob = 0.0
    return model


#: The training check's batch and learning rate: batch statistics over 2 images at a 1x1
#: last stage, at lr 0.01, diverge within three steps in float32 and float64 alike
#: (densenet169's running variances reach 1e8 eagerly), which checks nothing.
TRAIN_BATCH, TRAIN_LR = 8, 1e-3


def _eager_steps(model, batch, dtype, steps: int) -> dict[str, torch.Tensor]:
    """``steps`` eager SGD steps of ``model`` in ``dtype``: its parameters, buffers and
    optimizer state under the names salus gives them."""
    m = model.to(dtype)
    opt = torch.optim.SGD(m.parameters(), lr=TRAIN_LR, momentum=0.9)
    x, y = batch[0].to(dtype), batch[1]
    eager_steps(m, opt, F.cross_entropy, [(x, y)] * steps)
    opt.zero_grad(set_to_none=True)  # the gradients are not compared: free them first
    state = {n: p.detach() for n, p in m.named_parameters()}
    state.update({n: b.detach() for n, b in m.named_buffers()})
    opt_state = functional_optimizer(opt, dict(m.named_parameters())).initial_state()
    opt_state.pop(STEP, None)  # torch's SGD keeps no step counter
    state.update(opt_state)
    return state


def _in_file(tensors: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """Float64 copies of ``tensors`` backed by the file at ``path`` (shared pages the
    kernel can write back and drop), not by the process' own memory."""
    total = sum(t.numel() for t in tensors.values())
    store = torch.from_file(path, shared=True, size=max(total, 1), dtype=torch.float64)
    out, offset = {}, 0
    for name, t in tensors.items():
        out[name] = store[offset:offset + t.numel()].view(t.shape)
        out[name].copy_(t)
        offset += t.numel()
    return out


def _groups(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """The names of ``tensors`` in order, in groups of at most ``limit`` float32 bytes
    (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if groups[-1] and size + 4 * t.numel() > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += 4 * t.numel()
    return [g for g in groups if g]


def train_check(spec: CoverageModel, address: str, steps: int = 3,
                tracing_mode: str = "fake") -> dict:
    """Trains one model ``steps`` SGD steps on salusd and eagerly; the worst ratio of
    salus' error to the allowed one over every tensor (at most 1 passes).

    The float64 run is kept in a temporary file; each other run (PyTorch's float32 one,
    salus', the random-rounding ones) is reduced to its largest distance from it per
    tensor as soon as it ends, and each run builds the model afresh (the same draw), so
    a model of 640M parameters (regnet_y_128gf) fits in 24 GB of memory."""
    import tempfile

    def build() -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return _no_randomness(spec.build())

    batch = image_batch(TRAIN_BATCH, spec.image_size, 10)
    with tempfile.TemporaryDirectory(prefix="salus-coverage-") as scratch:
        return _train_check(build, batch, address, steps, scratch + "/exact.f64",
                            tracing_mode)


def _train_check(build, batch, address: str, steps: int, exact_path: str,
                 tracing_mode: str) -> dict:
    from .torch import TrainSession

    exact = _in_file({name: value for name, value in
                      _eager_steps(build(), batch, torch.float64, steps).items()
                      if value.is_floating_point()}, exact_path)

    def distances(state: dict[str, torch.Tensor], names=exact) -> dict[str, float]:
        out = {}
        for name in names:
            if name not in state:
                raise SalusError(f"the session has no tensor {name!r} to compare")
            out[name] = (state[name].double() - exact[name]).abs().max().item()
        return out

    noise = distances(_eager_steps(build(), batch, torch.float32, steps))
    m = build()
    with TrainSession(m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=TRAIN_LR,
                                                          momentum=0.9),
                      batch, address=address, admission_timeout=600,
                      tracing_mode=tracing_mode) as session:
        for _ in range(steps):
            session.step(*batch)
        # Read back a few hundred megabytes at a time: the state of the largest models
        # is 5 GB, and the process holds the model besides.
        errors = {}
        for names in _groups(exact, 256 << 20):
            errors.update(distances(session.read_state(names), names))
    del m
    eps = torch.finfo(torch.float32).eps
    scales = {name: want.abs().max().item() for name, want in exact.items()}

    def ratios() -> dict[str, float]:
        out = {}
        for name, error in errors.items():
            bound = 8 * noise[name] + 16 * eps * scales[name]
            out[name] = error / bound if bound else (0.0 if error == 0 else float("inf"))
        return out

    found = ratios()
    rounded = max(found.values(), default=0.0) > 1.0
    if rounded:
        # One float32 run of PyTorch's is one sample of its spread. It can be luckier than
        # rounding allows (its CPU batch norm accumulates in float64), and its summation
        # order is one of many: where the cheap yardstick is passed, take also the
        # amplification of random rounding, as the test suite does, and PyTorch's own
        # float32 run on one thread (another order of every sum its kernels split).
        from .rounding import RandomRounding

        for seed in (0, 1):
            model = build()  # not under the rounding: the model is the same draw
            with RandomRounding(eps, seed):
                run = distances(_eager_steps(model, batch, torch.float64, steps))
            del model
            broken = [name for name in noise if math.isnan(run[name])]
            if broken:
                raise SalusError(f"random rounding gave NaN on {broken[0]!r} (and "
                                 f"{len(broken) - 1} more): no yardstick for them")
            noise = {name: max(noise[name], run[name]) for name in noise}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run = distances(_eager_steps(build(), batch, torch.float32, steps))
        finally:
            torch.set_num_threads(threads)
        noise = {name: max(noise[name], run[name]) for name in noise}
        found = ratios()
    where = max(found, key=found.get, default="")
    worst = found.get(where, 0.0)
    return {"trained": worst <= 1.0, "worst_ratio": round(worst, 3), "worst_tensor": where,
            "tensors": len(exact), "random_rounding": rounded}


def run(names: list[str] | None = None, tracing_mode: str = "fake",
        save: Path | None = None, train: str | None = None,
        max_params: int = 30_000_000) -> dict:
    chosen = [m for m in coverage_models() if names is None or m.name in names]
    report: dict = {"models": {}}
    for m in chosen:
        result = check_model(m, tracing_mode, save)
        if train is not None and result["lowered"]:
            params = sum(p.numel() for p in m.build().parameters())
            result["parameters"] = params
            if params > max_params:
                result["train"] = {"skipped": f"{params} parameters > --max-params"}
            else:
                start = time.perf_counter()
                try:
                    result["train"] = train_check(m, train, tracing_mode=tracing_mode)
                except SalusError as e:
                    result["train"] = {"trained": False, "error": str(e)[:500]}
                result["train"]["seconds"] = round(time.perf_counter() - start, 1)
        report["models"][m.name] = result
        if train is not None:
            print(json.dumps({m.name: result.get("train")}), file=sys.stderr, flush=True)
    return report


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
    parser.add_argument("--train", metavar="ADDRESS",
                        help="also train each model 3 steps on the salusd at ADDRESS")
    parser.add_argument("--max-params", type=int, default=30_000_000,
                        help="train only models with at most this many parameters")
    args = parser.parse_args(argv)
    report = run(args.models, args.tracing_mode, args.save, args.train, args.max_params)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0 if all(r["lowered"] for r in report["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
