"""Helpers for the tests of multi-rank serving: tiny checkpoints (a GQA Llama, a Qwen3 with
tied embeddings) built at 1, 2 and 4 ranks into a signed home, servers and joins as real
`python -m flare` processes, and a rank's part of a model loaded in a thread of this process
(real gloo groups between threads, for the numerics)."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from checkpoints import make_llama
from helpers import child_processes

from flare.registry.refs import read_manifest
from flare.registry.registry import Registry
from flare.store.package import Manifest

RANKS = (1, 2, 4)
TIMEOUT = "8"
"""The servers' --timeout: a lost rank is named within it."""


def make_gqa_llama(folder: Path) -> Path:
    """8 query heads sharing 4 KV heads: 2 or 4 ranks keep whole KV heads."""
    return make_llama(folder, heads=8, kv_heads=4)


def make_qwen3_tied(folder: Path) -> Path:
    """Qwen3 (per-head q/k norms) with tied input and output embeddings."""
    import transformers

    make_llama(folder, "Qwen3ForCausalLM")
    config = transformers.Qwen3Config.from_pretrained(folder)
    config.tie_word_embeddings = True
    torch.manual_seed(2)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


CHECKPOINTS: dict[str, Callable[[Path], Path]] = {"llama": make_gqa_llama, "qwen3": make_qwen3_tied}


def flare_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"
    return env | {"FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")} | extra


def flare(
    env: dict[str, str], *args: str | Path, ok: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "flare", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if ok:
        assert done.returncode == 0, (args, done.stderr)
    return done


def build_home(root: Path) -> Path:
    """A host with alice's key and each checkpoint built at 1, 2 and 4 ranks (tags r1, r2,
    r4), signed; alice's public key saved as alice.pub for other hosts to trust."""
    env = flare_env(root)
    key = json.loads(flare(env, "key", "generate", "--publisher", "alice", "--json").stdout)
    (root / "alice.pub").write_text(key["public_key"])
    for name, make in CHECKPOINTS.items():
        folder = make(root / f"{name}-checkpoint")
        for ranks in RANKS:
            flare(env, "build", folder, "--name", name, "--tag", f"r{ranks}", "--ranks", ranks)
    return root


def package(home: Path, ref: str, into: Path) -> tuple[Manifest, dict[str, Path]]:
    """A package's manifest and its blobs as local files, read from the home's registry."""
    registry = Registry(str(home / "registry"), f"sqlite:///{home / 'registry' / 'index.db'}")
    _, digest = registry.resolve(ref)
    registry.db.dispose()
    store = registry.store
    manifest = read_manifest(store, digest)
    into.mkdir(parents=True, exist_ok=True)
    return manifest, {str(d): store.get(d, into)[0] for d in manifest.blobs()}


def in_threads(world: int, work: Callable[[int, Any], Any]) -> list[Any]:
    """`work(rank, group)` for every rank at once, each in a thread with a gloo process group
    of its own over one store, as separate processes would have; the results in rank order."""
    import torch.distributed as dist

    store = dist.HashStore()
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=60)
        try:
            results[rank] = work(rank, dist.ProcessGroupGloo(store, rank, world, options))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class Server:
    """A `flare serve` process (rank zero, and the ranks it starts) and its base URL."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        command = [sys.executable, "-m", "flare", "serve", *args, "--port", "0", "--device", "cpu"]
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.ready = self.process.stdout.readline() if self.process.stdout else ""
        if "http://" not in self.ready:
            self.process.kill()
            pytest.fail(f"flare serve did not start: {self.ready}{self.process.communicate()[1]}")
        self.url = self.ready[self.ready.index("http://") :].split()[0]
        self.root = self.url.removesuffix("/v1")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=60)

    def metrics(self) -> str:
        return httpx.get(f"{self.root}/metrics").text

    def ranks(self) -> list[int]:
        """The pids of the rank processes rank zero started (`flare join`; not the
        resource tracker of multiprocessing, nor an engine process)."""
        children = child_processes(self.process.pid)
        return [child for child, argv in children.items() if b"join" in argv]

    def stop(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        _, stderr = self.process.communicate(timeout=60)
        return self.process.returncode, stderr


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
