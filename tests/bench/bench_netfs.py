"""Benchmark of a registry on a real network filesystem: build and pull through sshfs, each
against `cp` of the same bytes through the same mount, timed in the same run.

An sshd of our own on loopback exports a folder that is mounted with sshfs, with sshfs's
default options (tests/netfs.py; needs the Debian packages sshfs and openssh-server). A
synthetic Llama checkpoint of about --size-mib MiB is made on the local disk. Each repeat,
cases alternating:

1. write: `cp model.safetensors MOUNT/copy.bin && sync MOUNT/copy.bin` (the bytes reach the
   server, as a build's fsyncs make sure) against `flare build CHECKPOINT --name big` into a
   fresh registry folder on the mount, with this host's own index under a local FLARE_HOME.
   The build's wall time includes its start-up (python, torch), its phases (its --json phase
   times are shown too) and, on a network filesystem, the cache window it holds its lease for
   after publishing (registry.cache_window, 21 s on sshfs; shown as a row of its own), so the
   ratio is given for the phases as well.
2. read: `cp -r MOUNT/REGISTRY/blobs LOCAL` (every blob the package has, and nothing more)
   against `flare pull big --device cpu` into a fresh local package cache: the pull reads,
   hashes and writes each blob, and checks the signature first. The same pull run again, with
   every blob in the cache, shows what a pull costs besides the copy (start-up, imports, the
   index and signature checks).

    python tests/bench/bench_netfs.py [--size-mib 256] [--repeat 3] [--workdir DIR]

Medians with min and max, and ratios as in docs/performance.md (cp's time over flare's: above 1,
flare is faster); the load average is printed, since other work on the machine disturbs the
figures. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoints import make_synthetic_llama
from common import flare_command, log, remove, scratch
from netfs import missing_tools, network_share

from flare.registry.registry import default_database
from flare.store.backends.filesystems import cache_window_s, filesystem_type


def timed_run(*args: str | Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Seconds a command takes, and its stdout; fails loudly."""
    start = time.perf_counter()
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed: {done.stderr.strip()}")
    return seconds, done.stdout


def host_env(home: Path, registry: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    return env | {
        "FLARE_HOME": str(home),
        "XDG_CONFIG_HOME": str(home / "xdg"),
        "FLARE_REGISTRY": str(registry),
        "FLARE_BUILD_TARGET": "none",  # eager packages, as the recorded figures were
    }


def one_repeat(index: int, mount: Path, local: Path, checkpoint: Path, home: Path) -> dict:
    """The four timings of one repeat (seconds), plus the build's own phase times."""
    model = checkpoint / "model.safetensors"
    copy = mount / f"copy-{index}.bin"
    cp_write, _ = timed_run("sh", "-c", f'cp "{model}" "{copy}" && sync "{copy}"')
    remove(copy)
    registry = mount / f"registry-{index}"
    env = host_env(home, registry) | {"FLARE_PACKAGE_CACHE": str(local / f"cache-{index}")}
    flare = flare_command()
    build_s, out = timed_run(*flare, "build", checkpoint, "--name", "big", "--json", env=env)
    phases = sum(p["seconds"] for p in json.loads(out)["phases"])
    target = local / f"blobs-{index}"
    cp_read, _ = timed_run("cp", "-r", registry / "blobs", target)
    remove(target)
    pull_s, _ = timed_run(*flare, "pull", "big", "--device", "cpu", env=env)
    again_s, _ = timed_run(*flare, "pull", "big", "--device", "cpu", env=env)
    remove(local / f"cache-{index}")
    return {
        "cp write": cp_write,
        "build": build_s,
        "build phases": phases,
        "cp read": cp_read,
        "pull": pull_s,
        "pull, cached": again_s,
    }


def report(rows: list[dict], size: int, window: float) -> None:
    """A table of medians (min, max) and rates, then the ratios."""
    print(f"\n{size / 1e6:.0f} MB checkpoint through sshfs on loopback; {len(rows)} repeats")
    print(f"{'case':<14} {'median s':>9} {'min':>7} {'max':>7} {'MB/s':>8}")
    medians = {}
    for case in rows[0]:
        values = [r[case] for r in rows]
        medians[case] = statistics.median(values)
        rate = size / 1e6 / medians[case]
        print(f"{case:<14} {medians[case]:9.2f} {min(values):7.2f} {max(values):7.2f} {rate:8.0f}")
    print(f"(build includes the {window:.0f} s it holds its lease after publishing)")
    print("ratios: cp's median time over flare's (above 1: flare is faster)")
    print(f"cp write / build:        {medians['cp write'] / medians['build']:.2f}")
    print(f"cp write / build phases: {medians['cp write'] / medians['build phases']:.2f}")
    print(f"cp read / pull:          {medians['cp read'] / medians['pull']:.2f}")
    copying = medians["pull"] - medians["pull, cached"]
    print(f"cp read / (pull - pull, cached): {medians['cp read'] / copying:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    why = missing_tools()
    if why is not None:
        sys.exit(f"cannot mount sshfs here: {why}")
    log(f"load average at start: {os.getloadavg()}")
    with scratch(args.workdir, "bench-netfs-") as work:
        checkpoint = make_synthetic_llama(work / "checkpoint", args.size_mib << 20)
        size = (checkpoint / "model.safetensors").stat().st_size
        home, local = work / "home", work / "local"
        local.mkdir()
        with network_share(work / "share", 1) as share:
            mount = share.mounts[0]
            env = host_env(home, mount / "registry-0")
            subprocess.run(
                [*flare_command(), "key", "generate", "--publisher", "bench"],
                env=env,
                check=True,
                capture_output=True,
            )
            log(f"index of a registry on the mount: {default_database(str(mount / 'r'), home)}")
            window = cache_window_s(filesystem_type(mount))
            rows = []
            for index in range(args.repeat):
                log(f"repeat {index + 1} of {args.repeat}")
                rows.append(one_repeat(index, mount, local, checkpoint, home))
        report(rows, size, window)
    log(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
