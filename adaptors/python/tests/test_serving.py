"""salus.serving against a real salusd: requests one at a time, batched by the daemon.

- A static MLP: requests sent from many threads at once, each answer the model's output
  for that input alone, within the rule of ``harness.assert_as_exact_as_pytorch`` against
  the model in float64, whatever batches they ran in.
- Early exits: a request's depth is its variant; salusd fills ``exit_at`` with each
  row's variant, so a request batched with deeper ones still gets its own exit.
- Sequence-length buckets: an input goes to the first variant that holds it, zero-padded.
- Decoding: a recurrent cell carries its state until a per-row counter reaches zero; each
  request takes as many steps as its counter said. Requests sent while a long request
  runs wait for it and are batched together (the worker runs one batch at a time).
- Refusals: inputs of the wrong shape, dtype or count, unknown variants, decoding models
  whose output is not ``(next_state, done)``; requests whose deadline cannot be met are
  dropped or answered late, never on time.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from daemon import Daemon
from harness import assert_as_exact_as_pytorch, f64_twin, randomly_rounded
from torch import nn

from salus.errors import BatchError, RequestDroppedError, SalusError, SessionClosedError
from salus.serving import ServedModel, Variant


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--memory", "256MiB") as d:
        yield d


def answers(served: ServedModel, requests: list[tuple], threads: int = 4):
    """``(outputs, info)`` of each request, sent from ``threads`` threads at once: each
    thread submits its share together (a client's requests arrive faster than one
    thread's blocking calls could send them), then waits for their answers."""
    start = threading.Barrier(threads)

    def share(t: int) -> list:
        start.wait()
        futures = [served.submit(*r, with_info=True) for r in requests[t::threads]]
        return [f.result() for f in futures]

    with ThreadPoolExecutor(threads) as pool:
        shares = list(pool.map(share, range(threads)))
    return [shares[k % threads][k // threads] for k in range(len(requests))]


def assert_each_as_exact(model: nn.Module, inputs: list[tuple], outputs: list[torch.Tensor],
                         run=lambda m, *x: m(*x)) -> None:
    """Each output against ``run(model, *its inputs)`` alone, by the rule of
    ``assert_as_exact_as_pytorch`` (float64 exact, eager float32 and random rounding as
    yardsticks)."""
    exact_model = f64_twin(model).eval()
    model.eval()

    def each(m, dtype):
        def cast(x):
            return x.to(dtype) if x.is_floating_point() else x
        return {f"request {k}": run(m, *(cast(x).unsqueeze(0) for x in xs))[0]
                for k, xs in enumerate(inputs)}

    with torch.no_grad():
        def exact():
            return each(exact_model, torch.float64)
        actual = {f"request {k}": out for k, out in enumerate(outputs)}
        assert_as_exact_as_pytorch(actual, exact(), each(model, torch.float32),
                                   randomly_rounded(exact, seeds=(0,)))


def test_a_static_model_batches_concurrent_requests_and_answers_each_alone(daemon):
    torch.manual_seed(0)
    # Large enough that requests arrive while a batch runs (about 0.1 ms on a CPU).
    model = nn.Sequential(nn.Linear(12, 256), nn.GELU(), nn.LayerNorm(256),
                          nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 5))
    inputs = [(torch.randn(12),) for _ in range(24)]
    with ServedModel(model, torch.randn(12), batch_sizes=(1, 2, 4),
                     address=daemon.address, name="mlp") as served:
        assert sorted(served.calibration) == [(0, 1), (0, 2), (0, 4)]
        got = answers(served, inputs)
    outputs = [out for out, _ in got]
    assert all(out.shape == (5,) and out.dtype == torch.float32 for out in outputs)
    assert_each_as_exact(model, inputs, outputs)
    infos = [info for _, info in got]
    assert all(i.batch_requests <= i.batch_size and i.batch_size in (1, 2, 4) for i in infos)
    assert all(i.steps == 1 and i.done and i.met_deadline for i in infos), infos


class EarlyExit(nn.Module):
    """``depth`` blocks, then the head; with ``exit_at`` (each row's exit, 0-based), each
    row leaves after its own block (at most ``depth``)."""

    def __init__(self, width: int = 256, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x, depth: int = 3, exit_at: torch.Tensor | None = None):
        h, out = x, None
        for k in range(depth):
            h = torch.tanh(self.blocks[k](h))
            out = h if out is None or exit_at is None else torch.where(
                (exit_at >= k).unsqueeze(1), h, out)
        return self.head(out)


def test_early_exits_give_each_request_its_own_depth_in_deeper_batches(daemon):
    torch.manual_seed(1)
    model = EarlyExit()
    variants = [Variant(f"depth {d}", {"depth": d}) for d in (1, 2, 3)]
    requests = [(torch.randn(256),) for _ in range(24)]
    depths = [k % 3 for k in range(24)]
    with ServedModel(model, torch.randn(256), batch_sizes=(1, 2, 4), variants=variants,
                     variant_arg="exit_at", scheduler="fifo", address=daemon.address,
                     name="early-exit") as served:
        assert len(served.calibration) == 9
        # All at once: requests of every depth wait together while a batch runs.
        futures = [served.submit(*requests[k], variant=depths[k], with_info=True)
                   for k in range(24)]
        got = [future.result() for future in futures]
        by_name, by_name_info = served.infer(*requests[0], variant="depth 3", with_info=True)
    for k, (_, info) in enumerate(got):
        assert info.variant == depths[k] and info.batch_variant >= info.variant, info
    assert any(info.batch_variant > info.variant for _, info in got), \
        "no request ran in a deeper batch"
    assert by_name_info.variant == 2
    for depth in (0, 1, 2):
        picked = [k for k in range(24) if depths[k] == depth]
        assert_each_as_exact(model, [requests[k] for k in picked], [got[k][0] for k in picked],
                             run=lambda m, x, d=depth: m(x, depth=d + 1))


class BagOfTokens(nn.Module):
    """Sums a projection over the sequence: zero padding at its end changes nothing."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6, bias=False)

    def forward(self, tokens):
        return torch.tanh(self.proj(tokens).sum(dim=1))


def test_inputs_go_to_the_first_bucket_that_holds_them_zero_padded(daemon):
    torch.manual_seed(2)
    model = BagOfTokens()
    buckets = [Variant(f"{n} tokens", example=torch.zeros(n, 4)) for n in (4, 8)]
    requests = [(torch.randn(n, 4),) for n in (3, 4, 6, 8, 1)]
    with ServedModel(model, variants=buckets, batch_sizes=(1, 2), address=daemon.address,
                     name="buckets") as served:
        got = answers(served, requests)
        with pytest.raises(BatchError, match=r"input 0 is float32\[9, 4\] .* but the "
                                             r"largest variant takes float32\[8, 4\]"):
            served.infer(torch.randn(9, 4))
        with pytest.raises(BatchError, match=r"variant 0 \(4 tokens\) takes float32\[4, 4\]"):
            served.infer(torch.randn(6, 4), variant=0)
    assert [info.variant for _, info in got] == [0, 0, 1, 1, 0]
    assert_each_as_exact(model, requests, [out for out, _ in got])


class Countdown(nn.Module):
    """One step of a recurrent cell; ``left`` counts down, done at zero."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.cell = nn.Linear(width, width)

    def forward(self, h, left):
        left = left - 1
        return (torch.tanh(self.cell(h)), left), left <= 0


def test_decoding_requests_take_their_own_steps(daemon):
    torch.manual_seed(3)
    model = Countdown()
    requests = [(torch.randn(8), torch.tensor(k % 5 + 1, dtype=torch.int64))
                for k in range(15)]
    with ServedModel(model, (torch.randn(8), torch.tensor(1)), batch_sizes=(1, 2, 4),
                     decode_steps=2000, scheduler="edf", address=daemon.address,
                     name="countdown") as served:
        # A long request first: the others arrive while its batch runs (1,500 steps, tens
        # of milliseconds on any machine), so whatever the machine's speed they queue and
        # run batched once it is done.
        long = served.submit(torch.randn(8), torch.tensor(1500), with_info=True)
        got = answers(served, requests)
        (_, left), info = long.result()
        assert (info.steps, info.done, left.item()) == (1500, True, 0)
        # Not done within the bound: its state after the last step.
        (h, left), info = served.infer(torch.randn(8), torch.tensor(2040), with_info=True)
        assert (info.steps, info.done, left.item()) == (2000, False, 40)
    for (x, left), ((h, now), info) in zip(requests, got):
        assert (info.steps, info.done, now.item()) == (left.item(), True, 0), info
        assert h.shape == (8,) and now.dtype == torch.int64
    assert any(info.batch_requests > 1 for _, info in got)

    def steps(m, h, left):
        for _ in range(int(left)):
            (h, _), _ = m(h, left)
        return h

    assert_each_as_exact(model, requests, [h for (h, _), _ in got], run=steps)


class NoDone(Countdown):
    def forward(self, h, left):
        return torch.tanh(self.cell(h)), left - 1


class WrongState(Countdown):
    def forward(self, h, left):
        return (torch.tanh(self.cell(h)), (left - 1).float()), left <= 1


def test_wrong_inputs_and_decoding_outputs_are_refused_by_name(daemon):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 3))
    with ServedModel(model, torch.randn(6), batch_sizes=(1, 2), address=daemon.address) as s:
        with pytest.raises(BatchError, match=r"input 0 is float32\[7\] .* but it takes "
                                             r"float32\[6\]"):
            s.infer(torch.randn(7))
        with pytest.raises(BatchError, match=r"input 0 is float32\[2, 6\]"):
            s.infer(torch.randn(2, 6))  # a batch: one request at a time
        with pytest.raises(BatchError, match=r"input 0 is int64\[6\]"):
            s.infer(torch.zeros(6, dtype=torch.int64))
        with pytest.raises(BatchError, match="takes 1 input"):
            s.infer(torch.randn(6), torch.randn(6))
        with pytest.raises(ValueError, match="unknown variant 1"):
            s.infer(torch.randn(6), variant=1)
        assert s.infer(torch.randn(6)).shape == (3,), "refusals leave it serving"
        # New weights loaded into the model would not reach salusd's copy: said so.
        model.load_state_dict(nn.Sequential(nn.Linear(6, 3)).state_dict())
        with pytest.raises(SalusError, match="0.weight, 0.bias changed in place .* new "
                                             "ServedModel"):
            s.infer(torch.randn(6))
    with pytest.raises(SessionClosedError, match="is closed"):
        s.infer(torch.randn(6))
    example = (torch.randn(8), torch.tensor(3))
    with pytest.raises(SalusError, match=r"must return \(next_state, done\).* returns "
                                         r"\(float32\[8\], int64\[\]\)"):
        ServedModel(NoDone(), example, decode_steps=4, address=daemon.address)
    with pytest.raises(SalusError, match=r"returns \(\(float32\[8\], float32\[\]\), bool\[\]\)"):
        ServedModel(WrongState(), example, decode_steps=4, address=daemon.address)
    with pytest.raises(ValueError, match="does not hold variant 0"):
        ServedModel(model, variants=[Variant(example=torch.randn(6)),
                                     Variant(example=torch.randn(4))], address=daemon.address)


def test_requests_that_cannot_meet_their_deadline_are_dropped_or_late(daemon):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    with ServedModel(model, torch.randn(32), batch_sizes=(1, 2), scheduler="orloj",
                     address=daemon.address) as served:
        futures = [served.submit(torch.randn(32), slo_ms=0.001, with_info=True)
                   for _ in range(32)]
        dropped = late = 0
        for future in futures:
            try:
                _, info = future.result()
            except RequestDroppedError as error:
                assert error.code == "DEADLINE_EXCEEDED" and "dropped" in str(error), error
                dropped += 1
            else:
                assert not info.met_deadline, info
                late += 1
        assert dropped + late == 32 and dropped > 0, (dropped, late)
        # Without an SLO the same requests are answered.
        assert served.infer(torch.randn(32)).shape == (32,)
