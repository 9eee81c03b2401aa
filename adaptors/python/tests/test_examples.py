"""The examples run against a real salusd and give PyTorch's numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from daemon import ROOT, Daemon
from harness import tolerance


def run_example(daemon: Daemon, *args: str) -> str:
    env = {**os.environ, "SALUS_ADDRESS": daemon.address,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "adaptors" / "python"),
                                                       os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(daemon.salusctl_path.parent), os.environ["PATH"]])}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_train_and_serve_examples_match_pytorch():
    with Daemon("--policy", "fair") as daemon:
        out = run_example(daemon, "examples/torch_train.py", "--steps", "20", "--compare")
        # The tolerance rule of harness.assert_as_exact_as_pytorch, against float64.
        salus_error, torch_error, scale = map(float, re.search(
            r"against float64: salus (\S+), pytorch float32 (\S+) \(largest parameter "
            r"(\S+)\)", out).groups())
        assert salus_error <= tolerance(torch_error, scale), out
        out = run_example(daemon, "examples/torch_serve.py", "--requests", "3")
        salus_error, torch_error, scale = map(float, re.search(
            r"against float64: salus (\S+), pytorch float32 (\S+) \(largest output "
            r"(\S+)\)", out).groups())
        assert salus_error <= tolerance(torch_error, scale), out


def test_train_example_under_autocast_is_as_exact_as_eager_autocast():
    """`--amp f16`: float16 autocast with a GradScaler, PyTorch's run being eager
    autocast's."""
    with Daemon() as daemon:
        out = run_example(daemon, "examples/torch_train.py", "--steps", "8", "--compare",
                          "--amp", "f16")
    salus_error, torch_error, scale = map(float, re.search(
        r"against float64: salus (\S+), pytorch autocast f16 (\S+) \(largest parameter "
        r"(\S+)\)", out).groups())
    assert salus_error <= tolerance(torch_error, scale), out


def test_share_gpu_runs_four_jobs_at_once():
    with Daemon("--policy", "fair") as daemon:
        out = run_example(daemon, "examples/share_gpu.py", "--steps", "24")
    assert "$ salusctl status" in out and "policy fair" in out
    assert out.count("] done:") == 4, out
    # The status was taken while all four sessions were open.
    status = out.split("$ salusctl status", 1)[1]
    for name in ("mlp-small", "cnn", "gpt", "mlp-large"):
        assert f"({name})" in status, status


def test_serve_dynamic_answers_early_exits_and_decoding():
    with Daemon() as daemon:
        out = run_example(daemon, "examples/serve_dynamic.py", "--seconds", "1", "--rate",
                          "100", "--slo-ms", "200")
    for name in ("early-exit", "decoder"):
        sent, rate = re.search(rf"{name}: (\d+) requests, finish rate (\S+)", out).groups()
        assert int(sent) > 0 and float(rate) > 0, out
    error, wrong = re.search(r"early exits within (\S+) of eager PyTorch .*; (\d+) decoded",
                             out).groups()
    assert float(error) < 1e-5 and int(wrong) == 0, out


def test_keras_example_matches_tensorflow():
    """examples/keras_train.py: a compiled Keras model trained by salus.tf.fit, against
    Keras' own fit and float64 by the suite's rule."""
    with Daemon() as daemon:
        out = run_example(daemon, "examples/keras_train.py", "--epochs", "2", "--compare")
    salus_error, keras_error, scale = map(float, re.search(
        r"against float64: salus (\S+), keras float32 (\S+) \(largest weight (\S+)\)",
        out).groups())
    assert salus_error <= tolerance(keras_error, scale), out
