"""Long byte work piped to a log says how far it is, as pip and docker do: a plain line every
few seconds (FLARE_PROGRESS_INTERVAL; shortened here so a 32 MB package is enough), before
the command's result, and never a bar's control characters."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_synthetic_llama
from conftest import RunFlare

SIZE = r"\d[\d.]* (?:[kMG]?B|bytes)"
LINE = rf"{{name}}: {SIZE} of {SIZE} \(\d+%\), {SIZE}/s"
FAST = {"FLARE_PROGRESS_INTERVAL": "0.001"}


@pytest.fixture
def built(run_flare: RunFlare, tmp_path: Path) -> str:
    """A signed 32 MB package `big` in the default registry; what its build wrote to stderr
    (a pipe)."""
    source = make_synthetic_llama(tmp_path / "synthetic", 32 << 20)
    assert run_flare("key", "generate", "--publisher", "alice").returncode == 0
    done = run_flare("build", str(source), "--name", "big", env=FAST)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_piped_build_prints_progress_lines_within_its_phases(built: str) -> None:
    lines = built.splitlines()
    assert lines[0] == "phase resolve", lines
    assert re.fullmatch(LINE.format(name="resolve") + r", \d+ s left", lines[1]), lines


def piped(env: dict[str, str], *args: str) -> list[str]:
    """The command's stdout and stderr through one pipe, in the order it wrote them."""
    done = subprocess.run(
        [sys.executable, "-m", "flare", *args],
        env=env | FAST,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout
    assert "\x1b" not in done.stdout and "\r" not in done.stdout  # no bar, no colour
    return done.stdout.splitlines()


def test_a_piped_pull_prints_progress_lines_before_its_result(
    built: str, flare_env: dict[str, str]
) -> None:
    lines = piped(flare_env, "pull", "big", "--device", "cpu")
    result = next(i for i, line in enumerate(lines) if line.startswith("pulled big@"))
    progress = [
        i
        for i, line in enumerate(lines)
        if re.fullmatch(LINE.format(name="pull") + r"(, \d+ s left)?", line)
    ]
    assert progress and progress[0] < result, lines


def test_a_piped_copy_prints_progress_lines(
    built: str, flare_env: dict[str, str], tmp_path: Path
) -> None:
    lines = piped(flare_env, "registry", "copy", "big", "--to", str(tmp_path / "other"))
    assert any(re.match(LINE.format(name="copy"), line) for line in lines), lines


def test_a_bad_progress_interval_is_one_line(built: str, run_flare: RunFlare) -> None:
    done = run_flare("pull", "big", "--device", "cpu", env={"FLARE_PROGRESS_INTERVAL": "soon"})
    assert done.returncode == 4
    assert done.stderr == (
        "error: FLARE_PROGRESS_INTERVAL='soon' is not a number of seconds above 0; "
        "use e.g. 5 or 0.5\n"
    )
