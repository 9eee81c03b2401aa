"""Traced graphs pass the daemon's own checks: the Rust validator (shape and dtype
inference for every node) accepts them, and the Rust planner's P equals the persistent
bytes PyTorch holds, with E within 1.10x of the lower bound."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from harness import assert_as_exact_as_pytorch, f64_twin, randomly_rounded

from salus import models
from salus.trace import trace_inference, trace_train_step

ROOT = Path(__file__).resolve().parents[3]
ALIGNMENT = 256


def rust_plan(paths: list[Path]) -> dict[str, dict]:
    """Runs `salus-bench plan --json` (the Rust validator and planner) on graph files:
    ``SALUS_BENCH`` names a built binary of it, else cargo builds and runs it."""
    if os.environ.get("SALUS_BENCH"):
        command = [os.environ["SALUS_BENCH"]]
    elif shutil.which("cargo") is None:
        pytest.skip("cargo is not installed and SALUS_BENCH is not set")
    else:
        command = ["cargo", "run", "--quiet", "--locked", "-p", "salus-bench", "--"]
    out = subprocess.run([*command, "plan", "--json", *map(str, paths)],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return {g["graph"]: g for g in json.loads(out.stdout)["graphs"]}


def aligned_bytes(tensors) -> int:
    return sum(-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in tensors)


def test_target_models_validate_and_plan_in_rust(tmp_path: Path) -> None:
    expected_p: dict[str, int] = {}
    paths: list[Path] = []
    for name, target in models.target_models().items():
        model = target.model()
        *inputs, label = target.batch(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        traced = trace_train_step(model, target.loss_fn, optimizer, (*inputs, label))
        path = tmp_path / f"{name}_train.pb"
        path.write_bytes(traced.to_graph().SerializeToString())
        paths.append(path)
        expected_p[f"{name}_train"] = aligned_bytes(traced.initial_state.values())

        inference = trace_inference(target.model(), tuple(inputs))
        path = tmp_path / f"{name}_forward.pb"
        graph = inference.to_graph()
        path.write_bytes(graph.SerializeToString())
        paths.append(path)

    plans = rust_plan(paths)
    assert set(plans) == {p.stem for p in paths}
    for name, plan in plans.items():
        assert plan["ephemeral_bytes"] <= 1.10 * plan["lower_bound"], plan
        assert plan["ephemeral_bytes"] >= plan["lower_bound"] > 0, plan
        if name in expected_p:
            assert plan["persistent_bytes"] == expected_p[name], (name, plan)


LOSSES = {
    "mse": (lambda: torch.nn.Linear(8, 3), torch.nn.functional.mse_loss),
    "l1": (lambda: torch.nn.Linear(8, 3), torch.nn.functional.l1_loss),
    "bce_logits": (lambda: torch.nn.Linear(8, 3),
                   torch.nn.functional.binary_cross_entropy_with_logits),
    "leaky_relu_mse": (lambda: torch.nn.Sequential(torch.nn.Linear(8, 3),
                                                   torch.nn.LeakyReLU(0.1)),
                       torch.nn.functional.mse_loss),
}


def test_common_losses_and_activations_lower_match_eager_and_validate(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen)
    y = torch.rand(4, 3, generator=gen)
    paths = []
    for name, (build, loss_fn) in LOSSES.items():
        torch.manual_seed(0)
        model = build()
        eager_loss = loss_fn(model(x), y).item()
        def exact():
            return [loss_fn(f64_twin(model)(x.double()), y.double()).item()]  # noqa: B023

        traced = trace_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1),
                                  (x, y))
        _, loss = traced.run(dict(traced.initial_state), x, y)
        assert_as_exact_as_pytorch([loss.item()], exact(), [eager_loss],
                                   randomly_rounded(exact), label=name, dtype=torch.float32)
        path = tmp_path / f"{name}.pb"
        path.write_bytes(traced.to_graph().SerializeToString())
        paths.append(path)
    plans = rust_plan(paths)
    assert set(plans) == set(LOSSES)


def test_dropout_steps_validate_and_plan_in_rust(tmp_path: Path) -> None:
    """Dropout draws from the session's generator: the graph the Rust validator sees has
    the generator as bernoulli.p's second input and as persistent state."""
    model = models.MLP(8, (16,), 4, dropout=0.5)
    traced = trace_train_step(model, torch.nn.functional.cross_entropy,
                              torch.optim.SGD(model.parameters(), lr=0.1),
                              (torch.randn(16, 8), torch.randint(0, 4, (16,))))
    path = tmp_path / "dropout.pb"
    path.write_bytes(traced.to_graph().SerializeToString())
    plan = rust_plan([path])["dropout"]
    assert plan["persistent_bytes"] == aligned_bytes(traced.initial_state.values())
