"""Pull: bring a package from a registry into this host's cache, admission first.

Only the small things move before the decision: the index (verified against its digest) and
its signatures. The signature is checked against the trust policy, the manifest against this
host's toolchain, and the blobs it lacks against free disk and memory. Then the blobs are
copied in parallel (linked on one filesystem, verified always), under a lease so gc leaves
them alone, and the index is written last: a package in the cache is complete.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field

from flare.errors import FlareError, IntegrityError, NoSpaceError, NotFoundError
from flare.faults import crash_point
from flare.registry.leases import hold_lease
from flare.registry.registry import Registry
from flare.serve.cache import HostCache
from flare.serve.compat import HostToolchain, check_compatible
from flare.serve.memory_plan import free_for_admission, memory_size
from flare.sign.policy import TrustPolicy
from flare.sign.verify import Verdict, check_trusted
from flare.store.blobs import PutResult
from flare.store.digest import Digest
from flare.store.hashing import Progress, parallel_map
from flare.store.package import Manifest, check_sizes, decode_index
from flare.store.safetensors import DTYPE_SIZES


@dataclass(frozen=True)
class Admission:
    """What the host must give the package: disk for the blobs it lacks, memory for weights."""

    missing: list[tuple[Digest, int]]
    disk_needed: int
    disk_free: int
    linked: bool
    memory_needed: int
    memory_free: int


@dataclass
class PullPlan:
    """A package accepted for this host, before its blobs move."""

    name: str | None
    digest: Digest
    manifest: Manifest
    index: bytes
    signatures: list[bytes]
    verdict: Verdict
    admission: Admission
    device: str
    """Where the package will run ("cpu" or "cuda"), which admission sized memory for."""


@dataclass
class PullReport:
    plan: PullPlan
    methods: dict[str, int] = field(default_factory=dict)
    bytes: int = 0


@dataclass(frozen=True)
class PullRequest:
    """What the operator asked for, and what this host offers."""

    ref: str
    host: HostToolchain
    policy: TrustPolicy
    reserve: int
    """Memory to leave free beyond the weights: memory.reserve plus what the KV cache takes."""
    revision: str | None = None
    accept_publisher: str | None = None
    ranks: tuple[int, ...] | None = None
    """The tensor-parallel ranks this host serves (None: all of them): admission sizes, and
    the pull copies, their payloads and the shared ones only."""


def plan_pull(registry: Registry, cache: HostCache, request: PullRequest) -> PullPlan:
    """Fetch the index and signatures, check trust, compatibility and room; move no weights."""
    name, digest = registry.resolve(request.ref)
    registry.require_index(name, digest)
    index = registry.store.read_bytes(digest)  # verified against the digest
    manifest = decode_index(index, f"package {digest.short()}")
    signatures = registry.signatures(digest)
    verdict = check_trusted(signatures, digest, manifest, request.policy, request.accept_publisher)
    check_compatible(manifest, request.host, request.revision, request.ranks)
    admission = admit(registry, cache, manifest, request)
    device = request.host.device
    return PullPlan(name, digest, manifest, index, signatures, verdict, admission, device)


def admit(
    registry: Registry, cache: HostCache, manifest: Manifest, request: PullRequest
) -> Admission:
    """Refuse, before any copy, a package whose manifest misstates its blobs' sizes (disk
    and memory are sized by them) or that the host has no disk or memory for."""
    sizes, missing_digests = stored_sizes(registry, cache, manifest, request.ranks)
    check_sizes(manifest, sizes, f"package {manifest.name}")
    missing = [(d, sizes[d]) for d in missing_digests]
    linked = cache.links_from(registry.store)
    disk_needed = 0 if linked else sum(size for _, size in missing)
    disk_free = shutil.disk_usage(cache.root).free
    admission = Admission(
        missing=missing,
        disk_needed=disk_needed,
        disk_free=disk_free,
        linked=linked,
        memory_needed=weight_bytes(manifest, request.host.device, request.ranks) + request.reserve,
        memory_free=free_for_admission(request.host.device),
    )
    _check_room(manifest, cache, admission)
    return admission


def stored_sizes(
    registry: Registry,
    cache: HostCache,
    manifest: Manifest,
    ranks: tuple[int, ...] | None = None,
) -> tuple[dict[Digest, int], list[Digest]]:
    """Each blob's real size (the registry's, which pull copies from; the cache's for a blob
    only the cache still has), and the blobs the cache lacks (of `ranks`' share)."""
    sizes: dict[Digest, int] = {}
    missing = []
    for digest in manifest.blobs(ranks):
        cached = cache.locate(digest)
        source = registry.store.locate(digest)
        if source is not None:
            sizes[digest] = registry.store.plain_size(source)
        elif cached is not None:
            sizes[digest] = cache.store.plain_size(cached)
        else:
            raise _lost_blob(registry, manifest.name, digest)
        if cached is None:
            missing.append(digest)
    return sizes, missing


def _check_room(manifest: Manifest, cache: HostCache, admission: Admission) -> None:
    if admission.disk_needed > admission.disk_free:
        raise NoSpaceError(
            f"{manifest.name} stores {memory_size(admission.disk_needed)} under {cache.root}, "
            f"{memory_size(admission.disk_free)} are free",
            "free space there or point paths.package_cache elsewhere; nothing was copied",
        )
    if admission.memory_needed > admission.memory_free:
        needed, free = memory_size(admission.memory_needed), memory_size(admission.memory_free)
        raise NoSpaceError(
            f"{manifest.name} needs {needed} of memory "
            f"(weights, KV cache and memory.reserve), {free} are free",
            "free memory, lower memory.reserve, or serve it on a larger host; nothing was copied",
        )


def weight_bytes(manifest: Manifest, device: str, ranks: tuple[int, ...] | None = None) -> int:
    """The weights' size once loaded (of `ranks`' share, a shared payload once per rank):
    CPU runs in float32, GPUs in the stored dtype."""
    total = 0
    for payload in manifest.payloads:
        copies = len(set(payload.ranks) & set(ranks)) if ranks is not None else len(payload.ranks)
        if not copies:
            continue
        for tensor in payload.tensors:
            itemsize = 4 if device == "cpu" else DTYPE_SIZES[tensor.dtype]
            total += math.prod(tensor.shape) * itemsize * copies
    return total


def fetch(
    registry: Registry,
    cache: HostCache,
    plan: PullPlan,
    workers: int | None = None,
    progress: Progress | None = None,
) -> PullReport:
    """Copy the missing blobs (in parallel, verified), then the signatures and the index."""
    report = PullReport(plan)

    def copy(digest: Digest) -> PutResult:
        crash_point("pull:blob")
        try:
            return registry.store.copy_to(cache.store, digest, progress)
        except (NotFoundError, IntegrityError) as exc:
            package = f"{plan.name or 'package'}@{plan.digest.short()}"
            if not registry.store.backend.list_dir(""):  # the whole registry, not one blob
                raise NotFoundError(
                    f"the registry {registry.location} went away while {package} was pulled "
                    "(unmounted or moved?)",
                    "make it reachable again, then pull again: what was copied is kept",
                ) from exc
            problem = exc.what if isinstance(exc, IntegrityError) else None
            raise _lost_blob(registry, package, digest, problem) from exc

    with hold_lease(registry.store, "pull", packages=[plan.digest]):
        for result in parallel_map(copy, [d for d, _ in plan.admission.missing], workers):
            report.methods[result.method] = report.methods.get(result.method, 0) + 1
            if result.method != "existing":  # another pull's, meanwhile: not moved by this one
                report.bytes += result.size
        cache.add(plan.digest, plan.index, plan.signatures, plan.name)
    return report


def _lost_blob(
    registry: Registry, package: str, digest: Digest, problem: str | None = None
) -> FlareError:
    """A blob `package` needs, missing from the registry (or corrupt there: `problem`), said
    as the package's (the store's own words name only the blob), with what its keeper does."""
    fix = (
        f"run `flare registry verify {package}` on {registry.location}, then build or push the "
        "package again, and pull it"
    )
    if problem is None:
        return NotFoundError(f"{package} needs blob {digest}, which {registry.location} lacks", fix)
    return IntegrityError(f"{package}'s blob {digest} in {registry.location}: {problem}", fix)
