"""Weights read through staging buffers (serve/models/staging.py), the GPU's way, driven on
the CPU: large reads into a ring of host buffers, each chunk hashed and copied into one buffer
per payload, its tensors made only once the payload's digest matched the manifest.

Tiny chunks put chunk boundaries inside tensors and make the ring wrap many times; the
package is a real build in a real host cache, whose blobs a test damages as a disk would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from registry_helpers import Quiet
from torch.utils._python_dispatch import TorchDispatchMode

from flare.build.pipeline import Build, BuildRequest
from flare.build.tiny import make_tiny_llama
from flare.errors import IntegrityError
from flare.registry.refs import read_manifest
from flare.registry.registry import Registry
from flare.serve import models
from flare.serve.cache import HostCache
from flare.serve.models.files import PackageFiles
from flare.serve.models.staging import Staging
from flare.store.digest import Digest
from flare.store.hashing import hash_bytes
from flare.store.package import Manifest, Payload
from flare.store.safetensors import FormatError

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Manifest, Path]:
    """The tiny Llama in payloads of at most 64 kB (several of them), built into a registry
    whose store serves as a host cache."""
    root = tmp_path_factory.mktemp("staged")
    source = make_tiny_llama(root / "checkpoint")
    registry = Registry(str(root / "registry"), f"sqlite:///{root / 'index.db'}")
    staging = root / "staging"
    request = BuildRequest(
        source=str(source), name="tiny", staging=staging, hub_cache=root, payload_bytes=64_000
    )
    digest = Build(request, registry, Quiet()).run().digest
    manifest = read_manifest(registry.store, digest)
    registry.db.dispose()
    return manifest, root / "registry"


@pytest.fixture
def cache(built: tuple[Manifest, Path], tmp_path: Path) -> Iterator[tuple[HostCache, Manifest]]:
    """A host cache of its own holding the package's blobs (a test may damage them)."""
    manifest, store = built
    shutil.copytree(store, tmp_path / "cache")
    yield HostCache(tmp_path / "cache"), manifest


def package_files(cache: HostCache, manifest: Manifest) -> PackageFiles:
    return PackageFiles(manifest, cache.files(manifest), cache.quarantine_if_corrupt)


def rot(path: Path, offset: int) -> None:
    """Flip one bit of a read-only blob, as a failing disk would."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def largest(manifest: Manifest) -> Payload:
    return max(manifest.payloads, key=lambda p: p.size)


@pytest.mark.parametrize(("chunk", "slots"), [(7, 2), (4096, 3), (1 << 30, 4)])
def test_staged_tensors_are_the_mapped_ones(
    cache: tuple[HostCache, Manifest], chunk: int, slots: int
) -> None:
    """Every tensor, read in chunks that cut tensors anywhere (7 bytes), cut them at page
    sizes, or hold a whole payload, equals its view in the payload's memory map."""
    host, manifest = cache
    mapped = dict(package_files(host, manifest).tensors(0))
    files = package_files(host, manifest)
    staged = list(files.tensors(0, Staging(CPU, chunk, slots)))
    assert [name for name, _ in staged] == list(mapped)
    for name, tensor in staged:
        want = mapped[name]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(tensor, want), name
    read = files.weights_read
    assert read is not None and read.size == sum(p.size for p in manifest.payloads)
    assert read.seconds > 0


def test_a_payloads_tensors_are_views_of_one_buffer_freed_before_the_next_is_read(
    cache: tuple[HostCache, Manifest],
) -> None:
    """The tensors of a payload share the one buffer its bytes were read into (no copy per
    tensor), and once load_by_name has copied them into the model that buffer is gone before
    the next payload's is made: the device holds the weights and one payload, never two."""
    host, manifest = cache
    assert len(manifest.payloads) >= 3
    buffers: list[weakref.ref[torch.UntypedStorage]] = []
    live_when_read: list[int] = []

    def watched(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            buffer = tensor.untyped_storage()
            if not buffers or buffers[-1]() is not buffer:
                buffers.append(weakref.ref(buffer))
                live_when_read.append(sum(ref() is not None for ref in buffers))
            del buffer
            yield name, tensor
            del tensor

    files = package_files(host, manifest)
    model = empty_model(files, torch.float32)
    model.load_weights(watched(files.tensors(0, Staging(CPU, 4096, 2))))
    assert len(buffers) == len(manifest.payloads)
    assert live_when_read == [1] * len(manifest.payloads)


def test_a_staged_load_casts_into_the_model_as_the_mapped_one_does(
    cache: tuple[HostCache, Manifest],
) -> None:
    """BF16 payloads into a float32 model: every parameter is what the mapped load gives."""
    host, manifest = cache
    mapped = empty_model(package_files(host, manifest), torch.float32)
    mapped.load_weights(package_files(host, manifest).tensors(0))
    staged = empty_model(package_files(host, manifest), torch.float32)
    staged.load_weights(package_files(host, manifest).tensors(0, Staging(CPU, 1000, 3)))
    want = dict(mapped.named_parameters())
    for name, parameter in staged.named_parameters():
        assert parameter.dtype == torch.float32
        assert torch.equal(parameter, want[name]), name


def empty_model(files: PackageFiles, dtype: torch.dtype) -> torch.nn.Module:
    recipe = files.manifest.recipe
    return models.empty_model(
        recipe.name, recipe.version, files.require_json("config.json"), CPU, dtype
    )


@pytest.mark.parametrize("where", ["header", "quarter", "middle", "last"])
def test_a_corrupt_byte_is_refused_before_any_tensor_of_its_payload_and_quarantined(
    cache: tuple[HostCache, Manifest], where: str
) -> None:
    """One flipped bit in the payload's data (the header is intact, so it passes the header
    check) stops the load before any tensor of that payload is handed out; the blob goes to
    the host cache's quarantine, so the next pull fetches it again."""
    host, manifest = cache
    files = package_files(host, manifest)
    payload = largest(manifest)
    path = files.files[str(payload.digest)]
    offsets = {"header": 20, "quarter": payload.size // 4, "middle": payload.size // 2}
    rot(path, offsets.get(where, -1))
    handed: list[str] = []
    with pytest.raises(IntegrityError, match="is corrupt on this host") as refused:
        for name, _ in files.tensors(0, Staging(CPU, 4096, 2)):
            handed.append(name)
    assert "moved it to" in refused.value.hint
    assert not set(handed) & {t.name for t in payload.tensors}
    earlier = manifest.payloads[: manifest.payloads.index(payload)]
    assert handed == [t.name for p in earlier for t in p.tensors]  # those were sound
    assert not path.exists()
    assert list(host.root.joinpath("quarantine").rglob(Digest.parse(payload.digest).hex + "*"))
    assert files.weights_read is None


def test_a_manifest_that_lies_about_a_sound_payload_is_refused_and_nothing_is_moved(
    cache: tuple[HostCache, Manifest],
) -> None:
    """A manifest listing a payload's tensors in another order than the blob holds them is
    refused at the header check, before anything is read onto the device; the blob hashes
    right, so it stays where it is (the package is malformed, not the host cache)."""
    host, manifest = cache
    payload = largest(manifest)
    lying = payload.model_copy(update={"tensors": tuple(reversed(payload.tensors))})
    payloads = [lying if p is payload else p for p in manifest.payloads]
    files = package_files(host, manifest.model_copy(update={"payloads": payloads}))
    with pytest.raises(FormatError, match="the manifest's order puts it at"):
        list(files.tensors(0, Staging(CPU, 4096, 2)))
    assert files.files[str(payload.digest)].exists()


def test_a_truncated_blob_is_refused_and_quarantined(cache: tuple[HostCache, Manifest]) -> None:
    """A blob cut short (a disk full while it was written outside flare, a bad copy) fails
    the size check before anything is read onto the device, and is moved aside as corrupt."""
    host, manifest = cache
    files = package_files(host, manifest)
    payload = largest(manifest)
    path = files.files[str(payload.digest)]
    path.chmod(0o644)
    os.truncate(path, payload.size // 2)
    with pytest.raises(IntegrityError, match="is corrupt on this host"):
        list(files.tensors(0, Staging(CPU, 4096, 2)))
    assert not path.exists()


@pytest.mark.parametrize(("slots", "readers"), [(2, 1), (3, 2), (4, 3)])
def test_staging_reads_any_length_in_chunks_and_hashes_it(
    tmp_path: Path, slots: int, readers: int
) -> None:
    """The core alone: bytes in, the same bytes on the device and their digest out, for an
    empty file, a file of one partial chunk, and one that ends inside the ring's third lap,
    however many reads are in flight at once (each lands and is hashed in order)."""
    for size in (0, 5, 7 * slots * 3 + 4):
        data = os.urandom(size)
        path = tmp_path / f"blob-{size}"
        path.write_bytes(data)
        with open(path, "rb") as handle:
            tensor, digest = Staging(CPU, 7, slots, readers).read(handle.fileno(), size)
        assert tensor.dtype == torch.uint8 and bytes(tensor.numpy()) == data
        assert digest == hash_bytes(data)


def test_staging_needs_a_free_buffer_beside_its_readers() -> None:
    """As many readers as buffers would leave none to copy and hash from: refused."""
    with pytest.raises(ValueError, match="3 readers need more than 3 ring buffers"):
        Staging(CPU, 7, 3, 3)


def test_staging_refuses_a_file_shorter_than_its_size(tmp_path: Path) -> None:
    """A file that ends before the size it was checked at (it shrank meanwhile) is not read
    as if its missing bytes were there."""
    path = tmp_path / "blob"
    path.write_bytes(bytes(20))
    with open(path, "rb") as handle, pytest.raises(EOFError, match="ended at byte 20, 1 short"):
        Staging(CPU, 7, 2).read(handle.fileno(), 21)
    with open(path, "rb") as handle, pytest.raises(EOFError, match="ended at byte 20, 1 short"):
        Staging(CPU, 7, 4, 3).read(handle.fileno(), 35)  # later reads past the end in flight


def test_a_model_started_runs_while_its_weights_arrive_and_has_them_once_awaited(
    cache: tuple[HostCache, Manifest],
) -> None:
    """`start_model` hands the model back before its weights are in (load_runtime warms the
    compiled forward up meanwhile); its parameters keep their tensors (a graph captured
    after holds their addresses), and once awaited they are what `load_model` gives. The
    interpreter's switch interval, short while the weights are read, is back after."""
    host, manifest = cache
    switch = sys.getswitchinterval()
    model, loading = models.start_model(package_files(host, manifest), CPU, torch.float32)
    held = {name: p.data_ptr() for name, p in model.named_parameters()}
    with torch.no_grad():  # the caller may run the model meanwhile: its results are dropped
        model.model.embed_tokens(torch.tensor([[1, 2]]))
    loading.wait()
    assert sys.getswitchinterval() == switch
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == held
    want = dict(
        models.load_model(package_files(host, manifest), CPU, torch.float32).named_parameters()
    )
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, want[name]), name


def test_a_corrupt_payload_read_beside_the_warm_up_fails_the_load_runtime_way(
    cache: tuple[HostCache, Manifest],
) -> None:
    """The weights' thread stops at a corrupt payload; `load_runtime`, which warmed the
    forward up meanwhile, raises that error (not a later one of its own), quarantines the
    blob, and leaves the switch interval as it found it."""
    from flare.serve.runtime import load_runtime

    host, manifest = cache
    path = host.files(manifest)[str(largest(manifest).digest)]
    rot(path, -1)
    switch = sys.getswitchinterval()
    with pytest.raises(IntegrityError, match="is corrupt on this host"):
        load_runtime(
            manifest, host.files(manifest), quarantine=host.quarantine_if_corrupt, cuda_graphs=False
        )
    assert sys.getswitchinterval() == switch
    assert not path.exists()


def test_what_runs_beside_the_read_fails_the_load_once_the_read_has_stopped(
    cache: tuple[HostCache, Manifest],
) -> None:
    """The engine process imports its backends beside the weights' read (`beside_read`):
    it runs once, on the caller's thread, while the weights' thread is started; if it fails,
    `load_runtime` raises its error only once that thread has stopped writing into the model,
    with the switch interval as it was."""
    from flare.serve.runtime import load_runtime
    from flare.serve.thread_names import WEIGHTS_THREAD

    host, manifest = cache
    switch = sys.getswitchinterval()
    seen: list[str | bool] = []

    def fail(compiled: bool) -> None:
        seen.append(threading.current_thread().name)
        raise RuntimeError("no backend here")

    with pytest.raises(RuntimeError, match="no backend here"):
        load_runtime(manifest, host.files(manifest), cuda_graphs=False, beside_read=fail)
    assert seen == [threading.main_thread().name]
    assert not [t for t in threading.enumerate() if t.name == WEIGHTS_THREAD]
    assert sys.getswitchinterval() == switch
    runtime = load_runtime(
        manifest, host.files(manifest), cuda_graphs=False, beside_read=lambda c: seen.append(c)
    )
    assert seen[1:] == [False] and runtime.kind == "generate"  # a CPU package: eager


@pytest.mark.parametrize("compiler", [False, True])
def test_the_compilers_imports_beside_the_read_are_left_out_for_an_eager_forward(
    compiler: bool,
) -> None:
    """The backends' steps left when the package came run beside the read as the forward
    needs them: in a fresh interpreter, as the engine process is, an eager forward's load
    imports neither Dynamo nor Inductor's compiler (half a second of a tiny CPU package's
    start), one that runs Inductor's graphs imports both."""
    script = (
        "import sys\n"
        "from flare.serve.engine_process import _run_left, backend_imports\n"
        f"_run_left(backend_imports('cpu'), compiler={compiler})\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor.compile_fx')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    imported = "['torch._dynamo', 'torch._inductor.compile_fx']" if compiler else "[]"
    assert done.stdout.strip() == imported


def test_an_engine_given_its_package_before_its_backends_reads_beside_them_and_answers(
    cache: tuple[HostCache, Manifest],
) -> None:
    """An engine process handed its package while it still imports (the pull was quicker):
    it takes the package at once and imports its backends beside the weights' read
    (`backend_imports`, the steps left when the package came), then answers greedy requests
    with the tokens an engine loaded in this process gives."""
    from flare.serve.engine_client import start_engine
    from flare.serve.engine_process import EngineProcess, EngineSpec, backend_imports
    from flare.serve.runtime import SamplingParams, load_runtime

    host, manifest = cache
    assert [step.__name__ for step in backend_imports("cpu")] == [
        "_import_dynamo",
        "_import_inductor",
    ]
    on_gpu = [step.__name__ for step in backend_imports("cuda")]  # its forward: flare's kernels
    assert on_gpu == ["_cublas_handle", "_import_flashinfer", "start"]
    files = host.files(manifest)
    spec = EngineSpec(manifest, dict(files), "cpu", host.root, {"cuda_graphs": False})
    client = start_engine(spec, package_files(host, manifest), EngineProcess("cpu"), 60.0)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    try:
        client.start()
        answered = [[t for d in client.submit(p, greedy) for t in d.token_ids] for p in prompts]
    finally:
        client.stop(drain=True)
    local = load_runtime(manifest, files, cuda_graphs=False)
    local.start()
    try:
        expected = [[t for d in local.submit(p, greedy) for t in d.token_ids] for p in prompts]
    finally:
        local.stop(drain=True)
    assert answered == expected and all(len(tokens) == 8 for tokens in answered)


class Allocations(TorchDispatchMode):
    """Every tensor with memory (not on the meta device) the ops run under it make:
    (dtype, elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        made = isinstance(out, torch.Tensor) and func._schema.name.startswith("aten::empty")
        if made and out.device.type != "meta":
            self.made.append((out.dtype, out.numel()))
        return out


def test_a_started_model_is_given_its_memory_once_in_the_dtype_it_runs_in(
    cache: tuple[HostCache, Manifest],
) -> None:
    """A bf16 model's weights get bf16 memory and no float32 copy first: a float32 pass
    would double the model's memory at its peak (an 8B model that fits a 24 GB GPU would not
    load) and, on a GPU, leave the float32 copies in the allocator's cache, out of the KV
    cache's budget. The parameters are all there, in bf16, with the load's values."""
    host, manifest = cache
    files = package_files(host, manifest)
    with Allocations() as seen:
        model, loading = models.start_model(files, CPU, torch.bfloat16)
        loading.wait()
    weights = sum(p.numel() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    in_bf16 = sum(n for dtype, n in seen.made if dtype == torch.bfloat16)
    assert in_bf16 >= weights
    big_float32 = [n for dtype, n in seen.made if dtype == torch.float32 and n > weights // 50]
    assert not big_float32, big_float32  # the rotary table's float32 is all there may be
    want = dict(
        models.load_model(package_files(host, manifest), CPU, torch.bfloat16).named_parameters()
    )
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, want[name]), name
