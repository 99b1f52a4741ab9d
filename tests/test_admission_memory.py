"""A pull's admission reads the device's free memory without taking any of it: on a GPU,
`flare serve`'s API process admits the package and its engine process loads it, and a CUDA
context made by the API process would hold part of the GPU for the server's life."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flare.serve.memory_plan import device_memory, free_for_admission

NVML = torch.cuda.is_available() and importlib.util.find_spec("pynvml") is not None

PROBE = """
import json
import pynvml, torch
from flare.serve.memory_plan import free_for_admission

def contexts():
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    return sum(len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)) for h in handles)

admitted = free_for_admission("cuda")
before = contexts()
free, total = torch.cuda.mem_get_info()
print(json.dumps({"admitted": admitted, "contexts_before": before,
                  "contexts_after": contexts(), "cuda_free": free, "total": total}))
"""
"""Contexts are counted, not matched by pid: in a container NVML may name the host's pids."""


def test_on_the_cpu_admission_reads_the_hosts_available_memory() -> None:
    """The host's MemAvailable in bytes, read here from /proc/meminfo's kB (it moves a little
    between reads), and what the runtime reads too."""
    kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemAvailable:")
    )
    admitted = free_for_admission("cpu")
    assert abs(admitted - kb * 1024) < 256 << 20
    assert abs(admitted - device_memory("cpu")[0]) < 256 << 20


@pytest.mark.skipif(not NVML, reason="needs CUDA and NVML's binding (nvidia-ml-py)")
def test_on_a_gpu_admission_makes_no_cuda_context_and_reads_what_cuda_reads() -> None:
    """A fresh process reads the GPU's free memory for admission without a CUDA context, then
    CUDA's own read makes one: NVML counts one compute process more after the second read
    only (had the first made the context, the second would add none), and the two reads
    agree within that context's size."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True
    )
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["contexts_after"] == found["contexts_before"] + 1
    assert abs(found["admitted"] - found["cuda_free"]) < 2 << 30
    assert 0 < found["admitted"] <= found["total"]
