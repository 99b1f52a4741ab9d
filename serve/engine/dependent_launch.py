"""Programmatic dependent launch: a decode kernel that starts before the one ahead of it ends.

A decode step is a chain of some 200 short kernels, and each used to start only once the one
ahead had ended: a few microseconds a kernel in which the GPU read no weights (the products'
start, docs/performance.md). On Hopper GPUs (compute capability 9.0 and up) a kernel launched
with CUDA's programmatic stream serialization may be launched while the kernel ahead runs,
and a captured CUDA graph keeps such launches as programmatic edges. flare's decode kernels
(`few_rows`, `add_rms_norm`, `rotate_and_store`) launch so there: each waits for the kernel
ahead to end and its writes to show (`gdc_wait`), and then lets the kernel behind it launch
(`gdc_launch_dependents`), which is then on the GPU, its start paid, by the time it may run.
So when a kernel starts, every kernel before the one ahead has ended, which Inductor's
kernels compiled with `triton.enable_pdl` (serve/compiled.py) count on; and every kernel
waits before it reads another's output or writes memory, so the chain's results are what a
serial one gives. FlashInfer's decode launches this way on its own on these GPUs.

On an H200 this took a 1B decode step's products and norms from 913 to 839 µs at one row and
an 8B one's from 4,155 to 3,975 µs (tests/bench/gpu_linear.py --chain); serving went from
865-881 to 968-988 tok/s at batch 1 on 1B and from 209.5 to 229.8 on 8B. Sending the first
weights of each product toward the L2 cache before its wait was measured too, and cost more
than it gave (2-8 MB a product: 863-887 µs), so a product does nothing before its wait.
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
