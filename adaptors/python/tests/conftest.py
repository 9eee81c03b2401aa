"""Fixtures every test module may use; a module's own fixture of the same name wins."""

from __future__ import annotations

import pytest
from daemon import Daemon


@pytest.fixture(scope="module")
def daemon():
    """One salusd (256 MiB) for the module's tests."""
    with Daemon("--memory", "256MiB") as d:
        yield d
