"""What a package is prepared for: its target, the batch sizes it plans for, its toolchain.

A package targets one runtime (cpu, or cuda with its toolchain) or none. Tune and compile
prepare what that runtime needs for the package's shapes; the manifest declares the decode
batch sizes planned for (powers of two up to the package's max concurrency) and records the
toolchain the prepared artifacts need. A package of target none, a family that serves no
compiled forward (an embedding model) or a multi-rank package prepares nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flare import toolchain
from flare.errors import InvalidInputError
from flare.model_sizes import decode_batch_sizes

MAX_CONCURRENCY = 32
"""Default: the largest decode batch a package plans for."""
PREFILL_CHUNK = 8192
"""Default: prompt tokens prefilled in one step at most."""
MAX_CONCURRENCY_LIMIT = 4096
"""More sequences than this in one decode step is a typo, not a plan."""


def resolve_target(asked: str) -> str:
    """`--target`: cpu, cuda or none as given; auto is the build host's device."""
    return toolchain.host_target() if asked == "auto" else asked


def check_runtime_options(target: str, max_concurrency: int, prefill_chunk: int) -> None:
    """Refuse options no runtime can plan for, before any work."""
    if target not in toolchain.TARGETS:
        raise InvalidInputError(
            f"unknown build target {target!r}", f"use one of {', '.join(toolchain.TARGETS)}"
        )
    if not 1 <= max_concurrency <= MAX_CONCURRENCY_LIMIT:
        raise InvalidInputError(
            f"--max-concurrency {max_concurrency} is not in 1..{MAX_CONCURRENCY_LIMIT}",
            "use e.g. --max-concurrency 32",
        )
    if prefill_chunk < 1:
        raise InvalidInputError(
            f"--prefill-chunk {prefill_chunk} takes no token", "use e.g. --prefill-chunk 8192"
        )


@dataclass(frozen=True)
class Preparation:
    """What tune and compile do for one build: the target, its toolchain, the plan."""

    target: str
    toolchain: dict[str, Any]
    max_concurrency: int
    prefill_chunk: int

    @property
    def prepares(self) -> bool:
        return self.target != "none"

    def plan(self) -> dict[str, Any]:
        """The batch geometry the package plans for (compiled artifacts cover it)."""
        return {
            "decode_batch_sizes": decode_batch_sizes(self.max_concurrency),
            "prefill_tokens": [1, self.prefill_chunk],
        }


def preparation(
    target: str, compiled_forward: bool, ranks: int, max_concurrency: int, prefill_chunk: int
) -> Preparation:
    """The build's preparation: none unless the target is a device, the family serves a
    compiled forward and the package is one rank (serve runs one rank per package)."""
    if target != "none" and (not compiled_forward or ranks != 1):
        target = "none"
    return Preparation(target, toolchain.detect(target), max_concurrency, prefill_chunk)
