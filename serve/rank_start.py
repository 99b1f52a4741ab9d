"""What every rank of a tensor-parallel server does to start: form the group, agree on the
package and the KV cache, load its part of the model.

The group forms over the same rendezvous a multi-rank build uses (flare/rendezvous.py, kind
`serve`): rank zero hosts the store; the others arrive, each started by rank zero on its own
host (`flare serve` on a multi-rank package) or by hand on another host (`flare join`). Then,
in order, each a key of the store that the waiting side watches with the poster's heartbeat:

1. rank zero posts `serve/package` (the package's digest and name, the device, whether the
   other ranks share its host cache); each other rank obtains the package (from rank zero's
   host cache, or by its own pull, admission included) and posts `serve/admitted/R`, or posts
   the group's abort with its reason, which stops every rank;
2. rank zero loads its part and posts `serve/kv` (KV blocks, block size, attention backend):
   every rank's cache has the same blocks, each for its own KV heads;
3. each other rank loads its part, allocates its cache and posts `serve/ready/R` with what its
   load cost; rank zero says ready once all have.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from flare.rendezvous import Rendezvous
from flare.serve.memory_plan import parameter_bytes
from flare.serve.models.shard import Shard
from flare.serve.rank_group import RankGroup

PACKAGE_KEY = "serve/package"
KV_KEY = "serve/kv"


@dataclass(frozen=True)
class PackageNotice:
    """What rank zero tells the other ranks to serve (`serve/package`)."""

    digest: str
    name: str | None
    device: str
    dtype: str
    """torch's name for it, without `torch.`: float32, bfloat16."""
    shared_cache: bool
    """The other ranks run on rank zero's host and read its host cache: nothing to pull."""

    def ref(self) -> str:
        """The reference another host pulls: the exact package, under its name if it has one."""
        return f"{self.name}@{self.digest}" if self.name else self.digest

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PackageNotice:
        return cls(
            data["digest"], data["name"], data["device"], data["dtype"], data["shared_cache"]
        )


def rank_device(device: str, rank: int, world: int, shared_host: bool) -> torch.device:
    """The device this rank runs on: GPU R of a host that runs every rank, else GPU 0; on a
    CPU host that runs every rank, its share of the cores (N processes each using all of them
    would contend for every core and wait on each other in every collective)."""
    if device != "cuda":
        if shared_host:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        return torch.device("cpu")
    index = rank if shared_host else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_group(rendezvous: Rendezvous, device: torch.device) -> RankGroup:
    """The group's process groups: the rendezvous's gloo group carries the step messages
    (and, on CPU, the model's collectives); on CUDA the collectives run on NCCL."""
    collectives = rendezvous.group
    if device.type == "cuda":
        import torch.distributed as dist

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=rendezvous.timeout)
        prefix = dist.PrefixStore("nccl", rendezvous.store)
        collectives = dist.ProcessGroupNCCL(prefix, rendezvous.rank, rendezvous.world, options)
    return RankGroup(rendezvous, Shard(rendezvous.rank, rendezvous.world, collectives))


def wait_admitted(rendezvous: Rendezvous) -> None:
    """Rank zero: every other rank has the package and admitted it (or the group stops with
    the reason of the rank that refused it)."""
    for rank in range(1, rendezvous.world):
        rendezvous.wait_for(f"serve/admitted/{rank}", rank, f"while rank {rank} pulls")


def wait_ready(rendezvous: Rendezvous) -> dict[int, dict[str, float]]:
    """Rank zero: every other rank's load report, once each has loaded its part."""
    return {
        rank: rendezvous.wait_for(f"serve/ready/{rank}", rank, f"while rank {rank} loads")
        for rank in range(1, rendezvous.world)
    }


def load_report(model: torch.nn.Module, kv_bytes: int, seconds: float) -> dict[str, float]:
    """What one rank's part cost: load seconds, weight bytes, KV cache bytes, and the
    process's peak resident memory."""
    weights = parameter_bytes(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "rank_load_seconds": round(seconds, 3),
        "rank_weight_bytes": weights,
        "rank_kv_bytes": kv_bytes,
        "rank_peak_rss_bytes": peak,
    }


def child_environment() -> dict[str, str]:
    """A spawned rank's environment: NCCL's NVLink multicast off (it needs a fabric manager
    these hosts may lack), and the C++ logs cut to errors."""
    return {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_CPP_LOG_LEVEL": "ERROR"}
