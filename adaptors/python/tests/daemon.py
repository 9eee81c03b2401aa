"""Real salusd processes for the tests: built from this checkout, on temporary sockets.

``SALUSD`` names a binary to use instead (e.g. a release build); otherwise the first use
runs ``cargo build -p salusd -p salusctl`` (a no-op when up to date) and takes
``target/debug/salusd``.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@functools.cache
def binaries() -> tuple[Path, Path]:
    """``(salusd, salusctl)``, built when needed."""
    if os.environ.get("SALUSD"):
        salusd = Path(os.environ["SALUSD"])
        return salusd, salusd.with_name("salusctl")
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed and SALUSD is not set")
    out = subprocess.run(["cargo", "build", "--quiet", "--locked", "-p", "salusd", "-p",
                          "salusctl"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return ROOT / "target" / "debug" / "salusd", ROOT / "target" / "debug" / "salusctl"


class Daemon:
    """``salusd --socket <tmp> *args`` (``--memory 256MiB`` unless given; ``socket``: at
    that path instead); stopped (SIGKILL) by :meth:`stop` or on exit of a ``with``
    block."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 socket: str | None = None):
        salusd, self.salusctl_path = binaries()
        if "--memory" not in args:
            # Small daemons: the tests need little memory.
            args = (*args, "--memory", "256MiB")
        self.dir = tempfile.TemporaryDirectory(prefix="salusd-")
        self.socket = socket or str(Path(self.dir.name) / "salusd.sock")
        self.log_path = Path(self.dir.name) / "salusd.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(salusd), "--socket", self.socket, *args], stdout=subprocess.DEVNULL,
                stderr=log, env={**os.environ, "RUST_LOG": "info", **(env or {})})
        deadline = time.monotonic() + 20
        while not Path(self.socket).exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"salusd did not start:\n{self.log()}")
            time.sleep(0.02)

    @property
    def address(self) -> str:
        return self.socket

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 20) -> int:
        """SIGTERM (salusd closes its sessions and removes its socket); its exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def salusctl(self, *args: str) -> str:
        out = subprocess.run([str(self.salusctl_path), *args],
                             env={**os.environ, "SALUS_ADDRESS": self.socket},
                             capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.dir.cleanup()
