"""A pull's admission reads the device's free memory without taking any of it: on a GPU,
`flare serve`'s API process admits the package and its engine process loads it, and a CUDA
context made by the API process would hold part of the GPU for the server's life."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from flare.serve.memory_plan import device_memory, free_for_admission

NVML = torch.cuda.is_available() and importlib.util.find_spec("pynvml") is not None

PROBE = """
import json, os
import pynvml, torch
from flare.serve.memory_plan import free_for_admission

def holds_context():
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    pids = {p.pid for h in handles for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    return os.getpid() in pids

admitted = free_for_admission("cuda")
before = holds_context()
free, total = torch.cuda.mem_get_info()
print(json.dumps({"admitted": admitted, "context_before": before,
                  "context_after": holds_context(), "cuda_free": free, "total": total}))
"""


def test_on_the_cpu_admission_reads_the_hosts_available_memory() -> None:
    """The host's MemAvailable, as the runtime reads it (it moves a little between reads)."""
    assert abs(free_for_admission("cpu") - device_memory("cpu")[0]) < 256 << 20


@pytest.mark.skipif(not NVML, reason="needs CUDA and NVML's binding (nvidia-ml-py)")
def test_on_a_gpu_admission_makes_no_cuda_context_and_reads_what_cuda_reads() -> None:
    """A fresh process reads the GPU's free memory for admission without a CUDA context (NVML
    lists no compute process of its pid), then CUDA's own read makes one (so the check can
    see one): the two reads agree within that context's size."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True
    )
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert not found["context_before"]
    assert found["context_after"]
    assert abs(found["admitted"] - found["cuda_free"]) < 2 << 30
    assert 0 < found["admitted"] <= found["total"]
