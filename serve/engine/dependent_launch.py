"""Programmatic dependent launch: a decode kernel that starts before the one ahead of it ends.

A decode step is a chain of some 200 short kernels, and each used to start only once the one
ahead had ended: a few microseconds a kernel in which the GPU read no weights (the products'
start, docs/performance.md). On Hopper GPUs (compute capability 9.0 and up) a kernel launched
with CUDA's programmatic stream serialization may start while the kernel ahead still runs, and
a captured CUDA graph keeps such launches as programmatic edges. flare's decode kernels
(`few_rows`, `add_rms_norm`, `rotate_and_store`) launch so there: each does first what needs
nothing from the kernel ahead (a product starts its weights on their way into the L2 cache),
then waits for that kernel to end and its writes to show (`gdc_wait`), and only then lets the
kernel behind it launch (`gdc_launch_dependents`). So when a kernel starts, every kernel
before the one ahead has ended, which Inductor's kernels compiled with `triton.enable_pdl`
(serve/compiled.py) count on; and every kernel waits before it reads another's output or
writes memory, so the chain's results are what a serial one gives. FlashInfer's decode
launches this way on its own on these GPUs.
"""

from __future__ import annotations

import functools

import torch


def chained(device: torch.device) -> bool:
    """Whether kernels on this device launch with programmatic dependent launch."""
    return device.type == "cuda" and _capability(device.index) >= 9


@functools.cache
def _capability(index: int | None) -> int:
    """The device's major compute capability (asked once: the call costs microseconds)."""
    return torch.cuda.get_device_capability(index)[0]
