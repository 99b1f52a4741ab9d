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


def test_an_interval_set_meanwhile_is_kept() -> None:
    """The engine sets its own interval as it starts serving; a hash thread that ends after
    that (no one waited for it: an eager forward loads no graph) leaves it as it is."""
    before = sys.getswitchinterval()
    try:
        switching.quicken()
        sys.setswitchinterval(0.00025)
        switching.relax()
        assert sys.getswitchinterval() == pytest.approx(0.00025)
    finally:
        sys.setswitchinterval(before)
