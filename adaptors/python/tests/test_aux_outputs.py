"""A loss function that returns ``(loss, aux)``: the step computes ``aux`` without a
gradient and fetches it with the loss. Outputs for a training metric, and the hidden
state that truncated backpropagation through time carries from batch to batch (the
word-language-model loop of PyTorch's examples), each against eager PyTorch."""

from __future__ import annotations

import pytest
import torch
from harness import assert_as_exact_as_pytorch, randomly_rounded, torch_state, twin
from torch import nn

import salus
import salus.torch as st

CE = nn.functional.cross_entropy


def _classifier() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(count: int, rows: int = 8):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(count)]


def _with_metrics(model, x, y):
    logits = model(x)
    return CE(logits, y), {"logits": logits, "correct": (logits.argmax(1) == y).sum()}


def test_a_step_fetches_the_loss_functions_outputs_as_eagerly_computed(daemon):
    batches = _batches(3)
    model = _classifier()

    def reference(dtype):
        m = twin(model, dtype)
        optimizer = torch.optim.Adam(m.parameters(), lr=1e-2)
        logits = {}
        for i, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            loss, aux = _with_metrics(m, x.to(dtype), y)
            loss.backward()
            optimizer.step()
            logits[f"logits.{i}"] = aux["logits"].detach()
        return {**torch_state(m, optimizer), **logits}

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    with st.TrainSession(model, None, torch.optim.Adam(model.parameters(), lr=1e-2),
                         batches[0], loss_of=_with_metrics, address=daemon.address) as s:
        fetched = [s.step(*b) for b in batches]
        state = s.state_dict()
    for i, (loss, aux) in enumerate(fetched):
        assert loss.dim() == 0 and set(aux) == {"logits", "correct"}
        assert aux["logits"].shape == (8, 3) and not aux["logits"].requires_grad
        assert aux["correct"].item() == (aux["logits"].argmax(1) == batches[i][1]).sum()
        state[f"logits.{i}"] = aux["logits"]
    assert_as_exact_as_pytorch(state, exact, eager, rounded)


class _LanguageModel(nn.Module):
    """The shape of PyTorch's word-language-model example: embedding, LSTM, decoder."""

    def __init__(self, tokens: int = 11, width: int = 8):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.embed = nn.Embedding(tokens, width)
            self.rnn = nn.LSTM(width, width, num_layers=2)
            self.decoder = nn.Linear(width, tokens)

    def forward(self, data, hidden):
        output, hidden = self.rnn(self.embed(data), hidden)
        return self.decoder(output), hidden


def _lm_loss(model, data, hidden, targets):
    output, hidden = model(data, hidden)
    return CE(output.flatten(0, 1), targets.flatten()), hidden


def test_a_single_tensor_is_aux_too_and_a_plain_loss_has_none():
    model = _classifier()
    batch = _batches(1)[0]
    for loss_of, fetched in [(lambda m, x, y: (CE(m(x), y), m(x)), 1),
                             (lambda m, x, y: CE(m(x), y), 0)]:
        traced = salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(),
                                                                     lr=0.1),
                                        batch, loss_of=loss_of)
        assert sum(o.kind == "output" for o in traced.outputs) == fetched
        state = dict(traced.initial_state)
        state.update(traced.rule.changed_hyperparameters())
        _, result = traced.run(state, *batch)
        if fetched:
            assert result[0].dim() == 0 and result[1].shape == (8, 3)
        else:
            assert result.dim() == 0


def test_truncated_backpropagation_carries_the_hidden_state_as_eagerly(daemon):
    g = torch.Generator().manual_seed(5)
    stream = torch.randint(0, 11, (25, 3), generator=g)  # [time, batch]
    bptt = 6
    chunks = [(stream[i:i + bptt], stream[i + 1:i + 1 + bptt]) for i in range(0, 24, bptt)]
    model = _LanguageModel()

    def fresh_hidden(dtype=torch.float32):
        return tuple(torch.zeros(2, 3, 8, dtype=dtype) for _ in range(2))

    def reference(dtype):
        m = twin(model, dtype)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.5)
        hidden = fresh_hidden(dtype)
        for data, targets in chunks:
            hidden = tuple(h.detach() for h in hidden)  # repackage_hidden
            optimizer.zero_grad()
            loss, hidden = _lm_loss(m, data, hidden, targets)
            loss.backward()
            optimizer.step()
        return {**torch_state(m, optimizer), "hidden.h": hidden[0].detach(),
                "hidden.c": hidden[1].detach()}

    exact, eager = reference(torch.float64), reference(torch.float32)
    rounded = randomly_rounded(lambda: reference(torch.float64))
    hidden = fresh_hidden()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    with st.TrainSession(model, None, optimizer, (chunks[0][0], hidden, chunks[0][1]),
                         loss_of=_lm_loss, address=daemon.address) as s:
        for data, targets in chunks:
            loss, hidden = s.step(data, hidden, targets)
        state = s.state_dict()
    assert isinstance(hidden, tuple) and hidden[0].shape == (2, 3, 8)
    state.update({"hidden.h": hidden[0], "hidden.c": hidden[1]})
    assert_as_exact_as_pytorch(state, exact, eager, rounded)


def test_accumulated_micro_batches_stack_their_outputs():
    model = _classifier()
    (x, y), = _batches(1)
    traced = salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                                    (x, y), loss_of=_with_metrics,
                                    gradients=salus.GradientRecipe(accumulate=2))
    state = dict(traced.initial_state)
    state.update(traced.rule.changed_hyperparameters())
    _, (loss, aux) = traced.run(state, x, y)
    assert aux["logits"].shape == (2, 4, 3) and aux["correct"].shape == (2,)

    def eager(dtype):  # each micro-batch's logits, and the mean of their losses
        m = twin(model, dtype)
        with torch.no_grad():
            halves = [m(x[:4].to(dtype)), m(x[4:].to(dtype))]
            return {"logits": torch.stack(halves),
                    "loss": (CE(halves[0], y[:4]) + CE(halves[1], y[4:])) / 2}

    assert_as_exact_as_pytorch({"logits": aux["logits"], "loss": loss}, eager(torch.float64),
                               eager(torch.float32),
                               randomly_rounded(lambda: eager(torch.float64)))


@pytest.mark.parametrize("returned, what", [
    (lambda loss, out: (loss, 0.5), "not float"),
    (lambda loss, out: (loss, {}), "holds none"),
    (lambda loss, out: (out, loss), "scalar"),
])
def test_aux_that_is_not_tensors_is_refused_by_name(returned, what):
    model = _classifier()

    def loss_of(m, x, y):
        out = m(x)
        return returned(CE(out, y), out)

    with pytest.raises(salus.TraceError, match=what):
        salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                               _batches(1)[0], loss_of=loss_of)
