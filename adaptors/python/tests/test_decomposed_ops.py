"""Ops Core ATen keeps whole that salus runs through decompositions: ``repeat`` (an expand
and a copy), adaptive max pooling (plain max pooling with its indices where the windows
divide the input, gathered windows where they do not), ``elu`` (through ``expm1``) and
``isnan`` (``x != x``, inside ``logsumexp``), ``sub.Scalar`` (an ``add.Scalar``); and
``log1p``/``expm1`` themselves (binary cross-entropy with logits, softplus);
``EmbeddingBag`` in sum, mean (gathers and accumulating ``index_put``) and max
(``scatter_reduce``). Each model trains three Adam steps on salusd, every tensor against
float64 by the suite's rule (harness.py)."""

from __future__ import annotations

import pytest
import torch
from daemon import Daemon
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn


class Repeats(nn.Module):
    """A learned position table repeated over the batch, then the sum tiled."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.pos = nn.Parameter(torch.randn(1, 3, 6))

    def forward(self, x):
        h = self.linear(x) + self.pos.repeat(x.shape[0], 1, 1)
        return h.repeat(1, 2, 3).sum(1)


class AdaptiveMax(nn.Module):
    """Adaptive max pooling in 1-d (10 to 5) and 2-d (4 x 5 to 2 x 5), then a classifier."""

    def __init__(self, out2d=(2, 5)):
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 3, padding=1)
        self.c2 = nn.Conv2d(2, 4, 3, padding=1)
        self.out2d = out2d
        self.fc = nn.Linear(8 * 5 + 4 * out2d[0] * out2d[1], 5)

    def forward(self, x):
        a = nn.functional.adaptive_max_pool1d(self.c1(x), 5).flatten(1)
        b = self.c2(x.reshape(x.shape[0], 2, 4, -1))
        b = nn.functional.adaptive_max_pool2d(b, self.out2d).flatten(1)
        return self.fc(torch.cat([a, b], 1))


class Smooth(nn.Module):
    """elu, softplus, log1p, expm1 and logsumexp on a linear layer's output."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 6)

    def forward(self, x):
        h = self.linear(x)
        h = nn.functional.elu(h) + nn.functional.softplus(h) + torch.expm1(h.tanh())
        return h * torch.logsumexp(h, 1, keepdim=True) + torch.log1p(h.abs())


def _cosine_embedding():
    # cosine_embedding_loss subtracts the similarity from a Python number (sub.Scalar).
    g = torch.Generator().manual_seed(5)
    return (nn.Linear(6, 4), (torch.randn(5, 6, generator=g), torch.tensor([1, -1, 1, 1, -1])),
            lambda m, x, y: nn.functional.cosine_embedding_loss(m(x)[:, :2], m(x)[:, 2:], y))


def _smooth():
    g = torch.Generator().manual_seed(3)
    # Multi-label targets: binary cross-entropy with logits computes log1p(exp(-|x|)).
    return (Smooth(), (torch.randn(4, 5, generator=g), torch.rand(4, 6, generator=g)),
            lambda m, x, y: nn.functional.binary_cross_entropy_with_logits(m(x), y))


class Bags(nn.Module):
    """The text classifier of PyTorch's tutorial: one flat tensor of token ids, the offset
    where each text starts (a bag), an ``EmbeddingBag`` and a linear layer."""

    def __init__(self, mode="mean", padding_idx=None, include_last_offset=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 6, mode=mode, padding_idx=padding_idx,
                                   include_last_offset=include_last_offset)
        self.fc = nn.Linear(6, 3)

    def forward(self, text, offsets, weights=None):
        return self.fc(self.bag(text, offsets, per_sample_weights=weights))


def _bags(mode="mean", padding_idx=None, include_last_offset=False, weighted=False):
    g = torch.Generator().manual_seed(4)
    text = torch.randint(0, 20, (13,), generator=g)
    text[[2, 7]] = 0  # the padding index, where one is set
    # Four texts, the third empty; with include_last_offset the end closes the last.
    offsets = torch.tensor([0, 5, 9, 9] + ([13] if include_last_offset else []))
    labels = torch.randint(0, 3, (4,), generator=g)
    model = Bags(mode, padding_idx, include_last_offset)
    if weighted:
        weights = torch.rand(13, generator=g)
        return (model, (text, offsets, weights, labels),
                lambda m, t, o, w, y: nn.functional.cross_entropy(m(t, o, w), y))
    return (model, (text, offsets, labels),
            lambda m, t, o, y: nn.functional.cross_entropy(m(t, o), y))


def _repeats():
    g = torch.Generator().manual_seed(1)
    return (Repeats(), (torch.randn(2, 3, 4, generator=g), torch.randn(2, 18, generator=g)),
            lambda m, x, y: nn.functional.mse_loss(m(x), y))


def _adaptive_max():
    g = torch.Generator().manual_seed(2)
    return (AdaptiveMax(), (torch.randn(3, 4, 10, generator=g),
                            torch.randint(0, 5, (3,), generator=g)),
            lambda m, x, y: nn.functional.cross_entropy(m(x), y))


MODELS = {
    "repeat": _repeats,
    "adaptive_max_pool": _adaptive_max,
    "smooth": _smooth,
    "cosine_embedding": _cosine_embedding,
    "bag_mean": _bags,
    "bag_sum_padded_weighted": lambda: _bags("sum", padding_idx=0, weighted=True),
    "bag_mean_last_offset_padded": lambda: _bags("mean", padding_idx=0,
                                                 include_last_offset=True),
    "bag_max": lambda: _bags("max"),
    "bag_max_padded": lambda: _bags("max", padding_idx=0),
    # 4 x 5 into 3 x 2: windows of uneven sizes.
    "adaptive_max_pool_uneven": lambda: (AdaptiveMax(out2d=(3, 2)), *_adaptive_max()[1:]),
}


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--memory", "256MiB") as d:
        yield d


@pytest.mark.parametrize("name", MODELS)
def test_trains_on_salusd_as_eagerly(daemon, name):
    torch.manual_seed(0)
    model, batch, loss_of = MODELS[name]()
    assert_trains_on_salusd_as_eagerly(model, batch, loss_of,
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address, label=f"{name}: ")

