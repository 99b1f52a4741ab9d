"""A model's sizes as its config.json declares them, checked against its tensors' shapes.

Build and serve both allocate by these numbers (a recipe lists the tensors of every layer,
the runtime makes a module per layer and a KV cache per head), so a config that lies
(`num_hidden_layers: 1000000000`) must be refused before anything is sized by it. The
weights' shapes, from the safetensors headers (build) or the manifest (serve), say what
each size is; one table per recipe says which tensor dimension holds which size. Both
sides read config.json through `read_sizes`, so they agree on keys and defaults.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flare.errors import InvalidInputError
from flare.store.package import Manifest
from flare.store.safetensors import FormatError

Sizes = dict[str, int]


class Shaped(Protocol):
    """A tensor as either side knows it: its whole shape and the file that holds it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def file(self) -> str: ...


@dataclass(frozen=True)
class _Held:
    """A manifest's tensor as `Shaped`: its whole shape, and its payload for the file."""

    shape: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class Witness:
    """A tensor dimension that holds a size (times another size `times`, when given)."""

    key: str
    tensor: str
    dim: int
    times: str | None = None


@dataclass(frozen=True)
class Layout:
    """One recipe's sizes: which keys config.json must give, which default to what, which
    may be absent, which must divide which, and the tensors that witness them."""

    required: tuple[str, ...]
    defaults: Mapping[str, Callable[[Sizes], int]]
    optional: tuple[str, ...]
    layer_prefix: str
    """Per-layer tensors are named `<layer_prefix><index>.`: their count is the layer count."""
    witnesses: tuple[Witness, ...]
    divides: tuple[tuple[str, str], ...] = ()


LAYOUTS: dict[str, Layout] = {
    "llama": Layout(
        required=(
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        ),
        defaults={
            "num_key_value_heads": lambda s: s["num_attention_heads"],
            "head_dim": lambda s: s["hidden_size"] // s["num_attention_heads"],
        },
        optional=("max_position_embeddings",),
        layer_prefix="model.layers.",
        witnesses=(
            Witness("vocab_size", "model.embed_tokens.weight", 0),
            Witness("hidden_size", "model.embed_tokens.weight", 1),
            Witness("intermediate_size", "model.layers.0.mlp.gate_proj.weight", 0),
            Witness("head_dim", "model.layers.0.self_attn.q_norm.weight", 0),
            Witness("num_attention_heads", "model.layers.0.self_attn.q_proj.weight", 0, "head_dim"),
            Witness("num_key_value_heads", "model.layers.0.self_attn.k_proj.weight", 0, "head_dim"),
        ),
    ),
    "bert": Layout(
        required=(
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ),
        defaults={"type_vocab_size": lambda s: 2},
        optional=(),
        layer_prefix="encoder.layer.",
        witnesses=(
            Witness("vocab_size", "embeddings.word_embeddings.weight", 0),
            Witness("hidden_size", "embeddings.word_embeddings.weight", 1),
            Witness("max_position_embeddings", "embeddings.position_embeddings.weight", 0),
            Witness("type_vocab_size", "embeddings.token_type_embeddings.weight", 0),
            Witness("intermediate_size", "encoder.layer.0.intermediate.dense.weight", 0),
        ),
        divides=(("num_attention_heads", "hidden_size"),),
    ),
}
"""Recipe name → its sizes. Every recipe that builds or serves has an entry."""


def read_sizes(recipe: str, config: Mapping[str, Any], where: str = "config.json") -> Sizes:
    """Every size the recipe's model is made with, each a positive integer, defaults filled
    in (a JSON null counts as absent); anything else is a one-line error naming the key."""
    layout = LAYOUTS[recipe]
    sizes = {key: _positive(config, key, where) for key in layout.required}
    for key, default in layout.defaults.items():
        if config.get(key) is None:
            sizes[key] = _default(key, default(sizes), where)
        else:
            sizes[key] = _positive(config, key, where)
    for key in layout.optional:
        if config.get(key) is not None:
            sizes[key] = _positive(config, key, where)
    for part, whole in layout.divides:
        if sizes[whole] % sizes[part]:
            raise InvalidInputError(
                f"{where}: {part} {sizes[part]} does not divide {whole} {sizes[whole]}",
                "fix config.json",
            )
    return sizes


def check_sizes(
    recipe: str, config: Mapping[str, Any], tensors: Mapping[str, Shaped], where: str
) -> Sizes:
    """The config's sizes, once each agrees with the weights: the layer count first (it is
    what a recipe and the runtime loop over), then every size a tensor dimension holds.
    A witness tensor that is absent is left to the full shape check that follows."""
    layout = LAYOUTS[recipe]
    sizes = read_sizes(recipe, config, where)
    _check_layers(layout.layer_prefix, sizes["num_hidden_layers"], tensors, where)
    for witness in layout.witnesses:
        tensor = tensors.get(witness.tensor)
        if tensor is not None and len(tensor.shape) > witness.dim:
            _check_witness(witness, sizes, tensor, where)
    return sizes


def manifest_shapes(manifest: Manifest) -> dict[str, Shaped]:
    """Every tensor of a package with its whole shape (a split part times its parts), and
    the payload that holds it: what `check_sizes` compares a package's config.json with. A
    fused tensor's parts are listed too, with the rows the manifest gives them, so the sizes
    they witness (heads, intermediate size) are checked in either layout."""
    shapes: dict[str, Shaped] = {}
    fused = manifest.recipe.fused or {}
    for payload in manifest.payloads:
        for tensor in payload.tensors:
            shape = list(tensor.shape)
            if tensor.split is not None:
                shape[tensor.split.dim] *= tensor.split.parts
            where = f"payload {payload.digest}"
            shapes[tensor.name] = _Held(tuple(shape), where)
            for part in fused.get(tensor.name, ()):
                shapes[part.name] = _Held((part.rows, *shape[1:]), where)
    return shapes


def _positive(config: Mapping[str, Any], key: str, where: str) -> int:
    if key not in config or config[key] is None:
        raise InvalidInputError(f"{where} lacks {key}", "fix config.json")
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidInputError(
            f"{where}: {key} must be a positive integer, got {_shown(value)}", "fix config.json"
        )
    return value


def _shown(value: Any) -> str:
    """A value short enough for a one-line message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _default(key: str, value: int, where: str) -> int:
    if value <= 0:
        raise InvalidInputError(
            f"{where}: {key} is not given and its default is {value}",
            f"give {key}, or fix the sizes it is computed from",
        )
    return value


def _check_layers(prefix: str, count: int, tensors: Mapping[str, Shaped], where: str) -> None:
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)\.")
    indices = {int(m[1]): t.file for name, t in tensors.items() if (m := pattern.match(name))}
    held = max(indices, default=-1) + 1
    if held == count:
        return
    if held:
        what = f"{held} layers ({prefix}0 to {prefix}{held - 1}, in {_files(indices.values())})"
    else:
        what = f"no {prefix}N tensors (in {_files(t.file for t in tensors.values())})"
    raise FormatError(
        f"{where}: num_hidden_layers is {_shown(count)}, but the weights hold {what}",
        "config.json and the weights disagree; fix config.json or use the weights it is for",
    )


def _check_witness(witness: Witness, sizes: Sizes, tensor: Shaped, where: str) -> None:
    value = sizes[witness.key]
    want = value * (sizes[witness.times] if witness.times else 1)
    got = tensor.shape[witness.dim]
    if got == want:
        return
    said = f"{witness.key} is {_shown(value)}"
    if witness.times:
        said += f" (times {witness.times} {sizes[witness.times]} = {_shown(want)})"
    raise FormatError(
        f"{where}: {said}, but {witness.tensor} in {tensor.file} has {got} on dim {witness.dim}",
        "config.json and the weights disagree; fix config.json or use the weights it is for",
    )


def _files(files: Iterable[str]) -> str:
    names = sorted(set(files))
    if not names:
        return "no weight file"
    return names[0] + (f" and {len(names) - 1} more" if names[1:] else "")


def decode_batch_sizes(max_concurrency: int) -> list[int]:
    """The decode batch sizes a package plans for: powers of two below its max concurrency,
    then the max itself (1, 2, 4, 8, 16, 32 for 32; ..., 32, 48 for 48). Tune measures
    these sizes at build; serve captures a CUDA graph of each, padding a batch to the next."""
    sizes = [1]
    while sizes[-1] * 2 < max_concurrency:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_concurrency:
        sizes.append(max_concurrency)
    return sizes
