"""A build publishes only what serve can use: files whose names are not UTF-8 are left out
(or, where the build needs one, refused naming it), and a config setting, tokenizer or chat
template that serve would refuse as malformed is refused at build, exit 4, naming the file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from checkpoints import make_llama
from test_build import build
from test_build_inputs import copy, edit_config, flare, minilm, one_line_error, stored_files

from flare.errors import InvalidInputError


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("llama") / "ckpt")


def named(folder: Path, raw: bytes) -> Path:
    """A path under folder whose name is these bytes (not UTF-8, as a tester made them)."""
    return folder / os.fsdecode(raw)


# -- file names that are not UTF-8 -------------------------------------------------------------


def test_a_file_not_needed_with_a_name_not_utf8_is_left_out(llama: Path, tmp_path: Path) -> None:
    plain = build(llama, tmp_path / "plain")[0]
    source = copy(llama, tmp_path / "ckpt")
    named(source, b"\xff\xfe.json").write_text("{}")
    named(source, b"sub\xff").mkdir()
    (named(source, b"sub\xff") / "notes.txt").write_text("notes")
    digest, manifest, _, _ = build(source, tmp_path / "odd")
    assert digest == plain
    assert all(os.fsencode(f.path) == f.path.encode() for f in manifest.model.files)


def test_a_weight_file_with_a_name_not_utf8_is_refused_naming_it(
    llama: Path, tmp_path: Path
) -> None:
    source = copy(llama, tmp_path / "ckpt")
    (source / "model.safetensors").rename(named(source, b"mod\xffel.safetensors"))
    result = flare(tmp_path / "home", "build", str(source), "--name", "tiny")
    assert result.returncode == 4, result.stderr
    line = one_line_error(result)
    assert f"{source}/mod\\xffel.safetensors: the build needs this file" in line
    assert "not UTF-8" in line and "rename it" in line
    assert stored_files(tmp_path / "home" / "registry" / "blobs") == []


def test_a_file_not_needed_with_a_backslash_in_its_name_is_left_out(
    llama: Path, tmp_path: Path
) -> None:
    """A backslash is a folder separator on other systems: a package cannot name such a file.
    It is left out with a note, before any work, not refused once everything was stored."""
    plain = build(llama, tmp_path / "plain")[0]
    source = copy(llama, tmp_path / "ckpt")
    (source / "notes\\old.txt").write_text("notes")
    result = flare(tmp_path / "home", "build", str(source), "--name", "tiny", "--json")
    assert result.returncode == 0, result.stderr
    assert "left out files whose names a package cannot hold" in result.stderr
    assert json.loads(result.stdout)["digest"] == str(plain)


def test_a_weight_file_with_a_backslash_in_its_name_is_refused_before_any_work(
    llama: Path, tmp_path: Path
) -> None:
    source = copy(llama, tmp_path / "ckpt")
    (source / "model.safetensors").rename(source / "mod\\el.safetensors")
    result = flare(tmp_path / "home", "build", str(source), "--name", "tiny")
    assert result.returncode == 4, result.stderr
    line = one_line_error(result)
    assert "the build needs this file, but its name holds a backslash" in line
    assert stored_files(tmp_path / "home" / "registry" / "blobs") == []


def test_a_source_folder_named_not_utf8_builds_and_checks(llama: Path, tmp_path: Path) -> None:
    source = copy(llama, named(tmp_path, b"lab\xff") / "ckpt")
    home = tmp_path / "home"
    built = flare(home, "build", str(source), "--name", "tiny", "--json")
    assert built.returncode == 0, built.stderr
    check = flare(home, "build", "--check", "tiny", "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["identical"] is True


# -- settings and text files serve would refuse ------------------------------------------------


def raw_config(text_from: str, text_to: str) -> Any:
    def edit(folder: Path) -> None:
        path = folder / "config.json"
        text = path.read_text()
        assert text_from in text
        path.write_text(text.replace(text_from, text_to))

    return edit


def config(**changes: Any) -> Any:
    return lambda folder: edit_config(folder, **changes)


def write(name: str, data: bytes) -> Any:
    return lambda folder: (folder / name).write_bytes(data)


RANDOM = bytes(range(128, 256)) * 2
"""Bytes that are not UTF-8 (the tester's random bytes, made the same every run)."""

MALFORMED = [
    ("tokenizer-bytes", write("tokenizer.json", RANDOM), "tokenizer.json is not UTF-8 text"),
    ("tokenizer-object", write("tokenizer.json", b'{"a":1}'),
     "tokenizer.json is not a tokenizer the runtime can load"),
    ("tokenizer-config", write("tokenizer_config.json", b"garbage{"),
     "tokenizer_config.json is not valid JSON"),
    ("chat-template", write("chat_template.jinja", b"{% for m in messages %}"),
     "chat_template.jinja holds a chat template that does not parse"),
    ("generation-eos", write("generation_config.json", b'{"eos_token_id": "end"}'),
     "generation_config.json: eos_token_id must be a token id or a list of them"),
    ("rope-theta", config(rope_theta="abc", rope_parameters={"rope_type": "default"}),
     "config.json: rope_theta must be a positive finite number, got 'abc'"),
    ("rope-parameters", config(rope_parameters={"rope_theta": "abc"}),
     "config.json: rope_parameters.rope_theta must be a positive finite number"),
    ("rope-type", config(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"}),
     "config.json: RoPE scaling 'yarn' is not supported"),
    ("tie", config(tie_word_embeddings="yes"),
     "config.json: tie_word_embeddings must be true, false or null, got 'yes'"),
    ("eps", config(rms_norm_eps=-1), "config.json: rms_norm_eps must be a positive finite"),
    ("positions", config(max_position_embeddings=10**30),
     "config.json: max_position_embeddings must be an integer from 1 to 2147483647"),
    ("infinity", raw_config('"rms_norm_eps": 1e-06', '"rms_norm_eps": Infinity'),
     "config.json is not valid JSON: Infinity is not a JSON number"),
    ("nan", raw_config('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'),
     "config.json is not valid JSON: NaN is not a JSON number"),
    ("huge-integer", raw_config('"rms_norm_eps": 1e-06', '"rms_norm_eps": ' + "9" * 5000),
     "config.json is not valid JSON: an integer of more than 4300 digits, which no setting"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "said"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_what_serve_would_refuse_is_refused_at_build(
    llama: Path, tmp_path: Path, edit: Any, said: str
) -> None:
    source = copy(llama, tmp_path / "ckpt")
    edit(source)
    with pytest.raises(InvalidInputError) as info:
        build(source, tmp_path)
    assert f"{source}/{said}" in str(info.value)
    assert stored_files(tmp_path / "registry" / "blobs") == []


def test_the_cli_says_it_in_one_line_with_exit_4(llama: Path, tmp_path: Path) -> None:
    source = edit_config(copy(llama, tmp_path / "ckpt"), tie_word_embeddings="yes")
    result = flare(tmp_path / "home", "build", str(source), "--name", "tiny")
    assert result.returncode == 4, result.stderr
    assert one_line_error(result) == (
        f"error: {source / 'config.json'}: tie_word_embeddings must be true, false or null, "
        "got 'yes'; fix config.json"
    )


def test_a_bert_layer_norm_epsilon_is_checked(tmp_path: Path) -> None:
    source = edit_config(copy(minilm(), tmp_path / "ckpt"), layer_norm_eps="small")
    with pytest.raises(InvalidInputError, match="layer_norm_eps must be a positive finite"):
        build(source, tmp_path)


def test_a_checkpoint_without_a_tokenizer_still_builds(llama: Path, tmp_path: Path) -> None:
    """serve says a package without tokenizer.json has none (not that it is malformed)."""
    source = copy(llama, tmp_path / "ckpt")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (source / name).unlink()
    shutil.rmtree(tmp_path / "registry", ignore_errors=True)
    manifest = build(source, tmp_path)[1]
    assert "tokenizer.json" not in {f.path for f in manifest.model.files}


@pytest.mark.parametrize(
    "shard", ["../../elsewhere/model.safetensors", "/etc/model.safetensors", 3, "a//b.safetensors"]
)
def test_a_shard_index_naming_a_file_outside_the_folder_is_invalid(
    tmp_path: Path, shard: object
) -> None:
    """A weight map's file must be a safetensors file inside the checkpoint: else the index is
    bad (exit 4), not a download to redo (exit 3)."""
    source = make_llama(tmp_path / "ckpt", shard_size="20KB")
    index = source / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(InvalidInputError) as info:
        build(source, tmp_path)
    assert f"weight_map puts {first} in" in str(info.value)
    assert "not a safetensors file of the checkpoint's folder" in str(info.value)
