"""Programmatic dependent launch (PDL): whether flare's kernels start as the one before ends.

A decode step on a GPU is a chain of a few hundred small kernels, each waiting for the one
before it; between two, the GPU drains the first, then starts the second (its programs
scheduled, its first loads out to memory): a few microseconds a kernel, a tenth of a 1B
step. On Hopper (compute capability 9) a kernel launched as a programmatic dependent is
scheduled while the one before it runs; it does what does not depend on it (a product asks
for its weights), then waits for it (`gdc_wait`), and once its own loads are done lets the
next one start (`gdc_launch_dependents`). FlashInfer's attention launches so on Hopper, and
Inductor's kernels do with its `enable_pdl` setting (serve/compiled.py); flare's own Triton
kernels ask `dependent_launch` (serve/models/linear.py, rms_norm.py, engine/cache_store.py).
A kernel launched so waits before it reads what the kernel before it wrote, so the chain's
results are those of a plain launch; inside a CUDA graph the dependency is kept as the
graph's own edge.
"""

from __future__ import annotations

import torch

try:
    from triton.language.extra import cuda as triton_cuda
except ImportError:  # a CPU build of torch ships without Triton
    triton_cuda = None

_dependent: dict[torch.device, bool] = {}


def dependent_launch(device: torch.device) -> bool:
    """Whether flare's kernels on `device` launch as programmatic dependents: on Hopper and
    later, with a Triton that has the grid-dependency calls."""
    if device not in _dependent:
        _dependent[device] = (
            device.type == "cuda"
            and hasattr(triton_cuda, "gdc_wait")
            and torch.cuda.get_device_capability(device) >= (9, 0)
        )
    return _dependent[device]
