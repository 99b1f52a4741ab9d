"""Model families, by recipe: the only place that maps a package's recipe to model code.

Each family builds itself from the package's files (`create`) and loads its weights by
Hugging Face tensor name (`load_weights`); `load_model` does both, on the meta device first
so no memory is spent on initial values that the payloads overwrite, and `start_model` does
the same with the weights read on a thread while its caller goes on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flare.errors import FlareError, InvalidInputError
from flare.model_sizes import LAYOUTS, check_sizes, manifest_shapes
from flare.serve import switching
from flare.serve.models.bert import BertEmbedder, Pooling
from flare.serve.models.files import PackageFiles, staging_for
from flare.serve.models.fused import check_layout
from flare.serve.models.llama import LlamaForCausalLM
from flare.serve.models.shard import Shard
from flare.serve.thread_names import WEIGHTS_THREAD, name_os_thread


def _llama(files: PackageFiles, shard: Shard) -> nn.Module:
    model = LlamaForCausalLM(files.require_json("config.json"), shard)
    manifest = files.manifest
    check_layout(manifest.recipe.fused, model.fused_parts(), shard.world, manifest.name)
    return model


def _bert(files: PackageFiles, shard: Shard) -> nn.Module:
    modules = files.json("modules.json", list) or []
    pooling_path = next((m["path"] for m in modules if m.get("type", "").endswith("Pooling")), None)
    pooling = files.json(f"{pooling_path}/config.json") if pooling_path else None
    return BertEmbedder(files.require_json("config.json"), Pooling.from_files(modules, pooling))


Create = Callable[[PackageFiles, Shard], nn.Module]

FAMILIES: dict[tuple[str, int], tuple[str, Create]] = {
    ("llama", 1): ("generate", _llama),
    ("llama", 2): ("generate", _llama),
    ("bert", 1): ("embed", _bert),
}
"""(recipe name, recipe version) → (what the model does, how to build it). llama v1 is the
unfused layout, v2 the fused one: one model serves both (serve/models/fused.py)."""


COMPILED: dict[tuple[str, int], Callable[[dict[str, Any]], nn.Module]] = {
    ("llama", 1): LlamaForCausalLM,
    ("llama", 2): LlamaForCausalLM,
}
"""(recipe name, recipe version) → the generating model a compiled forward is traced from."""


def empty_model(
    recipe: str, version: int, config: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> nn.Module:
    """A model of these shapes whose weights were never set: what `flare build` compiles a
    forward from (weights are the compiled graph's inputs, so their values never matter)."""
    with torch.device("meta"):
        model = COMPILED[(recipe, version)](config)
    return materialize(model, device, dtype)


def model_kind(files: PackageFiles) -> str:
    """ "generate" or "embed", or an error listing the recipes this runtime serves."""
    return _family(files)[0]


def load_model(
    files: PackageFiles, device: torch.device, dtype: torch.dtype, shard: Shard | None = None
) -> nn.Module:
    """The package's model on `device` in `dtype`, weights loaded, in eval mode; with a
    `shard`, that rank's part of it, read from the shared payloads and its own only."""
    model, loading = start_model(files, device, dtype, shard)
    loading.wait()
    return model


class WeightsLoading:
    """A package's weights being copied into a model's parameters on a thread of its own, so
    that the caller may meanwhile run the model (trace and warm up its compiled forward,
    whose results it drops: the values are not yet the weights; capture its CUDA graphs) and
    `wait` before anything counts. The parameters are written in place (their addresses do
    not change), on a CUDA stream of the thread's own that is drained before the thread
    ends. While it runs, the interpreter switches threads quickly (serve/switching.py): the
    load takes the GIL back between its reads and copies, which a busy main thread (imports)
    would otherwise hold for whole switch intervals."""

    def __init__(
        self, model: nn.Module, files: PackageFiles, device: torch.device, rank: int
    ) -> None:
        self._error: BaseException | None = None
        self._quick = True
        """Whether the switch interval is still short for this load (`wait` may be called
        more than once)."""
        switching.quicken()
        self._thread = threading.Thread(
            target=self._load, args=(model, files, device, rank), name=WEIGHTS_THREAD
        )
        self._thread.start()

    def _load(self, model: nn.Module, files: PackageFiles, device: torch.device, rank: int) -> None:
        name_os_thread(WEIGHTS_THREAD)
        try:
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                model.load_weights(files.tensors(rank, staging_for(device)))
            if stream is not None:
                stream.synchronize()
        except BaseException as exc:  # raised again by wait(), on the caller's thread
            self._error = exc

    def wait(self) -> None:
        """Return once every weight is in place, or raise what stopped the load."""
        self._thread.join()
        if self._quick:
            self._quick = False
            switching.relax()
        if self._error is not None:
            raise self._error


def start_model(
    files: PackageFiles, device: torch.device, dtype: torch.dtype, shard: Shard | None = None
) -> tuple[nn.Module, WeightsLoading]:
    """The package's model on `device` in `dtype` and eval mode, its parameters allocated,
    and its weights being loaded into them (`WeightsLoading`: wait before using its
    results); with a `shard`, that rank's part of it, read from the shared payloads and its
    own only. A config the manifest refutes, or that describes no model of the recipe, is
    refused before anything is allocated."""
    shard = shard or Shard()
    create = _family(files)[1]
    _check_config(files)
    manifest = files.manifest
    if manifest.ranks != shard.world:
        raise InvalidInputError(
            f"package {manifest.name} is built for {manifest.ranks} ranks, not {shard.world}"
        )
    shard.split_vocab = any(
        t.name == "model.embed_tokens.weight" and t.split is not None
        for p in manifest.payloads
        for t in p.tensors
    )
    with torch.device("meta"):
        model = _create(create, files, shard)
    model = materialize(model, device, dtype)
    return model, WeightsLoading(model, files, device, shard.rank)


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A model built on the meta device, in eval mode, its tensors given memory on `device`
    once, in the dtype they run in (floating-point ones in `dtype`, others as they are),
    their values undefined until the weights are read. Not `to_empty(device).to(dtype)`:
    that gives every weight float32 memory first (twice a bf16 model's memory at its peak:
    an 8B model that fits a 24 GB GPU would not load; and what the bf16 copies leave of the
    float32 memory, about the model's size, stays in CUDA's caching allocator, out of the KV
    cache's budget), and goes through torch's reference ops, whose first use imports SymPy
    (0.5-0.65 s) before the weights' read can begin."""

    def allocate(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    return model._apply(allocate).eval()


def _check_config(files: PackageFiles) -> None:
    """The config's sizes against the manifest's tensor shapes, before anything is sized by
    them: a signed config.json claiming a billion layers is refused at once, not allocated."""
    recipe = files.manifest.recipe.name
    if recipe not in LAYOUTS:
        return
    config = files.require_json("config.json")
    try:
        check_sizes(recipe, config, manifest_shapes(files.manifest), "config.json")
    except FlareError as exc:
        raise files.malformed("config.json", f"is refused: {exc.what}") from exc


def _create(create: Create, files: PackageFiles, shard: Shard) -> nn.Module:
    """Build the model from the package's config files; a config that does not describe a
    model of the recipe (a missing key, a wrong type) is a malformed package, said so."""
    try:
        return create(files, shard)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as exc:
        recipe = files.manifest.recipe.name
        problem = f"does not describe a {recipe} model ({type(exc).__name__}: {exc})"
        raise files.malformed("config.json", problem) from exc


def _family(files: PackageFiles) -> tuple[str, Create]:
    recipe = files.manifest.recipe
    family = FAMILIES.get((recipe.name, recipe.version))
    if family is None:
        supported = ", ".join(f"{name} v{version}" for name, version in FAMILIES)
        raise InvalidInputError(
            f"package {files.manifest.name} uses recipe {recipe.name} v{recipe.version}, "
            "which this runtime cannot serve",
            f"supported: {supported}",
        )
    return family


def served_recipes() -> dict[str, int]:
    """Recipe name → the newest version of it this runtime serves (for compatibility checks)."""
    newest: dict[str, int] = {}
    for name, version in FAMILIES:
        newest[name] = max(version, newest.get(name, 0))
    return newest
