"""Special functions as Chebyshev series (``salus.rules.special``): the modified Bessel
functions of the first kind and ``erfcx`` and ``log_ndtr`` against PyTorch's in float64
over their series' ranges, at 0, 8, infinities and NaN; a von Mises likelihood head
(``log I0(k) = log i0e(k) + k``, ``i1e`` for its mean resultant length, ``torch.i0``
and ``special.i1`` of a wider range) and a probit model (``log_ndtr`` of both signs, far
into the tail), trained three Adam steps on salusd against float64 by the suite's rule
(harness.py)."""

from __future__ import annotations

import math

import torch
from harness import assert_trains_on_salusd_as_eagerly
from torch import nn


class VonMisesHead(nn.Module):
    """Angles predicted with a learned concentration: the von Mises negative
    log-likelihood, its normalizer ``log(2 pi I0(k))`` from ``i0e``, and the mean
    resultant length ``I1(k) / I0(k)`` as an auxiliary term; a Kaiser-like window from
    ``torch.i0`` and ``special.i1`` of a wider range."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)

    def forward(self, x, angle):
        h = self.body(x)
        mean, k = h[:, 0], nn.functional.softplus(h[:, 1]) * 6
        log_i0 = torch.log(torch.special.i0e(k)) + k
        nll = (log_i0 + math.log(2 * math.pi) - k * torch.cos(angle - mean)).mean()
        resultant = torch.special.i1e(k) / torch.special.i0e(k)
        window = torch.i0(h[:, 2] * 5) + torch.special.i1(h[:, 3] * 12)
        return nll + (1 - resultant).mean() + 1e-3 * window.mean()


class Probit(nn.Module):
    """A probit classifier's log-likelihood, ``log Phi(z)`` for the positives and
    ``log Phi(-z)`` for the negatives (``log_ndtr``, exact in the far tail where ``Phi``
    underflows), plus an ``erfcx`` feature."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(3, 1)

    def forward(self, x, label):
        z = self.score(x).squeeze(1) * 6
        sign = label * 2 - 1
        return -torch.special.log_ndtr(sign * z).mean() + torch.special.erfcx(z / 4).mean() * 0.1


def test_trains_on_salusd_as_eagerly(daemon):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(6, 3, generator=g), torch.rand(6, generator=g) * 6 - 3)
    assert_trains_on_salusd_as_eagerly(VonMisesHead(), batch, lambda m, x, a: m(x, a),
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address)


def test_a_probit_model_trains_on_salusd_as_eagerly(daemon):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(8, 3, generator=g) * 2, (torch.rand(8, generator=g) > 0.5).float())
    assert_trains_on_salusd_as_eagerly(Probit(), batch, lambda m, x, y: m(x, y),
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address)


def test_the_error_function_rules_give_pytorchs_values():
    """Within 8 float64 epsilons of PyTorch's (``erfcx`` relative; ``log_ndtr`` relative,
    less where it is below float64's smallest normal number), infinite and NaN where
    PyTorch's is."""
    from salus.rules.special import _erfcx, _log_ndtr
    x = torch.cat([torch.linspace(-27, 40, 8001, dtype=torch.float64),
                   torch.tensor([0.0, -0.0, 1e-300, 1e10, 1e300, -1.0, math.inf, -math.inf,
                                 math.nan], dtype=torch.float64)])
    eps, tiny = torch.finfo(torch.float64).eps, torch.finfo(torch.float64).tiny
    for rule, pytorchs in ((_erfcx, torch.special.erfcx), (_log_ndtr, torch.special.log_ndtr)):
        mine, theirs = rule(x), pytorchs(x)
        assert torch.equal(mine.isnan(), theirs.isnan()), pytorchs.__name__
        assert torch.equal(mine.isinf(), theirs.isinf()), pytorchs.__name__
        finite = theirs.isfinite()
        error = (mine[finite] - theirs[finite]).abs()
        assert (error <= 8 * eps * theirs[finite].abs() + tiny).all(), pytorchs.__name__


def test_the_bessel_rules_give_pytorchs_values():
    """Within 8 float64 epsilons of PyTorch's (the two series are the functions' own to
    double precision; PyTorch's are Cephes' of about the same accuracy); NaN where
    PyTorch's is (``i0`` and ``i1`` of infinities, NaN)."""
    from salus.rules.special import _i0, _i0e, _i1, _i1e
    x = torch.cat([torch.linspace(-40, 40, 8001, dtype=torch.float64),
                   torch.tensor([0.0, -0.0, 8.0, -8.0, 8.0 + 1e-12, 700.0, math.inf,
                                 -math.inf, math.nan], dtype=torch.float64)])
    eps = torch.finfo(torch.float64).eps
    for rule, pytorchs in ((_i0, torch.special.i0), (_i0e, torch.special.i0e),
                           (_i1, torch.special.i1), (_i1e, torch.special.i1e)):
        mine, theirs = rule(x), pytorchs(x)
        assert torch.equal(mine.isnan(), theirs.isnan()), pytorchs.__name__
        both = ~theirs.isnan()
        error = (mine[both] - theirs[both]).abs()
        assert (error <= 8 * eps * theirs[both].abs()).all(), (pytorchs.__name__, error.max())
    ints = torch.tensor([-2, 0, 3])
    torch.testing.assert_close(_i0(ints), torch.special.i0(ints))
