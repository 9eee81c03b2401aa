"""Plain Python values a traced step read (a module's settings, numbers the loss and the
forwards read from globals or their enclosing scope) are held by the graph as they were
when it was traced: changing one afterwards is refused at the next iteration, naming it,
where eager PyTorch would have computed with the new value (salus.watch.TracedValues)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import salus
import salus.torch as st

KL_WEIGHT = 0.0  # annealed by a training loop, read by the loss below


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.0)
        self.temperature = 1.0
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # counted while a step records; never read
        return self.drop(self.fc(x)) / self.temperature


def _loss_with_the_global(model, x, y):
    return nn.functional.cross_entropy(model(x), y) + KL_WEIGHT * model.fc.weight.square().sum()


def _batch(rows: int = 5):
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _session(model, loss_of, daemon):
    return st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                           _batch(), loss_of=loss_of, address=daemon.address)


def test_a_global_the_loss_reads_changed_after_tracing_is_refused(daemon, monkeypatch):
    model = _Net()
    with _session(model, _loss_with_the_global, daemon) as session:
        session.step(*_batch())
        monkeypatch.setattr(__import__(__name__), "KL_WEIGHT", 0.5)
        with pytest.raises(salus.TraceError, match=r"the global KL_WEIGHT \(read by "
                                                   r"_loss_with_the_global\) \(0.0 -> 0.5\)"):
            session.step(*_batch())
        assert session.iterations == 1
        monkeypatch.setattr(__import__(__name__), "KL_WEIGHT", 0.0)
        session.step(*_batch())  # set back: the session goes on
        assert session.iterations == 2


def test_a_variable_of_the_enclosing_scope_changed_after_tracing_is_refused(daemon):
    beta = 1.0

    def loss_of(model, x, y):
        return beta * nn.functional.cross_entropy(model(x), y)

    model = _Net()
    with _session(model, loss_of, daemon) as session:
        session.step(*_batch())
        beta = 0.25  # noqa: F841  (read by loss_of, through its closure)
        with pytest.raises(salus.TraceError,
                           match=r"beta \(which .*loss_of reads from its enclosing scope\) "
                                 r"\(1.0 -> 0.25\).*belongs in the batch"):
            session.step(*_batch())


@pytest.mark.parametrize("change, what", [
    (lambda m: setattr(m.drop, "p", 0.3), r"drop.p \(0.0 -> 0.3\)"),
    (lambda m: setattr(m, "temperature", 2.0), r"model.temperature \(1.0 -> 2.0\)"),
])
def test_a_module_setting_changed_after_tracing_is_refused(change, what, daemon):
    model = _Net()
    with _session(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y),
                  daemon) as session:
        session.step(*_batch())
        change(model)
        with pytest.raises(salus.TraceError, match=what):
            session.step(*_batch())
        # Closing (the end of the with) reads the session's tensors back, which the
        # setting does not concern: it is not refused.


def test_what_a_forward_changes_while_it_records_is_not_a_change(daemon):
    model = _Net()
    with _session(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y),
                  daemon) as session:
        session.step(*_batch())
        session.step(*_batch(3))  # a smaller batch: traced again, counting a call
        session.step(*_batch())
        assert session.programs == 2 and session.iterations == 3


def test_an_inference_session_refuses_a_changed_setting(daemon):
    model = _Net().eval()
    x, _ = _batch()
    with st.InferenceSession(model, (x,), address=daemon.address) as session:
        session(x)
        model.temperature = 0.5
        with pytest.raises(salus.TraceError, match=r"model.temperature \(1.0 -> 0.5\)"):
            session(x)


def test_a_loss_modules_setting_and_a_replaced_global_tensor_are_refused(daemon):
    global CLASS_WEIGHTS
    CLASS_WEIGHTS = torch.tensor([1.0, 2.0, 1.0])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.0)

    def loss_of(model, x, y):
        return criterion(model(x), y) + nn.functional.nll_loss(
            model(x).log_softmax(1), y, weight=CLASS_WEIGHTS)

    model = _Net()
    with _session(model, loss_of, daemon) as session:
        session.step(*_batch())
        criterion.label_smoothing = 0.1
        with pytest.raises(salus.TraceError,
                           match=r"criterion.label_smoothing \(0.0 -> 0.1\)"):
            session.step(*_batch())
    model = _Net()
    with st.TrainSession(model, criterion, torch.optim.SGD(model.parameters(), lr=0.1),
                         _batch(), address=daemon.address) as session:
        session.step(*_batch())
        criterion.label_smoothing = 0.2
        with pytest.raises(salus.TraceError,
                           match=r"CrossEntropyLoss.label_smoothing \(0.1 -> 0.2\)"):
            session.step(*_batch())
        criterion.label_smoothing = 0.1
        session.step(*_batch())
    with _session(_Net(), loss_of, daemon) as session:
        session.step(*_batch())
        CLASS_WEIGHTS = torch.tensor([1.0, 1.0, 3.0])  # a new tensor, as per epoch
        with pytest.raises(salus.TraceError,
                           match=r"the global CLASS_WEIGHTS \(read by .*loss_of\) "
                                 r"\(another tensor now\)"):
            session.step(*_batch())
