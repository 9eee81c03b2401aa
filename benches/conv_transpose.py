"""One ``nn.ConvTranspose2d`` at a time as an inference session on salusd's CPU device,
against eager PyTorch in the same process: the session's call (batch in, result out over
the Unix socket) and ``torch.no_grad()`` eager PyTorch, each timed 15 times after 3 of
warm-up, the fastest kept; and the largest difference between the two results.

    python benches/conv_transpose.py [--salusd target/release/salusd]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "adaptors" / "python"))
sys.path.insert(0, str(ROOT / "benches"))

import torch  # noqa: E402

import salus.torch as st  # noqa: E402
from torch_e2e import start_daemon  # noqa: E402

# (batch, in channels, height, width, out channels, kernel, stride, padding, output padding)
SHAPES = [(32, 64, 16, 16, 32, 2, 2, 0, 0), (32, 32, 16, 16, 16, 3, 2, 1, 1),
          (8, 128, 8, 8, 64, 4, 2, 1, 0)]


def fastest_ms(run, times: int = 15) -> float:
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--salusd", type=Path, default=ROOT / "target" / "release" / "salusd")
    args = parser.parse_args()
    torch.manual_seed(0)
    process, socket = start_daemon(args.salusd, tempfile.mkdtemp())
    try:
        for n, cin, h, w, cout, k, s, p, op in SHAPES:
            layer = torch.nn.ConvTranspose2d(cin, cout, k, stride=s, padding=p,
                                             output_padding=op)
            x = torch.randn(n, cin, h, w)
            with st.InferenceSession(layer, (x,), address=socket) as session:
                salus_ms = fastest_ms(lambda: session(x))
                got = session(x)
            with torch.no_grad():
                torch_ms = fastest_ms(lambda: layer(x))
                want = layer(x)
            print(f"ConvTranspose2d {cin}->{cout} kernel {k} stride {s} padding {p} "
                  f"output_padding {op} on {n}x{cin}x{h}x{w}: salusd {salus_ms:.2f} ms, "
                  f"torch {torch_ms:.2f} ms, max |diff| {(got - want).abs().max().item():.2e}")
    finally:
        process.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
