"""Tuning: what serve runs for a package's shapes, decided at build time and recorded.

`flare build` runs `tune` on the build host's device (serve/prepare.py) and records the
decisions as JSON records, which later builds of the same shapes and toolchain take as they
are (a lock file, in paths.kernel_cache) and the package carries; serve reads them
(`Decisions`) instead of deciding at start. A decision is measured where there is a choice
(FlashInfer's decode kernel on tensor cores or CUDA cores, timed at the package's largest
decode batch) and fixed where there is none (the CPU has one attention backend); a record
says which. Records hold decisions only, never timings, so a package's bytes do not depend
on how fast the build host was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flare.serve.engine.attention import AttentionMetadata, AttentionSpec
from flare.serve.engine.attention_choice import flashinfer_unfit
from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention
from flare.store.safetensors import FormatError

PAGE_SIZE = 16
"""KV-cache block size: the torch backend takes any; 16 is FlashInfer's usual page."""
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
"""The dtype a target serves in: float32 where bf16 matmuls are slow (CPU), bf16 on GPUs."""
TIMED_CONTEXT = 512
"""Tokens of context each sequence has while a decode variant is timed."""
TIMED_RUNS = 20


@dataclass(frozen=True)
class Decisions:
    """What a runtime runs, from a package's tuning records."""

    backend: str
    variant: str
    dtype: str
    page_size: int

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> Decisions:
        """Read the decisions serve needs; records it does not know are ignored."""
        by_kind = {r.get("decision"): r.get("choice") for r in records if isinstance(r, dict)}
        attention, cache = by_kind.get("attention"), by_kind.get("kv_cache")
        try:
            return cls(
                attention["backend"],
                attention["variant"],
                by_kind["dtype"],
                int(cache["page_size"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"the package's tuning records lack a decision ({exc})") from exc

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def tune(target: str, shapes: dict[str, int], decode_batch_sizes: list[int]) -> list[dict]:
    """The records for `shapes` (head_dim, num_heads, num_kv_heads) on this host's `target`."""
    dtype = DTYPES[target]
    spec = AttentionSpec(1, shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"], 1.0)
    device = torch.device(target)
    unfit = flashinfer_unfit(spec, getattr(torch, dtype), device)
    key = {**shapes, "gqa": shapes["num_heads"] // shapes["num_kv_heads"], "dtype": dtype}
    if unfit is not None:
        choice = {"backend": "torch", "variant": "sdpa"}
        attention = _record("attention", key, choice, f"FlashInfer cannot run here: {unfit}")
    else:
        attention = _measured(spec, getattr(torch, dtype), device, max(decode_batch_sizes), key)
    return [
        attention,
        _record("dtype", {"target": target}, dtype, f"what {target} serves in"),
        _record("kv_cache", key, {"page_size": PAGE_SIZE}, "the block size both backends take"),
    ]


def _record(decision: str, key: dict[str, Any], choice: Any, why: str) -> dict[str, Any]:
    return {"decision": decision, "for": key, "choice": choice, "how": "fixed", "why": why}


def _measured(
    spec: AttentionSpec, dtype: torch.dtype, device: torch.device, batch: int, key: dict
) -> dict[str, Any]:
    """FlashInfer, with the faster of its decode kernels (tensor cores or CUDA cores) for a
    decode batch of `batch` sequences of TIMED_CONTEXT tokens."""
    timings = {
        variant: _time_decode(spec, dtype, device, batch, tensor_cores)
        for variant, tensor_cores in (("tensor-cores", True), ("cuda-cores", False))
    }
    best = min(timings, key=timings.__getitem__)
    return {
        "decision": "attention",
        "for": key,
        "choice": {"backend": "flashinfer", "variant": best},
        "how": "measured",
        "why": f"the faster decode kernel of {sorted(timings)} at batch {batch}",
    }


def _time_decode(
    spec: AttentionSpec, dtype: torch.dtype, device: torch.device, batch: int, tensor_cores: bool
) -> float:
    """Seconds per decode attention call of one layer, FlashInfer's kernel built and warm."""
    pages = -(-TIMED_CONTEXT // PAGE_SIZE)
    backend = FlashInferPagedAttention(
        spec, batch * pages * PAGE_SIZE, PAGE_SIZE, dtype, device, tensor_cores
    )
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([t[-1] * PAGE_SIZE for t in tables], device=device),
        query_start_loc=torch.arange(batch + 1, device=device),
        context_lens=torch.full((batch,), TIMED_CONTEXT, device=device),
        block_tables=torch.tensor(tables, device=device),
        block_size=PAGE_SIZE,
        query_lens_cpu=[1] * batch,
        context_lens_cpu=[TIMED_CONTEXT] * batch,
        block_tables_cpu=tables,
    )
    backend.plan(meta)
    q = torch.randn(batch, spec.num_heads, spec.head_dim, dtype=dtype, device=device)
    kv = torch.randn(batch, 2, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
    rotary = torch.randn(batch, 2, spec.head_dim, dtype=dtype, device=device)
    return _timed(lambda: backend.attend(torch.tensor(0), q, kv, rotary), device)


def _timed(action: Callable[[], object], device: torch.device) -> float:
    action()  # the first call may build or load the kernel
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(TIMED_RUNS):
        action()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / TIMED_RUNS
