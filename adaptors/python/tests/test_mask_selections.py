"""Selections by a boolean mask. A mask the step captures as a constant (a graph
network's ``out[train_mask]`` over a fixed graph, a fixed set of labelled positions): its
true positions are found once at trace time, so the selection has a fixed shape. A mask
from the batch (``salus.selections``): the selection keeps every row and the mask, and
the losses, sums and means of it count the selected rows only. Each model trains three
Adam steps on salusd against float64 by the suite's rule (harness.py); a session follows
a new mask each step; what a selection cannot follow is refused, naming it."""

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


class Scorer(nn.Module):
    """Per-position scores over 4 classes and a 2-d regression head, for [B, T, 3]."""

    def __init__(self):
        super().__init__()
        self.classes = nn.Linear(3, 4)
        self.values = nn.Linear(3, 2)

    def forward(self, x):
        return self.classes(x), self.values(x)


def _batch_of_masks(g):
    x = torch.randn(3, 5, 3, generator=g)
    labels = torch.randint(0, 4, (3, 5), generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.5
    labels = torch.where(mask, labels, torch.full_like(labels, -7))  # invalid where unused
    x = torch.where(mask[..., None], x, torch.full_like(x, float("inf")))
    return x, labels, torch.randn(3, 5, 2, generator=g), mask


def _select_every_way(m, x, labels, targets, mask):
    """Cross-entropy of the selected positions (weights, label smoothing), the
    negative log-likelihood of the nodes a 1-d mask selects, elementwise losses, sums and
    means of selected elements, and a layer applied to selected inputs (whose unselected
    rows are infinite), each as eager PyTorch computes on the selection."""
    logits, values = m(torch.where(mask[..., None], x, torch.zeros_like(x)))
    weight = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=logits.dtype)
    per_position = F.cross_entropy(logits.reshape(-1, 4), labels.reshape(-1).clamp(min=0),
                                   reduction="none").reshape(3, 5)
    row = mask[:, 0]
    return (F.cross_entropy(logits[mask], labels[mask], weight=weight, label_smoothing=0.1)
            + F.nll_loss(logits[:, 0].log_softmax(-1)[row], labels[:, 0][row], reduction="sum")
            + F.mse_loss(values[mask], targets[mask])
            + F.smooth_l1_loss(values[mask] * 2, targets[mask], reduction="sum") * 0.1
            + F.binary_cross_entropy_with_logits(values[mask][:, 0], (targets[mask][:, 1] > 0)
                                                 .to(values.dtype))
            + (values[mask] - targets[mask]).abs().mean()
            + per_position[mask].mean()
            + torch.masked_select(values, mask[..., None].expand(3, 5, 2)).pow(2).sum() * 0.01
            + logits[mask].softmax(-1).sum(1).mean()
            + m.classes(x[mask]).relu().sum(1).mean() * 0.1)


def test_selections_by_masks_from_the_batch_train_on_salusd_as_eagerly(daemon):
    """Rows the masks leave out hold infinities and invalid labels, which eager PyTorch
    never reads: they change nothing on salusd either."""
    torch.manual_seed(0)
    batch = _batch_of_masks(torch.Generator().manual_seed(2))
    assert_trains_on_salusd_as_eagerly(Scorer(), batch, _select_every_way,
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address)


def test_a_session_follows_a_different_mask_each_step(daemon):
    """One session, a new mask (and count) each step: its losses are eager PyTorch's."""
    import salus.torch as st
    torch.manual_seed(0)
    model = Scorer()
    eager = Scorer()
    eager.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    batches = [_batch_of_masks(g) for _ in range(4)]

    def loss_of(m, x, labels, targets, mask):
        logits, values = m(torch.where(mask[..., None], x, torch.zeros_like(x)))
        return F.cross_entropy(logits[mask], labels[mask]) + F.mse_loss(values[mask],
                                                                        targets[mask])

    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                         batches[0], loss_of=loss_of, address=daemon.address) as session:
        for batch in batches:
            optimizer.zero_grad()
            want = loss_of(eager, *batch)
            want.backward()
            optimizer.step()
            torch.testing.assert_close(session.step(*batch), want.detach(), rtol=1e-5,
                                       atol=1e-6)


def test_what_a_selection_cannot_follow_is_refused_naming_it():
    import salus
    model = Scorer()
    batch = _batch_of_masks(torch.Generator().manual_seed(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for loss_of, what in ((lambda m, x, l, t, k: m(x)[1][k].sum() / m(x)[1][k].shape[0],
                           "uses the count of"),
                          (lambda m, x, l, t, k: m(x)[1][k].max(), "applies max to")):
        with pytest.raises(salus.TraceError, match=what):
            salus.trace_train_step(model, None, optimizer, batch, loss_of=loss_of)

    class Selected(nn.Module):
        def forward(self, x, mask):
            return x[mask]

    with pytest.raises(salus.TraceError, match="returns .* a selection by a boolean mask"):
        salus.trace_inference(Selected(), (batch[0], batch[3]))
