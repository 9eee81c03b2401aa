"""Fluid's decisions in Python: the packing degree (Eq. 3.1), the scaling degree and
StaticFluid's widths (Algorithm 3.1, Eq. B.1).

A mirror of the Rust planner ``salus-fluid`` (``crates/salus-fluid/src/degree.rs`` and
``plan.rs``), kept in Python because the ``salus`` package is pure Python (no compiled
extension to build per platform) and these are a few lines of arithmetic. Both are checked
against the same test vectors, ``crates/salus-fluid/tests/vectors.json``
(``tests/test_fluid.py`` here, ``tests/vectors.rs`` there): change one, change the other
and the vectors. The state machine that places trials on devices and resizes them
(DynamicFluid) lives only in Rust; :mod:`salus.tune` needs the packing degree alone (see
``docs/tune.md``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

#: Width of a trial packed with others: ``1/c`` of a device.
SHARE = "share"


def packing_marginal_benefit(times: Sequence[float]) -> list[float]:
    """Eq. 3.1 for ``p = 2..len(times)``: ``O^p = 1 - (p - 1) / p * T^p / T^(p-1)``, where
    ``times[p - 1]`` is the mean iteration time of a trial while ``p`` trials share the
    device."""
    return [1.0 - (p - 1) / p * times[p - 1] / times[p - 2] for p in range(2, len(times) + 1)]


def packing_degree(times: Sequence[float], threshold: float) -> int:
    """``c``: the largest ``p`` such that packing each of the 2nd..``p``-th trial still had a
    marginal benefit above ``threshold``; at least 1."""
    c = 1
    for benefit in packing_marginal_benefit(times):
        if benefit <= threshold:
            break
        c += 1
    return c


def scaling_marginal_benefit(times: Sequence[float]) -> list[float]:
    """What the ``w``-th device saves as a fraction of a perfectly scaling device's saving,
    ``w * (1 - T_w / T_(w-1))``, for ``w = 2..len(times)``."""
    return [w * (1.0 - times[w - 1] / times[w - 2]) for w in range(2, len(times) + 1)]


def scaling_degree(times: Sequence[float], threshold: float) -> int:
    """``d``: the largest ``w`` such that every device up to the ``w``-th saved more than
    ``threshold`` of a device's worth; at least 1."""
    d = 1
    for benefit in scaling_marginal_benefit(times):
        if benefit <= threshold:
            break
        d += 1
    return d


def dynamic_target(h: float, total_h: float, resources: float, d: int) -> int | str:
    """Eq. B.1 for one trial: ``floor(h / total_h * resources)`` whole devices (at most
    ``d``) when that is at least 1, else :data:`SHARE`."""
    if total_h <= 0 or not math.isfinite(h):
        return SHARE
    w = h / total_h * resources
    if w >= 1.0:
        return max(1, min(int(math.floor(w)), max(d, 1)))
    return SHARE


def static_widths(trials: Sequence[tuple[Hashable, float]], resources: float,
                  d: int) -> list[tuple[Hashable, int | str]]:
    """Algorithm 3.1: ``(id, h)`` pairs (``h`` the remaining runtime alone on one device),
    sorted by ``h`` non-increasing (ties by id), each with its width on ``resources`` idle
    devices: a number of whole devices or :data:`SHARE`."""
    total = sum(max(h, 0.0) for _, h in trials)
    ordered = sorted(trials, key=lambda t: (-t[1], t[0]))
    return [(i, dynamic_target(max(h, 0.0), total, resources, d)) for i, h in ordered]
