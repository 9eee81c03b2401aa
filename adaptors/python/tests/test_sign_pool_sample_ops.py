"""Ops of signs, 3-d adaptive pooling and categorical draws, in IR ops: ``copysign``,
``signbit`` and ``angle`` of reals, ``AdaptiveAvgPool3d`` and ``AdaptiveMaxPool3d``
of even and uneven windows (a video model's head), each trained three Adam steps on
salusd against float64 by the suite's rule (harness.py); and ``multinomial`` (with and
without replacement, ``Categorical.sample``, a policy's actions) drawn on salusd from
the session's generator, against the distribution it must follow, with PyTorch's checks
of the weights."""

from __future__ import annotations

import pytest
import torch
from harness import assert_built_model_trains_on_salusd_as_eagerly
from torch import nn

import salus.torch as st

F = nn.functional


class Signs(nn.Module):
    """Magnitudes with another tensor's sign (a signed-distance head), a sign bit as a
    mask, and the angle of real numbers (pi for the negative ones) as a feature."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)
        self.head = nn.Linear(18, 3)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        signed = torch.copysign(a, b) + torch.copysign(b, -1.0)
        masked = torch.where(torch.signbit(a), a * 0.5, a)
        turned = torch.angle(b) * b
        return self.head(torch.cat([signed, masked, turned], -1))


class VideoHead(nn.Module):
    """A 3-d convolution, then adaptive average and max pooling of its clip to sizes that
    divide it and to sizes that do not."""

    def __init__(self, sizes):
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.avg = nn.AdaptiveAvgPool3d(sizes)
        self.max = nn.AdaptiveMaxPool3d(sizes)
        cells = sizes[0] * sizes[1] * sizes[2]
        self.head = nn.Linear(2 * 3 * cells, 4)

    def forward(self, clip):
        h = self.conv(clip).relu()
        return self.head(torch.cat([self.avg(h).flatten(1), self.max(h).flatten(1)], 1))


def _signs():
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    return Signs(), (x, torch.randn(5, 3)), lambda m, x, y: F.mse_loss(m(x), y)


def _video(sizes):
    def build():
        clip = torch.randn(2, 2, 4, 6, 5, generator=torch.Generator().manual_seed(2))
        return VideoHead(sizes), (clip, torch.randn(2, 4)), lambda m, x, y: F.mse_loss(m(x), y)
    return build


MODELS = {"signs": _signs, "video_even": _video((2, 3, 5)), "video_uneven": _video((3, 4, 2)),
          "video_one": _video((1, 1, 1))}


@pytest.mark.parametrize("name", MODELS)
def test_trains_on_salusd_as_eagerly(daemon, name):
    assert_built_model_trains_on_salusd_as_eagerly(MODELS[name], daemon.address,
                                                   label=f"{name}: ")


def test_the_sign_rules_give_pytorchs_values_at_zeros_infinities_and_nans():
    from salus.rules.arithmetic import _angle, _copysign, _signbit
    x = torch.tensor([-2.0, -0.0, 0.0, 3.0, float("inf"), float("-inf"), float("nan")])
    y = x.flip(0)
    assert torch.equal(_signbit(x), torch.signbit(x))
    torch.testing.assert_close(_copysign(y, x), torch.copysign(y, x), equal_nan=True,
                               rtol=0, atol=0)
    torch.testing.assert_close(_angle(x), torch.angle(x), equal_nan=True, rtol=0, atol=0)
    ints = torch.tensor([-3, 0, 4])
    assert torch.equal(_signbit(ints), torch.signbit(ints))
    torch.testing.assert_close(_angle(ints), torch.angle(ints), rtol=0, atol=0)
    torch.testing.assert_close(_copysign(ints, -1.0), torch.copysign(ints, -1.0))


@pytest.mark.parametrize("sizes", [(2, 3, 5), (3, 4, 2), (1, 1, 1), (4, 6, 5)])
def test_the_adaptive_3d_pooling_rules_give_pytorchs_values_indices_and_gradients(sizes):
    from salus.rules.pooling import _adaptive_avg_pool3d, _adaptive_max_pool3d
    x = torch.randn(2, 3, 4, 6, 5, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(3))
    x[0, 0, 1, 2] = 7.0  # ties: the first of equal cells, as PyTorch's
    values, indices = _adaptive_max_pool3d(x, sizes)
    want_values, want_indices = F.adaptive_max_pool3d(x, sizes, return_indices=True)
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(2, 3, *sizes, dtype=torch.float64)
    (_adaptive_avg_pool3d(mine, sizes) * weights).sum().backward()
    (F.adaptive_avg_pool3d(theirs, sizes) * weights).sum().backward()
    # A window's sum (at most 4 * 6 * 5 cells) and a cell's gradient (from at most 2 * 2 * 2
    # overlapping windows) added in another order: each addition rounds once.
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(_adaptive_avg_pool3d(x, sizes), F.adaptive_avg_pool3d(x, sizes),
                               rtol=0, atol=120 * eps * x.abs().max().item())
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0,
                               atol=8 * eps * weights.abs().max().item())


class _Draws(nn.Module):
    """Categorical draws of every kind from the same weights (one of them 0)."""

    def forward(self, weights):
        rows = weights.expand(4000, -1)
        return (torch.multinomial(rows, 3, replacement=True),
                torch.multinomial(rows, 3),
                torch.distributions.Categorical(probs=rows).sample(),
                torch.multinomial(weights, 2))


def test_multinomial_draws_follow_their_distribution(daemon):
    """With replacement, each category's share of the draws within 5 standard errors of
    its probability; without, three different categories in every row, the first drawn
    with its probability; a category of weight 0 never drawn; an unbatched draw; new
    draws each call. Weights PyTorch refuses fail the iteration with its message."""
    weights = torch.tensor([1.0, 0.0, 2.0, 3.0, 4.0])
    p = weights / weights.sum()
    with st.InferenceSession(_Draws(), weights, address=daemon.address) as session:
        first = session(weights)
        with_replacement, without, categorical, single = first
        for drawn in (with_replacement.flatten(), without[:, 0], categorical):
            share = torch.bincount(drawn, minlength=5).double() / drawn.numel()
            bound = 5 * (p * (1 - p) / drawn.numel()).sqrt() + 1e-12
            assert ((share - p).abs() <= bound).all(), (share, p)
        assert without.dtype == torch.int64 and without.shape == (4000, 3)
        assert (without.sort(1).values.diff(dim=1) > 0).all()
        assert (without != 1).all() and (with_replacement != 1).all()
        assert single.shape == (2,) and single[0] != single[1] and (single != 1).all()
        again = session(weights)
        assert not torch.equal(first[0], again[0]), "new draws each call"
        for bad, message in ((torch.tensor([1.0, -1.0, 2.0, 3.0, 4.0]), "element < 0"),
                             (torch.zeros(5), "sum of probabilities <= 0")):
            with pytest.raises(RuntimeError, match=message):
                torch.multinomial(bad, 1)
            with pytest.raises(st.DaemonError, match=message):
                session(bad)
