"""Sources: a local checkpoint folder, or ORG/NAME[@REVISION] found offline in the hub cache."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from flare.store.errors import InvalidInputError, NotFoundError

_HUB_ID = re.compile(r"^(?P<org>[\w.-]+)/(?P<name>[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Source:
    """A checkpoint on this host: where it is, what it is called, which revision it is."""

    root: Path
    model_id: str
    revision: str | None
    files: tuple[str, ...]
    """Every regular file under root (links followed, dot-files skipped), relative, sorted."""


def resolve_source(spec: str, hub_cache: Path, model_id: str | None = None) -> Source:
    """Find the checkpoint a user named: a folder first, else a hub id in the cache."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return _folder_source(folder.absolute(), model_id)
    match = _HUB_ID.match(spec)
    if match and not folder.exists():
        return _hub_source(match["org"], match["name"], match["rev"], hub_cache, model_id)
    if folder.exists():
        raise InvalidInputError(f"{spec} is not a folder", "pass a checkpoint folder")
    raise NotFoundError(
        f"no checkpoint folder {spec}", "pass a folder with config.json, or ORG/NAME[@REVISION]"
    )


def _folder_source(root: Path, model_id: str | None) -> Source:
    """A local folder; inside a hub cache snapshot, the id and revision come from its path."""
    snapshot = root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--")
    if snapshot:
        cached_id = root.parent.parent.name.removeprefix("models--").replace("--", "/")
        return _make(root, model_id or cached_id, root.name)
    return _make(root, model_id or root.name, None)


def _hub_source(
    org: str, name: str, revision: str | None, hub_cache: Path, model_id: str | None
) -> Source:
    repo = hub_cache / f"models--{org}--{name}"
    if not repo.is_dir():
        raise NotFoundError(
            f"{org}/{name} is not in the hub cache {hub_cache}",
            f"download it first (`hf download {org}/{name}`) or set paths.hub_cache",
        )
    commit = _commit_for(repo, revision or "main")
    root = repo / "snapshots" / commit
    if not root.is_dir():
        raise NotFoundError(
            f"{org}/{name}@{commit} has no snapshot in {repo}", "download that revision first"
        )
    return _make(root, model_id or f"{org}/{name}", commit)


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


def _make(root: Path, model_id: str, revision: str | None) -> Source:
    if not (root / "config.json").is_file():
        raise NotFoundError(f"{root} has no config.json", "pass a Hugging Face checkpoint folder")
    return Source(root=root, model_id=model_id, revision=revision, files=_list_files(root))


def _list_files(root: Path) -> tuple[str, ...]:
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_symlink() and not path.exists():
            raise NotFoundError(
                f"{path} is a broken link to {os.readlink(path)}",
                "the download is incomplete; fetch the checkpoint again",
            )
        if not path.is_file():
            continue
        found.append(rel.as_posix())
    return tuple(sorted(found))
