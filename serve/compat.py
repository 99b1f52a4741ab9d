"""Compatibility: does this package fit this host's runtime, toolchain and devices?

Checked from the manifest alone, before any weight byte moves. Each refusal says what differs
and what to do, because the fix differs: upgrade flare, rebuild the package, or pick a host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flare import toolchain
from flare.errors import FlareError
from flare.store.package import RUNTIME_ABI, Manifest

MIN_REVISION_PREFIX = 7
"""A shorter `--revision` could match a commit by accident."""


class IncompatibleError(FlareError):
    """A package this host cannot run as it is."""

    exit_code = 12


@dataclass(frozen=True)
class HostToolchain:
    """What this host runs packages with."""

    runtime_abi: int
    recipes: Mapping[str, int]
    """Recipe name → the newest version of it this runtime knows."""
    device: str
    devices: int
    torch: str | None = None
    cuda: str | None = None
    gpu_archs: tuple[str, ...] = ()
    flashinfer: str | None = None
    python: str | None = None
    triton: str | None = None
    cpu_isa: str | None = None
    cpu_features: tuple[str, ...] = ()
    forward_code: str | None = None
    compiles: bool = False
    """The server compiles at start (`--compile-on-start`): a package's compiled artifacts
    are not used, so their toolchain need not match."""


def choose_device(asked: str | None) -> str:
    """`--device`: cpu or cuda; by default CUDA where a GPU is, else the CPU."""
    import torch

    if asked is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if asked not in ("cpu", "cuda"):
        raise IncompatibleError(f"unknown device {asked!r}", "use --device cpu or --device cuda")
    if asked == "cuda" and not torch.cuda.is_available():
        raise IncompatibleError(
            "--device cuda, but this host has no usable CUDA device", "use --device cpu"
        )
    return asked


def detect_toolchain(
    device: str, recipes: Mapping[str, int], compiles: bool = False
) -> HostToolchain:
    """This host's toolchain for `device` ("cpu" or "cuda"), read as `flare build` reads the
    build host's (flare/toolchain.py), so the two compare field by field."""
    import torch

    found = toolchain.detect(device)
    return HostToolchain(
        runtime_abi=RUNTIME_ABI,
        recipes=recipes,
        device=device,
        devices=torch.cuda.device_count() if device == "cuda" else 1,
        torch=found["torch"],
        cuda=found.get("cuda"),
        gpu_archs=tuple(found.get("gpu_archs", ())),
        flashinfer=toolchain.package_version("flashinfer-python"),
        python=found["python"],
        triton=found.get("triton"),
        cpu_isa=found.get("cpu_isa"),
        cpu_features=tuple(found.get("cpu_features", ())),
        forward_code=found["forward_code"],
        compiles=compiles,
    )


def check_compatible(
    manifest: Manifest,
    host: HostToolchain,
    revision: str | None = None,
    ranks: tuple[int, ...] | None = None,
) -> None:
    """Refuse a package this host cannot run (`ranks`: the ranks it serves; None: all),
    naming the first difference and the fix."""
    _check_runtime(manifest, host)
    _check_toolchain(manifest, host)
    _check_ranks(manifest, host, len(ranks) if ranks is not None else manifest.ranks)
    if revision is not None:
        check_revision(manifest, revision)


def _check_runtime(manifest: Manifest, host: HostToolchain) -> None:
    abi = manifest.toolchain.runtime_abi
    if abi != host.runtime_abi:
        newer = abi > host.runtime_abi
        raise IncompatibleError(
            f"{manifest.name} needs runtime ABI {abi}; this flare's runtime is ABI "
            f"{host.runtime_abi}",
            "upgrade flare on this host" if newer else "rebuild the package with this flare",
        )
    recipe = manifest.recipe
    known = host.recipes.get(recipe.name)
    if known is None:
        raise IncompatibleError(
            f"{manifest.name} uses recipe {recipe.name} v{recipe.version}, unknown to this runtime",
            f"this runtime serves: {', '.join(sorted(host.recipes))}; upgrade flare",
        )
    if recipe.version > known:
        raise IncompatibleError(
            f"{manifest.name} uses recipe {recipe.name} v{recipe.version}; this runtime knows "
            f"up to v{known}",
            "upgrade flare on this host",
        )


def _check_toolchain(manifest: Manifest, host: HostToolchain) -> None:
    """Compiled artifacts name the target and toolchain they were made with; none named, none
    needed. A server that compiles at start uses none of them."""
    if host.compiles:
        return
    _check_target(manifest, host)
    need = manifest.toolchain
    fix = f"rebuild it on a host like this one (flare build --target {host.device}), or serve it "
    for what, wanted, have in (
        ("torch", need.torch, host.torch),
        ("Python", need.python, host.python),
        ("CUDA", need.cuda, host.cuda),
        ("Triton", need.triton, host.triton),
        ("FlashInfer", need.flashinfer, host.flashinfer),
        ("CPU ISA level", need.cpu_isa, host.cpu_isa),
        ("flare forward code", need.forward_code, host.forward_code),
    ):
        if wanted is not None and wanted != have:
            raise IncompatibleError(
                f"{manifest.name}'s compiled artifacts need {what} {wanted}; this host has "
                f"{have or f'no {what}'} on {host.device}",
                f"{fix}where {what} {wanted} is, or with --compile-on-start",
            )
    missing = sorted(set(need.cpu_features) - set(host.cpu_features))
    if missing:
        raise IncompatibleError(
            f"{manifest.name}'s compiled kernels may use CPU features this host lacks: "
            f"{', '.join(missing)}",
            f"{fix}on a CPU that has them, or with --compile-on-start",
        )
    if need.gpu_archs and not set(host.gpu_archs) & set(need.gpu_archs):
        raise IncompatibleError(
            f"{manifest.name} was compiled for GPU architectures {', '.join(need.gpu_archs)}; "
            f"this host has {', '.join(host.gpu_archs) or 'none'} ({host.device})",
            "rebuild the package on a host with this GPU, serve it on a matching one, or serve "
            "it with --compile-on-start",
        )


def _check_target(manifest: Manifest, host: HostToolchain) -> None:
    """Prepared artifacts are for one device; serving them on another is refused."""
    targets = sorted({a.target for a in manifest.artifacts if a.target is not None})
    if targets and host.device not in targets:
        raise IncompatibleError(
            f"{manifest.name} was prepared for {', '.join(targets)}; this server runs on "
            f"{host.device}",
            f"serve it with --device {targets[0]}, rebuild it with --target {host.device}, or "
            "serve it with --compile-on-start",
        )


def _check_ranks(manifest: Manifest, host: HostToolchain, here: int) -> None:
    """Each rank a host serves takes a GPU of its own on CUDA (a process of its own on CPU,
    which any host can start)."""
    if host.device == "cuda" and here > host.devices:
        raise IncompatibleError(
            f"{manifest.name} is built for {manifest.ranks} ranks, {here} of them on this host; "
            f"this host has {host.devices} cuda device(s)",
            "serve it on a host with enough GPUs, spread the ranks over hosts with "
            f"--rendezvous and flare join, or rebuild it with --ranks {host.devices}",
        )


def check_revision(manifest: Manifest, revision: str) -> None:
    """`--revision` must name the model revision the package was built from."""
    built = manifest.model.revision
    matches = built is not None and (
        revision == built or (len(revision) >= MIN_REVISION_PREFIX and built.startswith(revision))
    )
    if not matches:
        raise IncompatibleError(
            f"{manifest.name} was built from {manifest.model.id}@{built or 'no recorded revision'}"
            f", not revision {revision}",
            "build a package from that revision, or drop --revision",
        )
