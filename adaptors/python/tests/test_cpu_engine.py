"""The Rust CPU device runs traced training steps and matches PyTorch.

Reference runs come from ``python -m salus.reference`` (eager PyTorch from the same initial
state on the same batches); the Rust side replays them with ``cargo run -p salus-testkit
--example replay_reference`` and reports its losses and final persistent tensors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from salus import reference

ROOT = Path(__file__).resolve().parents[3]

# The four target models; every op of their training steps has a CPU kernel.
ENGINE_MODELS = ["mlp", "cnn", "gpt", "resnet18"]
STEPS = 10
# Losses: relative to the loss (at least 1).
LOSS_RTOL = 1e-5
# Updated tensors: the largest difference relative to the tensor's largest magnitude (at
# least 1).
RTOL = 1e-4
# Tensors allowed a looser bound, per model, with why. gpt: the key third of each
# attention's qkv bias has a gradient that is zero in exact arithmetic (softmax ignores a
# shift common to a row of scores), so what reaches AdamW is f32 rounding noise, which
# depends on the order of the reductions and which Adam normalises into steps of size lr.
# PyTorch's own f32 run ends about 1e-4 from its f64 run on these tensors (the manifest's
# f32_error); every other gpt tensor stays within 1e-4.
LOOSER = {"gpt": ("attn.qkv.bias", 1e-3)}


def replay(model_dir: Path) -> dict:
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed")
    out = subprocess.run(
        ["cargo", "run", "--quiet", "--locked", "-p", "salus-testkit", "--example",
         "replay_reference", "--", str(model_dir)],
        cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_cpu_device_matches_pytorch(tmp_path: Path, name: str) -> None:
    reference.write_all(tmp_path, steps=STEPS, names=[name])
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    result = replay(tmp_path / name)
    assert len(result["losses"]) == STEPS
    for ours, theirs in zip(result["losses"], manifest["losses"], strict=True):
        assert abs(ours - theirs) <= LOSS_RTOL * max(1.0, abs(theirs)), (result["losses"],
                                                                          manifest["losses"])
    assert result["final"], "no tensors compared"
    looser, looser_rtol = LOOSER.get(name, (None, RTOL))
    for tensor, err in result["final"].items():
        rtol = looser_rtol if looser is not None and looser in tensor else RTOL
        assert err["max_abs"] <= rtol * max(1.0, err["max_value"]), (tensor, err, rtol)
