"""The profiling helpers: benches/torch_profile.py's attribution of kernels to ops, the
large target models, unchecked reference runs, and tracing without gRPC."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from salus import reference

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def torch_profile():
    path = ROOT / "benches" / "torch_profile.py"
    spec = importlib.util.spec_from_file_location("torch_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(name, parent=None, kernels=(), self_us=0.0):
    return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=self_us,
                           kernels=[SimpleNamespace(duration=d) for d in kernels])


def test_kernels_go_to_the_innermost_aten_op_and_the_optimizer(torch_profile):
    conv2d = _event("aten::conv2d")
    cudnn = _event("aten::cudnn_convolution", conv2d, kernels=[300.0, 100.0])
    step = _event("Optimizer.step#SGD.step")
    foreach = _event("aten::_foreach_add_", step, kernels=[50.0])
    runtime = _event("cudaLaunchKernel", foreach, kernels=[10.0])
    bare = _event("Memset (Device)", None, kernels=[5.0])
    ops, total = torch_profile.aggregate([conv2d, cudnn, step, foreach, runtime, bare],
                                         steps=2)
    by = {(o["op"], o["optimizer"]): o for o in ops}
    assert by[("aten::cudnn_convolution", False)]["ms"] == pytest.approx(0.2)
    assert by[("aten::cudnn_convolution", False)]["kernels"] == 1
    # A launch below an op counts for the op; under Optimizer.step for the optimizer.
    assert by[("aten::_foreach_add_", True)]["ms"] == pytest.approx(0.03)
    assert by[("Memset (Device)", False)]["ms"] == pytest.approx(0.0025)
    assert total == pytest.approx(0.2325)
    assert ops[0]["op"] == "aten::cudnn_convolution"


def test_on_the_cpu_ops_get_their_self_time(torch_profile):
    linear = _event("aten::linear", self_us=10.0)
    addmm = _event("aten::addmm", linear, self_us=90.0)
    other = _event("Optimizer.zero_grad#SGD.zero_grad", self_us=5.0)
    ops, total = torch_profile.aggregate([linear, addmm, other], steps=1, device="cpu")
    assert {o["op"]: o["ms"] for o in ops} == pytest.approx({"aten::addmm": 0.09,
                                                              "aten::linear": 0.01})
    assert total == pytest.approx(0.1)


def test_large_models_build_small():
    runs = reference.large_runs(batch_size=2, image_size=32, num_classes=10, seq=8,
                                d_model=16, layers=1, gpt_seq=8, gpt_width=16, gpt_heads=2,
                                gpt_layers=1, gpt_vocab=32)
    assert set(runs) == set(reference.MODEL_NAMES_LARGE)
    for name in ("transformer", "transformer_nodrop", "gpt512"):
        spec = runs[name].spec
        model = spec.model(0)
        *inputs, target = spec.batch(0)
        loss = spec.loss_fn(model(*inputs), target)
        assert loss.dim() == 0, name
    assert runs["transformer"].spec.model(0).encoder.layers[0].dropout.p == 0.1
    assert runs["transformer_nodrop"].spec.model(0).encoder.layers[0].dropout.p == 0.0


def test_an_unchecked_run_has_graph_state_and_batch(tmp_path):
    runs = reference.large_runs(batch_size=2, gpt_seq=8, gpt_width=16, gpt_heads=2,
                                gpt_layers=1, gpt_vocab=32)
    manifest = reference.write_model(tmp_path / "gpt512", "gpt512", runs["gpt512"], steps=1,
                                     check=False)
    assert manifest["checked"] is False and manifest["losses"] == []
    assert "final" not in manifest
    for f in ("graph.pb", "initial.bin", "batch_0.bin", "manifest.json"):
        assert (tmp_path / "gpt512" / f).stat().st_size > 0
    written = json.loads((tmp_path / "gpt512" / "manifest.json").read_text())
    assert [t["name"] for t in written["batches"][0]["tensors"]] == ["input.0", "input.1"]


def test_tracing_does_not_import_grpc():
    code = ("import sys, salus, salus.reference, salus.trace\n"
            "assert 'grpc' not in sys.modules, 'grpc imported'\n"
            "assert salus.Client.__name__ == 'Client'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
