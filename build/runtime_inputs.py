"""What serve reads from a checkpoint besides the sizes, checked before a build does any work.

A package is signed once and served many times: a config.json setting or a tokenizer file
that the runtime cannot use would be published, signed, pulled, and only then refused as a
malformed package. So each setting the runtime reads (serve/models/llama.py, bert.py) must be
of the type and range it uses, and the text files must load the way serve/package_text.py
loads them (the same tokenizers and Jinja calls; that module is not imported here: it brings
torch, which a build for no device target never loads). Sizes are model_sizes.py's part.
A file whose name is not UTF-8 is left out of a package; one the build needs is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flare.build.checkpoint import SHARD_INDEX, read_json_object, top_level_weights
from flare.build.recipes.base import Recipe
from flare.build.sources import Source, name_problem, shown_name
from flare.errors import InvalidInputError, from_os_error

MAX_POSITIONS = 2**31 - 1
"""The most positions a config may claim: far past any model's, and what an int32 holds."""
ROPE_TYPES = ("default", "llama3")
"""The RoPE scalings the runtime computes (serve/models/llama.py, `Rotary`)."""
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
FIX_CONFIG = "fix config.json"


def check_runtime_inputs(source: Source, config: Mapping[str, Any], recipe: Recipe) -> None:
    """Refuse, exit 4, a checkpoint whose package serve would refuse as malformed: a setting
    of the wrong type or range, a tokenizer or chat template that does not load."""
    where = str(source.root / "config.json")
    CONFIG_CHECKS.get(recipe.name, lambda config, where: None)(config, where)
    _check_text(source, config, recipe)


# -- file names ----------------------------------------------------------------------------


def check_file_names(source: Source, recipe: Recipe) -> None:
    """A file the build would read (a weight file, or one the recipe ships) must have a name
    a package can hold (UTF-8, no backslash), exit 4; others are left out, like dot-files.
    Checked before the weights are looked for, so a weight file is named, not reported
    missing."""
    weights = () if SHARD_INDEX in source.files else top_level_weights(source.unnamed)
    for name in source.unnamed:
        if name in weights or recipe.artifact_kind(name):
            raise InvalidInputError(
                f"{shown_name(source.root / name)}: the build needs this file, but its name "
                f"{name_problem(name)} (a package names its files in UTF-8, with / alone "
                "between folders)",
                "rename it",
            )


# -- config.json ---------------------------------------------------------------------------


def _check_llama(config: Mapping[str, Any], where: str) -> None:
    """The settings serve/models/llama.py reads besides the sizes."""
    _number(config, "rms_norm_eps", where)
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        _flag(config, key, where)
    _count(config, "max_position_embeddings", where, 1)
    _count(config, "sliding_window", where, 0)
    _check_rope(config, where)


def _check_bert(config: Mapping[str, Any], where: str) -> None:
    """The settings serve/models/bert.py reads besides the sizes."""
    _number(config, "layer_norm_eps", where)
    if config.get("hidden_act", "gelu") != "gelu":
        raise InvalidInputError(
            f"{where}: hidden_act {_shown(config.get('hidden_act'))} is not supported",
            "the bert recipe serves gelu",
        )


CONFIG_CHECKS: dict[str, Callable[[Mapping[str, Any], str], None]] = {
    "llama": _check_llama,
    "bert": _check_bert,
}
"""Recipe name → the check of the settings its runtime model reads."""


def _check_rope(config: Mapping[str, Any], where: str) -> None:
    """RoPE settings merged as serve merges them (`rope_parameters` in serve/models/llama.py:
    the top-level rope_theta, then rope_scaling, then rope_parameters), each key named by
    where its value came from."""
    merged: dict[str, Any] = {"rope_theta": config.get("rope_theta", 10000.0)}
    named = {"rope_theta": "rope_theta"}
    for block in ("rope_scaling", "rope_parameters"):
        settings = config.get(block)
        if settings is None:
            continue
        if not isinstance(settings, dict):
            raise InvalidInputError(
                f"{where}: {block} must be an object or null, got {_shown(settings)}", FIX_CONFIG
            )
        merged |= settings
        named |= {key: f"{block}.{key}" for key in settings}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise InvalidInputError(
            f"{where}: RoPE scaling {_shown(rope_type)} is not supported",
            f"supported: {', '.join(ROPE_TYPES)}",
        )
    keys = ("rope_theta", *LLAMA3_ROPE_KEYS) if rope_type == "llama3" else ("rope_theta",)
    for key in keys:
        _number(merged, key, where, named.get(key, key))
    if rope_type == "llama3":
        _count(merged, "original_max_position_embeddings", where, 1, required=True)


def _number(config: Mapping[str, Any], key: str, where: str, shown_key: str | None = None) -> None:
    """A required setting that must be a positive finite number (an epsilon, a RoPE base)."""
    value = config.get(key)
    if not _is_positive_finite(value):
        raise InvalidInputError(
            f"{where}: {shown_key or key} must be a positive finite number, got {_shown(value)}",
            FIX_CONFIG,
        )


def _is_positive_finite(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an integer past float's range: no epsilon or base is that
        return False


def _flag(config: Mapping[str, Any], key: str, where: str) -> None:
    """An optional switch: true, false or null (serve takes any value's truth: "no" is on)."""
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidInputError(
            f"{where}: {key} must be true, false or null, got {_shown(value)}", FIX_CONFIG
        )


def _count(
    config: Mapping[str, Any], key: str, where: str, least: int, required: bool = False
) -> None:
    """An integer setting from `least` to MAX_POSITIONS; null or absent unless required."""
    value = config.get(key)
    if value is None and not required:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= MAX_POSITIONS:
        raise InvalidInputError(
            f"{where}: {key} must be an integer from {least} to {MAX_POSITIONS}, "
            f"got {_shown(value)}",
            FIX_CONFIG,
        )


def _shown(value: Any) -> str:
    """A value short enough for a one-line message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- tokenizer and chat template -----------------------------------------------------------


def _check_text(source: Source, config: Mapping[str, Any], recipe: Recipe) -> None:
    """The text files the package ships, loaded as serve/package_text.py's `read_text` loads
    them: the tokenizer, its settings, the end-of-sequence ids and the chat template. A
    checkpoint without tokenizer.json builds (serve then says the package has none)."""
    shipped = {name for name in source.files if recipe.artifact_kind(name)}

    def path(name: str) -> Path | None:
        return source.root / name if name in shipped else None

    if tokenizer := path("tokenizer.json"):
        _check_tokenizer(tokenizer)
    settings = read_json_object(p) if (p := path("tokenizer_config.json")) else {}
    generation = read_json_object(p) if (p := path("generation_config.json")) else {}
    _check_eos(source, config, generation)
    template = path("chat_template.jinja")
    if template is not None:
        _check_template(_utf8(template), template)
    elif isinstance(text := _template_in_settings(settings), str):
        _check_template(text, source.root / "tokenizer_config.json")


def _utf8(path: Path) -> str:
    """A text file serve decodes as UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
    except UnicodeDecodeError as exc:
        raise InvalidInputError(
            f"{path} is not UTF-8 text (byte {exc.start})", "fix or re-download the file"
        ) from None


def _check_tokenizer(path: Path) -> None:
    """tokenizer.json must load with the call serve makes (`Tokenizer.from_str`)."""
    from tokenizers import Tokenizer  # what builds for no device need, imported when used

    text = _utf8(path)
    try:
        Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises plain Exception for bad input
        problem = " ".join(str(exc).split())
        raise InvalidInputError(
            f"{path} is not a tokenizer the runtime can load ({problem})",
            "fix or re-download the tokenizer files",
        ) from None


def _check_eos(source: Source, config: Mapping[str, Any], generation: Mapping[str, Any]) -> None:
    """The end-of-sequence ids serve takes (generation_config.json's, else config.json's):
    a token id or a list of them."""
    name = "generation_config.json" if "eos_token_id" in generation else "config.json"
    listed = (generation if name == "generation_config.json" else config).get("eos_token_id")
    ids = listed if isinstance(listed, list) else [] if listed is None else [listed]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InvalidInputError(
            f"{source.root / name}: eos_token_id must be a token id or a list of them, "
            f"got {_shown(listed)}",
            f"fix {name}",
        )


def _template_in_settings(settings: Mapping[str, Any]) -> Any:
    """tokenizer_config.json's chat template as serve picks it: the text, or of a list of
    named templates the default one."""
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template


def _check_template(text: str, path: Path) -> None:
    """A chat template must parse in the sandbox serve compiles it in (same options)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    try:
        env.parse(text)
    except TemplateError as exc:
        problem = " ".join(str(exc).split())
        raise InvalidInputError(
            f"{path} holds a chat template that does not parse ({problem})",
            "fix the chat template",
        ) from None
