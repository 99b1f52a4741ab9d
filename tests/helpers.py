"""Small helpers the tests share."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from flare.serve.engine.attention import TorchPagedAttention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.sequence import SamplingParams, Sequence
from flare.serve.models import load_model
from flare.serve.models.files import PackageFiles
from flare.serve.models.shard import Shard
from flare.store.digest import Digest
from flare.store.hashing import Progress, hash_file, parallel_map
from flare.store.package import Manifest

CPU = torch.device("cpu")


def child_processes(pid: int) -> dict[int, list[bytes]]:
    """The live children of process `pid`, each with its command line's arguments (from
    /proc): a server's engine process (multiprocessing's `spawn_main`), its ranks (`flare
    join`), multiprocessing's resource tracker."""
    found = {}
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            found[int(child)] = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:  # it exited meanwhile
            continue
    return found


def spawned_children(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned (an engine process)."""
    return [
        child
        for child, argv in child_processes(pid).items()
        if any(b"spawn_main" in arg for arg in argv)
    ]


def write_random(path: Path, size: int, seed: int = 0) -> bytes:
    """A file of seeded pseudo-random bytes; returns them."""
    data = random.Random(seed).randbytes(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def hash_files(
    paths: Iterable[Path], workers: int | None = None, progress: Progress | None = None
) -> list[tuple[Digest, int]]:
    """Hash many files at once, each also on several threads: the many-files case of the
    hashing tests and of bench_store (the build hashes through its stat cache instead)."""
    return parallel_map(lambda path: hash_file(path, progress=progress), paths, workers)


class CliHome:
    """One host's environment for the `flare` command: its own FLARE_HOME and config, eager
    packages (tests/test_compiled.py compiles), plus `extra` settings."""

    def __init__(self, root: Path, **extra: str) -> None:
        self.root = root
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
        env["FLARE_BUILD_TARGET"] = "none"
        self.env = env | {"FLARE_HOME": str(root), "XDG_CONFIG_HOME": str(root / "xdg")} | extra

    def run(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        """`flare ARGS`, which must exit `code`; a failure says one line, never a traceback."""
        done = subprocess.run(
            [sys.executable, "-m", "flare", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == code, (args, done.stdout, done.stderr)
        if code:
            assert done.stderr.count("\n") == 1, done.stderr  # one line: no traceback
            assert "Traceback" not in done.stderr and "internal error" not in done.stderr
        return done


def cpu_runner(
    manifest: Manifest, files: dict[str, Path], shard: Shard | None = None
) -> ModelRunner:
    """A package's model (or one rank's part of it) on the CPU in float32, with the torch
    attention over a 16-block KV cache: the runner of the parity tests."""
    model = load_model(PackageFiles(manifest, files), CPU, torch.float32, shard)
    attention = TorchPagedAttention(model.attention_spec, 16 * 16, torch.float32, CPU)
    return ModelRunner(model, attention, 16, CPU)


def greedy_answer(
    runner: ModelRunner, ids: list[int], tokens: int
) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits at every position, and `tokens` greedy tokens after it."""
    seq = Sequence(ids, SamplingParams(temperature=0, ignore_eos=True), max_tokens=tokens)
    blocks = BlockManager(16, 16)
    blocks.allocate(seq)
    with torch.inference_mode():
        input_ids, positions, meta = runner.prepare([seq], prefill=True)
        runner.attention.plan(meta)
        model = runner.model
        logits = model.compute_logits(model.forward(input_ids, positions, runner.attention))
    out = [int(logits[-1].argmax())]
    while len(out) < tokens:
        seq.append(out[-1])
        blocks.append_slot(seq)
        out.append(int(runner.run([seq], prefill=False).logits[0].argmax()))
    return logits, out
