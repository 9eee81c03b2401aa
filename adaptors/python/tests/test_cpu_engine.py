"""The Rust CPU device runs traced training steps and matches PyTorch.

Reference runs come from ``python -m salus.reference`` (eager PyTorch from the same initial
state on the same batches); the Rust side replays them with ``cargo run -p salus-exec
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


def replay(model_dir: Path) -> dict:
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed")
    out = subprocess.run(
        ["cargo", "run", "--quiet", "--locked", "-p", "salus-exec", "--example",
         "replay_reference", "--", str(model_dir)],
        cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_cpu_device_matches_pytorch(tmp_path: Path, name: str) -> None:
    reference.write_all(tmp_path, steps=3, names=[name])
    manifest = json.loads((tmp_path / name / "manifest.json").read_text())
    result = replay(tmp_path / name)
    for ours, theirs in zip(result["losses"], manifest["losses"], strict=True):
        assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (result["losses"],
                                                                     manifest["losses"])
    assert result["final"], "no tensors compared"
    for tensor, err in result["final"].items():
        # Within 1e-4 of the tensor's scale, as the engine's parity target asks.
        assert err["max_abs"] <= 1e-4 * max(1.0, err["max_value"]), (tensor, err)
