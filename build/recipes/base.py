"""What every recipe provides: the tensors a config implies and how each splits over ranks."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flare.build.checkpoint import SourceTensor
from flare.errors import InvalidInputError
from flare.store.safetensors import FormatError

ARTIFACT_KINDS = {
    "config.json": "config",
    "generation_config.json": "config",
    "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer",
    "tokenizer.model": "tokenizer",
    "special_tokens_map.json": "tokenizer",
    "added_tokens.json": "tokenizer",
    "vocab.txt": "tokenizer",
    "vocab.json": "tokenizer",
    "merges.txt": "tokenizer",
    "chat_template.jinja": "chat_template",
    "chat_template.json": "chat_template",
}


@dataclass(frozen=True)
class Expected:
    """A tensor the config implies: its shape, the dim it splits on (None: replicated)."""

    shape: tuple[int, ...]
    split_dim: int | None = None
    optional: bool = False


class Recipe(Protocol):
    """A model family's weight layout, chosen by config.json's architecture."""

    name: str
    version: int
    architectures: tuple[str, ...]
    compiled_forward: bool
    """Whether serve runs this family through a compiled forward (tune and compile prepare
    one for a device target); an embedding model serves eagerly."""

    def expected(self, config: Mapping[str, Any], ranks: int) -> dict[str, Expected]:
        """Every tensor the checkpoint must hold, with its shape and split."""

    def check_ranks(self, config: Mapping[str, Any], ranks: int) -> None:
        """Refuse a ranks count this model cannot be split into, before any work."""

    def ignores(self, tensor_name: str) -> bool:
        """Tensors some exports carry that the runtime does not need (left out of payloads)."""

    def fused(self, tensor_names: Collection[str]) -> dict[str, tuple[str, ...]]:
        """The payload tensors made of several checkpoint tensors (concatenated on dim 0, in
        the order given) that the runtime computes as one: each replaces its parts."""

    def artifact_kind(self, path: str) -> str | None:
        """What a non-weight source file is to the runtime, or None if it does not ship."""


def check_divides(what: Mapping[str, int], ranks: int, supported: Iterable[int]) -> None:
    """Each count must split evenly over the ranks; say which does not and what would."""
    for key, count in what.items():
        if count % ranks:
            fits = [n for n in supported if all(c % n == 0 for c in what.values())]
            raise InvalidInputError(
                f"--ranks {ranks} does not divide {key}={count}",
                f"use one of: {', '.join(map(str, fits))}",
            )


def check_tensors(
    recipe: Recipe, expected: Mapping[str, Expected], tensors: Mapping[str, SourceTensor]
) -> None:
    """The checkpoint must hold the expected tensors with the shapes config.json implies."""
    for name, want in expected.items():
        got = tensors.get(name)
        if got is None:
            if want.optional:
                continue
            raise FormatError(f"the checkpoint lacks tensor {name}", "is config.json for it?")
        if got.shape != want.shape:
            raise FormatError(
                f"tensor {name} is {list(got.shape)} but config.json implies {list(want.shape)}",
                "the checkpoint and its config.json disagree",
            )
    unexpected = sorted(n for n in set(tensors) - set(expected) if not recipe.ignores(n))
    if unexpected:
        raise FormatError(
            f"the checkpoint holds tensors this recipe does not know: {', '.join(unexpected[:3])}",
            "is config.json's architecture right?",
        )


def default_artifact_kind(path: str) -> str | None:
    return ARTIFACT_KINDS.get(path)
