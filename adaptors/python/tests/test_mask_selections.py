"""Selections by a boolean mask the step captures as a constant (a graph network's
``out[train_mask]`` over a fixed graph, a fixed set of labelled positions): the mask's
true positions are found once at trace time, so the selection has a fixed shape. Each
model trains three Adam steps on salusd against float64 by the suite's rule
(harness.py)."""

from __future__ import annotations

import pytest
import torch
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn

F = nn.functional

_G = torch.Generator().manual_seed(0)
TRAIN_NODES = torch.rand(10, generator=_G) > 0.4           # 1-d: nodes of a fixed graph
LABELLED = torch.rand(3, 5, generator=_G) > 0.5             # 2-d: positions of a sequence
ADJACENCY = (torch.rand(10, 10, generator=_G) > 0.6).float()


class NodeClassifier(nn.Module):
    """One graph convolution over a fixed adjacency, log-probabilities per node."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return (ADJACENCY.to(x.dtype) @ self.lin(x)).log_softmax(-1)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        return self.lin(x)


def _nodes(m, x, y):
    out = m(x)
    return F.nll_loss(out[TRAIN_NODES], y[TRAIN_NODES]) + out[~TRAIN_NODES].exp().mean()


def _positions(m, x, y):
    return F.cross_entropy(m(x)[LABELLED], y[LABELLED])


CASES = {
    "nodes": (NodeClassifier, lambda g: (torch.randn(10, 4, generator=g),
                                         torch.randint(0, 3, (10,), generator=g)), _nodes),
    "positions": (Tagger, lambda g: (torch.randn(3, 5, 4, generator=g),
                                     torch.randint(0, 6, (3, 5), generator=g)), _positions),
}


@pytest.mark.parametrize("name", CASES)
def test_a_constant_mask_selects_on_salusd_as_eagerly(daemon, name):
    torch.manual_seed(0)
    build, batch, loss_of = CASES[name]
    assert_trains_on_salusd_as_eagerly(build(), batch(torch.Generator().manual_seed(1)),
                                       loss_of, lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address, label=f"{name}: ")
