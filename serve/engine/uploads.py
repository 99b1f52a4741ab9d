"""Small host lists onto the device without waiting for it."""

from __future__ import annotations

import torch


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device (from
    pinned memory, where the device is a GPU): a step's row numbers and settings go up while
    the device still runs the step before."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
