"""Mixtures of experts: tokens routed by the positions of a mask from the batch
(``nonzero``, ``torch.where(mask)``), iterated, gathered, and added or written back
(``index_add_``, ``y[positions] += ...``, ``y[mask] = ...``), an expert no token chose
skipped (``if token.numel() > 0``), and a loss over the labelled rows, train on salusd
as eagerly (salus.positions); a count used otherwise is refused, naming it."""

from __future__ import annotations

import pytest
import torch
from harness import (assert_built_model_trains_on_salusd_as_eagerly,
                     assert_trains_on_salusd_as_eagerly)
from torch import nn

import salus
import salus.torch as st

F = nn.functional


class _Expert(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.gate = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Router(nn.Module):
    def __init__(self, width: int, experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(_Expert(width) for _ in range(experts))
        self.top_k, self.width = top_k, width

    def route(self, x):
        weights = F.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), chosen


class HitExperts(_Router):
    """Mixtral's layer: a loop over the experts any token chose (``nonzero``), the
    tokens of each by ``torch.where`` on a one-hot mask, ``index_add_`` back."""

    def forward(self, x):
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            rows = x[None, token].reshape(-1, self.width)
            y = self.experts[e](rows) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


class EveryExpert(_Router):
    """A loop over every expert, its tokens' positions compared by index, and the
    output written back by ``out[token] += ...``."""

    def forward(self, x):
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == i)
            out[token] += expert(x[token]) * weights[token, slot].unsqueeze(-1)
        return out


class SwitchExperts(_Router):
    """Switch Transformer's top-1 layer: each expert's tokens by a boolean mask, written
    back by assignment under that mask."""

    def forward(self, x):
        weights, chosen = self.route(x)
        out = x.clone()
        for i, expert in enumerate(self.experts):
            tokens = chosen[:, 0] == i
            out[tokens] = expert(x[tokens])
        return out * weights


class SkipsUnchosen(_Router):
    """DeepSeek-V3's layer: every expert, skipped when no token chose it
    (``if token.numel() > 0``); the last expert's gate makes sure no token ever does."""

    def __init__(self, width, experts, top_k):
        super().__init__(width, experts, top_k)
        self.gate = nn.Linear(width, experts)
        with torch.no_grad():
            self.gate.bias[-1] = -1e4

    def forward(self, x):
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == i)
            if token.numel() > 0:
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class Block(nn.Module):
    def __init__(self, layer: type, top_k: int):
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.moe = layer(8, 4, top_k)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        return self.head(h + self.moe(h))


def _case(layer: type, top_k: int):
    def build():
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)
        return Block(layer, top_k), (x, y), lambda m, x, y: F.cross_entropy(m(x), y)
    return build


CASES = {"hit_experts_top2": _case(HitExperts, 2), "hit_experts_top1": _case(HitExperts, 1),
         "every_expert_top2": _case(EveryExpert, 2), "switch_top1": _case(SwitchExperts, 1),
         "skips_unchosen_top1": _case(SkipsUnchosen, 1)}


@pytest.mark.parametrize("name", CASES)
def test_trains_on_salusd_as_eagerly(daemon, name):
    assert_built_model_trains_on_salusd_as_eagerly(CASES[name], daemon.address,
                                                   label=f"{name}: ")


def test_a_mixtral_model_trains_on_salusd_as_eagerly(daemon):
    transformers = pytest.importorskip("transformers")

    def build():
        config = transformers.MixtralConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            num_local_experts=4, num_experts_per_tok=2, use_cache=False)
        ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
        return (transformers.MixtralForCausalLM(config), (ids,),
                lambda m, ids: m(input_ids=ids, labels=ids).loss)

    assert_built_model_trains_on_salusd_as_eagerly(build, daemon.address, label="mixtral: ")



def _labelled_rows_loss(model, x, y):
    """DeBERTa's classification loss: the rows with a label (``y >= 0``) by ``nonzero``
    and ``gather``, when there are any."""
    logits = model(x)
    index = (y >= 0).nonzero()
    if index.size(0) > 0:
        rows = torch.gather(logits, 0, index.expand(index.size(0), logits.size(1)))
        return F.cross_entropy(rows, torch.gather(y, 0, index.view(-1)))
    return logits.sum() * 0


def test_a_loss_over_the_labelled_rows_trains_and_an_empty_batch_is_refused(daemon):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(8, 5, generator=g), torch.tensor([0, -1, 2, 1, -1, 0, 2, -1]))
    assert_trains_on_salusd_as_eagerly(model, batch, _labelled_rows_loss,
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address)
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                         loss_of=_labelled_rows_loss, address=daemon.address) as session:
        before = session.state_dict()
        with pytest.raises(st.DaemonError, match="would have taken the other branch"):
            session.step(batch[0], torch.full((8,), -1))
        assert all(torch.equal(v, session.state_dict()[k]) for k, v in before.items())
        session.step(*batch)


class ComparesCounts(_Router):
    def forward(self, x):
        _, chosen = self.route(x)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, _ = torch.where(chosen == i)
            if token.numel() > 2:
                out[token] += expert(x[token])
        return out


def test_a_count_compared_with_other_than_zero_is_refused_naming_it():
    torch.manual_seed(0)
    model = Block(ComparesCounts, 2)
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    with pytest.raises(salus.TraceError, match=r"compares \(> 2\) the count of"):
        salus.trace_train_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(),
                                                                       lr=0.1), (x, y))
