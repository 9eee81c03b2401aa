"""``torch.histc`` in IR ops (``salus.rules.indexing._histc``): PyTorch's counts, bin for
bin, for given ranges and the data's own, with values on the bin edges, outside the
range and NaN; served by salusd; a range PyTorch finds not finite fails the iteration."""

from __future__ import annotations

import pytest
import torch
from daemon import Daemon
from torch import nn

import salus.torch as st

RANGES = [(10, 0, 0), (7, -1.0, 1.0), (4, 0.0, 1.0), (3, 1, 1), (1, -5, 5)]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1000, generator=g), torch.rand(7, 9, generator=g) * 10,
            torch.tensor([1.0, 1.0, 1.0]), torch.arange(0, 10.0) / 10,
            torch.tensor([0.0, 0.5, 1.0, 2.0, -1.0, float("nan")])]


@pytest.mark.parametrize("bins, low, high", RANGES)
def test_the_histc_rule_counts_as_pytorch(bins, low, high):
    from salus.rules.indexing import _histc
    for x in _inputs():
        try:
            want = torch.histc(x, bins, low, high)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="range of .* is not finite"):
                _histc(x, bins, low, high)
            continue
        assert torch.equal(_histc(x, bins, low, high), want), (x, bins, low, high)


class _Histograms(nn.Module):
    def forward(self, x):
        return torch.histc(x, 6), torch.histc(x.tanh(), 5, -1.0, 1.0)


def test_a_served_histogram_is_pytorchs():
    model = _Histograms()
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    with Daemon("--memory", "64MiB") as daemon:
        with st.InferenceSession(model, (x,), address=daemon.address) as session:
            for batch in (x, x * 3, torch.full((4, 50), 2.0)):
                for got, want in zip(session(batch), model(batch)):
                    assert torch.equal(got, want)
            nan = x.clone()
            nan[0, 0] = float("nan")
            with pytest.raises(st.DaemonError, match="range of .* is not finite"):
                session(nan)
