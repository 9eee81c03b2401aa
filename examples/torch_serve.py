"""Serving a PyTorch model's forward pass from salusd.

    python examples/torch_serve.py [--requests 20]

Runs `--requests` batches through an inference session and checks each answer against
the model itself (eval mode) in float64, next to PyTorch's own float32 answer.
"""

import argparse
import copy
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
        exact = copy.deepcopy(model).double()
        errors, scale, start = {"salus": 0.0, "pytorch": 0.0}, 0.0, time.perf_counter()
        for i in range(args.requests):
            x = torch.randn(16, 64)
            logits = serve(x)                       # the forward pass, on salusd
            with torch.no_grad():
                want = exact(x.double())
                errors["salus"] = max(errors["salus"], (logits - want).abs().max().item())
                errors["pytorch"] = max(errors["pytorch"], (model(x) - want).abs().max().item())
                scale = max(scale, want.abs().max().item())
            print(f"request {i:3d}: classes {logits.argmax(dim=1).tolist()}")
        per = (time.perf_counter() - start) / args.requests * 1e3
    print(f"{args.requests} requests, {per:.2f} ms each; largest error against float64: "
          f"salus {errors['salus']:.2e}, pytorch float32 {errors['pytorch']:.2e} "
          f"(largest output {scale:.2e})")


if __name__ == "__main__":
    main()
