"""`flare build --check REF`: rebuild a package from its recorded inputs and compare.

The rebuild runs every phase afresh (no journal or kernel-cache reuse, every source file hashed
again, the forward compiled again) into a scratch store, so the registry is not touched; like
`nix build --check`, it says the package is reproducible or lists what differs. The package's
tuning records are taken as inputs, as a lock file is.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flare.build.journal import Journal
from flare.build.phases import Events
from flare.build.pipeline import Build, BuildRequest
from flare.build.target import MAX_CONCURRENCY, PREFILL_CHUNK
from flare.errors import NotFoundError
from flare.registry.registry import Registry
from flare.store.digest import Digest
from flare.store.package import Manifest


@dataclass
class CheckResult:
    """The package checked, the digest its inputs rebuild to, and what differs."""

    digest: Digest
    rebuilt: Digest
    source_files: list[str] = field(default_factory=list)
    """Source files whose digests differ from the recorded ones."""
    payloads: list[dict[str, object]] = field(default_factory=list)
    """Payloads of the package that the rebuild did not produce."""
    artifacts: list[dict[str, object]] = field(default_factory=list)
    """Artifacts of the package (tuning records, compiled forwards, ...) the rebuild did not
    produce byte for byte."""

    @property
    def identical(self) -> bool:
        return self.digest == self.rebuilt


def check_build(
    registry: Registry,
    ref: str,
    staging: Path,
    hub_cache: Path,
    events: Events,
    source: str | None = None,
    allow_outside_links: bool = False,
) -> CheckResult:
    """Rebuild REF from its recorded inputs in a scratch area and compare the results.
    Links out of the source are refused as in a build, unless `allow_outside_links`."""
    _, digest, manifest = registry.manifest(ref)
    source = source or _recorded_source(staging, manifest, ref)
    scratch = Path(tempfile.mkdtemp(prefix="check-", dir=_ensure(staging)))
    try:
        request = BuildRequest(
            source=source,
            name=manifest.name,
            staging=scratch / "staging",
            hub_cache=hub_cache,
            ranks=manifest.ranks,
            model_id=manifest.model.id,
            rehash=True,
            payload_bytes=int(manifest.options["payload_bytes"]),
            allow_outside_links=allow_outside_links,
            target=manifest.options.get("target", "none"),
            max_concurrency=int(manifest.options.get("max_concurrency", MAX_CONCURRENCY)),
            prefill_chunk=int(manifest.options.get("prefill_chunk", PREFILL_CHUNK)),
            records=_tuning_records(registry, manifest),
        )
        scratch_registry = Registry(str(scratch / "store"), f"sqlite:///{scratch / 'index.db'}")
        rebuilt = Build(request, scratch_registry, events, reuse=False).run()
        scratch_registry.db.dispose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _compare(digest, manifest, rebuilt.digest, rebuilt.manifest)


def _tuning_records(registry: Registry, manifest: Manifest) -> tuple[dict, ...] | None:
    """The package's tuning records: the rebuild takes them as inputs (a lock file) rather
    than measuring again, so timing cannot make it differ."""
    for artifact in manifest.artifacts:
        if artifact.kind == "tuning":
            return tuple(json.loads(registry.store.read_bytes(Digest.parse(artifact.digest))))
    return None


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _recorded_source(staging: Path, manifest: Manifest, ref: str) -> str:
    record = Journal(staging).get("builds", Digest.parse(manifest.inputs))
    if record is None:
        raise NotFoundError(
            f"{ref} was not built on this host, so its source is not recorded here",
            f"pass the checkpoint: flare build SOURCE --check {ref}",
        )
    return str(record["source"])


def _compare(digest: Digest, old: Manifest, rebuilt: Digest, new: Manifest) -> CheckResult:
    result = CheckResult(digest, rebuilt)
    new_files = {f.path: f.digest for f in new.model.files}
    result.source_files = sorted(
        f.path for f in old.model.files if new_files.get(f.path) != f.digest
    ) + sorted(set(new_files) - {f.path for f in old.model.files})
    produced = {p.digest for p in new.payloads}
    result.payloads = [
        {"digest": p.digest, "ranks": list(p.ranks), "first_tensor": p.tensors[0].name}
        for p in old.payloads
        if p.digest not in produced
    ]
    made = {a.digest for a in new.artifacts}
    result.artifacts = [
        {"path": a.path, "kind": a.kind, "digest": a.digest}
        for a in old.artifacts
        if a.digest not in made
    ]
    return result
