"""The llama recipe's fused layout (v2: qkv_proj, gate_up_proj) against the unfused one (v1).

A v1 package is made here as flare made it before the layout changed: the same checkpoint
planned without fusing (the real planner and payload writer), its manifest the v2 package's
with those payloads and recipe version 1. Both must load into the one model class and answer
alike, at one rank and at two (gloo groups between threads); a package that gives a fused
tensor and its parts, lacks a part, or whose fused map says another layout is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_llama
from helpers import cpu_runner, greedy_answer
from multirank_serving import in_threads
from registry_helpers import Quiet

from flare.build.checkpoint import read_config, read_tensors
from flare.build.payloads import store_payload
from flare.build.pipeline import Build, BuildRequest
from flare.build.plan import plan_payloads
from flare.build.recipes.llama import LlamaRecipe
from flare.build.sources import resolve_source
from flare.errors import InvalidInputError
from flare.registry.refs import read_manifest
from flare.registry.registry import Registry
from flare.serve.engine.sequence import SamplingParams
from flare.serve.models import load_model
from flare.serve.models.files import PackageFiles
from flare.serve.models.shard import Shard
from flare.store.hashing import FileState
from flare.store.package import Manifest, canonical_json
from flare.store.safetensors import FormatError

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
Package = tuple[Manifest, dict[str, Path]]


def build_both(checkpoint: Path, tmp: Path, ranks: int) -> tuple[Package, Package]:
    """The checkpoint built by the pipeline (v2), and the same package in the v1 layout."""
    registry = Registry(str(tmp / "registry"), f"sqlite:///{tmp / 'index.db'}")
    request = BuildRequest(
        source=str(checkpoint), name="tiny", staging=tmp / "staging", hub_cache=tmp, ranks=ranks
    )
    digest = Build(request, registry, Quiet()).run().digest
    registry.db.dispose()
    store = registry.store
    fused = read_manifest(store, digest)
    source = resolve_source(str(checkpoint), tmp)
    digests = {f.path: f.digest for f in fused.model.files}
    states = {name: FileState.of((checkpoint / name).stat()) for name in digests}
    expected = LlamaRecipe().expected(read_config(source), ranks)
    plan = plan_payloads(expected, read_tensors(source), digests, ranks)
    entries = []
    for payload in plan:
        put = store_payload(store, payload, source.root, states, lambda _: None)
        entries.append(payload.manifest_entry(str(put.digest), put.size))
    data = fused.model_dump(mode="json", exclude_unset=True)
    data["payloads"] = entries
    data["recipe"] = {**data["recipe"], "version": 1}
    del data["recipe"]["fused"]
    unfused = Manifest.model_validate_json(canonical_json(data))
    blobs = tmp / "blobs"
    blobs.mkdir()
    manifests = (fused, unfused)
    files = {str(d): store.get(d, blobs)[0] for m in manifests for d in m.blobs()}
    return (fused, files), (unfused, files)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Package, Package]:
    """Qwen2: q/k/v biases, so the fused layout has a qkv_proj bias too."""
    root = tmp_path_factory.mktemp("qwen2")
    return build_both(make_llama(root / "checkpoint", "Qwen2ForCausalLM"), root, 1)


def make_biased_llama(folder: Path) -> Path:
    """Llama with `attention_bias` (q/k/v and o_proj biases) and `mlp_bias` (gate/up/down)."""
    import transformers

    make_llama(folder)
    config = transformers.LlamaConfig.from_pretrained(folder)
    config.attention_bias = config.mlp_bias = True
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # transformers starts biases at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Package, Package]:
    root = tmp_path_factory.mktemp("tp2")
    return build_both(make_llama(root / "checkpoint"), root, 2)


def prompt(length: int = 48) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(4)).tolist()


def ranked_answer(package: Package, shard: Shard, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One rank's logits and 16 greedy tokens (all ranks' steps run together)."""
    return greedy_answer(cpu_runner(*package, shard), ids, 16)


def names(manifest: Manifest) -> set[str]:
    return {t.name for p in manifest.payloads for t in p.tensors}


def test_the_two_layouts_are_what_each_recipe_version_says(
    qwen2: tuple[Package, Package],
) -> None:
    (fused, _), (unfused, _) = qwen2
    p = "model.layers.0."
    assert fused.recipe.version == 2 and unfused.recipe.version == 1
    assert {p + "self_attn.qkv_proj.bias", p + "mlp.gate_up_proj.weight"} <= names(fused)
    assert not any("q_proj" in n or "gate_proj" in n for n in names(fused))
    assert {p + "self_attn.q_proj.bias", p + "mlp.up_proj.weight"} <= names(unfused)


def test_an_unfused_package_answers_as_the_fused_one(qwen2: tuple[Package, Package]) -> None:
    ids = prompt()
    fused_logits, fused_tokens = greedy_answer(cpu_runner(*qwen2[0]), ids, 16)
    unfused_logits, unfused_tokens = greedy_answer(cpu_runner(*qwen2[1]), ids, 16)
    assert torch.equal(fused_logits, unfused_logits)
    assert fused_tokens == unfused_tokens


def test_an_unfused_two_rank_package_answers_as_the_fused_one(
    llama_tp2: tuple[Package, Package],
) -> None:
    ids = prompt()
    for package in llama_tp2:
        assert len({p.digest for p in package[0].payloads if len(p.ranks) == 1}) >= 2
    results = [
        in_threads(2, lambda rank, group, p=package: ranked_answer(p, Shard(rank, 2, group), ids))
        for package in llama_tp2
    ]
    (fused, _), (unfused, _) = results
    assert torch.equal(fused[0], unfused[0]) and fused[1] == unfused[1]


def tensors_of(package: Package) -> list[tuple[str, torch.Tensor]]:
    manifest, files = package
    return [(name, tensor.clone()) for name, tensor in PackageFiles(manifest, files).tensors()]


def empty_model(package: Package) -> torch.nn.Module:
    manifest, files = package
    model = load_model(PackageFiles(manifest, files), CPU, torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model


def test_a_package_giving_a_fused_tensor_and_its_part_is_refused(
    qwen2: tuple[Package, Package],
) -> None:
    part = next(t for t in tensors_of(qwen2[1]) if t[0].endswith("0.self_attn.k_proj.weight"))
    with pytest.raises(FormatError, match=r"gives both .*0\.self_attn\.qkv_proj\.weight and its "):
        empty_model(qwen2[0]).load_weights([*tensors_of(qwen2[0]), part])


def test_an_unfused_package_lacking_a_part_is_refused_naming_it(
    qwen2: tuple[Package, Package],
) -> None:
    lacking = [t for t in tensors_of(qwen2[1]) if t[0] != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(InvalidInputError, match=r"lacks tensors: model\.layers\.1\.self_attn\.k_"):
        empty_model(qwen2[1]).load_weights(lacking)


def test_a_fused_map_in_another_order_is_refused(qwen2: tuple[Package, Package]) -> None:
    (manifest, files), _ = qwen2
    data = manifest.model_dump(mode="json", exclude_unset=True)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    data["recipe"]["fused"][name].reverse()
    swapped = Manifest.model_validate_json(canonical_json(data))
    with pytest.raises(
        FormatError, match=r"fuses model\.layers\.0\.mlp\.gate_up_proj\.weight from"
    ):
        load_model(PackageFiles(swapped, files), CPU, torch.float32)


def test_a_llama_with_attention_and_mlp_biases_answers_as_transformers(tmp_path: Path) -> None:
    """Every bias fused or replicated: qkv_proj's and gate_up_proj's are their parts', o_proj's
    and down_proj's are added once after the ranks' sum; at 1 and 2 ranks."""
    checkpoint = make_biased_llama(tmp_path / "checkpoint")
    fused = {}
    for ranks in (1, 2):
        fused[ranks], _ = build_both(checkpoint, tmp_path / f"r{ranks}", ranks)
    assert "model.layers.0.mlp.gate_up_proj.bias" in names(fused[1][0])
    ids = prompt()
    logits, tokens = greedy_answer(cpu_runner(*fused[1]), ids, 16)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    assert (logits - expected).abs().max().item() <= 1e-4
    parts = in_threads(2, lambda rank, group: ranked_answer(fused[2], Shard(rank, 2, group), ids))
    for part_logits, part_tokens in parts:
        assert (part_logits - logits).abs().max().item() <= 1e-4 and part_tokens == tokens
