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
