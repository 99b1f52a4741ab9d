"""From a reference to a running API, as `flare pull`, `flare serve` and `flare demo` do it:
admission and the pull into the host cache (with a bar), the runtime loaded (with what it
cost), the API app made; and the demo's one question to a server on loopback.

torch, FastAPI, uvicorn and httpx are imported inside the functions, after
`require_serve_extra` has said what to install where they are missing."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rich.filesize import decimal

from flare.cli_common import err, progress_bar
from flare.config import load_config
from flare.errors import FlareError, InvalidInputError
from flare.extras import install_hint
from flare.registry.commands import open_registry
from flare.registry.registry import Registry
from flare.serve.cache import HostCache
from flare.serve.pull import PullPlan, PullReport
from flare.sign import policy as trust
from flare.sign.commands import warn_accepted

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flare.serve.engine_process import EngineProcess
    from flare.serve.limits import BodyLimits
    from flare.serve.rank_leader import RankLeader
    from flare.serve.rank_start import PackageNotice
    from flare.serve.rank_worker import Obtained
    from flare.serve.runtime import Runtime
    from flare.store.package import Manifest


SERVE_MODULES = (
    "torch",
    "fastapi",
    "uvicorn",
    "httptools",
    "uvloop",
    "jinja2",
    "prometheus_client",
    "httpx",
)
"""What the serve extra installs (pyproject.toml), by import name."""


def require_serve_extra(command: str = "flare pull and serve") -> None:
    """Pull, serve and the demo run models: without the serve extra, say how to get it,
    before any work (a demo would otherwise build and publish, then fail)."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise FlareError(
            f"{command} needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed",
            install_hint("serve"),
        )


def pull_into_cache(
    ref: str,
    registry: str | None,
    device: str | None,
    revision: str | None,
    accept: str | None,
    compiles: bool = False,
    ranks: tuple[int, ...] | None = None,
) -> tuple[Registry, HostCache, PullReport]:
    """Admission (signature, compatibility, disk, memory), then the missing blobs, with a bar.
    `compiles`: the server compiles at start, so compiled artifacts need not match this host.
    `ranks`: the tensor-parallel ranks this host serves (None: all), whose share is pulled.

    Returns the source registry, the host cache and the pull report."""
    require_serve_extra()
    from flare.serve.compat import choose_device, detect_toolchain
    from flare.serve.models import served_recipes
    from flare.serve.pull import PullRequest, fetch, plan_pull
    from flare.serve.runtime import kv_cache_reservation

    config = load_config()
    source = open_registry(registry)
    cache = HostCache(config["paths.package_cache"])
    chosen = choose_device(device)
    request = PullRequest(
        ref=ref,
        host=detect_toolchain(chosen, served_recipes(), compiles),
        policy=trust.load_policy(config),
        reserve=config["memory.reserve"] + kv_cache_reservation(chosen),
        revision=revision,
        accept_publisher=accept,
        ranks=ranks,
    )
    plan = plan_pull(source, cache, request)
    if plan.verdict.accepted_dangerously:
        warn_accepted(plan.verdict)
    with progress_bar("pull", sum(size for _, size in plan.admission.missing)) as advance:
        report = fetch(source, cache, plan, progress=advance)
    return source, cache, report


def load_package_app(
    source: Registry,
    cache: HostCache,
    plan: PullPlan,
    kv_cache_tokens: int | None,
    api_key: str | None,
    attention: str = "auto",
    limits: BodyLimits | None = None,
    compile_mode: str = "package",
    leader: RankLeader | None = None,
    cuda_graphs: bool = True,
    batch_invariant: bool = False,
    prefill_graphs: bool | None = None,
    *,
    engine: EngineProcess,
    stall_timeout: float | None = None,
) -> tuple[Runtime, FastAPI]:
    """Load the pulled package on the device pull admitted it for (printing what it cost)
    and make its API app: a generating package in `engine`, the engine process started
    early (serve/engine_process.py), which is closed unused for an embedding package (loaded
    here) and a multi-rank one (here as rank zero of `leader`'s group, once every rank has
    loaded its part)."""
    from flare.serve.api import ServedPackage, create_app
    from flare.serve.engine_client import start_engine
    from flare.serve.engine_process import EngineSpec
    from flare.serve.models import model_kind
    from flare.serve.models.files import PackageFiles
    from flare.serve.runtime import GenerateRuntime, load_runtime

    started = time.perf_counter()
    manifest = plan.manifest
    files = cache.files(manifest, (0,) if leader is not None else None)
    options = {
        "kv_cache_tokens": kv_cache_tokens,
        "memory_reserve": load_config()["memory.reserve"],
        "attention": attention,
        "compile_mode": compile_mode,
        "compile_root": cache.root / "compiled",
        "cuda_graphs": cuda_graphs,
        "batch_invariant": batch_invariant,
        "prefill_graphs": prefill_graphs,
    }
    package = PackageFiles(manifest, files, cache.quarantine_if_corrupt)
    runtime: Runtime
    if leader is None and model_kind(package) == "generate":
        spec = EngineSpec(manifest, dict(files), plan.device, cache.root, options)
        stall = stall_timeout or load_config()["serve.stall_timeout"]
        runtime = start_engine(spec, package, engine, stall)
    else:  # embeddings answer no streams; rank zero's engine steps its group in this process
        engine.close()
        runtime = load_runtime(
            manifest,
            files,
            plan.device,
            quarantine=cache.quarantine_if_corrupt,
            group=leader.group if leader is not None else None,
            on_group_failure=leader.collective_failed if leader is not None else None,
            **options,
        )
    ranks_text = ""
    if leader is not None:
        assert isinstance(runtime, GenerateRuntime)
        leader.ready(runtime, time.perf_counter() - started)
        ranks_text = f"; rank 0 of {plan.manifest.ranks}, every rank loaded"
    weights = payload_bytes(plan.manifest)
    kv_text = ""
    memory = runtime.memory_plan
    if memory is not None and memory.kv is not None:  # a generating model (asked nothing of
        # the engine process, which freezes its heap meanwhile: serve/heap.py)
        kv_text = f"; KV cache {memory.kv.tokens} tokens, {runtime.attention} attention"
    err.print(
        f"loaded {plan.manifest.name} ({decimal(weights)} of weights) on {plan.device} in "
        f"{time.perf_counter() - started:.2f} s{kv_text}{ranks_text}",
        markup=False,
    )
    package = ServedPackage(
        name=plan.manifest.name,
        digest=str(plan.digest),
        publisher=plan.verdict.publisher,
        created=_created(source, plan),
    )
    return runtime, create_app(runtime, package, api_key, limits)


def payload_bytes(manifest: Manifest) -> int:
    """The package's weights as stored: what loading it reads, every rank's part."""
    return sum(p.size for p in manifest.payloads)


def start_ranks(
    plan: PullPlan, rendezvous: str | None, ranks: int | None, timeout: float
) -> RankLeader:
    """Rank zero of a multi-rank package: host the group (at `rendezvous`, where the other
    hosts join; else on loopback, starting the other ranks here), and wait until every rank
    has the package and admitted it."""
    from flare.rendezvous import RankError
    from flare.serve.rank_leader import RankLeader
    from flare.serve.rank_start import PackageNotice
    from flare.serve.runtime import default_dtype

    manifest = plan.manifest
    if manifest.ranks == 1:
        raise InvalidInputError(
            f"{manifest.name} is built for one rank: it needs no --rendezvous", "drop it"
        )
    if ranks is not None and ranks != manifest.ranks:
        raise RankError(
            f"--ranks {ranks}, but {manifest.name} is built for {manifest.ranks} ranks",
            f"give --ranks {manifest.ranks}, and start that many ranks",
        )
    leader = RankLeader.start(rendezvous, manifest.ranks, timeout)
    import torch

    dtype = str(default_dtype(torch.device(plan.device))).removeprefix("torch.")
    notice = PackageNotice(str(plan.digest), plan.name, plan.device, dtype, rendezvous is None)
    leader.offer(notice)
    return leader


def join_serve(
    address: str, rank: int, timeout: float, registry: str | None, accept: str | None
) -> None:
    """`flare join` on a serving group: this host's rank, until rank zero stops it."""
    from flare.rendezvous import Rendezvous
    from flare.serve.rank_worker import serve_rank

    require_serve_extra()
    rendezvous = Rendezvous.join(address, rank, timeout, kind="serve")
    try:
        serve_rank(rendezvous, lambda notice: _obtain(notice, rank, registry, accept))
    finally:
        rendezvous.say_goodbye()
        rendezvous.close()


def _obtain(notice: PackageNotice, rank: int, registry: str | None, accept: str | None) -> Obtained:
    """The package rank zero names: from rank zero's host cache on its own host, else pulled
    into this host's cache, with this host's admission for this rank's share."""
    from flare.store.digest import Digest
    from flare.store.package import decode_index

    if notice.shared_cache:
        cache = HostCache(load_config()["paths.package_cache"])
        digest = Digest.parse(notice.digest)
        manifest = decode_index(cache.store.read_bytes(digest), f"package {digest.short()}")
    else:
        _source, cache, report = pull_into_cache(
            notice.ref(), registry, notice.device, None, accept, ranks=(rank,)
        )
        manifest = report.plan.manifest
    return manifest, cache.files(manifest, (rank,)), cache.quarantine_if_corrupt


def _created(source: Registry, plan: PullPlan) -> int:
    """When the package was published under its name (0 if it has none)."""
    from flare.registry.refs import read_record

    record = read_record(source.store, plan.name, plan.digest) if plan.name else None
    return int(datetime.fromisoformat(record.created).timestamp()) if record else 0


@contextmanager
def serving_leases(source: Registry, cache: HostCache, plan: PullPlan, url: str) -> Iterator[None]:
    """A server's leases: in its registry (gc keeps the package; `flare ps` lists it) and in
    the host cache (`flare cache rm` and `prune` leave it alone)."""
    from flare.registry.leases import hold_lease

    what = f"{plan.name or ''}@{plan.digest}"
    with (
        hold_lease(source.store, "serve", [plan.digest], url=url, what=what),
        hold_lease(cache.store, "serve", [plan.digest], url=url, what=what),
    ):
        yield


def ask_served(ref: str, question: str, engine: EngineProcess) -> dict[str, Any]:
    """Pull REF, serve it on a free loopback port (a generating model in `engine`, started
    early), ask one chat question, stop the server."""
    import httpx

    from flare.serve.server import background_server

    source, cache, pulled = pull_into_cache(ref, None, None, None, None)
    runtime, api = load_package_app(source, cache, pulled.plan, None, None, engine=engine)
    body = {
        "model": pulled.plan.manifest.name,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 24,
        "temperature": 0,
    }
    with (
        background_server(api, runtime) as url,
        serving_leases(source, cache, pulled.plan, url),
    ):
        reply = httpx.post(f"{url}/chat/completions", json=body, timeout=120)
    if reply.status_code != 200:
        raise FlareError(f"the demo server answered {reply.status_code}: {reply.text}")
    data = reply.json()
    return {
        "publisher": pulled.plan.verdict.publisher,
        "url": url,
        "question": question,
        "answer": data["choices"][0]["message"]["content"],
        "usage": data["usage"],
    }
