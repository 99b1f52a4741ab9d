"""Benchmark of flare's blob store against the tools it should keep up with.

Every figure is measured in one run, on the same files, against a baseline timed in the same
run: flare's BLAKE3 hashing against `b3sum`, a durable put against `cp` + `sync`, and a linked
import of a checkpoint folder against a copying one, on the working folder's filesystem and on
a loop-mounted XFS with reflinks. Source files are random bytes, read once before timing so
they sit in the page cache. After one untimed run of each, runs of a case and of its
baseline alternate, each is repeated, and the tables give medians with min and max; before
each durable run the previous destination is deleted and everything synced. The `cp`
baseline is `cp --reflink=never`, so that it writes the bytes even on XFS. Nothing here
asserts on time: targets are printed as PASS or MISS.

    python tests/bench/bench_store.py [--size-gib 2] [--repeat 5] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

import blake3
from common import log, remove, run, scratch, sync, timed
from helpers import hash_files

from flare.store.blobs import BlobStore, PutResult
from flare.store.hashing import hash_file

MIB = 1 << 20
GIB = 1 << 30
CHUNK = 64 * MIB
MANY_FILES = 16
TREE_FILES = 4
HASH_TARGET = 0.9
PUT_TARGET = 0.8
LINK_SPEEDUP_TARGET = 2.0
LINK_FREE_TOLERANCE = 0.02
"""A linked import may take at most this fraction of the imported bytes in free space."""
CP = ("cp", "--reflink=never")
"""GNU cp 9 clones by default where it can; the baseline must write the bytes."""


@dataclass
class Comparison:
    """A flare case and its baseline, timed in alternating runs (pairs keep their order)."""

    section: str
    case: str
    subject: str
    baseline: str
    nbytes: int
    target: float | None
    """The least acceptable ratio of the baseline's median time to the subject's."""
    subject_s: list[float] = field(default_factory=list)
    baseline_s: list[float] = field(default_factory=list)

    def ratio(self) -> float:
        """Subject throughput over baseline throughput, from the medians."""
        return statistics.median(self.baseline_s) / statistics.median(self.subject_s)

    def paired_ratio(self) -> float:
        """The median of the ratios of runs made back to back."""
        pairs = zip(self.baseline_s, self.subject_s, strict=True)
        return statistics.median(b / s for b, s in pairs)

    def verdict(self) -> str:
        """PASS or MISS against the target, or '-' where there is none."""
        if self.target is None:
            return "-"
        return "PASS" if self.ratio() >= self.target else "MISS"

    def summary(self) -> dict[str, object]:
        """Raw times plus the figures the tables print, for --json."""
        return {
            **asdict(self),
            "subject_gbps": gbps_stats(self.nbytes, self.subject_s),
            "baseline_gbps": gbps_stats(self.nbytes, self.baseline_s),
            "ratio": self.ratio(),
            "paired_ratio": self.paired_ratio(),
            "verdict": self.verdict(),
        }


@dataclass
class Check:
    """A target that is not a speed: free space taken, how the bytes got into the store."""

    section: str
    name: str
    value: str
    expected: str
    ok: bool

    def verdict(self) -> str:
        return "PASS" if self.ok else "MISS"


@dataclass
class Report:
    """Everything one run measured."""

    environment: dict[str, str]
    comparisons: list[Comparison] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- small helpers ------------------------------------------------------------------------


def gbps_stats(nbytes: int, seconds: list[float]) -> dict[str, float]:
    """Median, min and max throughput in GB/s (10^9 bytes per second)."""
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged user could still write on the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def settled_free_bytes(path: Path, timeout_s: float = 10.0) -> int:
    """Free bytes once they stop changing: XFS frees a deleted file's blocks in the background."""
    sync()
    last, deadline = free_bytes(path), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = free_bytes(path)
        if now == last:
            break
        last = now
    return last


def reset(*paths: Path) -> None:
    """Delete earlier destinations and sync, so no run pays for another's writes."""
    for path in paths:
        remove(path)
    sync()


def write_random(path: Path, size: int) -> None:
    """A file of `size` random bytes, written in chunks."""
    with open(path, "wb") as sink:
        for offset in range(0, size, CHUNK):
            sink.write(os.urandom(min(CHUNK, size - offset)))


def copy_slice(source: Path, dest: Path, offset: int, length: int) -> None:
    """Copy a byte range with read and write, so that no filesystem shares extents."""
    with open(source, "rb") as src, open(dest, "wb") as sink:
        src.seek(offset)
        left = length
        while left:
            chunk = src.read(min(CHUNK, left))
            sink.write(chunk)
            left -= len(chunk)


def warm(paths: list[Path]) -> None:
    """Read files once so the timed runs find them in the page cache."""
    buffer = bytearray(CHUNK)
    for path in paths:
        with open(path, "rb", buffering=0) as src:
            while src.readinto(buffer):
                pass


def tree_files(tree: Path) -> list[Path]:
    """The files of a checkpoint folder, sorted."""
    return sorted(p for p in tree.iterdir() if p.is_file())


def make_tree(source: Path, tree: Path, total: int) -> None:
    """A checkpoint-like folder: TREE_FILES safetensors-named slices of the source."""
    tree.mkdir()
    part = total // TREE_FILES
    for index in range(TREE_FILES):
        name = f"model-{index + 1:05d}-of-{TREE_FILES:05d}.safetensors"
        copy_slice(source, tree / name, index * part, part)


def make_writable(paths: list[Path]) -> None:
    """Undo the chmod 444 a hardlink import leaves on the sources (they share the inode)."""
    for path in paths:
        path.chmod(0o644)


def interleaved(
    comparison: Comparison,
    subject: Callable[[], float],
    baseline: Callable[[], float],
    repeat: int,
) -> None:
    """Time subject and baseline `repeat` times each, alternating which goes first.

    One untimed run of each comes first: the first write into a new filesystem (or a new
    region of a loop image) pays costs that no later run does.
    """
    subject()
    baseline()
    for index in range(repeat):
        order = [(comparison.subject_s, subject), (comparison.baseline_s, baseline)]
        if index % 2:
            order.reverse()
        for times, action in order:
            times.append(action())
        log(
            f"  {comparison.section} / {comparison.case} #{index + 1}: "
            f"subject {comparison.subject_s[-1]:.3f} s, baseline {comparison.baseline_s[-1]:.3f} s"
        )


# -- hashing ------------------------------------------------------------------------------


def b3sum_digests(args: list[str | Path]) -> list[str]:
    """The hex digests `b3sum` prints, in the order of its files."""
    return [line.split()[0] for line in run("b3sum", *args).splitlines()]


def bench_hash(report: Report, source: Path, many: list[Path], repeat: int) -> None:
    """flare's hash_file and hash_files against b3sum on the same page-cached files."""
    section = "hash"
    size = source.stat().st_size
    many_size = sum(p.stat().st_size for p in many)
    cases: list[tuple[str, list[str | Path], Callable[[], object], int]] = [
        ("one file, default threads", [source], lambda: hash_file(source), size),
        (
            "one file, 1 thread",
            ["--num-threads", "1", source],
            lambda: hash_file(source, threads=1),
            size,
        ),
        (f"{len(many)} files, hash_files", list(many), lambda: hash_files(many), many_size),
    ]
    for case, b3_args, flare_hash, nbytes in cases:
        ours = flare_hash()
        digests = [d.hex for d, _ in (ours if isinstance(ours, list) else [ours])]
        if digests != b3sum_digests(b3_args):
            raise RuntimeError(f"{case}: flare and b3sum disagree on the digests")
        label = "b3sum " + " ".join(str(a) for a in b3_args if not isinstance(a, Path))
        comparison = Comparison(section, case, "flare", label.strip(), nbytes, HASH_TARGET)
        interleaved(
            comparison,
            lambda action=flare_hash: timed(action),
            lambda args=b3_args: timed(lambda: run("b3sum", *args)),
            repeat,
        )
        report.comparisons.append(comparison)


# -- putting and importing ----------------------------------------------------------------


def bench_put(
    report: Report, label: str, root: Path, source: Path, digest: str, repeat: int
) -> None:
    """BlobStore.put_file(link=False) into a fresh store against `cp` + `sync`."""
    size = source.stat().st_size
    store_dir, cp_dir = root / "put-store", root / "cp-dest"
    comparison = Comparison(
        f"put ({label})", "one file, durable", "put_file(link=False)", "cp + sync", size, PUT_TARGET
    )

    def put() -> float:
        reset(store_dir)
        result: list[PutResult] = []
        seconds = timed(lambda: result.append(BlobStore(store_dir).put_file(source, link=False)))
        if (result[0].method, result[0].digest.hex, result[0].size) != ("copy", digest, size):
            raise RuntimeError(f"unexpected put result {result[0]}")
        reset(store_dir)
        return seconds

    def copy() -> float:
        reset(cp_dir)
        cp_dir.mkdir()  # a new folder, as the store's are: the same placement on XFS
        seconds = timed(lambda: (run(*CP, source, cp_dir / source.name), sync()))
        reset(cp_dir)
        return seconds

    interleaved(comparison, put, copy, repeat)
    report.comparisons.append(comparison)


def bench_import(
    report: Report, label: str, root: Path, tree: Path, repeat: int, link_method: str
) -> None:
    """put_tree(link=True) against put_tree(link=False), with the free space each takes."""
    files = tree_files(tree)
    size = sum(p.stat().st_size for p in files)
    store_dir = root / "import-store"
    section = f"import ({label})"
    comparison = Comparison(
        section,
        f"{len(files)}-file checkpoint",
        "put_tree(link=True)",
        "put_tree(link=False)",
        size,
        LINK_SPEEDUP_TARGET,
    )
    deltas: dict[bool, list[int]] = {True: [], False: []}
    methods: dict[bool, set[str]] = {True: set(), False: set()}

    def put_tree(link: bool) -> float:
        make_writable(files)
        reset(store_dir)
        before = settled_free_bytes(root)
        results: list[dict[str, PutResult]] = []
        seconds = timed(lambda: results.append(BlobStore(store_dir).put_tree(tree, link=link)))
        deltas[link].append(before - settled_free_bytes(root))
        methods[link].update(r.method for r in results[0].values())
        reset(store_dir)
        make_writable(files)
        return seconds

    interleaved(comparison, lambda: put_tree(True), lambda: put_tree(False), repeat)
    report.comparisons.append(comparison)
    for link in deltas:
        del deltas[link][:-repeat]  # the untimed first run of each
    linked_delta, copied_delta = (statistics.median(deltas[k]) for k in (True, False))
    report.checks += [
        Check(
            section,
            "free space taken, linked import",
            f"{linked_delta / MIB:.1f} MiB (copy: {copied_delta / MIB:.1f} MiB)",
            f"<= {LINK_FREE_TOLERANCE * size / MIB:.0f} MiB",
            linked_delta <= LINK_FREE_TOLERANCE * size,
        ),
        Check(
            section,
            "method, linked import",
            ",".join(sorted(methods[True])),
            link_method,
            methods[True] == {link_method},
        ),
    ]
    report.notes.append(
        f"{section}: free-space deltas, linked (MiB): "
        + ", ".join(f"{d / MIB:.1f}" for d in deltas[True])
        + "; copied: "
        + ", ".join(f"{d / MIB:.1f}" for d in deltas[False])
    )


def bench_filesystem(
    report: Report,
    label: str,
    root: Path,
    source: Path,
    tree: Path,
    digest: str,
    repeat: int,
    link_method: str,
) -> None:
    """The put and import sections on one filesystem, its sources already cached."""
    bench_put(report, label, root, source, digest, repeat)
    bench_import(report, label, root, tree, repeat, link_method)


@contextmanager
def xfs_mount(workdir: Path, size: int) -> Iterator[Path | None]:
    """A loop-mounted XFS with reflinks in a sparse image; None (and a message) if it fails."""
    image, mount_point = workdir / "xfs.img", workdir / "xfs"
    mounted = False
    try:
        try:
            with open(image, "wb") as sink:
                sink.truncate(size)
            run("mkfs.xfs", "-q", "-m", "reflink=1", image)
            mount_point.mkdir()
            run("mount", "-o", "loop", image, mount_point)
            mounted = True
        except (OSError, RuntimeError) as exc:
            log(f"XFS section skipped: cannot make or mount a loop XFS image: {exc}")
        yield mount_point if mounted else None
    finally:
        if mounted:
            run("umount", mount_point)
        image.unlink(missing_ok=True)


def bench_xfs(
    report: Report, workdir: Path, source: Path, tree: Path, digest: str, repeat: int
) -> None:
    """The put and import sections again, sources and store on a reflink XFS."""
    size = source.stat().st_size
    with xfs_mount(workdir, 4 * size + GIB) as root:
        if root is None:
            report.notes.append("xfs: skipped, the loop XFS image could not be made or mounted")
            return
        log(f"XFS mounted at {root}; copying the sources onto it")
        xfs_source, xfs_tree = root / "source.bin", root / "tree"
        copy_slice(source, xfs_source, 0, size)
        xfs_tree.mkdir()
        for path in tree_files(tree):
            copy_slice(path, xfs_tree / path.name, 0, path.stat().st_size)
        sync()
        warm([xfs_source, *tree_files(xfs_tree)])
        label = "xfs loop, reflink"
        bench_filesystem(report, label, root, xfs_source, xfs_tree, digest, repeat, "reflink")


# -- report -------------------------------------------------------------------------------


def environment(workdir: Path) -> dict[str, str]:
    """What the figures depend on: cores, kernel, filesystem, tool versions."""
    return {
        "cores": str(len(os.sched_getaffinity(0))),
        "kernel": platform.release(),
        "workdir": str(workdir),
        "workdir_fs": run("findmnt", "-n", "-o", "FSTYPE", "-T", workdir).strip(),
        "b3sum": run("b3sum", "--version").strip(),
        "cp": run("cp", "--version").splitlines()[0],
        "python_blake3": getattr(blake3, "__version__", "?"),
        "data": "random bytes (os.urandom), in page cache",
        "load_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def fmt_rate(stats: dict[str, float]) -> str:
    """'median (min-max)' in GB/s."""
    return f"{stats['median']:5.2f} ({stats['min']:.2f}-{stats['max']:.2f})"


def print_tables(report: Report) -> None:
    """One compact table per section, then the non-speed checks and notes."""
    print("environment: " + ", ".join(f"{k}={v}" for k, v in report.environment.items()))
    header = (
        f"{'case':<28} {'subject':<21} {'GB/s med (min-max)':<19} {'baseline':<23} "
        f"{'GB/s med (min-max)':<19} {'ratio':>5} {'paired':>6}  target"
    )
    sections = dict.fromkeys(c.section for c in report.comparisons)
    for section in sections:
        print(f"\n== {section} ==\n{header}")
        for c in (c for c in report.comparisons if c.section == section):
            target = f">={c.target:.2f} {c.verdict()}" if c.target is not None else "-"
            print(
                f"{c.case:<28} {c.subject:<21} {fmt_rate(gbps_stats(c.nbytes, c.subject_s)):<19} "
                f"{c.baseline:<23} {fmt_rate(gbps_stats(c.nbytes, c.baseline_s)):<19} "
                f"{c.ratio():5.2f} {c.paired_ratio():6.2f}  {target}"
            )
        for check in (k for k in report.checks if k.section == section):
            print(f"  {check.name}: {check.value} (want {check.expected}) {check.verdict()}")
    if report.notes:
        print("\nnotes:")
        for note in report.notes:
            print(f"  {note}")
    print("\ntargets:")
    for c in report.comparisons:
        if c.target is not None:
            print(f"  {c.verdict():<4} {c.section} / {c.case}: {c.ratio():.2f} >= {c.target:.2f}")
    for check in report.checks:
        print(f"  {check.verdict():<4} {check.section} / {check.name}: {check.value}")


def print_json(report: Report) -> None:
    """The whole report as one JSON document on stdout."""
    document = {
        "environment": report.environment,
        "comparisons": [c.summary() for c in report.comparisons],
        "checks": [{**asdict(k), "verdict": k.verdict()} for k in report.checks],
        "notes": report.notes,
    }
    print(json.dumps(document, indent=2))


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="bytes per case (GiB)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each case")
    parser.add_argument("--workdir", type=Path, help="folder to work in (default: under /tmp)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.size_gib * GIB < MANY_FILES * MIB:
        parser.error(f"--repeat must be positive and --size-gib at least {MANY_FILES} MiB")
    return args


def benchmark(workdir: Path, size: int, repeat: int) -> Report:
    """Make the source files in `workdir`, then run every section."""
    report = Report(environment(workdir))
    load = os.getloadavg()[0]
    if load > 0.5:
        report.notes.append(f"load average {load:.2f} at start: other work may skew the figures")
    source, tree, many_dir = workdir / "source.bin", workdir / "tree", workdir / "many"
    log(f"writing {size / GIB:.2f} GiB of random bytes and slicing it into test files")
    write_random(source, size)
    many_dir.mkdir()
    part = size // MANY_FILES
    many = [many_dir / f"part-{i:02d}.bin" for i in range(MANY_FILES)]
    for index, path in enumerate(many):
        copy_slice(source, path, index * part, part)
    make_tree(source, tree, size)
    sync()
    warm([source, *many, *tree_files(tree)])
    digest = hash_file(source)[0].hex

    log("hashing")
    bench_hash(report, source, many, repeat)
    reset(many_dir)
    label = report.environment["workdir_fs"]
    log(f"put and import on the working folder's filesystem ({label})")
    bench_filesystem(report, label, workdir, source, tree, digest, repeat, "hardlink")
    log("put and import on a loop-mounted XFS")
    bench_xfs(report, workdir, source, tree, digest, repeat)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = int(args.size_gib * GIB) // (MANY_FILES * MIB) * (MANY_FILES * MIB)
    with scratch(args.workdir, "flare-bench-") as workdir:
        report = benchmark(workdir, size, args.repeat)
    if args.json:
        print_json(report)
    else:
        print_tables(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
