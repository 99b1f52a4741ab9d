"""Inductor's cache folder as a package artifact: packed deterministically, unpacked to serve.

What a compiled forward needs at start is in Inductor's cache folder after it compiled: the
FX graph entries (the generated wrapper code and its guards), AOTAutograd's entries that lead
to them, and the built kernels (`.so`; on CUDA the Triton cache). torch's Mega-Cache
(`torch.compiler.save_cache_artifacts`) carries the entries but not the kernels, which the
first call then builds again (19 s here), so flare ships the folder's files themselves, and
beside them, in `precompiled/`, the forward's graphs as Dynamo's ahead-of-time compile saved
them (serve/precompiled.py; made stable there).

The same compile gives the same archive bytes: members sorted by name, with fixed times,
modes and owners and no absolute path. Three things in Inductor's pickled entries are not
stable from one compile to the next and are normalized when packed: the compile time
(`_time_taken_ns`, `forward_time_taken_ns`), the repro script that names the cache folder
(`runnable_graph_str`), and debug lines that print a function's memory address
(`_fx_graph_cache_debug_lines`). None is read when a graph is loaded. Kernels are byte-stable
once their source paths are relative (serve/compiled.py's compiler hook). Everything else in
the folder (sources, locks, Python wrappers Inductor writes again on load) stays out, except
Inductor's autotuning results (`.best_config`, which config of a Triton kernel its benchmark
chose), without their timing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from flare.errors import IntegrityError

KERNEL_SUFFIXES = (".so",)
AUTOTUNED = ".best_config"
"""Inductor's autotuning result for one Triton kernel (the config its benchmark chose), kept
beside the kernel's source: without it a loaded kernel with several configs is compiled and
benchmarked again in every config at its first launch."""
GRAPHS = "fxgraph"
AUTOGRAD = "aotautograd"
TRITON = "triton"
PRECOMPILED = "precompiled"
"""The forward's graphs as Dynamo's ahead-of-time compile saved them (serve/precompiled.py)."""
GROUP = "__grp__"
"""Triton's group files (`__grp__<kernel>.json`) list the files of one compiled kernel by
absolute path, and Triton takes the kernel from its cache only if each exists. Packed, the
paths are made relative to the cache folder (else every kernel Triton compiled at build is
missed at a server's start and built again, and the archive's bytes name the build's folder);
unpacked, they are made absolute under the folder they are unpacked to."""


def pack(cache: Path, archive: Path) -> list[str]:
    """Write the cache folder's entries and kernels to `archive`; return the member names."""
    members = sorted(_members(cache))
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(KERNEL_SUFFIXES) else 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    return [name for name, _ in members]


def unpack(archive: bytes, folder: Path) -> bool:
    """Unpack the `archive` bytes (checked as the package was loaded) into `folder` unless it is
    already there (True when it was).

    Unpacked beside the folder, then renamed into place: a folder that exists is complete,
    and servers starting at once race harmlessly."""
    if folder.is_dir():
        return True
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _extract(archive, scratch, folder)
        try:
            os.rename(scratch, folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return False


def _extract(archive: bytes, folder: Path, final: Path) -> None:
    """Write the archive's regular files under `folder` (to be renamed `final`, where Triton's
    group files will point); anything else (a link, a device, a path leaving the folder) is
    refused. By hand, not `extractall(filter="data")`: Python 3.11 before 3.11.4 (Debian
    12's) has no extraction filters."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            target = (folder / member.name).resolve()
            source = tar.extractfile(member) if member.isfile() else None
            if source is None or not target.is_relative_to(folder.resolve()):
                raise IntegrityError(
                    f"compiled archive member {member.name!r} is not a plain file in the archive",
                    "the package is malformed: ask its publisher to rebuild it",
                )
            data = source.read()
            if member.name.startswith(f"{TRITON}/") and target.name.startswith(GROUP):
                children = _children(data).items()
                data = _group({file: _placed(final, path, member.name) for file, path in children})
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(0o755 if member.mode & 0o100 else 0o644)


def _placed(folder: Path, child: str, name: str) -> str:
    """`child`, a path relative to the unpacked folder, made absolute in it."""
    path = (folder / child).resolve()
    if Path(child).is_absolute() or not path.is_relative_to(folder.resolve()):
        raise IntegrityError(
            f"compiled archive member {name!r} names {child!r}, outside the archive",
            "the package is malformed: ask its publisher to rebuild it",
        )
    return str(path)


def _members(cache: Path) -> Iterator[tuple[str, bytes]]:
    """The folder's files to pack, normalized. AOTAutograd's entries are left out where the
    graphs are precompiled: nothing reads them then (each graph's own bytes hold its compiled
    code), and Dynamo's ahead-of-time compile saves them under keys that differ from one
    compile to the next."""
    precompiled = (cache / PRECOMPILED).is_dir()
    for path in cache.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        name = path.relative_to(cache).as_posix()
        top = name.split("/", 1)[0]
        if top == GRAPHS:
            yield _normalized(name, path.read_bytes(), stable_graph)
        elif top == AUTOGRAD:
            if not precompiled:
                yield _normalized(name, path.read_bytes(), _autograd_entry)
        elif top == TRITON and path.name.startswith(GROUP):
            group = _relative_group(cache, path)
            if group is not None:  # else left out: that kernel is built again at start
                yield name, group
        elif top in (TRITON, PRECOMPILED) or (name.endswith(KERNEL_SUFFIXES) and "/" in name):
            yield name, path.read_bytes()
        elif name.endswith(AUTOTUNED):
            yield name, _autotuned(path.read_bytes())


def _children(data: bytes) -> dict[str, str]:
    """A Triton group file's children: file name → path."""
    try:
        children = json.loads(data)["child_paths"]
        if not all(isinstance(v, str) for v in children.values()):
            raise TypeError("a child's path is not a string")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(
            f"Triton cache group file is not what flare expects ({exc})",
            "the package is malformed: ask its publisher to rebuild it",
        ) from exc
    return children


def _group(children: dict[str, Any]) -> bytes:
    """A Triton group file's bytes, children sorted (the same children, the same bytes)."""
    return json.dumps({"child_paths": children}, sort_keys=True).encode()


def _relative_group(cache: Path, path: Path) -> bytes | None:
    """The group file at `path` with its children relative to the cache folder; None for one
    Triton did not write as flare expects or that names a file elsewhere (a server builds
    that kernel again at start, and its ready line names it)."""
    root = cache.resolve()
    try:
        children = _children(path.read_bytes()).items()
        return _group(
            {file: Path(at).resolve().relative_to(root).as_posix() for file, at in children}
        )
    except (IntegrityError, ValueError):
        return None


def _autotuned(data: bytes) -> bytes:
    """An autotuning result without the time its benchmark took (not read when loaded)."""
    result = json.loads(data)
    result["time_taken_ms"] = 0
    return json.dumps(result, sort_keys=True).encode()


def _normalized(name: str, data: bytes, clean: Callable[[Any], None]) -> tuple[str, bytes]:
    """A pickled cache entry without its unstable fields, named by its new content (Inductor
    reads every file of an entry's folder, whatever its name)."""
    try:
        entry = pickle.loads(data)
    except Exception as exc:  # any unpickling error: the cache is not what flare expects
        raise IntegrityError(f"Inductor cache entry {name} does not load: {exc}") from exc
    clean(entry)
    stable = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    folder = name.rsplit("/", 1)[0]
    return f"{folder}/{hashlib.sha256(stable).hexdigest()[:32]}", stable


def stable_graph(graph: Any) -> None:
    """An Inductor graph without what differs between two compiles of it (none is read when
    it loads): its compile time, a repro script naming the cache folder, debug lines with a
    function's memory address."""
    graph._time_taken_ns = 0
    graph.runnable_graph_str = ""
    graph._fx_graph_cache_debug_lines = []


def _autograd_entry(entry: Any) -> None:
    entry.forward_time_taken_ns = 0
    entry.backward_time_taken_ns = 0
    for part in (entry.compiled_fw, entry.compiled_bw):
        info = getattr(part, "fx_graph_cache_info", None)
        if info is not None:
            part.fx_graph_cache_info = (info[0], [])
