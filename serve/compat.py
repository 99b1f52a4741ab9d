"""Compatibility: does this package fit this host's runtime, toolchain and devices?

Checked from the manifest alone, before any weight byte moves. Each refusal says what differs
and what to do, because the fix differs: upgrade flare, rebuild the package, or pick a host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from flare.store.errors import FlareError
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


def detect_toolchain(device: str, recipes: Mapping[str, int]) -> HostToolchain:
    """This host's toolchain for `device` ("cpu" or "cuda"), read from the libraries present."""
    import torch

    cuda = device == "cuda"
    archs: tuple[str, ...] = ()
    if cuda:
        count = torch.cuda.device_count()
        archs = tuple(sorted({_arch(torch.cuda.get_device_capability(i)) for i in range(count)}))
    return HostToolchain(
        runtime_abi=RUNTIME_ABI,
        recipes=recipes,
        device=device,
        devices=torch.cuda.device_count() if cuda else 1,
        torch=_major_minor(torch.__version__),
        cuda=torch.version.cuda if cuda else None,
        gpu_archs=archs,
        flashinfer=_flashinfer_version(),
    )


def _arch(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _flashinfer_version() -> str | None:
    try:
        return version("flashinfer-python")
    except PackageNotFoundError:
        return None


def check_compatible(manifest: Manifest, host: HostToolchain, revision: str | None = None) -> None:
    """Refuse a package this host cannot run, naming the first difference and the fix."""
    _check_runtime(manifest, host)
    _check_toolchain(manifest, host)
    _check_ranks(manifest, host)
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
    """Compiled artifacts name the toolchain they were made with; none named, none needed."""
    need = manifest.toolchain
    for what, wanted, have in (
        ("torch", need.torch, host.torch),
        ("CUDA", need.cuda, host.cuda),
        ("FlashInfer", need.flashinfer, host.flashinfer),
    ):
        if wanted is not None and wanted != have:
            raise IncompatibleError(
                f"{manifest.name}'s compiled artifacts need {what} {wanted}; this host has "
                f"{have or f'no {what}'} on {host.device}",
                f"rebuild the package on a host like this one, or serve it where {what} "
                f"{wanted} is",
            )
    if need.gpu_archs and not set(host.gpu_archs) & set(need.gpu_archs):
        raise IncompatibleError(
            f"{manifest.name} was compiled for GPU architectures {', '.join(need.gpu_archs)}; "
            f"this host has {', '.join(host.gpu_archs) or 'none'} ({host.device})",
            "rebuild the package on a host with this GPU, or serve it on a matching one",
        )


def _check_ranks(manifest: Manifest, host: HostToolchain) -> None:
    if manifest.ranks > host.devices:
        raise IncompatibleError(
            f"{manifest.name} is built for {manifest.ranks} ranks; this host has "
            f"{host.devices} {host.device} device(s)",
            f"serve it on a host with enough GPUs, or rebuild it with --ranks {host.devices}",
        )
    if manifest.ranks > 1:
        raise IncompatibleError(
            f"{manifest.name} is built for {manifest.ranks} ranks; this runtime serves "
            "one rank per package so far",
            "rebuild it with --ranks 1 to serve it",
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
