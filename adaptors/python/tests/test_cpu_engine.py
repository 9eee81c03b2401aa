"""The Rust CPU device runs traced training steps and matches PyTorch; so does the CUDA
device's lowering, run on the host by its emulator (the command list a GPU would run:
fused regions, batched launches, folded transposes; the kernels' own source).

Reference runs come from ``python -m salus.reference`` (eager PyTorch from the same initial
state on the same batches); the Rust side replays them with ``cargo run -p salus-testkit
--example replay_reference`` and reports its losses and final persistent tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from harness import tolerance

from salus import reference

ROOT = Path(__file__).resolve().parents[3]

# The four target models; every op of their training steps has a CPU kernel.
ENGINE_MODELS = ["mlp", "cnn", "gpt", "resnet18"]
STEPS = 10


# The CUDA lowering's models on the emulator: the small targets, and a stock
# ``nn.TransformerEncoder`` (its fused in-projection, AdamW) at a size the host runs quickly.
EMULATED_MODELS = ["mlp", "cnn", "gpt", "transformer_nodrop"]
SMALL_LARGE = dict(batch_size=2, seq=16, d_model=32, layers=2)


def replay(model_dir: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """Runs ``replay_reference`` on one model's reference files (``args`` after it, ``env``
    added to its environment): ``SALUS_REPLAY`` names a built binary of it, else cargo
    builds and runs it."""
    if os.environ.get("SALUS_REPLAY"):
        command = [os.environ["SALUS_REPLAY"], str(model_dir), *args]
    elif shutil.which("cargo") is None:
        pytest.skip("cargo is not installed and SALUS_REPLAY is not set")
    else:
        command = ["cargo", "run", "--quiet", "--locked", "-p", "salus-testkit", "--example",
                   "replay_reference", "--", str(model_dir), *args]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", ENGINE_MODELS)
def test_cpu_device_matches_pytorch(tmp_path: Path, name: str) -> None:
    """The rule of ``harness.assert_as_exact_as_pytorch``, against PyTorch's float32
    results: the reference stores them and, per tensor, their distance from float64
    (``f32_error``); the replay reports its largest difference from them. This covers
    gpt's attention qkv biases without a special case: the key third of each has a
    gradient that is zero in exact arithmetic, so AdamW trains it on rounding noise, and
    PyTorch's own float32 error there is as large as the engine's."""
    reference.write_all(tmp_path, steps=STEPS, names=[name])
    assert_matches_pytorch(tmp_path / name, replay(tmp_path / name))


@pytest.mark.parametrize("name", EMULATED_MODELS)
def test_cuda_lowering_on_the_emulator_matches_pytorch(tmp_path: Path, name: str) -> None:
    """The same rule for the CUDA device's command lists and kernels, run on the host."""
    write_for_emulator(tmp_path, name)
    assert_matches_pytorch(tmp_path / name, replay(tmp_path / name, "--device", "cuda-emulated"))


@pytest.mark.parametrize("name", ["gpt", "transformer_nodrop"])
def test_tiled_attention_on_the_emulator_matches_pytorch(tmp_path: Path, name: str) -> None:
    """The same with f32 attention in register tiles (``SALUS_CUDA_ATTENTION=tiled``)."""
    write_for_emulator(tmp_path, name)
    result = replay(tmp_path / name, "--device", "cuda-emulated",
                    env={"SALUS_CUDA_ATTENTION": "tiled"})
    assert_matches_pytorch(tmp_path / name, result)


def write_for_emulator(out: Path, name: str) -> None:
    """Writes model ``name``'s reference run under ``out``, or skips without a C++
    compiler (the emulator builds the kernels with it)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("the emulator needs a C++ compiler ($CXX, else c++)")
    if name in reference.reference_runs():
        reference.write_all(out, steps=STEPS, names=[name])
    else:
        run = reference.large_runs(**SMALL_LARGE)[name]
        reference.write_model(out / name, name, run, steps=STEPS)


def assert_matches_pytorch(model_dir: Path, result: dict) -> None:
    """Each loss and final tensor of ``result`` within ``tolerance`` of PyTorch's float32
    results, by PyTorch's own float32 error against float64."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert len(result["losses"]) == STEPS
    for k, (ours, theirs, exact) in enumerate(zip(result["losses"], manifest["losses"],
                                                  manifest["losses_f64"], strict=True)):
        bound = tolerance(abs(theirs - exact), abs(exact), against="pytorch")
        assert abs(ours - theirs) <= bound, (k, result["losses"], manifest["losses"], bound)
    assert result["final"], "no tensors compared"
    noise = {e["name"]: e["f32_error"] for e in manifest["final"]["tensors"]}
    for tensor, err in result["final"].items():
        bound = tolerance(noise[tensor], err["max_value"], against="pytorch")
        assert err["max_abs"] <= bound, (tensor, err, noise[tensor], bound)
