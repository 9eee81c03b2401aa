"""Serving two dynamic models from one salusd: early exits and decoding.

    python examples/serve_dynamic.py [--seconds 3] [--rate 300] [--slo-ms 25]
                                     [--scheduler orloj]

An early-exit classifier (each request asks for a depth of 1 to 3 blocks; a batch runs
the deepest its requests ask for and each row leaves at its own block) and a recurrent
cell that decodes until a per-request counter runs out (1 to 8 steps) are served side by
side, each with its own request scheduler. Two threads send requests open loop, at
`--rate` requests per second each (Poisson arrivals), for `--seconds`; every request
has the SLO `--slo-ms`. Printed per model: the share of requests answered by their
deadline (the finish rate), dropped and late requests, and the latency of answered
ones (p50, p99, from arrival at salusd to answer). The answers are checked against the
models run eagerly.
"""

import argparse
import random
import threading
import time

import torch
from torch import nn

from salus.errors import RequestDroppedError
from salus.serving import ServedModel, Variant

WIDTH = 128


class EarlyExit(nn.Module):
    """`depth` blocks, then the head; with `exit_at` (each row's exit, 0-based), each
    row leaves after its own block."""

    def __init__(self, blocks=3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x, depth=3, exit_at=None):
        h, out = x, None
        for k in range(depth):
            h = torch.tanh(self.blocks[k](h))
            out = h if out is None or exit_at is None else torch.where(
                (exit_at >= k).unsqueeze(1), h, out)
        return self.head(out)


class Decoder(nn.Module):
    """One step of a recurrent cell: (next state, done), done when `left` reaches 0."""

    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, left):
        left = left - 1
        return (torch.tanh(self.cell(h)), left), left <= 0


def open_loop(name, served, make_request, rate, seconds, slo_ms, sent):
    """Sends `make_request()` at Poisson times for `seconds`; appends (request, future)."""
    rng = random.Random(name)
    start = time.perf_counter()
    at = start
    while True:
        at += rng.expovariate(rate)
        if at - start > seconds:
            return
        time.sleep(max(0.0, at - time.perf_counter()))
        inputs, variant = make_request()
        sent.append((inputs, variant, served.submit(*inputs, variant=variant, slo_ms=slo_ms,
                                                     with_info=True)))


def report(name, sent):
    answered, dropped = [], 0
    for inputs, variant, future in sent:
        try:
            answered.append((inputs, variant, *future.result()))
        except RequestDroppedError:
            dropped += 1
    met = sum(info.met_deadline for *_, info in answered)
    latencies = sorted(info.latency_ms for *_, info in answered)
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] \
        if latencies else float("nan")  # noqa: E731
    batched = sum(info.batch_requests for *_, info in answered) / max(1, len(answered))
    print(f"{name}: {len(sent)} requests, finish rate {met / max(1, len(sent)):.3f} "
          f"({dropped} dropped, {len(answered) - met} late); latency p50 {pick(0.5):.2f} ms, "
          f"p99 {pick(0.99):.2f} ms; {batched:.1f} requests per batch on average")
    return answered


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--slo-ms", type=float, default=25.0)
    parser.add_argument("--scheduler", default="orloj")
    args = parser.parse_args()

    torch.manual_seed(0)
    classifier, decoder = EarlyExit(), Decoder()
    depths = [Variant(f"depth {d}", {"depth": d}) for d in (1, 2, 3)]
    with ServedModel(classifier, torch.randn(WIDTH), variants=depths, variant_arg="exit_at",
                     scheduler=args.scheduler, name="early-exit") as exits, \
            ServedModel(decoder, (torch.randn(WIDTH), torch.tensor(1)), decode_steps=16,
                        scheduler=args.scheduler, name="decoder") as decoding:
        for served in (exits, decoding):
            times = ", ".join(f"{v}/{b}: {ms:.2f}" for (v, b), ms in
                              sorted(served.calibration.items()))
            print(f"session {served.id} ({served.model.__class__.__name__}) open in "
                  f"{served.open_ms:.0f} ms; ms per batch (variant/size): {times}")
        sent = {"early-exit": [], "decoder": []}
        depth, length = random.Random(1), random.Random(2)
        makers = {
            "early-exit": (exits, lambda: ((torch.randn(WIDTH),), depth.randrange(3))),
            "decoder": (decoding, lambda: ((torch.randn(WIDTH),
                                            torch.tensor(length.randint(1, 8))), None)),
        }
        threads = [threading.Thread(target=open_loop, args=(name, served, make, args.rate,
                                                             args.seconds, args.slo_ms,
                                                             sent[name]))
                   for name, (served, make) in makers.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        exit_answers = report("early-exit", sent["early-exit"])
        decode_answers = report("decoder", sent["decoder"])

    with torch.no_grad():
        error = max((abs(out - classifier(x.unsqueeze(0), depth=v + 1)[0]).max().item()
                     for (x,), v, out, _ in exit_answers), default=0.0)
        wrong_steps = sum(info.steps != left.item() or state[1].item() != 0
                          for (_, left), _, state, info in decode_answers)
    print(f"checked: early exits within {error:.2e} of eager PyTorch at their own depth; "
          f"{wrong_steps} decoded requests took other than their own steps")


if __name__ == "__main__":
    main()
