"""Sources: a local checkpoint folder, or ORG/NAME[@REVISION] found offline in the hub cache.

A source is its folder's content and nothing else: a link that leads out of it is refused
before any byte is read (it would publish whatever it points at, a key or /proc/self/environ,
into a store others read), unless the user says they mean it. A hub-cache snapshot's links
into its own repo folder (`snapshots/REV/file -> ../../blobs/HASH`) are inside it.

What is checked when the folder is listed must be what the build reads: each file's identity
(device and inode) is taken then, and every later read of the file checks that it opened that
file (`Source.identity`). Else a folder renamed or swapped under the build (a twin whose file is
a link out of it) would have the build read, store and sign a file the listing never saw.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flare.errors import IntegrityError, InvalidInputError, NotFoundError
from flare.store.hashing import FileState

_HUB_ID = re.compile(r"^(?P<org>[\w.-]+)/(?P<name>[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
MAX_HOPS = 40
"""Links followed in one chain at most, as the kernel does (a loop is a broken link)."""


@dataclass(frozen=True)
class Source:
    """A checkpoint on this host: where it is, what it is called, which revision it is."""

    root: Path
    hub_id: str | None
    """ORG/NAME for a hub-cache snapshot; None for any other folder."""
    revision: str | None
    files: tuple[str, ...]
    """Every regular file under root (file links followed, linked folders not entered,
    dot-files skipped), relative, sorted."""
    unnamed: tuple[str, ...] = ()
    """Files left out of `files` because a package cannot name them (`name_problem`; held
    here as `os.fsdecode` gives them, with surrogate escapes). The build refuses a
    checkpoint that needs one."""
    identities: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Each file's device and inode when the folder was listed (and its links checked)."""

    def identity(self, name: str, state: FileState) -> None:
        """Refuse a read of `name` that opened another file than the one listed (`state`:
        the opened file's, from fstat): the folder or a link in it changed under the build."""
        if (state.dev, state.ino) != self.identities[name]:
            raise IntegrityError(
                f"{self.root / name} is no longer the file listed when the build began: the "
                "checkpoint folder, or a link in it, changed while the build read it",
                "run the build again once nothing moves or writes the checkpoint",
            )


def resolve_source(spec: str, hub_cache: Path, allow_outside_links: bool = False) -> Source:
    """Find the checkpoint a user named: a folder first, else a hub id in the cache."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return _folder_source(folder.absolute(), allow_outside_links)
    match = _HUB_ID.match(spec)
    if match and not folder.exists():
        repo = _hub_repo(match["org"], match["name"], hub_cache)
        return _snapshot(repo, _commit_for(repo, match["rev"] or "main"), allow_outside_links)
    if folder.exists():
        raise InvalidInputError(f"{spec} is not a folder", "pass a checkpoint folder")
    raise NotFoundError(
        f"no checkpoint folder {spec}", "pass a folder with config.json, or ORG/NAME[@REVISION]"
    )


def _folder_source(root: Path, allow_outside_links: bool) -> Source:
    """A local folder; inside a hub cache snapshot, the id and revision come from its path."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return _snapshot(root.parent.parent, root.name, allow_outside_links)
    return _make(root, root, None, None, allow_outside_links)


def _hub_repo(org: str, name: str, hub_cache: Path) -> Path:
    repo = hub_cache / f"models--{org}--{name}"
    if not repo.is_dir():
        raise NotFoundError(
            f"{org}/{name} is not in the hub cache {hub_cache}",
            f"download it first (`hf download {org}/{name}`) or set paths.hub_cache",
        )
    return repo


def _snapshot(repo: Path, commit: str, allow_outside_links: bool) -> Source:
    """The snapshot of one commit: its links may lead anywhere in the repo folder."""
    root = repo / "snapshots" / commit
    hub_id = repo.name.removeprefix("models--").replace("--", "/")
    if not root.is_dir():
        raise NotFoundError(
            f"{hub_id}@{commit} has no snapshot in {repo}", "download that revision first"
        )
    return _make(root, repo, hub_id, commit, allow_outside_links)


def _commit_for(repo: Path, revision: str) -> str:
    """A commit hash as given, or the commit a branch or tag ref points at."""
    if _COMMIT.match(revision):
        return revision
    ref = repo / "refs" / revision
    if not ref.is_file():
        known = sorted(p.name for p in (repo / "refs").glob("*"))
        raise NotFoundError(
            f"revision {revision!r} of {repo.name} is not in the hub cache",
            f"known refs: {', '.join(known) or 'none'}; or give a 40-hex commit",
        )
    return ref.read_text().strip()


def _make(
    root: Path, container: Path, hub_id: str | None, revision: str | None, allow_outside: bool
) -> Source:
    if not (root / "config.json").is_file():
        raise NotFoundError(f"{root} has no config.json", "pass a Hugging Face checkpoint folder")
    inside = None if allow_outside else container.resolve()
    identities: dict[str, tuple[int, int]] = {}
    unnamed = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        found = _file_identity(path, inside)
        if found is None:
            continue
        if name_problem(rel.as_posix()) is None:
            identities[rel.as_posix()] = found
        else:
            unnamed.append(rel.as_posix())
    files = tuple(sorted(identities))
    return Source(root, hub_id, revision, files, tuple(sorted(unnamed)), identities)


def _file_identity(path: Path, inside: Path | None) -> tuple[int, int] | None:
    """The device and inode of the regular file at `path` (a link's, once its chain is
    checked to stay within `inside`), None for anything else. A file is listed by one
    lstat, so what is not a link when looked at cannot be read as one. Linked folders are
    not entered (a file is listed once, where it really is)."""
    try:
        seen = os.lstat(path)
        if stat.S_ISLNK(seen.st_mode):
            _check_link(path, inside)
            seen = os.stat(path)
    except FileNotFoundError:  # gone since the folder was read
        return None
    if not stat.S_ISREG(seen.st_mode):
        return None
    return seen.st_dev, seen.st_ino


def name_problem(name: str) -> str | None:
    """Why a package cannot name a file, or None. Its manifest names files in UTF-8 JSON
    (a name `os.fsdecode` gave a lone surrogate for a byte that is not UTF-8 cannot be
    written), with `/` alone between folders (a backslash is one on other systems)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not UTF-8"
    return "holds a backslash" if "\\" in name else None


def shown_name(name: str | Path) -> str:
    """A path for a one-line message, its non-UTF-8 bytes written as \\xNN escapes (printing
    the lone surrogates `os.fsdecode` gives them would fail)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _check_link(link: Path, inside: Path | None) -> None:
    """The end of the link's chain must exist; and, followed hop by hop, each hop must land
    within `inside` (a chain that leaves and comes back is refused too: what is outside can
    change under the build)."""
    if not link.exists():
        raise NotFoundError(
            f"{link} is a broken link to {os.readlink(link)}",
            "the download is incomplete; fetch the checkpoint again",
        )
    hop = link
    for _ in range(MAX_HOPS):
        if inside is None or not hop.is_symlink():
            return
        hop = _landing(hop)
        if not hop.is_relative_to(inside):
            raise InvalidInputError(
                f"{link} links to {hop}, outside the checkpoint {inside}",
                "copy the file into the checkpoint, or pass --allow-outside-links to publish it",
            )


def _landing(link: Path) -> Path:
    """Where one hop of a link lands: its target, with the folders on the way resolved."""
    target = link.parent / os.readlink(link)
    if target.name in ("", "..") or target == target.parent:
        return Path(os.path.realpath(target))
    return Path(os.path.realpath(target.parent)) / target.name
