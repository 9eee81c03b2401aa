"""salus.fluid against the Rust planner's shared test vectors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from salus import fluid

VECTORS = json.loads((Path(__file__).resolve().parents[3] / "crates" / "salus-fluid" / "tests"
                      / "vectors.json").read_text())


@pytest.mark.parametrize("case", VECTORS["packing"])
def test_packing_degree(case):
    assert fluid.packing_marginal_benefit(case["times"]) == pytest.approx(case["benefit"])
    assert fluid.packing_degree(case["times"], case["threshold"]) == case["degree"]


@pytest.mark.parametrize("case", VECTORS["scaling"])
def test_scaling_degree(case):
    assert fluid.scaling_marginal_benefit(case["times"]) == pytest.approx(case["benefit"])
    assert fluid.scaling_degree(case["times"], case["threshold"]) == case["degree"]


@pytest.mark.parametrize("case", VECTORS["static"])
def test_static_widths(case):
    trials = [(i, h) for i, h in case["trials"]]
    widths = fluid.static_widths(trials, case["resources"], case["d"])
    assert [[i, w] for i, w in widths] == case["widths"]


# ---------------------------------------------------------------------------------------
# salus.tune.PackingProbe: Eq. 3.1 measured on the trials while they tune


class _Device:
    """Trials sharing one device in virtual time: with ``n`` trials on it, a trial of base
    time ``b`` per step takes ``b * slowdown[n - 1]`` per step. Trials queue in order and
    enter while fewer than the probe's limit run; each runs ``steps`` steps."""

    def __init__(self, trials, slowdown, steps=10_000):
        self.waiting = list(trials)          # (name, base time per step)
        self.slowdown, self.steps = slowdown, steps
        self.running: dict[str, list[float]] = {}   # name -> [base, steps taken]
        self.now = 0.0

    def run(self, probe, until=60.0, dt=0.01, leave=None):
        """Samples every ``dt``; ``leave(now)`` names a trial that ends now, if any."""
        while self.now < until and not probe.decided:
            while self.waiting and len(self.running) < probe.limit:
                name, base = self.waiting.pop(0)
                self.running[name] = [base, 0.0]
            self.now += dt
            factor = self.slowdown[len(self.running) - 1]
            for state in self.running.values():
                state[1] += dt / (state[0] * factor)
            gone = leave(self.now) if leave else None
            for name in [n for n, s in self.running.items() if s[1] >= self.steps or n == gone]:
                del self.running[name]
            probe.observe(self.now, {n: int(s[1]) for n, s in self.running.items()})
        return probe


def test_the_probe_packs_while_a_trial_still_pays_and_measures_eq_3_1():
    from salus.tune import PackingProbe
    slowdown = [1.0, 1.2, 1.9, 2.6]        # O^2 = 0.4, O^3 = 1 - 2/3 * 1.9/1.2 < 0.1
    probe = _Device([(f"t{i}", 0.01) for i in range(6)], slowdown).run(PackingProbe(4, 0.1))
    assert probe.decided and probe.limit == 2
    assert len(probe.times) == 3
    assert [t / probe.times[0] for t in probe.times] == pytest.approx(slowdown[:3], rel=0.03)
    assert probe.limit == fluid.packing_degree(probe.times, 0.1)


def test_the_probe_compares_each_trial_with_itself_not_other_configurations():
    from salus.tune import PackingProbe
    # The second trial is four times slower per step: its own time alone is unknown, so
    # the slowdown comes from the first trial, measured alone and then beside it.
    probe = _Device([("fast", 0.01), ("slow", 0.04), ("x", 0.01)], [1.0, 1.5, 3.0]).run(
        PackingProbe(2, 0.1))
    assert probe.decided and probe.limit == 2
    assert probe.times[1] / probe.times[0] == pytest.approx(1.5, rel=0.03)
    assert probe.benefits == pytest.approx([1 - 0.5 * 1.5], abs=0.02)  # whole steps


def test_the_probe_stops_at_max_packing_and_at_one_when_packing_never_pays():
    from salus.tune import PackingProbe
    trials = [(f"t{i}", 0.01) for i in range(6)]
    assert _Device(trials, [1.0, 1.1, 1.2, 1.3]).run(PackingProbe(3, 0.1)).limit == 3
    never = _Device(trials, [1.0, 2.0]).run(PackingProbe(4, 0.1))
    assert never.decided and never.limit == 1 and never.benefits == pytest.approx([0.0], abs=0.03)
    alone = _Device(trials, [1.0]).run(PackingProbe(1, 0.1))
    assert alone.decided and alone.limit == 1 and len(alone.times) == 1


def test_a_trial_that_ends_mid_window_starts_a_new_window():
    from salus.tune import PackingProbe
    # "a" ends 0.1 s into the two-trial phase (ASHA stopping it): that window is dropped,
    # "c" takes its place, and the slowdown comes from "b", measured in both phases.
    ends = {"done": False}

    def leave(now):
        if probe.limit == 2 and not ends["done"] and len(probe.times) == 1:
            ends.setdefault("at", now)
            if now - ends["at"] >= 0.1:
                ends["done"] = True
                return "a"
        return None

    probe = PackingProbe(2, 0.1, window=20)
    device = _Device([("b", 0.01), ("a", 0.01), ("c", 0.03)], [1.0, 1.6])
    device.run(probe, leave=leave)
    assert ends["done"] and probe.decided
    assert probe.times[1] / probe.times[0] == pytest.approx(1.6, rel=0.03)


def test_no_window_opens_before_every_trial_is_past_its_warmup():
    from salus.tune import PackingProbe
    probe = PackingProbe(4, 0.1, window=5, warmup=3)
    for now, steps in [(0.0, {"a": 0}), (0.1, {"a": 2}), (0.2, {"a": 30})]:
        probe.observe(now, steps)
    assert not probe.times                 # the window opened at 0.2 s, not before
    probe.observe(0.3, {"a": 40})
    assert probe.times == pytest.approx([0.01]) and probe.limit == 2
    probe.observe(0.4, {"a": 50})          # one trial where two are admitted: no window
    assert len(probe.times) == 1
