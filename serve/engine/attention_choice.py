"""Which attention backend a runtime gets: FlashInfer's kernels where they can run, else the
torch reference.

The choice lives apart from both backends so that each backend module imports only the
shared types of attention.py, and the choice imports both, one way.
"""

from __future__ import annotations

import importlib.util

import torch

from flare.errors import InvalidInputError
from flare.serve.engine.attention import AttentionBackend, AttentionSpec, TorchPagedAttention
from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention

ATTENTION_KINDS = ("auto", "torch", "flashinfer")
FLASHINFER_HEAD_DIMS = (64, 128, 256)
"""Head sizes FlashInfer's prebuilt and JIT kernels take."""


def make_attention(
    kind: str,
    spec: AttentionSpec,
    num_slots: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    variant: str | None = None,
) -> tuple[str, AttentionBackend]:
    """The backend `kind` names, with its name. "auto": FlashInfer where it can run (CUDA,
    the package installed, a 16-bit dtype, a head size its kernels take), else the torch
    reference; "flashinfer" where it cannot is refused with the reason. `variant` is the
    tuned FlashInfer decode kernel (serve/tuning.py), if any."""
    if kind not in ATTENTION_KINDS:
        raise InvalidInputError(
            f"unknown attention backend {kind!r}", f"use one of {', '.join(ATTENTION_KINDS)}"
        )
    unfit = flashinfer_unfit(spec, dtype, device)
    if kind == "flashinfer" and unfit:
        raise InvalidInputError(
            f"FlashInfer attention cannot run here: {unfit}", "use --attention torch or auto"
        )
    if kind == "torch" or unfit:
        return "torch", TorchPagedAttention(spec, num_slots, dtype, device)
    tensor_cores = {"tensor-cores": True, "cuda-cores": False}.get(variant or "")
    backend = FlashInferPagedAttention(spec, num_slots, block_size, dtype, device, tensor_cores)
    return "flashinfer", backend


def flashinfer_unfit(spec: AttentionSpec, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why FlashInfer's kernels cannot serve this model here, or None if they can."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the model runs in {dtype}, not float16 or bfloat16"
    if spec.head_dim not in FLASHINFER_HEAD_DIMS:
        return f"head size {spec.head_dim} is not one of {FLASHINFER_HEAD_DIMS}"
    if importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer-python package is not installed"
    return None
