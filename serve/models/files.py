"""A package's files as the runtime reads them: artifacts by path, weights by tensor name."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from flare.store.errors import InvalidInputError, NotFoundError
from flare.store.package import Manifest


class PackageFiles:
    """`files` maps each blob's digest text to a local, verified file."""

    def __init__(self, manifest: Manifest, files: Mapping[str, Path]) -> None:
        self.manifest = manifest
        self.files = files

    def artifact(self, path: str) -> Path | None:
        """The local file of an artifact, or None if the package has none at that path."""
        for artifact in self.manifest.artifacts:
            if artifact.path == path:
                return self._local(artifact.digest, path)
        return None

    def json(self, path: str) -> dict[str, Any] | None:
        local = self.artifact(path)
        return None if local is None else json.loads(local.read_text())

    def require_json(self, path: str) -> dict[str, Any]:
        data = self.json(path)
        if data is None:
            raise NotFoundError(f"package {self.manifest.name} has no {path}", "rebuild it")
        return data

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight by its Hugging Face name, memory-mapped from the payload files."""
        for payload in self.manifest.payloads:
            local = self._local(payload.digest, f"payload {payload.digest}")
            with safe_open(str(local), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, reader.get_tensor(name)

    def _local(self, digest: str, what: str) -> Path:
        local = self.files.get(digest)
        if local is None:
            raise NotFoundError(f"no local file for {what} ({digest})", "pull the package again")
        return local


def load_by_name(
    module: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    ignore: Callable[[str], bool] | None = None,
) -> None:
    """Copy tensors into same-named parameters (casting dtype, moving device); refuse a
    package that leaves a parameter unset or holds a tensor the model does not know."""
    params = dict(module.named_parameters())
    missing = set(params)
    for name, tensor in tensors:
        if ignore is not None and ignore(name):
            continue
        if name not in params:
            raise InvalidInputError(f"the package holds tensor {name}, unknown to this model")
        with torch.no_grad():
            params[name].copy_(tensor)
        missing.discard(name)
    if missing:
        raise InvalidInputError(f"the package lacks tensors: {', '.join(sorted(missing)[:3])}")
