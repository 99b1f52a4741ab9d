"""The registry bench's gc section: a store of many blobs, a fraction of them live, collected
against `find | wc -l` (bench_registry.py runs it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from common import timed
from registry_measure import (
    VERSIONS,
    Section,
    Target,
    Timing,
    alternate,
    log,
    make_manifest,
    open_registry,
    profile_top,
    shell,
    stages,
    time_stages,
    write_blob,
)

from flare.registry import gc, refs
from flare.registry.marks import Marked
from flare.registry.registry import Registry
from flare.store.backends.local import MAX_SWEEP_PROCESSES
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.layout import BLOB_DIR, blob_key
from flare.store.package import (
    encode_index,
)
from flare.store.sweep import sweep_share, unmarked

GC_TARGET = 2.0
GC_PACKAGES = 5
GC_BLOBS_PER_PACKAGE = 20


# -- 2. gc --------------------------------------------------------------------------------


def populate_blobs(registry: Registry, count: int, live: float) -> list[str]:
    """Write `count` distinct 64-byte blobs and publish a few tagged packages holding the
    `live` fraction of them (at least GC_BLOBS_PER_PACKAGE each)."""
    root = Path(registry.location)
    digests = [write_blob(root, n.to_bytes(8, "big") * 8) for n in range(count)]
    held: list[Digest] = []
    per_package = max(GC_BLOBS_PER_PACKAGE, int(count * live) // GC_PACKAGES)
    for k in range(GC_PACKAGES):
        chosen = digests[k * per_package : (k + 1) * per_package]
        held += chosen
        manifest = make_manifest(k * VERSIONS, [(d, 64) for d in chosen], [])
        index = write_blob(root, encode_index(manifest))
        registry.publish(f"gc-{k}", refs.DEFAULT_TAG, index, manifest)
    os.sync()
    sample = digests[:: max(1, count // 1000)]
    report = registry.store.verify(sample)
    if not report.ok or report.checked != len(sample):
        raise RuntimeError(f"the gc store's blobs are not sound: {report}")
    return [
        f"{count} blobs of 64 bytes plus {GC_PACKAGES} tagged packages holding "
        f"{len(set(held))} of them ({report.checked} blobs verified)"
    ]


def check_gc(registry: Registry, files: int) -> list[str]:
    """Run both collections once and check what they found; return notes."""
    keep = gc.collect(registry, grace_s=3600, dry_run=True)
    sweep = gc.collect(registry, grace_s=0, dry_run=True)
    candidates = files - keep.marked
    if keep.deleted or keep.kept_recent != candidates or len(sweep.deleted) != candidates:
        raise RuntimeError(f"unexpected gc reports: {keep} / {len(sweep.deleted)} deleted")
    return [
        f"find counts {files} blob files; gc marks {keep.marked} from {keep.roots} roots; "
        f"grace 3600 keeps {keep.kept_recent} as recent, grace 0 would delete "
        f"{len(sweep.deleted)}"
    ]


def count_files(blobs: Path) -> int:
    """What the baseline prints: the number of files under the store's blobs folder."""
    done = subprocess.run(
        f"find {blobs} -type f | wc -l", shell=True, check=True, capture_output=True, text=True
    )
    return int(done.stdout)


def bench_gc(workdir: Path, count: int, repeat: int, live: float) -> Section:
    """Time a dry-run collection over `count` blobs against listing them with find."""
    section = Section(
        f"2. gc over {count} blobs, {live:.1%} of them live "
        f"(target: within {GC_TARGET}x of find | wc -l)"
    )
    home, location = workdir / f"gc-{live:g}-home", workdir / f"gc-{live:g}-registry"
    registry = open_registry(location, home)
    log(f"writing {count} blobs into {location}")
    section.notes += populate_blobs(registry, count, live)
    blobs = location / BLOB_DIR
    section.notes += check_gc(registry, count_files(blobs))
    processes = registry.store.backend.sweep_processes
    keep = Timing(f"collect(grace_s=3600, dry_run=True), {processes} sweep processes")
    sweep = Timing(f"collect(grace_s=0, dry_run=True), {processes} sweep processes")
    single = Timing("ref: collect(grace_s=3600, dry_run=True), 1 sweep process")
    find = Timing("find STORE/blobs -type f | wc -l")
    find_stat = Timing("ref: find STORE/blobs -type f -printf '%s %T@\\n' | wc -l")
    log("timing gc")
    alternate(
        [
            (keep, lambda: gc.collect(registry, grace_s=3600, dry_run=True)),
            (sweep, lambda: gc.collect(registry, grace_s=0, dry_run=True)),
            (single, lambda: collect_in_one_process(registry)),
            (find, shell(f"find {blobs} -type f | wc -l")),
            (find_stat, shell(f"find {blobs} -type f -printf '%s %T@\\n' | wc -l")),
        ],
        repeat,
    )
    doomed = workdir / f"gc-{live:g}-doomed.txt"
    swept = gc.collect(registry, grace_s=0, dry_run=True).deleted
    doomed.write_text("".join(f"{blob_key(Digest.parse(d), Encoding.PLAIN)}\n" for d in swept))
    deleting = Timing("collect(grace_s=0), deleting: into the trash, then out of it")
    rm = Timing("ref: xargs rm of the same blob files")
    log("timing gc that deletes, on a fresh copy of the store each run")
    on_copies(
        location,
        repeat,
        [
            (deleting, lambda copy: partial(gc.collect, open_registry(copy, home), 0)),
            (rm, lambda copy: shell(f"cd {copy} && xargs -a {doomed} rm -f")),
        ],
    )
    section.timings = [keep, sweep, single, find, find_stat, deleting, rm]
    section.notes.append(
        f"gc that deletes {len(swept)} blobs / rm of those files: "
        f"{deleting.median / rm.median:.2f}x (each on a fresh copy of the store)"
    )
    section.notes.append(
        f"the sweep runs in {processes} processes (one per core, at most "
        f"{MAX_SWEEP_PROCESSES}); in one process it takes {single.median / find.median:.2f}x find"
    )
    section.notes.append(
        f"gc / find -printf (a stat per file): {keep.median / find_stat.median:.2f}x (grace "
        f"3600), {sweep.median / find_stat.median:.2f}x (grace 0)"
    )
    section.targets = [
        Target("gc, grace 3600 (keeps all)", keep, GC_TARGET, find),
        Target("gc, grace 0 (would sweep all)", sweep, GC_TARGET, find),
    ]
    if section.missed():
        section.diagnosis = explain_gc(registry, blobs, find.median)
    return section


def on_copies(
    store: Path, repeat: int, cases: list[tuple[Timing, Callable[[Path], Callable[[], object]]]]
) -> None:
    """Time actions that change a store, each run on a fresh copy of it (copied untimed): a
    case gives the action to time for the copy's folder."""
    copy = store.with_name(f"{store.name}-copy")
    for _ in range(repeat):
        for timing, prepare in cases:
            shutil.rmtree(copy, ignore_errors=True)
            subprocess.run(["cp", "-a", str(store), str(copy)], check=True)
            os.sync()  # the copy's writeback is not what is timed
            action = prepare(copy)
            timing.runs.append(timed(action))
    shutil.rmtree(copy, ignore_errors=True)


def collect_in_one_process(registry: Registry) -> object:
    """A dry-run collection with grace 3600 whose sweep runs in this process only."""
    with mock.patch.object(registry.store.backend, "sweep_processes", 1):
        return gc.collect(registry, grace_s=3600, dry_run=True)


def walk_names(top: Path) -> int:
    """Files under a folder by name only (what find -type f does: no stat)."""
    return sum(len(files) for _dir, _dirs, files in os.walk(top))


def walk_scandir_stat(top: Path) -> int:
    """Files under the two-level blob folder with one stat each, through os.scandir."""
    total = 0
    for shard in os.scandir(top):
        for entry in os.scandir(shard.path):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def explain_gc(registry: Registry, blobs: Path, find_s: float) -> list[str]:
    """Where a collection's time goes: its stages one by one, then a profile of it."""
    log("profiling gc")
    store = registry.store
    found = gc.roots(registry)
    marked = Marked(gc.mark(registry, found, keep=False), found.blobs)
    keys = list(store.backend.iter_names(BLOB_DIR))
    candidates = [c for share in unmarked(store, marked.in_folder) for c in share.unmarked]
    folders = store.backend.list_dir(BLOB_DIR)
    parts = time_stages(
        [
            ("roots(): refs, tags, pins, leases", lambda: gc.roots(registry)),
            ("mark(): the roots' marks files", lambda: gc.mark(registry, found, False)),
            ("list names under blobs/ (no stat)", lambda: list(store.backend.iter_names(BLOB_DIR))),
            (
                "sweep: list, drop marked names, stat and parse the rest, all processes",
                lambda: list(unmarked(store, marked.in_folder)),
            ),
            (
                "the same, one process",
                lambda: sweep_share(store, folders, marked.in_folder),
            ),
            (
                "one stat per candidate, by path, one thread (for reference)",
                lambda: [store.backend.stat(key) for _, key, _, _ in candidates],
            ),
        ]
    )
    scandir_s = min(timed(lambda: walk_scandir_stat(blobs)) for _ in range(3))
    lines = [
        f"gc stages, each timed alone (min of 3), {len(keys)} blobs, {len(candidates)} candidates:"
    ]
    lines += stages(parts)
    lines += [
        f"(find -type f: {find_s:.3f} s; os.scandir + DirEntry.stat, one stat per file: "
        f"{scandir_s:.3f} s)",
        *profile_top(lambda: gc.collect(registry, grace_s=3600, dry_run=True)),
    ]
    return lines
