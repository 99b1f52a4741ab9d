"""Where flare's Triton kernels are tested: on CUDA, or on a CPU through Triton's interpreter
where Triton is installed and TRITON_INTERPRET=1 is set (`TRITON_INTERPRET=1 pytest
tests/test_linear.py tests/test_cache_store.py tests/test_graph_step.py`)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available() and TRITON
DEVICE = "cuda" if CUDA else "cpu"
KERNEL = CUDA or (TRITON and os.environ.get("TRITON_INTERPRET") == "1")
DTYPE = torch.bfloat16 if CUDA else torch.float16
"""bf16 as a model serves; the interpreter's NumPy has no bf16, so half there."""
if CUDA:  # keyed as serve keys them: a kernel compiled here first fixes Triton's ptxas for
    # the process, and a package loaded after it would find none of its kernels
    from flare.serve.compiled import pin_triton_ptxas

    pin_triton_ptxas()
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs CUDA and Triton (or its interpreter)")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
