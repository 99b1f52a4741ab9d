"""Benchmark of multi-rank builds as separate processes against the single-process build.

On one synthetic Llama-shaped checkpoint (read once before timing, so it sits in the page
cache), for 2 and 4 ranks, each arrangement is a fresh build (empty staging and registries):

- single: `flare build --ranks N` in one process (the reference every ratio is against);
- shared+local: every peer reads its own copy and writes into rank zero's store folder;
- shared+received: peers receive their bytes from rank zero, write into the shared store;
- apart: peers have no copy and no shared store: bytes go to them and back to rank zero;
- serial: shared+local with `--workers 1` on every rank (serial hashing and publishing).

It prints rank zero's per-phase seconds for each, the wall time and its ratio to the
single-process build of the same N measured in the same run. Then, for linking against
copying, it stores the reference's payload files into a fresh store with `put_file(link=True)`
and `put_file(link=False)`, as a build that staged its payloads in files would.

    python tests/bench/bench_multirank.py [--gib 2] [--payload-size 256M] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from checkpoints import make_synthetic_llama
from common import log, remove, scratch, sync

from flare.store import BlobStore

PHASES = ("rendezvous", "resolve", "load", "shard", "assemble", "publish")


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages, as the recorded figures were
    return {**env, "FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def flare(*args: object) -> list[str]:
    return [sys.executable, "-m", "flare", *map(str, args)]


def build(ckpt: Path, root: Path, ranks: int, size: str, mode: str) -> dict:
    """One fresh build; rank zero's JSON summary plus the wall time of all ranks."""
    remove(root)
    sync()
    common = ["--payload-size", size, "--json"]
    workers = ["--workers", "1"] if mode == "serial" else []
    started = time.perf_counter()
    if mode == "single":
        done = subprocess.run(
            flare("build", ckpt, "--name", "b", "--ranks", ranks, *common),
            env=env_for(root / "rank0"),
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        return {**json.loads(done.stdout), "wall": time.perf_counter() - started}
    address = f"127.0.0.1:{free_port()}"
    shared = mode != "apart"
    local = ["--local-checkpoint", "require"] if mode in ("shared+local", "serial") else []
    peers = [
        subprocess.Popen(
            flare("join", address, "--rank", r, "--json", *local, *workers, "--registry",
                  root / ("rank0" if shared else f"rank{r}") / "registry"),
            env=env_for(root / f"rank{r}"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(1, ranks)
    ]  # fmt: skip
    done = subprocess.run(
        flare("build", ckpt, "--name", "b", "--ranks", ranks, "--rendezvous", address,
              *common, *workers),
        env=env_for(root / "rank0"),
        capture_output=True,
        text=True,
    )  # fmt: skip
    for peer in peers:
        assert peer.wait() == 0, peer.stderr.read() if peer.stderr else ""
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout), "wall": time.perf_counter() - started}


def link_vs_copy(root: Path) -> dict[str, float]:
    """Seconds to store one build's payload files, linked and copied."""
    blobs = sorted((root / "rank0" / "registry" / "blobs").rglob("*"))
    files = [p for p in blobs if p.is_file()]
    figures = {"bytes": sum(p.stat().st_size for p in files)}
    for link in (True, False):
        target = root / f"store-{link}"
        remove(target)
        sync()
        store = BlobStore(target)
        started = time.perf_counter()
        for path in files:
            store.put_file(path, link=link)
        figures["link" if link else "copy"] = time.perf_counter() - started
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--payload-size", default="256M")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with scratch(args.workdir, "flare-bench-multirank-") as work:
        rows, figures = run_all(work, args.gib, args.payload_size)
    print_table(rows)
    gb = figures["bytes"] / 1e9
    print(f"\nstoring {gb:.2f} GB of payload files: linked {figures['link']:.2f} s, "
          f"copied {figures['copy']:.2f} s")  # fmt: skip


def run_all(work: Path, gib: float, payload_size: str) -> tuple[list, dict]:
    """Every arrangement on one checkpoint made in `work`; the rows and link/copy figures."""
    ckpt = work / "ckpt"
    log(f"making a {gib} GiB checkpoint in {ckpt}")
    make_synthetic_llama(ckpt, int(gib * (1 << 30)))
    subprocess.run(["cat", *map(str, ckpt.iterdir())], stdout=subprocess.DEVNULL, check=True)
    rows = []
    for ranks, modes in ((1, ["single"]), (2, MODES), (4, MODES)):
        for mode in modes:
            log(f"{ranks} ranks, {mode}")
            summary = build(ckpt, work / "run", ranks, payload_size, mode)
            rows.append((ranks, mode, summary))
    return rows, link_vs_copy(work / "run")


MODES = ["single", "shared+local", "shared+received", "apart", "serial"]


def print_table(rows: list[tuple[int, str, dict]]) -> None:
    single = {ranks: s["wall"] for ranks, mode, s in rows if mode == "single"}
    digests = {ranks: s["digest"] for ranks, mode, s in rows if mode == "single"}
    print("| ranks | arrangement | " + " | ".join(PHASES) + " | wall s | vs single | same digest |")
    print("|---" * (len(PHASES) + 5) + "|")
    for ranks, mode, summary in rows:
        seconds = {p["name"]: p["seconds"] for p in summary["phases"]}
        cells = [f"{seconds[p]:.2f}" if p in seconds else "" for p in PHASES]
        ratio = summary["wall"] / single[ranks]
        same = "yes" if summary["digest"] == digests[ranks] else "NO"
        print(f"| {ranks} | {mode} | " + " | ".join(cells)
              + f" | {summary['wall']:.2f} | {ratio:.2f} | {same} |")  # fmt: skip


if __name__ == "__main__":
    main()
