"""A serving process's heap: imports run without the cycle collector and what they made is
frozen, and the collector is back on for what the process allocates after (a step loop's
garbage must still be collected)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    """`code` in a fresh interpreter (the test's own heap stays as pytest keeps it)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_a_block_runs_uncollected_and_its_objects_are_frozen_then_collection_resumes() -> None:
    out = run_python(
        """
        import gc
        from flare.serve.heap import uncollected

        before = gc.get_freeze_count()
        with uncollected():
            inside = gc.isenabled()
            made = [[i] for i in range(10000)]
        print(inside, gc.isenabled(), gc.get_freeze_count() - before >= 10000)
        """
    )
    assert out == "False True True"


def test_a_collector_turned_off_before_stays_off() -> None:
    out = run_python(
        """
        import gc
        from flare.serve.heap import uncollected

        gc.disable()
        with uncollected():
            pass
        print(gc.isenabled())
        """
    )
    assert out == "False"


def test_an_import_that_fails_still_turns_the_collector_back_on() -> None:
    out = run_python(
        """
        import gc
        from flare.serve.heap import uncollected

        try:
            with uncollected():
                import flare_no_such_module  # noqa: F401
        except ImportError:
            pass
        print(gc.isenabled())
        """
    )
    assert out == "True"


def test_the_engine_process_collects_again_once_its_imports_are_done() -> None:
    """Its backend steps run uncollected one by one (engine_process._uncollected), whether
    before the package arrives or beside the weights' read."""
    from flare.serve.engine_process import _uncollected

    seen: list[bool] = []
    assert gc.isenabled()
    try:
        _uncollected(lambda: seen.append(gc.isenabled()))
        assert seen == [False] and gc.isenabled()
    finally:
        gc.unfreeze()  # pytest's heap as it was for the tests after
