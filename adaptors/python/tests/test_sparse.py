"""Sparse matrices a step captures (a graph convolutional network's adjacency matrix: a
buffer or a global, COO or CSR): their products with dense tensors are recorded as gathers
and index additions over their entries (``salus.sparse``), and the models train on
salusd as eagerly; so do embeddings with sparse gradients under SGD and Adagrad. What
salus cannot follow is refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from harness import (assert_built_model_trains_on_salusd_as_eagerly,
                     assert_trains_on_salusd_as_eagerly)
from torch import nn

import salus

# PyTorch warns that its sparse support is in beta and its invariant checks are off.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NODES = 9


def _adjacency() -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    edges = torch.randint(0, NODES, (2, 24), generator=g)
    edges = torch.cat([edges, torch.arange(NODES).repeat(2, 1)], 1)  # self-loops
    return torch.sparse_coo_tensor(edges, torch.rand(edges.shape[1], generator=g),
                                   (NODES, NODES)).coalesce()


with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    GLOBAL_ADJACENCY = _adjacency()


class _GCN(nn.Module):
    """Two graph convolutions (Kipf and Welling's), the adjacency applied as ``how``
    says."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.first, self.second = nn.Linear(5, 8), nn.Linear(8, 3)
        self.register_buffer("adj", _adjacency())

    def propagate(self, h):
        if self.how == "global_spmm":
            return torch.spmm(GLOBAL_ADJACENCY.to(h.dtype), h)
        if self.how == "normalised":
            # D^-1/2 A D^-1/2, computed from the sparse constant alone, then applied.
            degree = torch.sparse.sum(self.adj, 1).to_dense()
            return torch.sparse.mm(self.adj, h * degree.rsqrt()[:, None]) \
                * degree.rsqrt()[:, None]
        if self.how == "from_the_left":
            return (h.t() @ self.adj.t()).t()
        if self.how == "addmm":
            return torch.sparse.addmm(h, self.adj, h, beta=0.5, alpha=2.0)
        if self.how == "csr":  # (PyTorch cannot deep-copy a CSR buffer)
            return self.adj.to_sparse_csr() @ h
        return self.adj @ h

    def forward(self, x):
        h = torch.relu(self.propagate(self.first(x)))
        return self.propagate(self.second(h))


def _node_classification(how: str):
    def build():
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(NODES, 5, generator=g), torch.randint(0, 3, (NODES,), generator=g)
        return (_GCN(how), (x, y),
                lambda m, x, y: nn.functional.cross_entropy(m(x), y))
    return build


@pytest.mark.parametrize("how", ["coo_buffer", "csr", "global_spmm", "normalised",
                                 "from_the_left", "addmm"])
def test_a_graph_convolutional_network_trains_on_salusd_as_eagerly(how, daemon):
    assert_built_model_trains_on_salusd_as_eagerly(_node_classification(how),
                                                   daemon.address, label=f"{how}: ")


def test_products_are_gathers_over_the_entries_and_the_buffer_is_a_constant():
    model, batch, loss_of = _node_classification("coo_buffer")()
    traced = salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                                    batch, loss_of=loss_of)
    assert "adj" not in traced.state_names
    ops = set(traced.ops())
    assert {"index_put", "index_select"} <= ops, ops  # gathers and index additions
    assert not any(tuple(t.shape) == (NODES, NODES) for t in traced.to_graph().tensors)


class _Refused(nn.Module):
    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.fc = nn.Linear(5, NODES)

    def forward(self, x):
        h = self.fc(x)
        if self.what == "built":
            # A sparse matrix of values the step computes: its values would train.
            adj = GLOBAL_ADJACENCY.coalesce()
            return torch.sparse_coo_tensor(adj.indices(), h[0, 0].expand(adj._nnz()),
                                           adj.shape) @ h
        return GLOBAL_ADJACENCY * h  # elementwise with a dense tensor


@pytest.mark.parametrize("what, message", [
    ("built", "builds a sparse tensor .*sparse_coo_tensor"),
    ("elementwise", "calls Tensor.mul with a sparse tensor and a dense one"),
])
def test_what_salus_cannot_follow_on_a_sparse_tensor_is_refused_by_name(what, message):
    model = _Refused(what)
    batch = (torch.randn(NODES, 5), torch.randint(0, 3, (NODES,)))
    with pytest.raises(salus.TraceError, match=message):
        salus.trace_train_step(model, nn.functional.cross_entropy,
                               torch.optim.SGD(model.parameters(), lr=0.1), batch)


def test_a_captured_sparse_matrix_changed_in_place_is_refused_at_the_next_step():
    adj = _adjacency()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            return torch.sparse.mm(adj, self.fc(x))

    model = Net()
    batch = (torch.randn(NODES, 5), torch.randint(0, 3, (NODES,)))
    traced = salus.trace_train_step(model, nn.functional.cross_entropy,
                                    torch.optim.SGD(model.parameters(), lr=0.1), batch)
    traced.check_constants()
    with torch.no_grad():
        adj.mul_(2)
    with pytest.raises(salus.SalusError, match="changed in place"):
        traced.check_constants()


class _Recommender(nn.Module):
    """DLRM's shape: a bag of embeddings of a categorical feature (sum), one embedding
    per item, both with sparse gradients, and an interaction head."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.bag = nn.EmbeddingBag(12, 4, mode="sum", sparse=True)
            self.item = nn.Embedding(12, 4, sparse=True, padding_idx=0)
            self.head = nn.Linear(4, 1)

    def forward(self, features, offsets, items):
        return self.head(self.bag(features, offsets) * self.item(items)).squeeze(1)


def _clicks():
    g = torch.Generator().manual_seed(2)
    features = torch.randint(0, 12, (10,), generator=g)  # a few rows never looked up
    offsets = torch.tensor([0, 3, 3, 6, 8])               # an empty bag among them
    items = torch.tensor([0, 5, 7, 5, 2])                 # the padding row once
    clicked = torch.randint(0, 2, (5,), generator=g).float()
    return features, offsets, items, clicked


def _click_loss(model, features, offsets, items, clicked):
    return nn.functional.binary_cross_entropy_with_logits(model(features, offsets, items),
                                                         clicked)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adagrad(p, lr=0.5, lr_decay=0.01),
], ids=["sgd", "adagrad"])
def test_embeddings_with_sparse_gradients_train_on_salusd_as_eagerly(make, daemon):
    # Eager PyTorch takes sparse gradients here; salus records dense ones, whose zero
    # rows move neither a row nor its state under these optimizers.
    assert_trains_on_salusd_as_eagerly(_Recommender(), _clicks(), _click_loss, make,
                                       daemon.address, steps=4)


def test_sparse_gradients_under_an_optimizer_that_does_not_take_them_are_refused():
    model = _Recommender()
    with pytest.raises(salus.UnsupportedOptimizerError, match="sparse=True.*Adam does not"):
        salus.trace_train_step(model, None, torch.optim.Adam(model.parameters()), _clicks(),
                               loss_of=_click_loss)
    # A frozen embedding gets no gradient at all: nothing to refuse.
    model.bag.weight.requires_grad_(False)
    model.item.weight.requires_grad_(False)
    salus.trace_train_step(model, None, torch.optim.Adam(model.head.parameters()),
                           _clicks(), loss_of=_click_loss)
