"""Compatibility checks: each difference between a package and this host is refused, with
what differs and what to do, before anything is copied."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from registry_helpers import Quiet, tiny_source

from flare.build.pipeline import Build, BuildRequest
from flare.registry.registry import Registry
from flare.serve.compat import HostToolchain, IncompatibleError, check_compatible
from flare.store.package import RUNTIME_ABI, Manifest

CPU_HOST = HostToolchain(
    runtime_abi=RUNTIME_ABI,
    recipes={"llama": 2, "bert": 1},
    device="cpu",
    devices=1,
    torch="2.13",
)
GPU_HOST = HostToolchain(
    runtime_abi=RUNTIME_ABI,
    recipes={"llama": 2, "bert": 1},
    device="cuda",
    devices=2,
    torch="2.13",
    cuda="12.8",
    gpu_archs=("sm_90",),
    flashinfer="0.6.1",
)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    root = tmp_path_factory.mktemp("compat")
    registry = Registry(str(root / "registry"), f"sqlite:///{root / 'index.db'}")
    request = BuildRequest(
        source=str(tiny_source(root, 0)),
        name="tiny",
        staging=root / "staging",
        hub_cache=root / "hub",
    )
    return Build(request, registry, Quiet()).run().manifest


def changed(manifest: Manifest, **fields: Any) -> Manifest:
    """The manifest with some top-level or nested fields replaced."""
    data = manifest.model_dump(mode="python")
    for dotted, value in fields.items():
        target = data
        *path, last = dotted.split("__")
        for part in path:
            target = target[part]
        target[last] = value
    return Manifest.model_validate(data, strict=False)


def refusal(manifest: Manifest, host: HostToolchain = CPU_HOST, **kwargs: Any) -> str:
    with pytest.raises(IncompatibleError) as caught:
        check_compatible(manifest, host, **kwargs)
    assert caught.value.exit_code == 12 and caught.value.hint
    return str(caught.value)


def test_a_package_built_here_fits_this_host(manifest: Manifest) -> None:
    check_compatible(manifest, CPU_HOST)
    check_compatible(manifest, GPU_HOST)


def test_a_newer_runtime_abi_asks_for_a_newer_flare(manifest: Manifest) -> None:
    message = refusal(changed(manifest, toolchain__runtime_abi=RUNTIME_ABI + 1))
    assert f"runtime ABI {RUNTIME_ABI + 1}" in message and "upgrade flare" in message


def test_an_older_runtime_abi_asks_for_a_rebuild(manifest: Manifest) -> None:
    host = HostToolchain(RUNTIME_ABI + 1, {"llama": 1}, "cpu", 1)
    assert "rebuild the package" in refusal(manifest, host)


def test_an_unknown_recipe_lists_the_known_ones(manifest: Manifest) -> None:
    message = refusal(changed(manifest, recipe__name="mamba"))
    assert "recipe mamba v2, unknown" in message and "bert, llama" in message


def test_a_newer_recipe_version(manifest: Manifest) -> None:
    assert "knows up to v2" in refusal(changed(manifest, recipe__version=3))


def test_an_older_recipe_version_still_fits(manifest: Manifest) -> None:
    """A llama package built before the fused layout (v1) is still served."""
    assert manifest.recipe.version == 2
    check_compatible(changed(manifest, recipe__version=1, recipe__fused=None), CPU_HOST)


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("torch", "2.9", "need torch 2.9; this host has 2.13"),
        ("cuda", "12.4", "need CUDA 12.4; this host has no CUDA"),
        ("flashinfer", "0.6.1", "need FlashInfer 0.6.1; this host has no FlashInfer"),
    ],
)
def test_compiled_artifacts_need_their_toolchain(
    manifest: Manifest, field: str, value: str, expect: str
) -> None:
    assert expect in refusal(changed(manifest, **{f"toolchain__{field}": value}))


def test_a_gpu_architecture_mismatch(manifest: Manifest) -> None:
    compiled = changed(manifest, toolchain__gpu_archs=("sm_100",))
    message = refusal(compiled, GPU_HOST)
    assert "compiled for GPU architectures sm_100; this host has sm_90" in message
    check_compatible(changed(manifest, toolchain__gpu_archs=("sm_90",)), GPU_HOST)


def test_more_ranks_than_gpus(manifest: Manifest) -> None:
    """Each rank a CUDA host serves takes a GPU; a CPU host starts a process per rank, and a
    host serving one rank of a group (--rendezvous, join) needs one GPU."""
    four = changed(manifest, ranks=4)
    message = refusal(four, GPU_HOST)
    assert "built for 4 ranks, 4 of them on this host; this host has 2 cuda device" in message
    assert "--rendezvous" in message and "--ranks 2" in message
    check_compatible(four, CPU_HOST)
    check_compatible(four, GPU_HOST, ranks=(2,))


def test_a_revision_other_than_the_one_built(manifest: Manifest, tmp_path: Path) -> None:
    pinned = changed(manifest, model__revision="0123456789abcdef")
    check_compatible(pinned, CPU_HOST, revision="0123456789abcdef")
    check_compatible(pinned, CPU_HOST, revision="0123456")
    assert "not revision fedcba9" in refusal(pinned, revision="fedcba9")
    assert "not revision 0123" in refusal(pinned, revision="0123")  # too short to be a prefix
    assert "no recorded revision" in refusal(manifest, revision="0123456")


CPU_TOOLCHAIN = {
    "toolchain__torch": "2.13.0+cpu",
    "toolchain__python": "3.11",
    "toolchain__cpu_isa": "AVX512",
    "toolchain__cpu_features": ("avx512f", "amx_tile"),
    "toolchain__forward_code": "0123abcd",
}
COMPILING_HOST = HostToolchain(
    runtime_abi=RUNTIME_ABI,
    recipes={"llama": 2, "bert": 1},
    device="cpu",
    devices=1,
    torch="2.13.0+cpu",
    python="3.11",
    cpu_isa="AVX512",
    cpu_features=("avx2", "avx512f", "amx_tile"),
    forward_code="0123abcd",
)


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("python", "3.12", "need Python 3.12; this host has 3.11"),
        ("cpu_isa", "AVX2", "need CPU ISA level AVX2; this host has AVX512"),
        ("forward_code", "feedbeef", "need flare forward code feedbeef"),
        ("cpu_features", ("avx512f", "amx_fp16"), "CPU features this host lacks: amx_fp16"),
    ],
)
def test_cpu_artifacts_need_their_toolchain_unless_the_server_compiles(
    manifest: Manifest, field: str, value: Any, expect: str
) -> None:
    compiled = changed(manifest, **{**CPU_TOOLCHAIN, f"toolchain__{field}": value})
    check_compatible(changed(manifest, **CPU_TOOLCHAIN), COMPILING_HOST)
    message = refusal(compiled, COMPILING_HOST)
    assert expect in message and "--compile-on-start" in message
    check_compatible(compiled, replace(COMPILING_HOST, compiles=True))


def test_artifacts_prepared_for_another_device_are_refused(manifest: Manifest) -> None:
    data = manifest.model_dump(mode="python")
    data["artifacts"] = [
        {**data["artifacts"][0], "kind": "compiled", "target": "cuda", "shapes": {}},
        *data["artifacts"][1:],
    ]
    for_gpu = Manifest.model_validate(data, strict=False)
    message = refusal(for_gpu, COMPILING_HOST)
    assert "prepared for cuda; this server runs on cpu" in message
    assert "--device cuda" in message
    check_compatible(for_gpu, replace(COMPILING_HOST, compiles=True))
