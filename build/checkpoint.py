"""The tensors of a checkpoint: every safetensors header read and validated, none loaded."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare.build.sources import Source
from flare.errors import InvalidInputError, NotFoundError, from_os_error
from flare.store.safetensors import FormatError, read_header

SHARD_INDEX = "model.safetensors.index.json"
_HUB_REPO_ID = re.compile(r"^(?!.*(?:--|\.\.))\w(?:[\w.-]{0,94}\w)?/\w(?:[\w.-]{0,94}\w)?$")
"""A hub repo id, ORG/NAME, as the hub allows it; a local path (`/x`, `./x`, `~/x`) is not."""


@dataclass(frozen=True)
class SourceTensor:
    """Where one tensor's bytes are in the checkpoint: file, absolute offset, dtype, shape."""

    name: str
    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def read_config(source: Source) -> dict[str, Any]:
    """config.json, parsed; an unreadable one is a clear error."""
    return read_json_object(source.root / "config.json")


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must be an object, read as serve reads it (UTF-8 text);
    anything else, NaN and Infinity included (not JSON, and no size or setting), is a clear
    error naming the file."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a huge integer, nesting
        raise InvalidInputError(
            f"{path} is not valid JSON: {_problem(exc)}", "fix the checkpoint"
        ) from exc
    if not isinstance(value, dict):
        raise InvalidInputError(f"{path} is not a JSON object", "fix the checkpoint")
    return value


def _problem(exc: Exception) -> str:
    """What is wrong with a JSON file, in words for its author: Python's own for an integer
    too long to read advises raising an interpreter limit, which is not theirs to do."""
    if "integer string conversion" in str(exc):
        return (
            f"an integer of more than {sys.get_int_max_str_digits()} digits, which no setting has"
        )
    return str(exc)


def _no_constant(name: str) -> Any:
    """Python's json reads NaN and Infinity, which JSON does not have: refused."""
    raise ValueError(f"{name} is not a JSON number")


def default_model_id(source: Source, config: Mapping[str, Any], package_name: str) -> str:
    """The model id when --model-id is not given, from what the checkpoint is, never from
    where it lies (a copy in another folder is the same package): a hub-cache snapshot's
    ORG/NAME, else config.json's `_name_or_path` when it is a hub id, else the package name."""
    if source.hub_id is not None:
        return source.hub_id
    claimed = config.get("_name_or_path")
    if isinstance(claimed, str) and _HUB_REPO_ID.match(claimed):
        return claimed
    return package_name


def weight_files(source: Source) -> tuple[str, ...]:
    """The safetensors files holding the weights: the shard index's, else the top-level ones."""
    if SHARD_INDEX in source.files:
        names = sorted(set(_shard_map(source).values()))
        missing = [n for n in names if n not in source.files]
        if missing:
            raise NotFoundError(
                f"{missing[0]} is named in {source.root / SHARD_INDEX} but missing",
                "re-download the checkpoint",
            )
        return tuple(names)
    found = top_level_weights(source.files)
    if not found:
        pickles = [f for f in source.files if f.endswith((".bin", ".pt", ".pth"))]
        hint = "convert it to safetensors first" if pickles else "is this a checkpoint folder?"
        raise NotFoundError(f"no *.safetensors weights in {source.root}", hint)
    return found


def top_level_weights(names: Iterable[str]) -> tuple[str, ...]:
    """The weight files of a checkpoint without a shard index: its top-level safetensors."""
    return tuple(f for f in names if "/" not in f and f.endswith(".safetensors"))


def _shard_map(source: Source) -> dict[str, str]:
    path = source.root / SHARD_INDEX
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidInputError(f"{path} has no valid weight_map", "fix the checkpoint") from exc
    if not isinstance(weight_map, dict):
        raise InvalidInputError(f"{path}: weight_map is not an object", "fix the checkpoint")
    for tensor, file in weight_map.items():
        if not _is_shard_name(file):
            raise InvalidInputError(
                f"{path}: weight_map puts {tensor} in {str(file)[:100]!r}, which is not a "
                "safetensors file of the checkpoint's folder",
                "fix the checkpoint's shard index",
            )
    return {str(k): v for k, v in weight_map.items()}


def _is_shard_name(file: object) -> bool:
    """A shard a weight map may name: a relative path to a .safetensors file that stays in the
    checkpoint's folder (no `..`, no absolute path, no empty part)."""
    if not isinstance(file, str) or not file.endswith(".safetensors") or file.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in file.split("/"))


def read_tensors(source: Source) -> dict[str, SourceTensor]:
    """Every tensor in the weight files, validated, with its place in its file."""
    tensors: dict[str, SourceTensor] = {}
    for name in weight_files(source):
        for tensor in _file_tensors(source.root / name, name):
            if tensor.name in tensors:
                raise FormatError(
                    f"tensor {tensor.name} is in both {tensors[tensor.name].file} and {name}"
                )
            tensors[tensor.name] = tensor
    if SHARD_INDEX in source.files:
        _check_shard_map(source, tensors)
    return tensors


def _file_tensors(path: Path, name: str) -> list[SourceTensor]:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(0)
            header = read_header(handle, size, str(path))
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
    return [
        SourceTensor(e.name, name, header.data_offset + e.start, e.dtype, e.shape, e.nbytes)
        for e in header.tensors.values()
    ]


def _check_shard_map(source: Source, tensors: dict[str, SourceTensor]) -> None:
    for tensor_name, file in _shard_map(source).items():
        where = tensors.get(tensor_name)
        if where is None or where.file != file:
            raise FormatError(
                f"{SHARD_INDEX} puts {tensor_name} in {file}, which does not hold it",
                "the checkpoint is inconsistent; re-download it",
            )
