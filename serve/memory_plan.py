"""The memory plan a server prints at start and /metrics reports: what each part of the
runtime holds on its device (weights, KV cache, attention workspace, captured graphs), the
`memory.reserve` kept free, and the device's memory as the plan found it once loaded.

So that an operator sees where the memory went, and why the KV cache is the size it is,
before the first request (as the seeds' server prints its cache budget and KV tokens)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

GIB = 1 << 30


@dataclass(frozen=True)
class KvSizing:
    """The KV cache's size in tokens, and how it was decided (given, or by a memory budget)."""

    tokens: int
    how: str


@dataclass(frozen=True)
class MemoryPlan:
    """One runtime's memory on its device (rank zero's part, for a multi-rank package)."""

    device: str
    dtype: str
    """What the weights and the KV cache are held in (float32 on CPU, bfloat16 on a GPU)."""
    weights: int
    """Bytes of the model's parameters as loaded (dtype and rank share applied)."""
    kv: KvSizing | None
    """The KV cache's tokens (whole blocks, as allocated) and how; None for an embedding model."""
    kv_cache: int
    workspace: int
    """Attention scratch allocated at start (FlashInfer's buffer; none for the torch backend)."""
    graphs: int
    """Bytes held by captured CUDA graphs: 0 while no step runs under CUDA graphs."""
    reserve: int
    """memory.reserve: left free beyond everything above."""
    total: int
    free: int
    """The device's memory (the host's on CPU: MemTotal and MemAvailable) once loaded."""
    ranks: int = 1

    def parts(self) -> dict[str, int]:
        """Bytes per part, for /metrics' flare_memory_bytes{part=...}."""
        return {
            "weights": self.weights,
            "kv_cache": self.kv_cache,
            "workspace": self.workspace,
            "graphs": self.graphs,
            "reserve": self.reserve,
        }

    def describe(self) -> str:
        """The plan in one line, for the start's output."""
        whose = f" (rank 0 of {self.ranks})" if self.ranks > 1 else ""
        kv = "KV cache none (an embedding model)"
        if self.kv is not None:
            kv = f"KV cache {self.kv.tokens} tokens, {memory_size(self.kv_cache)} ({self.kv.how})"
        graphs = "graphs none (no CUDA graphs are captured)"
        if self.graphs:
            graphs = f"graphs {memory_size(self.graphs)}"
        host = "host" if self.device == "cpu" else self.device
        return (
            f"memory plan on {self.device}{whose}: weights {memory_size(self.weights)} in "
            f"{self.dtype}, {kv}, "
            f"workspace {memory_size(self.workspace)}, {graphs}, "
            f"reserve {memory_size(self.reserve)}; {host} {memory_size(self.total)} total, "
            f"{memory_size(self.free)} free"
        )


def memory_size(nbytes: int) -> str:
    """GiB for what a user plans hosts by, MiB below one GiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def parameter_bytes(model: nn.Module) -> int:
    """The model's weights as loaded: its parameters' bytes (a tied one once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes: the GPU's (GPU 0, or the current one), else the host's
    MemAvailable and MemTotal."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info(torch.device(device))
    path = Path("/proc/meminfo")
    meminfo = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        key, _, value = line.partition(":")
        meminfo[key] = int(value.split()[0]) * 1024
    page = os.sysconf("SC_PAGE_SIZE")
    free = meminfo.get("MemAvailable", page * os.sysconf("SC_AVPHYS_PAGES"))
    return free, meminfo.get("MemTotal", page * os.sysconf("SC_PHYS_PAGES"))


def free_for_admission(device: str) -> int:
    """Free bytes on `device`, read by a process that will not run the model there: a pull's
    admission, in `flare serve`'s API process, whose engine process then loads the model.
    CUDA's own count (`device_memory`) makes a CUDA context in the process that asks, which
    then holds a few hundred MB of the GPU for the server's life, memory the engine's KV
    cache no longer finds; so on a GPU the driver's count is read through NVML instead (the
    nvidia-ml-py package, which FlashInfer needs too), as nvidia-smi reads it. CUDA's where
    NVML cannot answer (not installed, a device it does not name)."""
    if device == "cuda":
        import torch

        try:
            used = torch.cuda.device_memory_used()
        except Exception:  # whatever NVML's binding raises: ask CUDA instead
            return device_memory(device)[0]
        return max(0, torch.cuda.get_device_properties().total_memory - used)
    return device_memory(device)[0]
