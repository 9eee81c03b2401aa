"""The examples run against a real salusd and give PyTorch's numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from daemon import ROOT, Daemon


def run_example(daemon: Daemon, *args: str) -> str:
    env = {**os.environ, "SALUS_ADDRESS": daemon.address,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "adaptors" / "python"),
                                                       os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(daemon.salusctl.parent), os.environ["PATH"]])}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_train_and_serve_examples_match_pytorch():
    with Daemon("--policy", "fair") as daemon:
        out = run_example(daemon, "examples/torch_train.py", "--steps", "20", "--compare")
        for ours, theirs in re.findall(r"loss (\S+)  pytorch (\S+)", out):
            assert abs(float(ours) - float(theirs)) <= 1e-4 * max(1.0, abs(float(theirs)))
        diff = float(re.search(r"largest parameter difference from PyTorch: (\S+)", out)[1])
        assert diff < 1e-4, out
        out = run_example(daemon, "examples/torch_serve.py", "--requests", "3")
        assert float(re.search(r"largest difference from PyTorch: (\S+)", out)[1]) < 1e-4


def test_share_gpu_runs_four_jobs_at_once():
    with Daemon("--policy", "fair") as daemon:
        out = run_example(daemon, "examples/share_gpu.py", "--steps", "24")
    assert "$ salusctl status" in out and "policy fair" in out
    assert out.count("] done:") == 4, out
    # The status was taken while all four sessions were open.
    status = out.split("$ salusctl status", 1)[1]
    for name in ("mlp-small", "cnn", "gpt", "mlp-large"):
        assert f"({name})" in status, status
