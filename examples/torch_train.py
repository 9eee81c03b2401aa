"""A PyTorch training loop moved onto salusd: the changed lines are marked `# salus`.

Start salusd first (`salusd`, or `salusd --socket /tmp/s.sock` and
`SALUS_ADDRESS=/tmp/s.sock`), then:

    python examples/torch_train.py [--steps 100] [--compare] [--amp bf16|f16]

`--compare` also trains copies of the model in plain PyTorch, in float32 and float64, on
the same batches, and prints how far salus and PyTorch's float32 run each end up from
float64: salus gives PyTorch's numbers, as exactly as PyTorch does. The loop is an ordinary one: a learning-rate schedule, gradient
clipping, and a DataLoader whose last batch of each epoch is smaller.

`--amp bf16` trains under CPU autocast in bfloat16, `--amp f16` in float16 with a
`torch.amp.GradScaler` (the eager loop's lines for both are in `eager`); with
`--compare`, PyTorch's run is then eager autocast's, and salus ends up as close to
float64 as it does.
"""

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import salus.torch  # salus


class Net(nn.Module):
    # No bias before batch norm: its gradient is zero in exact arithmetic, so Adam would
    # train it on rounding noise, in PyTorch as on salus, and the two would differ there.
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 64), nn.ReLU(),
                                  nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.conv(x))


def data(n=624, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 16, 16, generator=g)
    y = (x.mean(dim=(1, 2, 3)) * 40).long().clamp(-5, 4) + 5   # a learnable target
    return TensorDataset(x, y)


AMP = {"bf16": torch.bfloat16, "f16": torch.float16}


def scaler_for(amp):
    """float16 needs a loss scaler; bfloat16 (float32's range) does not."""
    return torch.amp.GradScaler("cpu") if amp == "f16" else None


def eager(initial, batches, steps, dtype, amp=None):
    """The same loop in plain PyTorch, in ``dtype`` (under autocast with ``amp``):
    (model, losses)."""
    model = copy.deepcopy(initial).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3,
                                                    total_steps=steps)
    scaler = scaler_for(amp)
    losses = []
    for x, y, _ in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=AMP.get(amp, torch.bfloat16), enabled=amp is not None):
            loss = F.cross_entropy(model(x.to(dtype)), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return model, losses


def compare(model, initial, batches, steps, amp):
    """Prints how far salus and PyTorch's float32 run (eager autocast's with ``amp``) each
    are from float64."""
    torch32, losses32 = eager(initial, batches, steps, torch.float32, amp)
    exact, losses64 = eager(initial, batches, steps, torch.float64)

    def error(m):
        return max((p.double() - q).abs().max().item()
                   for p, q in zip(m.parameters(), exact.parameters()))

    scale = max(p.abs().max().item() for p in exact.parameters())
    print(f"final loss: salus {batches[-1][2]:.6f}, pytorch {losses32[-1]:.6f}, "
          f"float64 {losses64[-1]:.6f}")
    print(f"largest parameter error against float64: salus {error(model):.2e}, "
          f"pytorch {f'autocast {amp}' if amp else 'float32'} {error(torch32):.2e} "
          f"(largest parameter {scale:.2e})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--amp", choices=sorted(AMP), help="train under CPU autocast")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3,
                                                    total_steps=args.steps)
    # 624 samples: 19 batches of 32 and a last one of 16 per epoch.
    loader = DataLoader(data(), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    initial = copy.deepcopy(model) if args.compare else None
    seen = []                       # the batches, for --compare

    x0, y0 = next(iter(loader))                                             # salus
    with salus.torch.TrainSession(model, F.cross_entropy, optimizer, (x0, y0),  # salus
                                  clip_grad_norm=1.0,                       # salus
                                  autocast=AMP.get(args.amp),               # salus
                                  scaler=scaler_for(args.amp),              # salus
                                  name="torch_train", total_iterations=args.steps) as session:
        step = 0
        while step < args.steps:
            for x, y in loader:
                # optimizer.zero_grad()                                    # salus: these five
                # loss = F.cross_entropy(model(x), y)                      # lines run on
                # loss.backward()                                          # salusd now,
                # nn.utils.clip_grad_norm_(model.parameters(), 1.0)        # as one step
                # optimizer.step()                                         #
                loss = session.step(x, y)                                  # salus
                scheduler.step()
                step += 1
                if initial is not None:
                    seen.append((x, y, loss.item()))
                if step % 10 == 0 or step == args.steps:
                    print(f"step {step:4d}  loss {loss.item():.6f}", flush=True)
                if step == args.steps:
                    break
        session.update_model()      # salus: the trained weights back into `model`
    if initial is not None:
        compare(model, initial, seen, args.steps, args.amp)
    torch.save(model.state_dict(), "/tmp/torch_train.pt")
    print("saved /tmp/torch_train.pt")


if __name__ == "__main__":
    main()
