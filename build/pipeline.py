"""The build pipeline: resolve → load → shard → tune → compile → assemble → publish.

Each phase is a function of declared inputs; its outputs are recorded in the journal under
the digest of those inputs. Rerunning a build reuses every recorded output whose inputs are
unchanged and whose blobs are still stored: that is how a killed build resumes and how a
rebuild with one changed option redoes only what depends on it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flare.build.checkpoint import (
    SourceTensor,
    default_model_id,
    read_config,
    read_tensors,
    weight_files,
)
from flare.build.compile import COMPILED_PATH, compile_inputs, compiled_forward
from flare.build.journal import Journal, inputs_digest
from flare.build.kernel_cache import KernelCache
from flare.build.payloads import PayloadWriter, WrittenPayload, planned_size
from flare.build.phases import Events, PhaseLog, PhaseReport
from flare.build.plan import PAYLOAD_BYTES, PlannedPayload, fused_layout, plan_payloads
from flare.build.ranks import Leader
from flare.build.recipes import recipe_for
from flare.build.recipes.base import Recipe, check_tensors
from flare.build.runtime_inputs import check_file_names, check_runtime_inputs
from flare.build.sources import Source, resolve_source, shown_name
from flare.build.statcache import StatCache, digest_files
from flare.build.target import (
    MAX_CONCURRENCY,
    PREFILL_CHUNK,
    Preparation,
    check_runtime_options,
    preparation,
)
from flare.build.tune import TUNING_PATH, attention_shapes, tuning_inputs, tuning_records
from flare.errors import IntegrityError, InvalidInputError
from flare.faults import crash_point
from flare.model_sizes import check_sizes
from flare.registry import refs
from flare.registry.leases import Lease, add_to_lease, hold_lease, outlast_caches
from flare.registry.registry import Registry
from flare.rendezvous import Rendezvous
from flare.store import trash
from flare.store.digest import Digest
from flare.store.hashing import FileState, check_unchanged, hash_bytes
from flare.store.package import (
    FORMAT_VERSION,
    RUNTIME_ABI,
    Manifest,
    canonical_json,
    check_name,
    encode_index,
)


@dataclass(frozen=True)
class BuildRequest:
    """What the user asked for, plus where this host keeps things."""

    source: str
    name: str
    staging: Path
    hub_cache: Path
    tag: str = "latest"
    ranks: int = 1
    model_id: str | None = None
    rehash: bool = False
    payload_bytes: int = PAYLOAD_BYTES
    workers: int | None = None
    """Files hashed and payloads written at once (default: the cores for hashing,
    PAYLOAD_WORKERS for payloads); never changes a digest."""
    rendezvous: str | None = None
    """HOST:PORT where the other ranks join (`flare join`): one process per rank."""
    timeout: float = 300.0
    """Seconds a rank may stay silent (or take to join) before the build stops, naming it."""
    allow_outside_links: bool = False
    """Build from files that link out of the checkpoint folder (refused by default). It only
    permits: the package is the same bytes either way, so it is not a recorded option."""
    target: str = "none"
    """What tune and compile prepare the package for: cpu, cuda, or none (nothing: an eager
    package that serves on any host). `flare build` defaults to the build host's device."""
    max_concurrency: int = MAX_CONCURRENCY
    """The largest decode batch the package plans for (serve runs at most this many)."""
    prefill_chunk: int = PREFILL_CHUNK
    """Prompt tokens prefilled in one step at most (one longer prompt still runs alone)."""
    kernel_cache: Path | None = None
    """Where tuning records and compiled forwards are kept across builds, keyed by shapes and
    toolchain (paths.kernel_cache); None: every build tunes and compiles afresh."""
    retune: bool = False
    """Measure again rather than take the kernel cache's tuning records."""
    records: tuple[dict[str, Any], ...] | None = None
    """Tuning records to build with instead of tuning (--check takes the package's own)."""

    def __post_init__(self) -> None:
        """Refuse a request no build can carry out, as it is made: before the registry is
        opened (`flare build` would create a missing one for nothing) or any work is done."""
        check_name(self.name)
        check_name(self.tag, "tag")
        if self.model_id is not None and not 0 < len(self.model_id) <= 256:
            raise InvalidInputError("--model-id must be 1 to 256 characters", "shorten it")
        if self.rendezvous is not None and self.ranks < 2:
            raise InvalidInputError("--rendezvous needs --ranks 2 or more", "add --ranks N")
        check_runtime_options(self.target, self.max_concurrency, self.prefill_chunk)

    def options(self) -> dict[str, Any]:
        """The options that shape the package, recorded in its manifest."""
        return {
            "ranks": self.ranks,
            "payload_bytes": self.payload_bytes,
            "target": self.target,
            "max_concurrency": self.max_concurrency,
            "prefill_chunk": self.prefill_chunk,
        }

    def layout_options(self) -> dict[str, Any]:
        """The options that shape the payloads (the shard phase's)."""
        return {"ranks": self.ranks, "payload_bytes": self.payload_bytes}

    def recorded(self) -> dict[str, Any]:
        """The request as the journal keeps it (for --check), without host-only settings."""
        kept = asdict(self)
        for host_only in ("workers", "rendezvous", "timeout", "kernel_cache", "retune", "records"):
            kept.pop(host_only)
        return {k: str(v) if isinstance(v, Path) else v for k, v in kept.items()}


@dataclass
class BuildResult:
    name: str
    tag: str
    digest: Digest
    manifest: Manifest
    phases: list[PhaseReport] = field(default_factory=list)


@dataclass(frozen=True)
class PhaseOutput:
    """What a phase's action made: its outputs (journaled), the bytes it wrote, the blobs the
    outputs need stored, and its status: done, or reused/resumed when it took all or some of
    its work from a cache or an earlier run."""

    outputs: dict[str, Any]
    nbytes: int = 0
    blobs: list[str] = field(default_factory=list)
    status: str = "done"

    def record(self) -> dict[str, Any]:
        """What the journal keeps: all a rerun needs to reuse the phase (not its status)."""
        return {"outputs": self.outputs, "bytes": self.nbytes, "blobs": self.blobs}


Signer = Callable[[Registry, Digest, Manifest], None]


class Build:
    """One run of the pipeline for one request, writing into one store.

    The source is resolved as the build is made (a missing checkpoint is refused before
    anything else), so every phase has it."""

    def __init__(
        self,
        request: BuildRequest,
        registry: Registry,
        events: Events,
        reuse: bool = True,
        sign: Signer | None = None,
    ) -> None:
        self.request = request
        self.registry = registry
        self.store = registry.store
        self.events = events
        self.reuse = reuse
        self.sign = sign
        self.journal = Journal(request.staging)
        self.phases = PhaseLog(events)
        self.source: Source = resolve_source(
            request.source, request.hub_cache, request.allow_outside_links
        )
        self.lease: Lease | None = None
        self.leader: Leader | None = None

    def run(self) -> BuildResult:
        """Check the request, then every phase under a lease that keeps gc off its blobs."""
        started = time.perf_counter()
        request = self.request
        config = read_config(self.source)
        recipe, _architecture = recipe_for(config)
        check_file_names(self.source, recipe)
        _check_config(self.source, config, recipe)  # refused before any work is done
        check_runtime_inputs(self.source, config, recipe)
        self._note_unnamed()
        recipe.check_ranks(config, request.ranks)
        with hold_lease(self.store, "build", protect_new=True) as self.lease, self._ranks():
            if self.leader is not None:  # resolve's time starts once every rank has joined
                started = time.perf_counter()
            result = self._run(started, recipe, config)
            outlast_caches(self.registry.cache_window_s)
            crash_point("publish:check")
            self._check_published(result.manifest, result.digest)
            if self.leader is not None:
                self.leader.finish(str(result.digest))
            return result

    def _note_unnamed(self) -> None:
        """Say which files are left out for names a package cannot hold (none the build
        needs)."""
        if self.source.unnamed:
            names = ", ".join(shown_name(n) for n in self.source.unnamed[:3])
            more = f" and {len(self.source.unnamed) - 3} more" if self.source.unnamed[3:] else ""
            self.events.note(
                f"left out files whose names a package cannot hold (not UTF-8, or with a "
                f"backslash): {names}{more}"
            )

    @contextmanager
    def _ranks(self) -> Iterator[None]:
        """With --rendezvous: wait for every rank to join; stop them all if this build fails."""
        if self.request.rendezvous is None:
            yield
            return
        started = time.perf_counter()
        self.events.phase_started("rendezvous", 0)
        rendezvous = Rendezvous.host(
            self.request.rendezvous, self.request.ranks, self.request.timeout
        )
        self.phases.finish("rendezvous", started, 0)
        self.leader = Leader(rendezvous, self.store)
        try:
            yield
        except BaseException as exc:
            self.leader.fail(str(exc) or type(exc).__name__)
            raise
        finally:
            rendezvous.close()

    def _check_published(self, manifest: Manifest, index: Digest) -> None:
        """The index and every blob the package names are stored, asked of the server, not of
        a network client's cache; one that a gc moved to its trash after this build found it
        stored is put back (store/trash.py). One gone for good (a build stopped for longer
        than the trash keeps it) fails the build, exit 6: running it again restores it."""
        missing = trash.missing(self.store, [*manifest.blobs(), index])
        if missing:
            raise IntegrityError(
                f"blob {missing[0]} of the new package is gone from {self.store.location}",
                "a concurrent gc removed it; run the same build again to restore it",
            )

    def _run(self, started: float, recipe: Recipe, config: dict[str, Any]) -> BuildResult:
        """Every phase in order, under a lock on the build's inputs."""
        source = self.source
        files, states = self._resolve(started)
        build_key = self._inputs_digest(files, recipe)
        record = {"source": str(source.root), "request": self.request.recorded()}
        self.journal.put("builds", build_key, record)
        with self.journal.lock(build_key) as waited:
            if waited:
                self.events.note("waited for another build of the same inputs; reusing its work")
            tensors = self._load(files, recipe, config)
            plan = self._shard(tensors, recipe, config, files)
            if self.leader is not None:
                self.leader.share(
                    self.request.source, self.request.allow_outside_links, plan, files
                )
            prepared = self._preparation(recipe)
            tuning = self._tune(recipe, config, prepared)
            compiled = self._compile(recipe, config, prepared, tuning["records"])
            assembled = self._assemble(plan, files, states, recipe, compiled)
            assembled["artifacts"] = [
                *assembled["artifacts"],
                *tuning["artifacts"],
                *compiled["artifacts"],
            ]
            recipe_entry = _recipe_entry(recipe, config, plan)
            manifest = self._manifest(
                source, files, recipe_entry, config, assembled, build_key, prepared
            )
            digest = self._publish(manifest)
        return BuildResult(
            self.request.name, self.request.tag, digest, manifest, self.phases.reports
        )

    def _preparation(self, recipe: Recipe) -> Preparation:
        """What tune and compile prepare, with the toolchain the build host has for it."""
        request = self.request
        prepared = preparation(
            request.target,
            recipe.compiled_forward,
            request.ranks,
            request.max_concurrency,
            request.prefill_chunk,
        )
        if request.target != "none" and not prepared.prepares:
            self.events.note(
                f"nothing to prepare for --target {request.target}: the package serves eagerly "
                f"({'an embedding model' if not recipe.compiled_forward else 'several ranks'})"
            )
        return prepared

    # -- phases ----------------------------------------------------------------------------

    def _resolve(self, started: float) -> tuple[dict[str, dict[str, Any]], dict[str, FileState]]:
        """Digest every source file (from stat records where they are still true): each
        file's digest and size, and the state it was hashed in (later reads check it)."""
        request, source = self.request, self.source
        paths = [source.root / f for f in source.files]
        total = sum(p.stat().st_size for p in paths)
        self.events.phase_started("resolve", total)
        cache = StatCache(request.staging / "stat")
        crash_point("resolve:hash")
        digests = digest_files(paths, cache, request.rehash, request.workers, self.events.advance)
        files = {
            name: {"digest": str(d), "size": state.size}
            for name, (d, state) in zip(source.files, digests, strict=True)
        }
        states = {name: state for name, (_, state) in zip(source.files, digests, strict=True)}
        for name, state in states.items():
            source.identity(name, state)
        self.phases.finish("resolve", started, total, "done" if cache.hashed else "reused")
        return files, states

    def _load(self, files: dict, recipe: Recipe, config: dict) -> dict[str, SourceTensor]:
        source = self.source
        weights = {n: files[n]["digest"] for n in weight_files(source)}
        inputs = {
            "weights": weights,
            "config": files["config.json"]["digest"],
            "recipe": _recipe_id(recipe),
            "ranks": self.request.ranks,
        }

        def load() -> PhaseOutput:
            tensors = read_tensors(source)
            check_tensors(recipe, recipe.expected(config, self.request.ranks), tensors)
            return PhaseOutput({"tensors": [asdict(t) for t in tensors.values()]})

        outputs = self._phase("load", inputs, 0, load)
        return {
            t["name"]: SourceTensor(**{**t, "shape": tuple(t["shape"])}) for t in outputs["tensors"]
        }

    def _shard(
        self, tensors: dict[str, SourceTensor], recipe: Recipe, config: dict, files: dict
    ) -> list[PlannedPayload]:
        request = self.request
        inputs = {
            "tensors": _digest_of([asdict(t) for t in tensors.values()]),
            "files": {n: f["digest"] for n, f in files.items()},
            "recipe": _recipe_id(recipe),
            "options": request.layout_options(),
        }

        def shard() -> PhaseOutput:
            expected = recipe.expected(config, request.ranks)
            file_digests = {n: f["digest"] for n, f in files.items()}
            fused = recipe.fused(tensors)
            plan = plan_payloads(
                expected, tensors, file_digests, request.ranks, request.payload_bytes, fused
            )
            return PhaseOutput({"payloads": [p.describe() for p in plan]})

        outputs = self._phase("shard", inputs, 0, shard)
        return [PlannedPayload.from_description(p) for p in outputs["payloads"]]

    def _tune(self, recipe: Recipe, config: dict, prepared: Preparation) -> dict[str, Any]:
        """The tuning records (given, from the kernel cache, or decided now), stored as the
        package's `tuning` artifact; nothing when nothing is prepared."""
        request = self.request
        shapes = attention_shapes(recipe.name, config) if prepared.prepares else {}
        inputs = {**tuning_inputs(prepared, shapes), "given": request.records}

        def tune() -> PhaseOutput:
            if not prepared.prepares:
                return PhaseOutput({"records": [], "artifacts": []})
            if request.records is not None:
                records, from_cache = list(request.records), True
            else:
                scratch = request.staging / "prepare"
                cache = KernelCache(request.kernel_cache)
                records, from_cache = tuning_records(inputs, cache, scratch, request.retune)
            entry = self._prepared_blob(
                "tuning", TUNING_PATH, canonical_json(records).encode(), prepared, shapes
            )
            outputs = {"records": records, "artifacts": [entry]}
            status = "reused" if from_cache else "done"
            return PhaseOutput(outputs, entry["size"], [entry["digest"]], status)

        return self._phase("tune", inputs, 0, tune, reuse=not request.retune)

    def _compile(
        self, recipe: Recipe, config: dict, prepared: Preparation, records: list[dict]
    ) -> dict[str, Any]:
        """The compiled forward (from the kernel cache or compiled now), stored as the
        package's `compiled` artifact; nothing when nothing is prepared."""
        request = self.request
        recipe_id = _recipe_id(recipe)
        inputs = compile_inputs(recipe_id, config, prepared, records) if prepared.prepares else {}

        def compile_() -> PhaseOutput:
            if not prepared.prepares:
                return PhaseOutput({"artifacts": []})
            scratch = request.staging / "prepare"
            try:
                archive, made, from_cache = compiled_forward(
                    inputs, KernelCache(request.kernel_cache), scratch
                )
                if made.get("not_ahead"):
                    self.events.note(
                        "compile: the forward's graphs were traced, not compiled ahead of time "
                        f"({made['not_ahead']}); servers of this package trace them at start"
                    )
                path = COMPILED_PATH.format(target=prepared.target)
                entry = self._prepared_file("compiled", path, archive, prepared, made["shapes"])
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            status = "reused" if from_cache else "done"
            return PhaseOutput({"artifacts": [entry]}, entry["size"], [entry["digest"]], status)

        return self._phase("compile", inputs, 0, compile_)

    def _prepared_blob(
        self, kind: str, path: str, data: bytes, prepared: Preparation, shapes: dict
    ) -> dict[str, Any]:
        result = self.store.put_bytes(data)
        self._keep(result.digest)
        return _prepared_entry(kind, path, str(result.digest), len(data), prepared, shapes)

    def _prepared_file(
        self, kind: str, path: str, source: Path, prepared: Preparation, shapes: dict
    ) -> dict[str, Any]:
        result = self.store.put_file(source, link=False)
        self._keep(result.digest)
        return _prepared_entry(kind, path, str(result.digest), result.size, prepared, shapes)

    def _assemble(
        self,
        plan: list[PlannedPayload],
        files: dict,
        states: dict[str, FileState],
        recipe: Recipe,
        compiled: dict,
    ) -> dict[str, Any]:
        """Write every payload (reusing recorded ones) and store the runtime's other files."""
        artifacts = {n: f for n, f in files.items() if recipe.artifact_kind(n)}
        inputs = {
            "plan": _digest_of([p.describe() for p in plan]),
            "artifacts": {n: f["digest"] for n, f in artifacts.items()},
            "compiled": compiled,
        }
        sizes = [planned_size(p) for p in plan]

        def assemble() -> PhaseOutput:
            written = self._write_payloads(plan, sizes, states)
            entries = [w.entry for w in written]
            stored = [self._artifact(n, f, states, recipe) for n, f in sorted(artifacts.items())]
            blobs = [e["digest"] for e in entries] + [a["digest"] for a in stored]
            reused = sum(w.reused for w in written)
            status = "resumed" if 0 < reused < len(written) else "done"
            outputs = {"payloads": entries, "artifacts": stored}
            return PhaseOutput(outputs, sum(sizes), blobs, status)

        return self._phase("assemble", inputs, sum(sizes), assemble)

    def _write_payloads(
        self, plan: list[PlannedPayload], sizes: list[int], states: dict[str, FileState]
    ) -> list[WrittenPayload]:
        """Every payload, built here or, with peers, by the rank owning it."""
        writer = PayloadWriter(
            self.store,
            self.journal,
            self.source.root,
            states,
            self.events.advance,
            self._keep,
            self.request.workers,
            self.reuse,
        )
        if self.leader is not None:
            return self.leader.write_payloads(writer, plan, sizes)
        return writer.write_all(plan, sizes)

    def _keep(self, digest: Digest) -> None:
        """Name a blob this build uses in its lease, so a concurrent gc keeps it."""
        if self.lease is not None:
            add_to_lease(self.store, self.lease, digest)

    def _artifact(
        self, name: str, recorded: dict, states: dict[str, FileState], recipe: Recipe
    ) -> dict[str, Any]:
        """Copy (never link: the source stays the user's) a runtime file, stored only if its
        bytes are those resolve hashed: a file changed or swapped since is not stored."""
        path = self.source.root / name
        check_unchanged(path, states[name], FileState.of(path.stat()))
        try:
            result = self.store.put_file(path, link=False, expect=Digest.parse(recorded["digest"]))
        except IntegrityError as exc:
            raise IntegrityError(
                f"{path} changed since it was hashed ({exc.what}); nothing was stored",
                "run the build again once nothing moves or writes the checkpoint",
            ) from exc
        self._keep(result.digest)
        return {
            "kind": recipe.artifact_kind(name),
            "path": name,
            "digest": recorded["digest"],
            "size": result.size,
        }

    def _manifest(
        self,
        source: Source,
        files: dict,
        recipe: dict[str, Any],
        config: dict,
        assembled: dict,
        build_key: Digest,
        prepared: Preparation,
    ) -> Manifest:
        return Manifest.model_validate_json(
            canonical_json(
                {
                    "format": FORMAT_VERSION,
                    "name": self.request.name,
                    "model": {
                        "id": self.request.model_id
                        or default_model_id(source, config, self.request.name),
                        "revision": source.revision,
                        "files": [{"path": n, **f} for n, f in sorted(files.items())],
                    },
                    "recipe": recipe,
                    "options": self.request.options(),
                    "ranks": self.request.ranks,
                    "toolchain": {"runtime_abi": RUNTIME_ABI, **prepared.toolchain},
                    "payloads": assembled["payloads"],
                    "artifacts": assembled["artifacts"],
                    "inputs": str(build_key),
                }
            )
        )

    def _publish(self, manifest: Manifest) -> Digest:
        """Store the index, point NAME:TAG at it, let the signer sign it."""
        started = time.perf_counter()
        index = encode_index(manifest)
        self.events.phase_started("publish", len(index))
        result = self.store.put_bytes(index)
        crash_point("publish:index")
        name, tag = self.request.name, self.request.tag
        old = self.registry.publish(name, tag, result.digest, manifest)
        if old is not None:  # a rebuild moves its tag: say what keeps the package it left
            store = self.registry.store
            self.events.note(refs.tag_move(store, name, tag, old, result.digest).notice())
        crash_point("publish:ref")
        if self.sign is not None:
            self.sign(self.registry, result.digest, manifest)
        status = "reused" if result.method == "existing" else "done"
        self.phases.finish("publish", started, len(index), status)
        return result.digest

    # -- bookkeeping -----------------------------------------------------------------------

    def _phase(
        self,
        name: str,
        inputs: Any,
        total: int,
        action: Callable[[], PhaseOutput],
        reuse: bool = True,
    ) -> dict[str, Any]:
        """Run a phase, or take its outputs from the journal when its inputs are recorded
        (unless this build reuses nothing, or this phase must run again: --retune)."""
        started = time.perf_counter()
        self.events.phase_started(name, total)
        key = inputs_digest(name, inputs)
        record = self.journal.get(name, key) if self.reuse and reuse else None
        for blob in record["blobs"] if record else []:
            self._keep(Digest.parse(blob))
        if record is not None and all(self.store.has(Digest.parse(d)) for d in record["blobs"]):
            self.events.advance(total)
            self.phases.finish(name, started, record["bytes"], "reused")
            return record["outputs"]
        made = action()
        self.journal.put(name, key, made.record())
        self.phases.finish(name, started, made.nbytes, made.status)
        return made.outputs

    def _build_inputs(self, files: dict, recipe: Recipe) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "recipe": _recipe_id(recipe),
            "options": self.request.options(),
            "files": {n: f["digest"] for n, f in sorted(files.items())},
        }

    def _inputs_digest(self, files: dict, recipe: Recipe) -> Digest:
        return hash_bytes(canonical_json(self._build_inputs(files, recipe)).encode())


def _check_config(source: Source, config: dict[str, Any], recipe: Recipe) -> None:
    """config.json's sizes against the weights' safetensors headers, before anything is
    sized by them and before resolve hashes the files: a lying config fails in milliseconds."""
    check_sizes(recipe.name, config, read_tensors(source), str(source.root / "config.json"))


def _prepared_entry(
    kind: str, path: str, digest: str, size: int, prepared: Preparation, shapes: dict
) -> dict[str, Any]:
    """A tune or compile artifact's manifest entry: what it is, for which target and shapes."""
    return {
        "kind": kind,
        "path": path,
        "digest": digest,
        "size": size,
        "target": prepared.target,
        "shapes": shapes,
    }


def _recipe_entry(
    recipe: Recipe, config: dict[str, Any], plan: list[PlannedPayload]
) -> dict[str, Any]:
    """The manifest's `recipe`: which, for which architecture, and the fused tensors' parts
    (left out when nothing is fused, as in every package of a recipe that fuses nothing)."""
    entry = {**_recipe_id(recipe), "architecture": config["architectures"][0]}
    layout = fused_layout(plan)
    return entry | {"fused": layout} if layout else entry


def _recipe_id(recipe: Recipe) -> dict[str, Any]:
    return {"name": recipe.name, "version": recipe.version}


def _digest_of(value: Any) -> str:
    return str(hash_bytes(canonical_json(value).encode()))
