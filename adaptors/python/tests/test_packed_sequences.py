"""Packed sequences (``salus.rules.recurrent``): ``pack_padded_sequence`` (sorted or
not, batch or time first), ``pack_sequence``, ``nn.LSTM`` (layers, both directions,
projections, given states), ``nn.GRU`` and ``nn.RNN`` on them, and
``pad_packed_sequence`` (``total_length``, a padding value). Each model trains three
Adam steps on salusd against float64 by the suite's rule (harness.py); a served model
gives PyTorch's outputs for batches of other lengths; PyTorch's checks of the lengths
fail the iteration with its messages, and a use of the packed data that salus cannot
follow is refused at trace time, naming it."""

from __future__ import annotations

import pytest
import torch
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import salus
import salus.torch as st

F = nn.functional


class Tagger(nn.Module):
    """A sequence tagger and classifier over padded, packed sequences: the recurrent
    layer's padded outputs (to ``total_length``) feed a per-step head, its final states a
    sequence head."""

    def __init__(self, kind="LSTM", batch_first=True, enforce_sorted=False,
                 total_length=True, given_state=False, **options):
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 5, batch_first=batch_first, **options)
        directions = 2 if options.get("bidirectional") else 1
        out = options.get("proj_size") or 5
        self.step_head = nn.Linear(directions * out, 3)
        self.seq_head = nn.Linear(out, 2)
        self.kind, self.batch_first = kind, batch_first
        self.enforce_sorted, self.total_length = enforce_sorted, total_length
        self.given_state = given_state

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=self.batch_first,
                                      enforce_sorted=self.enforce_sorted)
        state = None
        if self.given_state:
            layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            batch = x.shape[0] if self.batch_first else x.shape[1]
            out = self.rnn.proj_size or self.rnn.hidden_size
            h = torch.linspace(-0.5, 0.5, layers * batch * out,
                               dtype=x.dtype).view(layers, batch, out)
            state = (h, torch.full((layers, batch, self.rnn.hidden_size), 0.1,
                                   dtype=x.dtype)) \
                if self.kind == "LSTM" else h
        out, final = self.rnn(packed, state)
        steps = x.shape[1] if self.batch_first else x.shape[0]
        padded, out_lengths = pad_packed_sequence(
            out, batch_first=self.batch_first, padding_value=-1.0,
            total_length=steps + 1 if self.total_length else None)
        h = final[0] if self.kind == "LSTM" else final
        time_dim = 1 if self.batch_first else 0
        per_step = self.step_head(padded).sum(time_dim)
        return per_step.sum(1) + self.seq_head(h[-1]).sum(1) + out_lengths.float() * 0.01


CASES = {
    "lstm_unsorted": dict(num_layers=2, bidirectional=True),
    "lstm_sorted_time_first": dict(batch_first=False, enforce_sorted=True),
    "lstm_projected_state": dict(proj_size=3, given_state=True, bidirectional=True),
    "lstm_padded_to_longest": dict(total_length=False),
    "gru": dict(kind="GRU", bidirectional=True, num_layers=2),
    "gru_state": dict(kind="GRU", given_state=True),
    "rnn_relu": dict(kind="RNN", nonlinearity="relu", bidirectional=True),
}


def _batch(case, lengths=(6, 2, 4)):
    g = torch.Generator().manual_seed(len(case))
    options = CASES[case]
    if options.get("enforce_sorted"):
        lengths = tuple(sorted(lengths, reverse=True))
    x = torch.randn(3, 6, 4, generator=g)
    if options.get("batch_first") is False:
        x = x.transpose(0, 1).contiguous()
    return x, torch.tensor(lengths)


@pytest.mark.parametrize("case", CASES)
def test_trains_on_salusd_as_eagerly(daemon, case):
    torch.manual_seed(0)
    x, lengths = _batch(case)
    y = torch.randn(3, generator=torch.Generator().manual_seed(9))
    assert_trains_on_salusd_as_eagerly(
        Tagger(**CASES[case]), (x, lengths, y),
        lambda m, x, lengths, y: F.mse_loss(m(x, lengths), y),
        lambda p: torch.optim.Adam(p, lr=1e-2), daemon.address, label=f"{case}: ")


class _Sequences(nn.Module):
    """``pack_sequence`` of three sequences of different lengths, then a GRU."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 5)

    def forward(self, a, b, c):
        out, h = self.rnn(pack_sequence([a, b, c], enforce_sorted=False))
        return pad_packed_sequence(out)[0].sum(0) + h[0]


def test_a_served_model_gives_pytorchs_outputs_for_batches_of_other_lengths(daemon):
    """One session, batches whose lengths differ (each sequence's steps past its length
    skipped at run time): the outputs of eager PyTorch on the same batches; and
    ``pack_sequence`` of separate sequences."""
    model = Tagger(num_layers=2, bidirectional=True).eval()
    x, lengths = _batch("lstm_unsorted")
    with st.InferenceSession(model, (x, lengths), address=daemon.address) as session:
        for other in ((6, 2, 4), (1, 6, 3), (5, 5, 6), (2, 6, 1)):
            got = session(x, torch.tensor(other))
            torch.testing.assert_close(got, model(x, torch.tensor(other)), rtol=1e-5,
                                       atol=1e-5)
    g = torch.Generator().manual_seed(3)
    parts = (torch.randn(2, 4, generator=g), torch.randn(5, 4, generator=g),
             torch.randn(3, 4, generator=g))
    model = _Sequences()
    with st.InferenceSession(model, parts, address=daemon.address) as session:
        torch.testing.assert_close(session(*parts), model(*parts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case, lengths, message", [
    ("lstm_sorted_time_first", (4, 6, 2), "must be sorted in decreasing order"),
    ("lstm_unsorted", (6, 0, 4), "has to be greater than 0"),
    ("lstm_padded_to_longest", (5, 2, 4), "pass total_length=6"),
])
def test_lengths_pytorch_refuses_fail_the_iteration(daemon, case, lengths, message):
    """Lengths out of order where the pack enforces it, a length of 0, and (salus only)
    a batch whose longest sequence is shorter than its steps where no ``total_length``
    fixes the padded length: the iteration fails with the message, and the session
    serves the next batch."""
    model = Tagger(**CASES[case]).eval()
    x, good = _batch(case)
    if case != "lstm_padded_to_longest":
        with pytest.raises(RuntimeError, match=message):
            model(x, torch.tensor(lengths))
    with st.InferenceSession(model, (x, good), address=daemon.address) as session:
        with pytest.raises(st.DaemonError, match=message):
            session(x, torch.tensor(lengths))
        torch.testing.assert_close(session(x, good), model(x, good), rtol=1e-5, atol=1e-5)


class _PackedData(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True,
                                               enforce_sorted=False))
        return out.data.sum()  # the packed rows: as many as the lengths' sum


def test_a_use_of_the_packed_data_is_refused_naming_it():
    x, lengths = _batch("lstm_unsorted")
    model = _PackedData()
    with pytest.raises(salus.TraceError, match="packed sequence's data .*unpack it first"):
        salus.trace_train_step(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                               (x, lengths), loss_of=lambda m, x, n: m(x, n))
