"""Antialiased resampling (``F.interpolate(..., antialias=True)``, bilinear and bicubic;
``salus.rules.pooling._antialiased``): PyTorch's values for shrinking and growing, to
sizes and by scale factors, with and without ``align_corners``; a model resizing its
input that way trains three Adam steps on salusd against float64 by the suite's rule
(harness.py)."""

from __future__ import annotations

import pytest
import torch
from daemon import Daemon
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn

F = nn.functional


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_the_resampling_rule_gives_pytorchs_values(mode):
    """Within 16 float64 epsilons of the values' scale (the same weights, summed in
    another order). An output one column wide is left out: PyTorch's CPU kernel then
    gives every row the first row's value (its result for the transposed input, which
    this rule gives, differs)."""
    from salus.rules.pooling import _antialiased
    rule = _antialiased(mode == "bicubic")
    x = torch.randn(2, 3, 17, 13, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    bound = 16 * torch.finfo(torch.float64).eps * x.abs().max().item()
    for size in ((5, 4), (8, 13), (17, 30), (1, 3), (40, 7)):
        for align_corners in (False, True):
            want = F.interpolate(x, size=size, mode=mode, align_corners=align_corners,
                                 antialias=True)
            assert (rule(x, size, align_corners) - want).abs().max() <= bound, size
    for factor in (0.5, 0.3, 2.0, 1.7):
        want = F.interpolate(x, scale_factor=factor, mode=mode, antialias=True)
        got = rule(x, want.shape[-2:], False, factor, factor)
        assert (got - want).abs().max() <= bound, factor


class Resizer(nn.Module):
    """A convolution over the image and over an antialiased half-size copy of it (a
    two-scale stem), then a classifier."""

    def __init__(self, mode):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.mode = mode

    def forward(self, x):
        small = F.interpolate(x, scale_factor=0.5, mode=self.mode, antialias=True)
        grown = F.interpolate(self.conv(small), size=(7, 9), mode=self.mode, antialias=True)
        return self.conv(x).mean((2, 3)) + grown.mean((2, 3))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_trains_on_salusd_as_eagerly(mode):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 10, generator=torch.Generator().manual_seed(1))
    with Daemon("--memory", "128MiB") as daemon:
        assert_trains_on_salusd_as_eagerly(Resizer(mode), (x, torch.randn(2, 4)),
                                           lambda m, x, y: F.mse_loss(m(x), y),
                                           lambda p: torch.optim.Adam(p, lr=1e-2),
                                           daemon.address, label=f"{mode}: ")
