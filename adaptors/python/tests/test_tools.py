"""The command-line tools: salus.coverage and salus.reference."""

from __future__ import annotations

import json

import pytest
import torch
from harness import tolerance
from torch import nn

from salus import coverage, reference
from salus.v1 import graph_pb2 as pb


def test_coverage_reports_a_model_that_lowers(capsys):
    assert coverage.main(["--json", "--model", "resnet18"]) == 0
    report = json.loads(capsys.readouterr().out)
    result = report["models"]["resnet18"]
    assert result["lowered"] is True and result["missing_ops"] == []
    assert "convolution_backward" in result["ops"]


class _ScaledBessel(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x)


def test_coverage_lists_the_missing_ops():
    spec = coverage.CoverageModel(
        "with_bessel_j0", lambda: nn.Sequential(nn.Conv2d(3, 10, 3), nn.AdaptiveAvgPool2d(1),
                                          nn.Flatten(), _ScaledBessel()), 8)
    result = coverage.check_model(spec, tracing_mode="real")
    assert result["lowered"] is False
    assert "special_bessel_j0" in result["missing_ops"]


@pytest.fixture(scope="module")
def mlp_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert reference.write_all(out, steps=3, names=["mlp"]) == ["mlp"]
    return out


def test_reference_files_describe_the_graph(mlp_reference):
    index = json.loads((mlp_reference / "index.json").read_text())
    assert index == {"format": "salus-reference", "version": 1, "models": ["mlp"]}
    directory = mlp_reference / "mlp"
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["steps"] == 3 and len(manifest["losses"]) == 3
    assert len(manifest["batches"]) == 3
    graph = pb.Graph()
    graph.ParseFromString((directory / manifest["graph"]).read_bytes())

    persistent = [t for t in graph.tensors
                  if t.role in (pb.TENSOR_ROLE_PARAMETER, pb.TENSOR_ROLE_STATE)]
    feeds = [t for t in graph.tensors if t.role == pb.TENSOR_ROLE_FEED]
    for section, expected in [(manifest["initial"], persistent),
                              (manifest["final"], persistent),
                              (manifest["batches"][0], feeds)]:
        entries = section["tensors"]
        assert [e["name"] for e in entries] == [t.name for t in expected]
        assert [e["shape"] for e in entries] == [list(t.shape) for t in expected]
        assert [e["dtype"] for e in entries] == [
            pb.DType.Name(t.dtype).removeprefix("DTYPE_").lower() for t in expected]
        assert sum(e["nbytes"] for e in entries) == (directory / section["file"]).stat().st_size
    for f in directory.iterdir():
        assert f.stat().st_size < 1_000_000, f


def test_reference_final_state_follows_from_initial_state(mlp_reference):
    """Running the traced graph from the stored initial state on the stored batches
    reproduces the stored eager results."""
    directory = mlp_reference / "mlp"
    manifest = json.loads((directory / "manifest.json").read_text())
    run = reference.reference_runs()["mlp"]
    model = run.spec.model(0)
    batches = [tuple(reference.read_tensors(directory, b).values())
               for b in manifest["batches"]]
    initial = reference.read_tensors(directory, manifest["initial"])
    final = reference.read_tensors(directory, manifest["final"])

    from salus import trace_train_step

    traced = trace_train_step(model, run.spec.loss_fn, run.optimizer(model.parameters()),
                              batches[0])
    state = dict(initial)
    losses = []
    for batch in batches:
        state, loss = traced.run(state, *batch)
        losses.append(loss.item())
    # Only PyTorch's float32 results and their distance from float64 (f32_error) are
    # stored: the harness rule, measured against PyTorch's run.
    for ours in (losses, manifest["graph_losses"]):
        for k, (got, want, exact) in enumerate(zip(ours, manifest["losses"],
                                                   manifest["losses_f64"], strict=True)):
            assert abs(got - want) <= tolerance(abs(want - exact), abs(exact),
                                                against="pytorch"), (k, ours, manifest)
    errors = {e["name"]: e["f32_error"] for e in manifest["final"]["tensors"]}
    assert set(errors) == set(final)
    for name, want in final.items():
        error = (state[name].double() - want.double()).abs().max().item()
        scale = want.double().abs().max().item()
        assert 0 <= errors[name] < scale or scale == 0, (name, errors[name], scale)
        assert error <= tolerance(errors[name], scale, against="pytorch"), (name, error)
