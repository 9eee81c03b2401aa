"""Helper of `salus-bench profile`: PyTorch's side of the per-op-family profile.

For each model named (the benchmark set of ``torch_engine.py``: mlp, cnn, gpt, resnet18;
and the large ones of ``salus.reference.large_runs``: resnet50, vit_b_16, transformer,
transformer_nodrop, gpt512), this

1. traces one training step and writes it as a reference run into OUT_DIR/<model>
   (graph, initial state, one batch; unchecked: fake-tensor tracing, no PyTorch steps),
   for salus-bench to run on the CUDA device; a model that cannot be traced gets
   ``"trace_error"`` and, where ops are missing, ``"missing_ops"``;
2. times eager PyTorch training steps on the same GPU (median of ``--iterations``,
   after 3 warm-up steps) and measures ``torch.cuda.max_memory_allocated()`` over one
   step (its peak: parameters, gradients, optimizer state and activations);
3. profiles ``--profiled-steps`` steps with ``torch.profiler`` and sums the GPU time of
   every kernel (and memcpy/memset) by the ATen op that launched it.

and prints JSON: ``{"device", "torch", "models": {name: {...}}}``, where each model has
``torch_ms``, ``max_memory_bytes``, ``kernel_ms`` (all kernels, per step) and ``ops``:
``[{"op": "aten::cudnn_convolution", "optimizer": false, "ms": ..., "kernels": n}]``, per
step. salus-bench maps the op names to families with the same mapping as its own nodes
(``salus_cuda::profile::op_family``), so the mapping lives in one place.

How an op is chosen, and the limits of the comparison:

- A kernel is charged to the innermost ``aten::`` op around its launch (``aten::addmm``
  under ``aten::linear``; ``aten::cudnn_convolution`` under ``aten::conv2d``). Kernels
  launched under ``Optimizer.step`` are the optimizer's, whatever the op (as salus'
  nodes the tracer attributes to the optimizer).
- PyTorch's fused ops have no salus counterpart in the same family: cuDNN batch norm is
  one reduce/norm kernel where salus runs var/mean reductions and pointwise nodes;
  scaled-dot-product attention is an ``attention`` kernel where salus runs bmm (matmul)
  and softmax (reduce/norm); ``cross_entropy`` is log_softmax plus nll_loss (index).
  Compare the totals, then the families with that in mind.
- cuBLAS and cuDNN may run several kernels per op; launches count kernels here and
  device commands on the salus side (a cuBLAS call counts one).
- Times are GPU kernel times; gaps between kernels (launch latency) are not counted.

    python benches/torch_profile.py OUT_DIR --model NAME [--model NAME ...]
        [--iterations N] [--profiled-steps K] [--device cuda|cpu]

With ``--device cpu`` (for a check without a GPU) ops get their CPU self time.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from salus.errors import UnsupportedOpError  # noqa: E402
from salus.reference import ReferenceRun, large_runs, write_model  # noqa: E402
from torch_engine import bench_runs  # noqa: E402

DEFAULT_MODELS = ["mlp", "cnn", "gpt", "resnet18"]
OPTIMIZER_SCOPE = "Optimizer.step"


def all_runs() -> dict[str, ReferenceRun]:
    return {**bench_runs(), **large_runs()}


def log(message: str) -> None:
    print(f"torch_profile: {message}", file=sys.stderr, flush=True)


def train_step(model, optimizer, loss_fn, inputs, target) -> None:
    optimizer.zero_grad()
    loss = loss_fn(model(*inputs), target)
    loss.backward()
    optimizer.step()


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def launching_op(event) -> tuple[str, bool]:
    """The innermost ``aten::`` op at or above a profiler event, and whether it runs
    under the optimizer's step."""
    op = None
    optimizer = False
    e = event
    while e is not None:
        if op is None and e.name.startswith("aten::"):
            op = e.name
        if e.name.startswith(OPTIMIZER_SCOPE):
            optimizer = True
        e = e.cpu_parent
    return op or event.name, optimizer


def aggregate(events, steps: int, device: str = "cuda") -> tuple[list[dict], float]:
    """Per-step device time by (op, optimizer) from ``torch.profiler`` events, and the
    per-step total. On the CPU, each ``aten::`` op's self CPU time instead."""
    totals: dict[tuple[str, bool], list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        if device == "cpu":
            if not event.name.startswith("aten::") or event.self_cpu_time_total <= 0:
                continue
            key = launching_op(event)
            totals[key][0] += event.self_cpu_time_total
            totals[key][1] += 1
            continue
        kernels = getattr(event, "kernels", None) or []
        if not kernels:
            continue
        key = launching_op(event)
        for kernel in kernels:
            totals[key][0] += kernel.duration
            totals[key][1] += 1
    ops = [{"op": op, "optimizer": optimizer, "ms": us / 1e3 / steps,
            "kernels": round(count / steps)}
           for (op, optimizer), (us, count) in totals.items()]
    ops.sort(key=lambda o: -o["ms"])
    return ops, sum(o["ms"] for o in ops)


def profile_model(name: str, run: ReferenceRun, out: Path, iterations: int, steps: int,
                  device: str) -> dict:
    result: dict = {}
    start = time.perf_counter()
    try:
        write_model(out / name, name, run, steps=1, check=False)
        result["trace_s"] = time.perf_counter() - start
    except UnsupportedOpError as e:
        result["trace_error"] = str(e).splitlines()[0]
        result["missing_ops"] = e.ops
    except Exception as e:  # noqa: BLE001 - reported, then the next model
        result["trace_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        traceback.print_exc(file=sys.stderr)
    log(f"{name}: traced in {time.perf_counter() - start:.1f} s"
        + (f" ({result['trace_error']})" if "trace_error" in result else ""))

    spec = run.spec
    model = spec.model(0).to(device)
    optimizer = run.optimizer(model.parameters())
    *inputs, target = (t.to(device) for t in spec.batch(0))
    try:
        for _ in range(3):
            train_step(model, optimizer, spec.loss_fn, inputs, target)
        _sync(device)
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            train_step(model, optimizer, spec.loss_fn, inputs, target)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        result["torch_ms"] = statistics.median(times)
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()
            train_step(model, optimizer, spec.loss_fn, inputs, target)
            _sync(device)
            result["max_memory_bytes"] = torch.cuda.max_memory_allocated()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device != "cpu":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                train_step(model, optimizer, spec.loss_fn, inputs, target)
            _sync(device)
        result["ops"], result["kernel_ms"] = aggregate(prof.events(), steps, device)
        result["profiled_steps"] = steps
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: reported, then the next
        result["torch_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        traceback.print_exc(file=sys.stderr)
    finally:
        del model, optimizer, inputs, target
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
    log(f"{name}: torch {result.get('torch_ms', float('nan')):.2f} ms per step, "
        f"{time.perf_counter() - start:.1f} s in all")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", action="append", dest="models")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--profiled-steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    runs = all_runs()
    names = args.models or DEFAULT_MODELS
    unknown = [n for n in names if n not in runs]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {sorted(runs)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("PyTorch sees no GPU")
    # PyTorch's defaults, as in `salus-bench cuda`: TF32 in cuDNN convolutions, not in
    # matrix products. The salus kernels compute in f32.
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "models": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(names):
        result["models"][name] = profile_model(name, runs[name], args.out, args.iterations,
                                               args.profiled_steps, args.device)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
