"""The switch interval is short while any thread that asked for it runs, then as before."""

from __future__ import annotations

import sys

import pytest

from flare.serve import switching


def test_the_interval_is_short_from_the_first_quicken_to_the_last_relax() -> None:
    """Two overlapping users (the weights' read and Triton's hash in a start): the first to
    finish leaves the interval short for the other; the last puts back what it was."""
    before = sys.getswitchinterval()
    switching.quicken()
    assert sys.getswitchinterval() == pytest.approx(min(before, switching.QUICK_S))
    switching.quicken()
    switching.relax()
    assert sys.getswitchinterval() == pytest.approx(min(before, switching.QUICK_S))
    switching.relax()
    assert sys.getswitchinterval() == before
