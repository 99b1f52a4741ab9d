"""The fault suite's fast seeded subset: the soak's own trials (tests/faults/trials.py), a few
seeds of each, with the same invariant checks; `python tests/bench/soak.py` runs them for
minutes at random seeds.

Each trial of an item of issue 13 asserts that the trial found no violation of that item; a
violation that belongs to another item, or a harness error, fails it too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from faults.lab import Lab, can_mount
from faults.trial import Outcome
from faults.trials import run_trial


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    """Checkpoints, a trusted key, the prepared registry and reference digests, made once."""
    return Lab(tmp_path_factory.mktemp("soak"), os.environ.get("FLARE_TEST_POSTGRES")).prepare()


def report(outcome: Outcome) -> str:
    lines = [f"{outcome.kind} seed {outcome.seed}: {'; '.join(outcome.notes)}"]
    for v in dict.fromkeys(outcome.violations):
        lines.append(f"[item {v.item}] {v.what}\n    {v.command}")
    lines.append(f"again: {outcome.violations[0].reproduce()}" if outcome.violations else "")
    return "\n".join(lines)


HOLDING = [
    "kill-build/random:1",
    "crash-build/point:4",
    "kill-publish/random:1",
    "kill-pull/random:1",
    "kill-copy/random:1",
    "kill-reindex/random:1",
    "corrupt-blob/flip-payloads:1",
    "corrupt-blob/truncate-artifacts:1",
    "hosts/sqlite:1",
]
"""Trials that hold on main: kills at random moments and at crash points, corrupted payloads
and artifacts, four hosts at once."""


@pytest.mark.parametrize("trial", HOLDING)
def test_the_invariants_hold(lab: Lab, trial: str) -> None:
    kind, seed = trial.rsplit(":", 1)
    outcome = run_trial(lab, kind, int(seed))
    assert not outcome.violations, report(outcome)
    assert outcome.faults and outcome.caught == outcome.faults, report(outcome)


DISKS = ["disk-full/staging-small:1", "disk-full/cache-small:1", "disk-full/dest-small:1"]


@pytest.mark.skipif(not can_mount(), reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("trial", DISKS)
def test_a_full_disk_is_a_clear_error_and_resumes(lab: Lab, trial: str) -> None:
    kind, seed = trial.rsplit(":", 1)
    outcome = run_trial(lab, kind, int(seed))
    assert not outcome.violations, report(outcome)


def test_four_hosts_on_postgresql(lab: Lab) -> None:
    if not lab.postgres:
        if os.environ.get("CI"):
            pytest.fail("CI must start PostgreSQL and set FLARE_TEST_POSTGRES (.ci/run does)")
        pytest.skip("set FLARE_TEST_POSTGRES to a server URL to test the PostgreSQL backend")
    outcome = run_trial(lab, "hosts/postgresql", 1)
    assert not outcome.violations, report(outcome)


ITEMS = [
    pytest.param("kill-copy/db:1", 7),
    pytest.param("kill-reindex/db:1", 7),
    pytest.param("kill-gc/forget:1", 8),
    pytest.param("kill-gc/sweep:1", 8),
    pytest.param("corrupt-ref/garbage-tag:1", 9),
    pytest.param("corrupt-ref/payload-tag:1", 9),
    pytest.param("corrupt-ref/bad-name:1", 9),
    pytest.param("serve-cache/flip:1", 4),
    pytest.param("serve-malformed/config-is-payload:1", 5),
    pytest.param("serve-malformed/dtype:1", 5),
    pytest.param("build-link/out:1", 10),
    pytest.param("build-link/hub:1", 10),
    pytest.param("build-layers/huge:1", 11),
    pytest.param("build-moved/moved:1", 12),
]


@pytest.mark.parametrize(("trial", "number"), ITEMS)
def test_issue_13_item(lab: Lab, trial: str, number: int) -> None:
    """The trial finds no violation of its item (and nothing else: the harness's own setup
    steps must work)."""
    kind, seed = trial.rsplit(":", 1)
    outcome = run_trial(lab, kind, int(seed))
    check_item(outcome, number)


def check_item(outcome: Outcome, number: int) -> None:
    """No violation at all: the item's, another item's, or the harness's."""
    assert not outcome.violations, f"(trial of item {number}) {report(outcome)}"


@pytest.fixture(scope="module")
def hostile(lab: Lab) -> Outcome:
    """One server, sent every hostile request of items 1, 2, 3 and 6."""
    return run_trial(lab, "serve-requests/hostile", 1)


@pytest.mark.parametrize("number", [1, 2, 3, 6])
def test_hostile_requests(hostile: Outcome, number: int) -> None:
    mine = Outcome(hostile.kind, hostile.seed, notes=hostile.notes)
    mine.violations = [v for v in hostile.violations if v.item in (number, None)]
    check_item(mine, number)


NEW = [
    pytest.param("corrupt-blob/flip-index:1"),
    pytest.param("disk-full/registry-small:3"),
    pytest.param("disk-full/registry-small:4"),
]
"""Seeds that meet the fault every time (the lab's checkpoints and sizes are fixed): the index
blob flipped; the registry on a 457k tmpfs, where the blobs fit and SQLite's WAL does not take
the publish's rows, and on a 51k one, where the new index DB cannot be made. (Seed 7 drew 540k,
which the build now fits in: it passed whatever flare did.)"""


@pytest.mark.parametrize("trial", NEW)
def test_found_by_the_soak(lab: Lab, trial: str) -> None:
    """Failures the soak found that no item of issue 13 names (see docs/reliability.md)."""
    kind, seed = trial.rsplit(":", 1)
    if kind.startswith("disk-full") and not can_mount():
        pytest.skip("mounting a tmpfs needs root")
    outcome = run_trial(lab, kind, int(seed))
    assert not outcome.violations, report(outcome)


def test_the_trials_clean_up(lab: Lab) -> None:
    """Nothing is left mounted or on disk by the trials above."""
    mounts = Path("/proc/self/mounts").read_text()
    assert str(lab.root) not in mounts
    assert not lab.trials.exists() or not list(lab.trials.iterdir())
