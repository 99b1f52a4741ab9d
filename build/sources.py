"""Sources: a local checkpoint folder, or ORG/NAME[@REVISION] found offline in the hub cache.

A source is its folder's content and nothing else: a link that leads out of it is refused
before any byte is read (it would publish whatever it points at, a key or /proc/self/environ,
into a store others read), unless the user says they mean it. A hub-cache snapshot's links
into its own repo folder (`snapshots/REV/file -> ../../blobs/HASH`) are inside it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from flare.errors import InvalidInputError, NotFoundError

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
    """Files left out of `files` because their names are not UTF-8 (held here as
    `os.fsdecode` gives them, with surrogate escapes): a package names its files in UTF-8
    JSON, so one of them cannot ship. The build refuses a checkpoint that needs one."""


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
    files, unnamed = _list_files(root, inside)
    return Source(root, hub_id, revision, files, unnamed)


def _list_files(root: Path, inside: Path | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Every regular file under root, and apart those whose names are not UTF-8; each link
    must stay within `inside` (when given). Linked folders are not entered (a file is listed
    once, where it really is)."""
    found, unnamed = [], []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_symlink():
            _check_link(path, inside)
        if not path.is_file():
            continue
        (found if is_utf8_name(rel.as_posix()) else unnamed).append(rel.as_posix())
    return tuple(sorted(found)), tuple(sorted(unnamed))


def is_utf8_name(name: str) -> bool:
    """Whether a file name, as `os.fsdecode` gives it, was UTF-8 on disk (a byte that is not
    is decoded to a lone surrogate, which no UTF-8 text, hence no manifest, can hold)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
