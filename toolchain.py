"""The toolchain a package's compiled artifacts are bound to, read the same way on both sides.

`flare build --target cpu|cuda` records the build host's toolchain in the manifest, because
what tune and compile prepare is only valid with it: Inductor keys its compiled graphs by the
exact torch version and Python, its C++ kernels are built for the CPU's vector ISA and
features, Triton and FlashInfer kernels for one CUDA, Triton and GPU architecture. `flare
serve` reads its own toolchain with the same function and refuses artifacts made with another
(serve/compat.py). A package of target `none` prepares nothing and records nothing: it serves
eagerly on any host.

torch is imported only when a toolchain is asked for: building a `none` package, like every
other command, runs without it.
"""

from __future__ import annotations

import importlib.util
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

TARGETS = ("cpu", "cuda", "none")
"""What a package can be prepared for; `none` prepares nothing (a portable, eager package)."""

CPU_FEATURES = (
    "avx2",
    "fma",
    "avx512f",
    "avx512dq",
    "avx512vl",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)
"""The x86 features Inductor's C++ kernels may be built to use (its vector ISA flags, -mavx512f
to -mamx-fp16): a kernel built where one is present may need it where it runs."""


FORWARD_SOURCES = (
    "serve/models/llama.py",
    "serve/models/rms_norm.py",
    "serve/models/activation.py",
    "serve/models/linear.py",
    "serve/engine/attention_op.py",
    "serve/engine/runner.py",
    "serve/compiled.py",
    "serve/precompiled.py",
    "serve/engine/cache_store.py",
    "serve/engine/decode_attention.py",
    "serve/engine/graph_step.py",
    "serve/engine/dependent_launch.py",
)
"""flare's code a compiled forward is traced from (model, attention operator, the step's
inputs, the compile settings): a change to it changes the graph Inductor looks up. And the
modules of flare's Triton kernels, which a CUDA package's artifact holds built (the KV store,
decode attention, the graphs' inputs and pick, how kernels launch, beside the model's): a
change to one would otherwise miss the package's kernel and build it at every start."""


def host_target() -> str:
    """The build host's own device: cuda where torch sees a GPU, cpu where torch is installed,
    none where it is not (a host without the runtime can prepare nothing for it)."""
    if importlib.util.find_spec("torch") is None:
        return "none"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def detect(target: str) -> dict[str, Any]:
    """This host's toolchain for `target`, as the manifest's `toolchain` records it (without
    the runtime ABI); empty for `none`."""
    if target == "none":
        return {}
    import torch

    found: dict[str, Any] = {
        "torch": torch.__version__,
        "python": _python(),
        "forward_code": forward_code(),
    }
    if target == "cpu":
        found["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
        found["cpu_features"] = cpu_features()
        return found
    found["cuda"] = torch.version.cuda
    found["gpu_archs"] = gpu_archs()
    found["triton"] = package_version("triton")
    found["flashinfer"] = package_version("flashinfer-python")
    return found


def forward_code() -> str:
    """A short digest of FORWARD_SOURCES as this flare has them."""
    from flare.store.hashing import hash_bytes

    root = Path(__file__).parent
    text = b"".join(name.encode() + b"\0" + (root / name).read_bytes() for name in FORWARD_SOURCES)
    return hash_bytes(text).hex[:16]


def gpu_archs() -> list[str]:
    """Every visible GPU's architecture (sm_90 ...), each once, sorted."""
    import torch

    count = torch.cuda.device_count()
    return sorted({_arch(torch.cuda.get_device_capability(i)) for i in range(count)})


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU_FEATURES this host's CPU has (from /proc/cpuinfo's flags; none elsewhere)."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        return []
    flags: set[str] = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    return [feature for feature in CPU_FEATURES if feature in flags]


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _python() -> str:
    return ".".join(platform.python_version_tuple()[:2])


def _arch(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"
