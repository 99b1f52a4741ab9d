"""A setting of a TOML type it does not take, a NUL byte in a value, and a signing key that is a
folder are each refused as a bad value, one line and exit 4, by every command (docs/config.md,
Validation): never turned into a path named `True`, a level truncated from 3.7, or a crash."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import RunFlare
from registry_helpers import tiny_source

INVALID = 4


def with_config(tmp_path: Path, text: str) -> dict[str, str]:
    config = tmp_path / "c.toml"
    config.write_text(text)
    return {"FLARE_CONFIG": str(config), "FLARE_BUILD_TARGET": ""}  # the file's, if it has one


def refused(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command printed, checked for exit 4 and no traceback."""
    assert done.returncode == INVALID, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "internal error" not in done.stderr, done.stderr
    return done.stderr.strip()


@pytest.mark.parametrize(
    ("section", "key", "value", "kind", "takes"),
    [
        ("store", "zstd_level", "true", "a boolean", "an integer or a string"),
        ("store", "zstd_level", "3.7", "a float", "an integer or a string"),
        ("store", "zstd_level", "3.0", "a float", "an integer or a string"),
        ("paths", "registry", '["a"]', "an array", "a string"),
        ("paths", "registry", "true", "a boolean", "a string"),
        ("paths", "registry", "{ x = 1 }", "a table", "a string"),
        ("paths", "hub_cache", "1979-05-27", "a date", "a string"),
        ("paths", "package_cache", "1979-05-27T07:32:00Z", "a date-time", "a string"),
        ("paths", "kernel_cache", "07:32:00", "a time", "a string"),
        ("paths", "export_staging", "0", "an integer", "a string"),
        ("trust", "file", "false", "a boolean", "a string"),
        ("registry", "database", "5", "an integer", "a string"),
        ("registry", "cache_window", "true", "a boolean", "an integer, a float or a string"),
        ("build", "target", "1", "an integer", "a string"),
        ("memory", "reserve", "1.5", "a float", "an integer or a string"),
        ("memory", "reserve", "true", "a boolean", "an integer or a string"),
        ("serve", "max_body_size", "[4096]", "an array", "an integer or a string"),
        ("serve", "body_timeout", "false", "a boolean", "an integer, a float or a string"),
        ("serve", "stall_timeout", "[60]", "an array", "an integer, a float or a string"),
        ("store", "encoding", "false", "a boolean", "a string"),
        ("signing", "key", "true", "a boolean", "a string"),
        ("signing", "publisher", "7", "an integer", "a string"),
    ],
)
def test_a_value_of_a_type_the_setting_does_not_take_is_refused(
    run_flare: RunFlare, tmp_path: Path, section: str, key: str, value: str, kind: str, takes: str
) -> None:
    env = with_config(tmp_path, f"[{section}]\n{key} = {value}\n")
    message = refused(run_flare("config", "show", env=env))
    assert message.startswith("error: bad value ") and f" for {section}.{key} in file " in message
    assert message.endswith(f": {kind}, where {section}.{key} takes {takes}; see docs/config.md")


def test_the_types_each_setting_takes_are_taken(run_flare: RunFlare, tmp_path: Path) -> None:
    env = with_config(
        tmp_path,
        "[store]\nzstd_level = 5\n"
        "[memory]\nreserve = 1024\n"
        "[serve]\nmax_body_size = 2048\nbody_timeout = 1.5\nstall_timeout = 7\n"
        "[registry]\ncache_window = 0.5\n",
    )
    shown = run_flare("config", "show", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    settings = {k: v["value"] for k, v in json.loads(shown.stdout)["settings"].items()}
    assert settings["store.zstd_level"] == 5 and settings["memory.reserve"] == 1024
    assert settings["serve.max_body_size"] == 2048 and settings["serve.body_timeout"] == 1.5
    assert settings["serve.stall_timeout"] == 7.0 and settings["registry.cache_window"] == 0.5

    quoted = with_config(tmp_path, '[store]\nzstd_level = "9"\n[memory]\nreserve = "6GiB"\n')
    shown = run_flare("config", "show", "--json", env=quoted)
    settings = {k: v["value"] for k, v in json.loads(shown.stdout)["settings"].items()}
    assert settings["store.zstd_level"] == 9 and settings["memory.reserve"] == 6 * 1024**3


def test_the_environment_still_reports_an_unparsable_string(
    run_flare: RunFlare, tmp_path: Path
) -> None:
    done = run_flare("config", "show", env={"FLARE_STORE_ZSTD_LEVEL": "abc"})
    assert refused(done) == (
        "error: bad value 'abc' for store.zstd_level in env FLARE_STORE_ZSTD_LEVEL: "
        "invalid literal for int() with base 10: 'abc'"
    )


def test_a_build_with_a_boolean_registry_makes_no_folder_named_true(
    run_flare: RunFlare, tmp_path: Path
) -> None:
    source = tiny_source(tmp_path / "sources", 0)
    env = with_config(tmp_path, "[paths]\nregistry = true\n")
    done = run_flare("build", str(source), "--name", "z", env=env)
    assert "a boolean, where paths.registry takes a string" in refused(done)
    assert not (tmp_path / "True").exists()


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("paths", "registry"),
        ("paths", "package_cache"),
        ("trust", "file"),
        ("signing", "key"),
        ("registry", "database"),
        ("signing", "publisher"),
    ],
)
@pytest.mark.parametrize("command", [("config", "show"), ("registry", "ls")])
def test_a_nul_byte_in_a_value_is_refused(
    run_flare: RunFlare, tmp_path: Path, section: str, key: str, command: tuple[str, ...]
) -> None:
    env = with_config(tmp_path, f'[{section}]\n{key} = "/tmp/a\\u0000b"\n')
    assert refused(run_flare(*command, env=env)) == (
        f"error: bad value '/tmp/a\\x00b' for {section}.{key} in file {tmp_path / 'c.toml'}: "
        "it holds a NUL byte; remove the \\u0000 escape"
    )


def test_a_signing_key_that_is_a_folder_is_a_bad_value(run_flare: RunFlare, tmp_path: Path) -> None:
    source = tiny_source(tmp_path / "sources", 0)
    (tmp_path / "keys").mkdir()
    hint = "point signing.key at the PEM file flare key generate wrote"
    in_file = with_config(tmp_path, '[signing]\nkey = "keys"\n')  # relative to the file
    for command in (("config", "show"), ("build", str(source), "--name", "z")):
        assert refused(run_flare(*command, env=in_file)) == (
            f"error: bad value '{tmp_path / 'keys'}' for signing.key in file "
            f"{tmp_path / 'c.toml'}: {tmp_path / 'keys'} is a folder, not a key file; {hint}"
        )
    in_env = {"FLARE_SIGNING_KEY": str(tmp_path)}
    assert refused(run_flare("build", str(source), "--name", "z", env=in_env)) == (
        f"error: bad value '{tmp_path}' for signing.key in env FLARE_SIGNING_KEY: "
        f"{tmp_path} is a folder, not a key file; {hint}"
    )


def test_a_missing_signing_key_is_still_a_build_time_error(
    run_flare: RunFlare, tmp_path: Path
) -> None:
    """Only a folder is refused when the config is read: a key not made yet is not checked
    until a build signs with it (exit 3, as before)."""
    env = with_config(tmp_path, '[signing]\nkey = "nokey.pem"\n')
    assert run_flare("config", "show", env=env).returncode == 0
