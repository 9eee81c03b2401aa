"""Serving a PyTorch model's forward pass from salusd.

    python examples/torch_serve.py [--requests 20]

Runs `--requests` batches through an inference session and checks each answer against
the model itself (eval mode).
"""

import argparse
import time

import torch
from torch import nn

import salus.torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10))
    example = torch.randn(16, 64)
    with salus.torch.InferenceSession(model, example, name="torch_serve") as serve:
        print(f"session {serve.id} open in {serve.open_ms:.0f} ms")
        model.eval()
        worst, start = 0.0, time.perf_counter()
        for i in range(args.requests):
            x = torch.randn(16, 64)
            logits = serve(x)                       # the forward pass, on salusd
            with torch.no_grad():
                worst = max(worst, (logits - model(x)).abs().max().item())
            print(f"request {i:3d}: classes {logits.argmax(dim=1).tolist()}")
        per = (time.perf_counter() - start) / args.requests * 1e3
    print(f"{args.requests} requests, {per:.2f} ms each; largest difference from PyTorch: "
          f"{worst:.1e}")


if __name__ == "__main__":
    main()
