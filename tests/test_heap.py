"""A serving process's heap: imports run without the cycle collector, which is back on for
what the process allocates after (a step loop's garbage must still be collected), and nothing
is frozen in the middle of a load."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    """`code` in a fresh interpreter (the test's own heap stays as pytest keeps it)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_a_block_runs_uncollected_then_collection_resumes_and_finds_its_cycles() -> None:
    out = run_python(
        """
        import gc, weakref
        from flare.serve.heap import uncollected

        class Node:
            pass

        with uncollected():
            inside = gc.isenabled()
            node = Node()
            node.me = node
            alive = weakref.ref(node)
            del node
            kept = alive() is not None
        gc.collect()
        print(inside, kept, gc.isenabled(), gc.get_freeze_count(), alive() is None)
        """
    )
    assert out == "False True True 0 True"


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


def test_a_block_of_imports_alone_is_frozen_when_asked() -> None:
    out = run_python(
        """
        import gc
        from flare.serve.heap import uncollected

        with uncollected(freeze=True):
            made = [[i] for i in range(10000)]
        print(gc.isenabled(), gc.get_freeze_count() >= 10000)
        """
    )
    assert out == "True True"


def test_an_engine_process_given_no_package_ends_with_the_collector_on() -> None:
    """Its start (imports, the load) runs without the collector; however it ends, the
    collector is on again for what comes after."""
    out = run_python(
        """
        import gc
        from multiprocessing import Pipe
        from flare.serve.engine_process import engine_main

        ours, theirs = Pipe()
        ours.close()  # the API process needed no engine
        engine_main(theirs, "cpu")
        print(gc.isenabled())
        """
    )
    assert out == "True"
