"""flare's one config file, `~/.config/flare/config.toml`, with every value overridable by
an environment variable. With no config at all, everything lives under one local folder
(`FLARE_HOME`, default `~/.local/share/flare`)."""

from __future__ import annotations

import datetime
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare.atomic import write_file_atomic
from flare.errors import InvalidInputError, NotFoundError
from flare.store.backends import normalize_location
from flare.store.encoding import Encoding, check_zstd_level
from flare.toolchain import TARGETS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """Bytes from `4G`, `512MiB`, `1.5T` or a plain number (units are powers of 1024)."""
    if isinstance(text, bool) or not isinstance(text, str | int):
        raise InvalidInputError(f"not a size: {text!r}", "use e.g. 512M, 4G or 4GiB")
    match = _SIZE.match(str(text))
    if not match:
        raise InvalidInputError(f"not a size: {text!r}", "use e.g. 512M, 4G or 4GiB")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** _UNITS[unit.lower()])


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds from `90`, `30s`, `15m`, `1h` or `2d`."""
    match = _DURATION.match(str(text).lower())
    if not match:
        raise InvalidInputError(f"not a duration: {text!r}", "use e.g. 30s, 15m, 1h or 2d")
    return float(match[1]) * _SECONDS[match[2]]


def _path(text: str | Path) -> Path:
    return Path(text).expanduser().absolute()


def _optional_path(text: str | Path) -> Path | None:
    return Path(text).expanduser().absolute() if str(text) else None


def _key_path(text: str | Path) -> Path | None:
    """signing.key: a path or empty; a folder is never a key file, so it is refused here, as a
    bad value, rather than when a build first reads it."""
    path = _optional_path(text)
    if path is not None and path.is_dir():
        raise InvalidInputError(
            f"{path} is a folder, not a key file",
            "point signing.key at the PEM file flare key generate wrote",
        )
    return path


def _optional_duration(text: str) -> float | None:
    return parse_duration(text) if str(text).strip() else None


def parse_target(text: str) -> str:
    """A build target: cpu, cuda, none (prepare nothing), or auto (the build host's device)."""
    choices = (*TARGETS, "auto")
    if text not in choices:
        raise InvalidInputError(
            f"unknown build target {text!r}", f"use one of {', '.join(choices)}"
        )
    return text


def _level(text: str | int) -> int:
    return check_zstd_level(int(text))


def parse_body_size(text: str | int) -> int:
    """A size (as parse_size) of at least one byte: the most a request body may hold."""
    size = parse_size(text)
    if size < 1:
        raise InvalidInputError(f"a body limit of {size} bytes takes no request", "use e.g. 4M")
    return size


def parse_timeout(text: str | int | float) -> float:
    """A duration (as parse_duration) longer than zero."""
    seconds = parse_duration(str(text))
    if seconds <= 0:
        raise InvalidInputError(f"a timeout of {seconds:g} s waits for nothing", "use e.g. 30s")
    return seconds


_STRING: tuple[type, ...] = (str,)
_SIZE_TYPES: tuple[type, ...] = (int, str)
_DURATION_TYPES: tuple[type, ...] = (int, float, str)


@dataclass(frozen=True)
class Setting:
    """One configurable value: its key in the file, its variable, how to read it."""

    key: str
    env: str
    parse: Callable[[Any], Any]
    default: Callable[[Path, Mapping[str, str]], Any]
    help: str
    takes: tuple[type, ...] = _STRING
    """The TOML types the file may give it (the environment gives strings): any other is
    refused before `parse` sees it, so a boolean or an array never becomes a path."""


def _hub_cache_default(_home: Path, env: Mapping[str, str]) -> str:
    """The Hugging Face cache, where checkpoints already are (it is read, never written)."""
    if cache := env.get("HF_HUB_CACHE"):
        return cache
    hf_home = env.get("HF_HOME") or "~/.cache/huggingface"
    return f"{hf_home}/hub"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "paths.hub_cache",
        "FLARE_HUB_CACHE",
        _path,
        _hub_cache_default,
        "Hugging Face hub cache that ORG/NAME sources resolve in",
    ),
    Setting(
        "paths.kernel_cache",
        "FLARE_KERNEL_CACHE",
        _path,
        lambda h, _e: h / "kernels",
        "compiled kernels and tuning records (keep it on a local disk)",
    ),
    Setting(
        "paths.package_cache",
        "FLARE_PACKAGE_CACHE",
        _path,
        lambda h, _e: h / "packages",
        "this host's cache of pulled packages",
    ),
    Setting(
        "paths.export_staging",
        "FLARE_EXPORT_STAGING",
        _path,
        lambda h, _e: h / "staging",
        "build staging area and journals",
    ),
    Setting(
        "build.target",
        "FLARE_BUILD_TARGET",
        parse_target,
        lambda _h, _e: "auto",
        "what builds prepare for: cpu, cuda, none, or auto (the build host's device)",
    ),
    Setting(
        "paths.registry",
        "FLARE_REGISTRY",
        normalize_location,
        lambda h, _e: h / "registry",
        "the registry: a folder, a NAS mount or an fsspec URL",
    ),
    Setting(
        "registry.database",
        "FLARE_DATABASE",
        str,
        lambda _h, _e: "",
        "index DB URL; empty: SQLite beside the registry's blobs, or this host's own",
    ),
    Setting(
        "registry.cache_window",
        "FLARE_CACHE_WINDOW",
        _optional_duration,
        lambda _h, _e: "",
        "how stale a network filesystem's listings may be; empty: by its type",
        _DURATION_TYPES,
    ),
    Setting(
        "memory.reserve",
        "FLARE_MEMORY_RESERVE",
        parse_size,
        lambda _h, _e: "4G",
        "device memory left free when serving",
        _SIZE_TYPES,
    ),
    Setting(
        "serve.max_body_size",
        "FLARE_SERVE_MAX_BODY_SIZE",
        parse_body_size,
        lambda _h, _e: "4M",
        "largest request body flare serve takes (413 past it)",
        _SIZE_TYPES,
    ),
    Setting(
        "serve.body_timeout",
        "FLARE_SERVE_BODY_TIMEOUT",
        parse_timeout,
        lambda _h, _e: "30s",
        "time a request body may take to arrive at flare serve (408 past it)",
        _DURATION_TYPES,
    ),
    Setting(
        "serve.stall_timeout",
        "FLARE_SERVE_STALL_TIMEOUT",
        parse_timeout,
        lambda _h, _e: "60s",
        "time flare serve's engine may have work and finish no step (/health 503 past it)",
        _DURATION_TYPES,
    ),
    Setting(
        "store.encoding",
        "FLARE_STORE_ENCODING",
        Encoding.from_name,
        lambda _h, _e: "plain",
        "how new blobs are kept: plain or zstd",
    ),
    Setting(
        "store.zstd_level",
        "FLARE_STORE_ZSTD_LEVEL",
        _level,
        lambda _h, _e: 3,
        "zstd level for new blobs when encoding is zstd",
        (int, str),
    ),
    Setting(
        "signing.key",
        "FLARE_SIGNING_KEY",
        _key_path,
        lambda _h, _e: "",
        "private key builds are signed with; empty: builds are unsigned",
    ),
    Setting(
        "signing.publisher",
        "FLARE_PUBLISHER",
        str,
        lambda _h, _e: "",
        "publisher name signatures carry",
    ),
    Setting(
        "trust.file",
        "FLARE_TRUST_FILE",
        _path,
        lambda _h, e: config_file(e).parent / "trust.toml",
        "trust policy: trusted publishers and revoked keys (flare trust)",
    ),
)
_BY_KEY = {s.key: s for s in SETTINGS}


@dataclass(frozen=True)
class Value:
    """An effective setting and where it came from."""

    value: Any
    source: str


@dataclass(frozen=True)
class Config:
    """Every effective setting, each with its source."""

    file: Path
    home: Path
    values: Mapping[str, Value]

    def __getitem__(self, key: str) -> Any:
        return self.values[key].value

    @property
    def registry(self) -> str:
        return self["paths.registry"]

    @property
    def database(self) -> str:
        return self["registry.database"]

    @property
    def cache_window(self) -> float | None:
        return self["registry.cache_window"]

    @property
    def store_encoding(self) -> Encoding:
        return self["store.encoding"]

    @property
    def zstd_level(self) -> int:
        return self["store.zstd_level"]


def flare_home(env: Mapping[str, str]) -> Path:
    """FLARE_HOME, else flare under XDG_DATA_HOME (default ~/.local/share)."""
    if home := env.get("FLARE_HOME"):
        return Path(home).expanduser().absolute()
    data = env.get("XDG_DATA_HOME") or "~/.local/share"
    return (Path(data).expanduser() / "flare").absolute()


def config_file(env: Mapping[str, str]) -> Path:
    """FLARE_CONFIG, else config.toml under XDG_CONFIG_HOME (default ~/.config)/flare."""
    if explicit := env.get("FLARE_CONFIG"):
        return Path(explicit).expanduser()
    base = env.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "flare" / "config.toml"


def read_file(path: Path, required: bool) -> dict[str, Any]:
    """The file's settings flattened to `section.key`; unknown keys are refused."""
    if not path.exists():
        if required:
            raise NotFoundError(f"FLARE_CONFIG names {path}, which does not exist", "fix the path")
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path} is not valid TOML: {exc}", "fix the file") from exc
    flat = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise InvalidInputError(f"{path}: {section} must be a [table]", "see docs/config.md")
        flat.update({f"{section}.{key}": value for key, value in table.items()})
    unknown = sorted(set(flat) - set(_BY_KEY))
    if unknown:
        raise InvalidInputError(
            f"{path}: unknown setting {', '.join(unknown)}", f"known: {', '.join(_BY_KEY)}"
        )
    return flat


_PATH_PARSERS = (_path, normalize_location, _optional_path, _key_path)
"""Parsers whose value, written relative in the file, is relative to the file's folder."""

_TOML_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),  # before int: a TOML boolean is a Python int too
    (str, "a string"),
    (int, "an integer"),
    (float, "a float"),
    (list, "an array"),
    (dict, "a table"),
    (datetime.datetime, "a date-time"),  # before date: a datetime is a date too
    (datetime.date, "a date"),
    (datetime.time, "a time"),
)


def _toml_type(kind: type) -> str:
    """What TOML calls a type tomllib gives values of."""
    return next((name for known, name in _TOML_TYPES if issubclass(kind, known)), kind.__name__)


def _shown(raw: Any) -> str:
    """A raw value as the error shows it: as written in TOML for a boolean, else its repr."""
    return ("true" if raw else "false") if isinstance(raw, bool) else repr(raw)


def _check_raw(setting: Setting, raw: Any, source: str) -> None:
    """Refuse a value from the file or the environment of a TOML type the setting does not
    take, and a string with a NUL byte (no path, URL or name holds one), before it is parsed:
    parsers call str() and int() on what they get, which would take nearly anything."""
    taken = isinstance(raw, setting.takes) and not (
        isinstance(raw, bool) and bool not in setting.takes
    )
    if not taken:
        *others, last = [_toml_type(kind) for kind in setting.takes]
        takes = f"{', '.join(others)} or {last}" if others else last
        raise InvalidInputError(
            f"bad value {_shown(raw)} for {setting.key} in {source}: "
            f"{_toml_type(type(raw))}, where {setting.key} takes {takes}",
            "see docs/config.md",
        )
    if isinstance(raw, str) and "\0" in raw:
        raise InvalidInputError(
            f"bad value {raw!r} for {setting.key} in {source}: it holds a NUL byte",
            "remove the \\u0000 escape",
        )


def _parse(setting: Setting, raw: Any, source: str) -> Value:
    try:
        return Value(setting.parse(raw), source)
    except (ValueError, TypeError, InvalidInputError) as exc:
        raise InvalidInputError(f"bad value {raw!r} for {setting.key} in {source}: {exc}") from exc


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """The effective config: environment over config file over defaults."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if v != ""}
    path = config_file(env)
    from_file = read_file(path, required="FLARE_CONFIG" in env)
    home = flare_home(env)
    values = {}
    for setting in SETTINGS:
        if setting.env in env:
            source = f"env {setting.env}"
            _check_raw(setting, env[setting.env], source)
            values[setting.key] = _parse(setting, env[setting.env], source)
        elif setting.key in from_file:
            raw, source = from_file[setting.key], f"file {path}"
            _check_raw(setting, raw, source)
            if setting.parse in _PATH_PARSERS and raw and "://" not in raw:
                raw = str(path.parent / Path(raw).expanduser())
            values[setting.key] = _parse(setting, raw, source)
        else:
            source = (
                "default (Hugging Face cache)" if setting.key == "paths.hub_cache" else "default"
            )
            values[setting.key] = _parse(setting, setting.default(home, env), source)
    return Config(file=path, home=home, values=values)


def record_signing_key(path: Path, key: Path, publisher: str) -> None:
    """Make a key this host's signing key by adding a [signing] table to the config file.

    The user's file is appended to, never rewritten, so their settings and comments stay as
    they wrote them; a file that already has [signing] settings is left for them to edit.
    """
    check_signing_unset(path)
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    table = f"[signing]\nkey = {json.dumps(str(key))}\npublisher = {json.dumps(publisher)}\n"
    write_file_atomic(path, (text + ("\n" if text else "") + table).encode())


def check_signing_unset(path: Path) -> None:
    """Refuse to add a [signing] table to a config file that already has one."""
    settings = read_file(path, required=False)
    if any(key.startswith("signing.") for key in settings):
        key, publisher = settings.get("signing.key", ""), settings.get("signing.publisher", "")
        raise InvalidInputError(
            f"this host already signs builds with {key or 'a key'} as {publisher or 'its owner'} "
            f"([signing] in {path})",
            "keep that key, or make one that is not this host's default: flare key generate "
            "--publisher NAME --no-default --out FILE (flare sign --key FILE signs with it)",
        )
