"""``nn.Embedding`` and ``nn.EmbeddingBag`` with ``max_norm``: the rows a batch looks up
are rescaled in place before the lookup (``embedding_renorm``), a change to a parameter
the step's update then carries. Trained three Adam steps on salusd against float64 by
the suite's rule (harness.py); served, the outputs are PyTorch's; a frozen weight is
refused at trace time, naming the remedy."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn

import salus
import salus.torch as st

F = nn.functional


class Bags(nn.Module):
    """Token embeddings renormalized to a max 2-norm, bags to a max 1-norm; rows start
    three times too long, so the first lookups rescale them."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(10, 4, max_norm=1.0)
        self.bags = nn.EmbeddingBag(10, 4, max_norm=2.0, norm_type=1.0, mode="mean")
        with torch.no_grad():
            self.tokens.weight.mul_(3)
            self.bags.weight.mul_(3)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.tokens(ids).sum(1) + self.bags(ids))


IDS = torch.tensor([[1, 2, 3], [3, 4, 1]])


def test_trains_on_salusd_as_eagerly(daemon):
    torch.manual_seed(0)
    assert_trains_on_salusd_as_eagerly(Bags(), (IDS, torch.randn(2, 2)),
                                       lambda m, ids, y: F.mse_loss(m(ids), y),
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address)


def test_a_served_model_gives_pytorchs_outputs(daemon):
    torch.manual_seed(0)
    model = Bags().eval()
    eager = copy.deepcopy(model)
    with st.InferenceSession(model, (IDS,), address=daemon.address) as session:
        for ids in (IDS, torch.tensor([[5, 6, 1], [9, 9, 0]])):
            torch.testing.assert_close(session(ids), eager(ids), rtol=1e-5, atol=1e-6)


def test_a_frozen_renormalized_weight_is_refused_naming_the_remedy():
    model = Bags()
    model.tokens.weight.requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(salus.TraceError, match="max_norm"):
        salus.trace_train_step(model, None, optimizer, (IDS,), loss_of=lambda m, i: m(i).sum())
