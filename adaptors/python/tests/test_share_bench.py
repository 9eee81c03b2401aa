"""`benches/share_e2e.py` at tiny sizes on the CPU: four jobs through a real salusd (its
default policy), then the same four as plain PyTorch processes; every job reports a rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from daemon import ROOT, binaries


def test_share_bench_reports_four_jobs_in_both_phases():
    salusd, _ = binaries()
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "adaptors" / "python"),
                                                       os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "benches/share_e2e.py", "--salusd", str(salusd), "--device", "cpu",
         "--size", "tiny", "--seconds", "1", "--warmup", "2", "--start-method", "forkserver",
         "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["policy"] == "share", "salusd shares the device by default"
    assert [j["name"] for j in report["jobs"]] == ["cnn-a", "cnn-b", "encoder-16", "encoder-8"]
    for job in report["jobs"]:
        assert job["salus_iterations"] > 0 and job["salus_it_s"] > 0, job
        assert job["plain_iterations"] > 0 and job["plain_it_s"] > 0, job
        assert job["ratio"] > 0, job
    aggregate = report["aggregate"]
    assert aggregate["salus_it_s"] > 0 and aggregate["plain_it_s"] > 0
    assert aggregate["ratio"] == aggregate["salus_it_s"] / aggregate["plain_it_s"]
