"""The guide's walk-through, run: every `$ command` in docs/guide.md's "Walk-through" section
is run in order in a fresh home, and what it prints must be what the guide shows, once
digests, free space, paths and column padding are set aside. A change to a command's output
fails here until the guide shows the new output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"
DOCS_HOME = "/tmp/docs-home"
"""The home the guide's outputs were made in (it says so); the test's own is put in its place."""

HEX = re.compile(r"\b[0-9a-f]{8,64}\b")
LARGE = re.compile(r"\b\d+(\.\d+)? (GB|TB)\b")
"""Free space: the filesystem's, never the same twice."""


def walk_through() -> list[tuple[str, list[str]]]:
    """(command, the lines the guide shows it print) for every `$ ` line of the section."""
    text = GUIDE.read_text()
    start = text.index("\n## Walk-through\n")
    section = text[start : text.index("\n## ", start + 1)]
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```\n(.*?)```", section, flags=re.DOTALL):
        if not block.startswith("$ "):
            continue  # a listing, not a transcript
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line)
    return steps


def normalized(lines: list[str], home: str) -> list[str]:
    """Digests as x's of their length, large sizes as <free>, the home as the guide's, and
    runs of spaces as one (column widths follow the paths' lengths)."""
    shown = []
    for line in lines:
        line = LARGE.sub("<free>", line.replace(home, DOCS_HOME))
        line = HEX.sub(lambda m: "x" * len(m[0]), line)
        if line.strip():
            shown.append(re.sub(r"\s+", " ", line.strip()))
    return shown


def checkpoint(folder: Path) -> None:
    """The folder the guide lists: a 44-byte config, 48 MB of weights, a 19-byte tokenizer
    (the weights from a seed whose digest sorts after the other two, as the guide's does)."""
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2}\n')
    weights = blake3.blake3(b"tiny-llama 2").digest(length=48_000_000)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}\n')
    assert [p.stat().st_size for p in sorted(folder.iterdir())] == [44, 48_000_000, 19]


def run_all(steps: list[tuple[str, list[str]]], work: Path, env: dict[str, str]) -> list[str]:
    """Run the commands in one shell (so `echo $?` sees the one before); each one's output,
    stdout and stderr together, ends at a marker line."""
    script = [f'flare() {{ "{sys.executable}" -m flare "$@"; }}']
    for command, _ in steps:
        script.append(f"{{ {command} ; }} 2>&1; __status=$?; echo @@step; (exit $__status)")
    done = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    outputs = done.stdout.split("@@step\n")
    assert len(outputs) == len(steps) + 1, done.stdout + done.stderr
    return outputs[:-1]


def test_the_guides_walk_through_prints_what_the_guide_shows(
    flare_env: dict[str, str], tmp_path: Path
) -> None:
    steps = walk_through()
    assert len(steps) >= 15, "the walk-through's transcripts were not found"
    work = tmp_path / "work"
    work.mkdir()
    checkpoint(work / "tiny-llama")
    home = flare_env["FLARE_HOME"]
    env = flare_env | {"COLUMNS": "200"}
    outputs = run_all(steps, work, env)
    if "reflink" in outputs[0]:
        pytest.skip("this filesystem makes reflinks: the guide's walk-through is on ext4")
    for (command, expected), output in zip(steps, outputs, strict=True):
        shown, wanted = normalized(output.splitlines(), home), normalized(expected, home)
        if "--json" in command:  # compact when piped, shown indented: the same document
            shown, wanted = json.loads(" ".join(shown)), json.loads(" ".join(wanted))
        assert shown == wanted, f"$ {command}\n{output}"
