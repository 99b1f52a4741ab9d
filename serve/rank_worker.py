"""A tensor-parallel rank other than zero: `flare join` on a serving group, or one of the
processes `flare serve` starts for a multi-rank package on its own host.

It obtains the package (rank zero's host cache, or its own pull with its own admission),
loads its part, sizes its KV cache as rank zero says, and then runs each step rank zero
sends until told to stop (exit 0). Anything that fails posts the group's abort with this
rank's reason first, so every rank stops with it; a lost peer or rank zero ends it with
exit 13 (RankError), from its watch thread if it is stuck in a collective.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from flare.errors import FlareError
from flare.rendezvous import RankError, Rendezvous
from flare.serve.engine.attention_choice import make_attention
from flare.serve.engine.runner import ModelRunner
from flare.serve.heap import freeze_heap
from flare.serve.models import load_model
from flare.serve.models.files import PackageFiles, Quarantine
from flare.serve.rank_group import RankGroup, follow
from flare.serve.rank_start import (
    KV_KEY,
    PACKAGE_KEY,
    PackageNotice,
    load_report,
    make_group,
    rank_device,
)
from flare.serve.rank_watch import Watch
from flare.store.package import Manifest

Obtained = tuple[Manifest, Mapping[str, Path], Quarantine | None]
Obtain = Callable[[PackageNotice], Obtained]
"""Gets the package rank zero names onto this host: its manifest and local files."""

Done = TypeVar("Done")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serve_rank(rendezvous: Rendezvous, obtain: Obtain) -> None:
    """This rank's whole life in the group; returns when rank zero stops it cleanly."""
    rank = rendezvous.rank
    notice = PackageNotice.from_json(
        rendezvous.wait_for(PACKAGE_KEY, 0, "to say which package to serve")
    )
    manifest, files, quarantine = _guarded(rendezvous, "refused the package", obtain, notice)
    rendezvous.post(f"serve/admitted/{rank}", True)
    obtained = (manifest, files, quarantine)
    group, runner, report = _guarded(
        rendezvous, "could not load its part", _load, rendezvous, notice, obtained
    )
    freeze_heap()
    rendezvous.post(f"serve/ready/{rank}", report)
    watch = Watch(rendezvous, _lost)
    watch.start()
    try:
        follow(group, runner)
    except Exception as exc:  # a collective with a lost rank: the watch names it, else this
        watch.report(f"rank {rank} lost the group in a step: {exc}")
        raise RankError(f"rank {rank} lost the group: {exc}") from exc
    watch.stop()


def _load(
    rendezvous: Rendezvous, notice: PackageNotice, obtained: Obtained
) -> tuple[RankGroup, ModelRunner, dict[str, float]]:
    """This rank's part of the model and its KV cache, as rank zero sized it."""
    started = time.perf_counter()
    manifest, files, quarantine = obtained
    device = rank_device(notice.device, rendezvous.rank, rendezvous.world, notice.shared_cache)
    group = make_group(rendezvous, device)
    dtype = DTYPES[notice.dtype]
    model = load_model(PackageFiles(manifest, files, quarantine), device, dtype, group.shard)
    kv = rendezvous.wait_for(KV_KEY, 0, "to size the KV cache")
    seconds = time.perf_counter() - started
    slots = kv["blocks"] * kv["block_size"]
    spec = model.attention_spec
    _, attention = make_attention(kv["attention"], spec, slots, kv["block_size"], dtype, device)
    runner = ModelRunner(model, attention, kv["block_size"], device)
    return group, runner, load_report(model, spec.bytes_per_token(dtype) * slots, seconds)


def _guarded(rendezvous: Rendezvous, doing: str, action: Callable[..., Done], *args: Any) -> Done:
    """Run `action`; if it fails, every rank stops with this rank's reason (the abort names
    the rank)."""
    try:
        return action(*args)
    except FlareError as exc:
        rendezvous.abort(f"{doing}: {exc}")
        raise
    except Exception as exc:
        rendezvous.abort(f"{doing}: {type(exc).__name__}: {exc}")
        raise


def _lost(reason: str) -> None:
    """The group is lost while this rank may be stuck in a collective: say why, and exit."""
    sys.stderr.write(f"error: the serving group stopped: {reason}\n")
    sys.stderr.flush()
    os._exit(RankError.exit_code)
