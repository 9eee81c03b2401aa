"""Attention with dropout on salusd: ``scaled_dot_product_attention(dropout_p=p)`` runs
as one fused op each way (PyTorch's efficient op), its keep-flags drawn from the
session's generator, the backward drawing the forward's flags again.

The flags are read off exactly: with queries and keys of zeros every probability of a
row is ``1 / n`` (``n`` the keys the row sees), so with the identity as the values each
output element is a flag times ``1 / (n (1 - p))``; a step of SGD with learning rate 1
then gives the values' gradient, each key's kept count over the queries, whose sum must
be the loss the forward computed."""

from __future__ import annotations

import pytest
import torch
from daemon import Daemon
from torch import nn
from torch.nn import functional as F

import salus.torch as st
from salus.v1 import graph_pb2 as pb


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--policy", "pack", "--memory", "256MiB") as d:
        yield d


class Revealing(nn.Module):
    """Attention of zero queries and keys over the identity as values: each output is a
    row of keep-flags, scaled. ``mask``: none, ``causal`` or a bool mask (a band);
    ``groups`` query heads per key head (grouped-query attention)."""

    def __init__(self, keys: int, p: float, mask: str = "none", heads: int = 2,
                 groups: int = 1):
        super().__init__()
        self.values = nn.Parameter(torch.eye(keys).expand(1, heads // groups, keys, keys)
                                   .clone())
        self.p, self.mask, self.groups = p, mask, groups

    def forward(self, x):
        kv = x[:, ::self.groups]
        bias = None
        if self.mask == "band":
            n = x.shape[2]
            i, j = torch.arange(n).unsqueeze(1), torch.arange(self.values.shape[2])
            bias = (j - i).abs() <= 3
        return F.scaled_dot_product_attention(
            x, kv, self.values.expand(x.shape[0], -1, -1, -1), attn_mask=bias,
            dropout_p=self.p, is_causal=self.mask == "causal",
            enable_gqa=self.groups > 1)


def _seen(mask: str, queries: int, keys: int) -> torch.Tensor:
    """Which keys each query sees (bool ``[queries, keys]``)."""
    i, j = torch.arange(queries).unsqueeze(1), torch.arange(keys)
    if mask == "causal":
        return j <= i
    if mask == "band":
        return (j - i).abs() <= 3
    return torch.ones(queries, keys, dtype=torch.bool)


@pytest.mark.parametrize("mask,groups", [("none", 1), ("causal", 1), ("band", 1),
                                         ("none", 2)])
def test_each_probability_is_kept_with_chance_one_minus_p(daemon, mask, groups):
    p, batch, heads, n = 0.3, 2, 4, 64
    x = torch.zeros(batch, heads, n, 8)
    model = Revealing(n, p, mask, heads, groups)
    with st.InferenceSession(model, x, eval_mode=False, address=daemon.address) as session:
        state = session.state_dict()
        first, second = session(x), session(x)
        session.load_state_dict(state)
        again = session(x)
    seen = _seen(mask, n, n)
    scale = seen.sum(1, keepdim=True) * (1 - p)
    flags = first * scale
    assert torch.allclose(flags, flags.round(), atol=1e-4), "each output a scaled flag"
    flags = flags.round()
    assert set(flags.unique().tolist()) <= {0.0, 1.0}
    assert not flags[..., ~seen].any(), "a key the mask hides is never kept"
    draws = flags[..., seen]
    kept, count = draws.mean().item(), draws.numel()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / count) ** 0.5, kept
    assert not torch.equal(first, second), "new flags each call"
    assert torch.equal(first, again), "the generator's state decides the flags"


def test_the_backward_draws_the_forwards_flags(daemon):
    p, n = 0.4, 96
    x = torch.zeros(1, 2, n, 8)
    model = Revealing(n, p)
    before = model.values.detach().clone()
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=1.0), (x,),
                         loss_of=lambda m, x: m(x).sum(), address=daemon.address) as session:
        loss = float(session.step(x))
        after = next(v for k, v in session.state_dict().items() if k.endswith("values"))
    grad = before - after
    # d loss / d values[j, d] = sum_i P_ij F_ij: the same for every d, each key's kept
    # count over the queries times 1 / (n (1 - p)).
    assert torch.allclose(grad, grad[..., :1].expand_as(grad), atol=1e-6)
    counts = grad[..., 0] * n * (1 - p)
    assert torch.allclose(counts, counts.round(), atol=1e-3)
    kept = counts.round().sum().item()
    assert abs(kept / (2 * n * n) - (1 - p)) < 5 * (p * (1 - p) / (2 * n * n)) ** 0.5
    # The loss is the forward's sum of the same flags.
    assert loss * n * (1 - p) == pytest.approx(kept, abs=1e-2)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_stock_encoder_with_dropout_trains_and_repeats_per_seed(daemon, autocast):
    """``nn.TransformerEncoder`` as users build it (dropout 0.1 in attention, the
    feed-forward and the residual branches), in f32 and under bf16 autocast: the loss
    falls, and a session started from the same seed draws the same flags (the same
    losses)."""

    def losses(seed: int) -> list[float]:
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        x, y = torch.randn(8, 12, 32), torch.randn(8, 12, 32)
        with st.TrainSession(model, F.mse_loss, torch.optim.AdamW(model.parameters(), 3e-3),
                             (x, y), autocast=autocast, address=daemon.address) as session:
            graph = session.traced.to_graph()
            fused = [n for n in graph.nodes if n.op == "_scaled_dot_product_efficient_attention"]
            assert len(fused) == 2
            query = graph.tensors[fused[0].inputs[0]]
            assert query.dtype == (pb.DTYPE_BF16 if autocast else pb.DTYPE_F32)
            return [float(session.step(x, y)) for _ in range(12)]

    first, again = losses(1), losses(1)
    assert first == again
    assert first[-1] < 0.8 * first[0], first


def test_the_cpu_kernels_nest_and_leave_pytorch_as_it_was():
    """The efficient op's CPU kernels exist inside the blocks only, however they nest or
    overlap across threads; outside, PyTorch's CPU refuses the op as before."""
    import threading

    from salus.attention import efficient_attention_on_cpu

    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.randn(1, 2, 5, 4)

    def run():
        return op(q, q, q, None, True, 0.5, False)[0]

    inside, errors = threading.Barrier(2), []

    def worker():
        try:
            with efficient_attention_on_cpu():
                inside.wait(timeout=10)
                run()
                inside.wait(timeout=10)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    with efficient_attention_on_cpu():
        inside.wait(timeout=10)
        with efficient_attention_on_cpu():
            assert run().shape == (1, 2, 5, 4)
        inside.wait(timeout=10)
    thread.join()
    assert not errors, errors
    with pytest.raises(NotImplementedError):
        run()


def test_calls_the_fused_op_cannot_take_run_as_pytorch_runs_them():
    """Mismatched heads without ``enable_gqa``, broadcast batches and a mask that needs a
    gradient are not the efficient op's: PyTorch runs (or refuses) them as it would."""
    from salus.attention import attention_with_dropout

    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q[:, :2], q[:, :2], dropout_p=0.5)
    with pytest.raises(RuntimeError):
        attention_with_dropout(q, q[:, :2], q[:, :2], dropout_p=0.5)
    broadcast = attention_with_dropout(q, q[:1], q[:1], dropout_p=0.5)
    assert broadcast.shape == (2, 4, 5, 8)
    bias = torch.zeros(5, 5, requires_grad=True)
    out = attention_with_dropout(q, q, q, attn_mask=bias, dropout_p=0.5)
    out.sum().backward()
    assert bias.grad is not None
