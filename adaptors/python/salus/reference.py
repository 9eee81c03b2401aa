"""``python -m salus.reference OUT_DIR``: reference runs of the target models for engines.

``--model NAME`` (repeatable) picks models, among the four below and the large ones of
:func:`large_runs` (resnet50, vit_b_16, transformer, transformer_nodrop, gpt512: real
sizes, written only when named). A large model is written unchecked: traced with fake
tensors, with its graph, its initial state and its batches, but no PyTorch steps, losses
or final state (``"checked": false`` in its manifest); ``--check`` runs the steps anyway
(slow: f64 on the CPU).

For each target model (``salus.models``, at small sizes) this traces one training step,
runs N steps (``--steps``, default 3) of eager PyTorch from the same initial state on the
same batches, and writes what an engine needs to run the graph and check its results::

    OUT_DIR/index.json          {"format": "salus-reference", "version": 1,
                                 "models": ["mlp", "cnn", "gpt", "resnet18"]}
    OUT_DIR/<model>/graph.pb    the serialized salus.v1.Graph of one training step
    OUT_DIR/<model>/manifest.json
    OUT_DIR/<model>/initial.bin persistent tensors before step 1
    OUT_DIR/<model>/batch_<k>.bin  the feeds of step k (k = 0 .. N-1)
    OUT_DIR/<model>/final.bin   persistent tensors after N eager steps

A ``.bin`` file is the tensors' raw bytes one after another, each little-endian and
row-major, with no header or padding. ``manifest.json`` says where each tensor is::

    {
      "format": "salus-reference", "version": 1, "model": "mlp", "steps": 3,
      "graph": "graph.pb",
      "optimizer": {"kind": "sgd", "groups": [{"params": [...], "lr": 0.05, ...}]},
      "losses": [2.31, ...],        # eager PyTorch, f32, one per step
      "losses_f64": [2.31, ...],    # the same run in f64
      "graph_losses": [2.31, ...],  # the traced FX graph, executed by PyTorch
      "initial": {"file": "initial.bin", "tensors": [TENSOR, ...]},
      "batches": [{"file": "batch_0.bin", "tensors": [TENSOR, ...]}, ...],
      "final": {"file": "final.bin", "tensors": [TENSOR, ...]}
    }

where ``TENSOR`` is ``{"name", "dtype", "shape", "offset", "nbytes"}``: the graph's
tensor name (parameter, state or feed name), a dtype among ``f32 f16 bf16 i64 i32 bool``,
the shape (``[]`` for a scalar) and the byte range in the file. ``initial`` and ``final``
list every parameter and state tensor of the graph in the graph's order; batch tensors
are the feeds in order. Final tensors also carry ``"f32_error"``: the largest absolute
difference between eager f32 and eager f64 after N steps, i.e. how far PyTorch's own
float32 result is from exact, a yardstick for an engine's tolerance.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .lower import DTYPES, constant_bytes
from .models import TargetModel, large_models, target_models
from .optim import STEP, functional_optimizer
from .trace import trace_train_step
from .v1 import graph_pb2 as pb

FORMAT = "salus-reference"
VERSION = 1
DTYPE_NAMES = {dtype: pb.DType.Name(code).removeprefix("DTYPE_").lower()
               for dtype, code in DTYPES.items()}
_NUMPY = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "i64": "<i8", "i32": "<i4", "bool": "|b1"}


@dataclass(frozen=True)
class ReferenceRun:
    """One model of the reference set and the optimizer it trains with."""

    spec: TargetModel
    optimizer: Callable[[object], torch.optim.Optimizer]


def reference_runs() -> dict[str, ReferenceRun]:
    """The four target models, sized so that every file stays around 1 MB or less."""
    models = target_models(batch_size=8, image_size=16, resnet_size=64, resnet_width=6)
    return {
        "mlp": ReferenceRun(models["mlp"], lambda p: torch.optim.SGD(
            p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=5e-4)),
        "cnn": ReferenceRun(models["cnn"], lambda p: torch.optim.Adam(p, lr=1e-3)),
        "gpt": ReferenceRun(models["gpt"], lambda p: torch.optim.AdamW(
            p, lr=1e-3, weight_decay=0.01)),
        "resnet18": ReferenceRun(models["resnet18"], lambda p: torch.optim.SGD(
            p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)),
    }


MODEL_NAMES_LARGE = ("resnet50", "vit_b_16", "transformer", "transformer_nodrop", "gpt512")


def large_runs(**sizes) -> dict[str, ReferenceRun]:
    """The profiling targets (:func:`salus.models.large_models`, ``sizes`` passed on) with
    their optimizers: resnet50 with SGD, the transformers with AdamW."""
    models = large_models(**sizes)
    return {
        "resnet50": ReferenceRun(models["resnet50"], lambda p: torch.optim.SGD(
            p, lr=0.1, momentum=0.9, weight_decay=1e-4)),
        "vit_b_16": ReferenceRun(models["vit_b_16"], lambda p: torch.optim.AdamW(
            p, lr=1e-3, weight_decay=0.05)),
        "transformer": ReferenceRun(models["transformer"], lambda p: torch.optim.AdamW(
            p, lr=1e-4, weight_decay=0.01)),
        "transformer_nodrop": ReferenceRun(models["transformer_nodrop"],
                                           lambda p: torch.optim.AdamW(
                                               p, lr=1e-4, weight_decay=0.01)),
        "gpt512": ReferenceRun(models["gpt512"], lambda p: torch.optim.AdamW(
            p, lr=3e-4, weight_decay=0.1)),
    }


# ---------------------------------------------------------------------------------------
# Tensor files


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> list[dict]:
    """Writes ``tensors`` back to back into ``path``; their manifest entries."""
    entries, offset = [], 0
    with open(path, "wb") as f:
        for name, tensor in tensors.items():
            data = constant_bytes(tensor)
            entries.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype],
                            "shape": list(tensor.shape), "offset": offset,
                            "nbytes": len(data)})
            f.write(data)
            offset += len(data)
    return entries


def read_tensors(directory: Path, section: dict) -> dict[str, torch.Tensor]:
    """The tensors of one manifest section (``initial``, a batch, ``final``)."""
    blob = (Path(directory) / section["file"]).read_bytes()
    tensors = {}
    for entry in section["tensors"]:
        raw = np.frombuffer(blob, dtype=_NUMPY[entry["dtype"]], offset=entry["offset"],
                            count=entry["nbytes"] // np.dtype(_NUMPY[entry["dtype"]]).itemsize)
        t = torch.from_numpy(raw.copy()).reshape(entry["shape"])
        tensors[entry["name"]] = t.view(torch.bfloat16) if entry["dtype"] == "bf16" else t
    return tensors


# ---------------------------------------------------------------------------------------
# Runs


def eager_steps(model, optimizer, loss_fn, batches, device: str = "cpu") -> list[float]:
    """Trains ``model`` (already on ``device``) in place with ``optimizer`` in eager
    PyTorch; the loss of every step."""
    losses = []
    for batch in batches:
        *xs, target = (t.to(device) for t in batch)
        optimizer.zero_grad()
        loss = loss_fn(model(*xs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _persistent(model, optimizer, names: list[str], initial_step: torch.Tensor | None,
                steps: int) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors under the graph's names, in ``names`` order."""
    values = {n: p.detach() for n, p in model.named_parameters()}
    values.update({n: b.detach() for n, b in model.named_buffers()})
    rule = functional_optimizer(optimizer, dict(model.named_parameters()))
    values.update(rule.initial_state())
    values.update(rule.hyperparameters())
    if isinstance(optimizer, torch.optim.SGD) and initial_step is not None:
        values[STEP] = initial_step + steps  # torch's SGD keeps no step counter
    return {n: values[n].cpu() for n in names}


def _f64(batch):
    return tuple(t.double() if t.is_floating_point() else t for t in batch)


def write_model(out: Path, name: str, run: ReferenceRun, steps: int,
                device: str = "cpu", check: bool = True,
                autocast: torch.dtype | None = None) -> dict:
    """Traces, runs and writes one model; returns its manifest. PyTorch's f32 steps run
    on ``device`` ("cpu" or "cuda"); the f64 ones on the CPU. Without ``check``, traces
    with fake tensors and writes the graph, the initial state and the batches only.
    ``autocast`` (torch.bfloat16 or torch.float16, unchecked only) traces a
    mixed-precision step, float16 with a default ``GradScaler``."""
    if autocast is not None and check:
        raise ValueError("a mixed-precision reference run is written unchecked only")
    out.mkdir(parents=True, exist_ok=True)
    spec = run.spec
    model = spec.model(0)
    batches = [spec.batch(k) for k in range(steps)]
    scaler = torch.amp.GradScaler("cpu") if autocast == torch.float16 else None
    traced = trace_train_step(model, spec.loss_fn, run.optimizer(model.parameters()),
                              batches[0], tracing_mode="real" if check else "fake",
                              autocast=autocast, scaler=scaler)
    (out / "graph.pb").write_bytes(traced.to_graph().SerializeToString())
    if not check:
        return _write_unchecked(out, name, traced, batches)
    model32, model64 = copy.deepcopy(model).to(device), copy.deepcopy(model).double()
    opt32, opt64 = run.optimizer(model32.parameters()), run.optimizer(model64.parameters())
    state, graph_losses = dict(traced.initial_state), []
    for batch in batches:
        state, loss = traced.run(state, *batch)
        graph_losses.append(loss.item())

    names = traced.state_names
    initial = {n: traced.initial_state[n] for n in names}
    losses = eager_steps(model32, opt32, spec.loss_fn, batches, device)
    losses64 = eager_steps(model64, opt64, spec.loss_fn, [_f64(b) for b in batches])
    step0 = initial.get(STEP)
    final = _persistent(model32, opt32, names, step0, steps)
    exact = _persistent(model64, opt64, names, None if step0 is None else step0.double(), steps)

    final_entries = write_tensors(out / "final.bin", final)
    for entry in final_entries:
        diff = final[entry["name"]].double() - exact[entry["name"]].double()
        entry["f32_error"] = diff.abs().max().item() if diff.numel() else 0.0
    feeds = traced.feed_names
    manifest = {
        "format": FORMAT, "version": VERSION, "model": name, "steps": steps,
        "graph": "graph.pb", "optimizer": traced.optimizer,
        "losses": losses, "losses_f64": losses64, "graph_losses": graph_losses,
        "initial": {"file": "initial.bin",
                    "tensors": write_tensors(out / "initial.bin", initial)},
        "batches": [{"file": f"batch_{k}.bin",
                     "tensors": write_tensors(out / f"batch_{k}.bin", dict(zip(feeds, b)))}
                    for k, b in enumerate(batches)],
        "final": {"file": "final.bin", "tensors": final_entries},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _write_unchecked(out: Path, name: str, traced, batches) -> dict:
    names = traced.state_names
    feeds = traced.feed_names
    manifest = {
        "format": FORMAT, "version": VERSION, "model": name, "steps": len(batches),
        "graph": "graph.pb", "optimizer": traced.optimizer, "checked": False,
        "losses": [], "losses_f64": [], "graph_losses": [],
        "initial": {"file": "initial.bin",
                    "tensors": write_tensors(out / "initial.bin",
                                             {n: traced.initial_state[n] for n in names})},
        "batches": [{"file": f"batch_{k}.bin",
                     "tensors": write_tensors(out / f"batch_{k}.bin", dict(zip(feeds, b)))}
                    for k, b in enumerate(batches)],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def write_all(out_dir: Path, steps: int = 3, names: list[str] | None = None,
              device: str = "cpu", check: bool | None = None) -> list[str]:
    """Writes the four reference models, or ``names`` (which may name large ones).
    ``check=None`` checks the four and not the large ones."""
    runs = reference_runs()
    large = large_runs()
    if names is None:
        chosen = list(runs)
    else:
        unknown = [n for n in names if n not in runs and n not in large]
        if unknown:
            raise ValueError(f"unknown models: {unknown}")
        chosen = list(dict.fromkeys(names))
    for name in chosen:
        run = runs.get(name) or large[name]
        checked = (name in runs) if check is None else check
        write_model(Path(out_dir) / name, name, run, steps, device, checked)
    index = {"format": FORMAT, "version": VERSION, "models": chosen}
    (Path(out_dir) / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", action="append", dest="models",
                        choices=[*reference_runs(), *MODEL_NAMES_LARGE])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where PyTorch's f32 steps run")
    parser.add_argument("--check", action="store_true", default=None,
                        help="run and write PyTorch's steps for the large models too")
    args = parser.parse_args(argv)
    for name in write_all(args.out_dir, args.steps, args.models, args.device, args.check):
        size = sum(f.stat().st_size for f in (args.out_dir / name).iterdir())
        print(f"{name}: {size / 1e6:.2f} MB in {args.out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
