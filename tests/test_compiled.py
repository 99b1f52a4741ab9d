"""Runtime packages on the CPU: tune and compile prepare what serve runs, nothing compiles after
ready, and artifacts made for another toolchain are refused at admission.

Compiling a forward takes most of a minute on two cores, so every build here shares the
session's kernel cache (conftest's `kernel_cache`): the tiny Llama and Qwen3 shapes compile once
each; `--check` and `--compile-on-start` compile once more each, because that is their job.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from checkpoints import make_llama

from flare.errors import IntegrityError
from flare.model_sizes import decode_batch_sizes
from flare.registry.refs import read_manifest, tag_package
from flare.serve.compilations import Compilations
from flare.serve.flashinfer_modules import WORKSPACE, collect
from flare.serve.inductor_archive import pack, unpack
from flare.serve.runtime import GenerateRuntime, SamplingParams, load_runtime
from flare.store.blobs import BlobStore
from flare.store.digest import Digest
from flare.store.package import (
    MANIFEST_KEY,
    Manifest,
    canonical_json,
    decode_index,
    encode_index,
)
from flare.store.safetensors import encode_header

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
MAX_CONCURRENCY = 8
"""Small, so the mixed load below fills whole decode batches of every size up to it."""


class Host:
    """A FLARE_HOME with a signing key, sharing the session's kernel cache."""

    def __init__(self, root: Path, kernel_cache: Path) -> None:
        self.root = root
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
        self.env = env | {
            "FLARE_HOME": str(root / "home"),
            "XDG_CONFIG_HOME": str(root / "xdg"),
            "FLARE_KERNEL_CACHE": str(kernel_cache),
        }

    def flare(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "flare", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert not check or done.returncode == 0, (args, done.stderr)
        return done

    def build(self, source: Path, name: str, *options: str) -> dict[str, Any]:
        args = ("build", str(source), "--name", name, "--json", *options)
        return json.loads(self.flare(*args).stdout)

    @property
    def store(self) -> BlobStore:
        return BlobStore(self.root / "home" / "registry")

    def manifest(self, digest: str) -> Manifest:
        return read_manifest(self.store, Digest.parse(digest))


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, kernel_cache: Path) -> Host:
    """Tiny Llama and Qwen3 checkpoints, each built for the CPU, signed by alice."""
    host = Host(tmp_path_factory.mktemp("compiled"), kernel_cache)
    host.flare("key", "generate", "--publisher", "alice")
    for arch in ARCHITECTURES:
        source = make_llama(host.root / arch, arch)
        host.build(source, arch.lower(), "--target", "cpu", "--max-concurrency", "8")
    return host


def phases(build: dict[str, Any]) -> dict[str, str]:
    return {p["name"]: p["status"] for p in build["phases"]}


def latest(host: Host, name: str) -> Manifest:
    digest = json.loads(host.flare("registry", "show", name, "--json").stdout)["digest"]
    return host.manifest(digest)


def test_the_manifest_lists_what_tune_and_compile_prepared(host: Host) -> None:
    manifest = latest(host, "llamaforcausallm")
    prepared = {a.kind: a for a in manifest.artifacts if a.target is not None}
    assert set(prepared) == {"tuning", "compiled"}
    compiled = prepared["compiled"]
    assert compiled.target == "cpu" and compiled.path == "runtime/forward-cpu.tar"
    assert compiled.shapes["decode_batch_sizes"] == [1, 2, 4, 8]
    assert compiled.shapes["kv_block_size"] == 16 and compiled.shapes["dtype"] == "float32"
    assert manifest.options["target"] == "cpu" and manifest.options["max_concurrency"] == 8
    toolchain = manifest.toolchain
    assert toolchain.torch == torch.__version__
    assert toolchain.cpu_isa == torch.backends.cpu.get_cpu_capability()
    records = json.loads(host.store.read_bytes(Digest.parse(prepared["tuning"].digest)))
    choice = next(r["choice"] for r in records if r["decision"] == "attention")
    assert choice == {"backend": "torch", "variant": "sdpa"}


def test_a_second_package_of_the_same_shapes_reuses_the_kernel_cache(host: Host) -> None:
    """Other weights, same shapes: tune and compile are reused, the compiled forward is the
    same blob (weights never go into it), the payloads are not. --retune decides again."""
    source = make_llama(host.root / "other-weights", seed=7)
    options = ("--target", "cpu", "--max-concurrency", "8")
    build = host.build(source, "retrained", *options)
    assert phases(build)["tune"] == "reused" and phases(build)["compile"] == "reused"
    first, second = latest(host, "llamaforcausallm"), host.manifest(build["digest"])
    assert compiled_blob(second) == compiled_blob(first)
    assert {p.digest for p in first.payloads}.isdisjoint({p.digest for p in second.payloads})
    retuned = host.build(source, "retrained", *options, "--retune")
    assert phases(retuned)["tune"] == "done" and phases(retuned)["compile"] == "reused"
    assert retuned["digest"] == build["digest"]  # the same decisions: the same package


def compiled_blob(manifest: Manifest) -> str:
    return next(a.digest for a in manifest.artifacts if a.kind == "compiled")


@pytest.fixture(scope="module")
def local_files(host: Host, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every blob of a built package as a local file (what a pull leaves)."""
    folder = tmp_path_factory.mktemp("blobs")

    def files(manifest: Manifest) -> dict[str, Path]:
        return {str(d): host.store.get(d, folder)[0] for d in manifest.blobs()}

    return files


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_compiled_forward_is_loaded_not_compiled_and_matches_transformers(
    host: Host, local_files: Any, arch: str, tmp_path: Path
) -> None:
    manifest = latest(host, arch.lower())
    runtime = load_runtime(manifest, local_files(manifest), compile_root=tmp_path)
    assert isinstance(runtime, GenerateRuntime)
    made = runtime.start_report.compilations
    assert runtime.start_report.forward == "package"
    # the first layer's graph, the other layers' (one for every layer after the first), the
    # logits': loaded as the build saved them, none traced
    assert (made.traced, made.compiled, made.kernels, made.loaded) == (0, 0, 0, 3)
    prompt = runtime.tokenizer.encode("the registry keeps packages on a shared folder").ids
    runtime.start()
    try:
        handle = runtime.submit(prompt, SamplingParams(temperature=0, max_tokens=24))
        ours = [t for delta in handle for t in delta.token_ids]
    finally:
        runtime.stop()
    assert runtime.compilations_since_ready().total == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(host.root / arch, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)
    assert ours == out[0, len(prompt) :].tolist()


def _six_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    """A six-layer float32 Llama of random weights, a torch attention backend and its
    blocks, with Inductor's cache in `tmp_path`."""
    from flare.build.tiny import llama_config
    from flare.serve.engine.attention_choice import make_attention
    from flare.serve.engine.block_manager import BlockManager
    from flare.serve.models.llama import LlamaForCausalLM

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(300, 64, 6, 4, 2))
    model = model.to_empty(device="cpu").float().eval()
    for param in model.parameters():
        torch.nn.init.normal_(param, 0.0, 0.1)
    cpu = torch.device("cpu")
    _, attention = make_attention("torch", model.attention_spec, 64 * 16, 16, torch.float32, cpu)
    return model, attention, BlockManager(64, 16)


def _greedy(runner: Any, blocks: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Eight greedy tokens for each prompt, decoded together through `runner`."""
    from flare.serve.engine.sequence import Sequence

    seqs = [Sequence(p, SamplingParams(temperature=0), max_tokens=8) for p in prompts]
    for seq in seqs:
        blocks.allocate(seq)
    for step in range(8):
        tokens = runner.run(seqs, prefill=step == 0).logits.argmax(-1).tolist()
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token)
            blocks.append_slot(seq)
    for seq in seqs:
        blocks.free_sequence(seq)
        blocks.forget(seq)
    return [seq.token_ids[len(p) :] for seq, p in zip(seqs, prompts, strict=True)]


PROMPTS = [[5, 6, 7], [9] * 20, list(range(1, 40))]


def test_a_deeper_model_compiles_to_the_same_three_graphs_and_answers_as_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six decoder layers: the warm-up traces three graphs (the first layer's, the one every
    later layer runs, the logits'), not one per layer, and greedy decoding through them gives
    the eager forward's tokens; varying batches compile nothing more. Saved and loaded in a
    new forward (what a start does with a package's), the graphs trace nothing and give the
    same tokens, and again once their guards are trusted (not checked) after a warm-up."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from flare.serve import compilations
    from flare.serve.compiled import CompiledForward, warm_up
    from flare.serve.engine.runner import EagerForward, ModelRunner

    model, attention, blocks = _six_layers(tmp_path, monkeypatch)
    cpu = torch.device("cpu")
    forward = CompiledForward(model)
    before = compilations.snapshot()
    warm_up(ModelRunner(model, attention, 16, cpu, forward), blocks)
    made = compilations.snapshot() - before
    assert forward.graphs == made.traced == made.compiled == 3

    compiled = ModelRunner(model, attention, 16, cpu, forward)
    eager = ModelRunner(model, attention, 16, cpu, EagerForward(model))
    expected = _greedy(eager, blocks, PROMPTS)
    assert _greedy(compiled, blocks, PROMPTS) == expected
    assert _greedy(compiled, blocks, PROMPTS[:1]) == _greedy(eager, blocks, PROMPTS[:1])
    assert (compilations.snapshot() - before).traced == 3

    forward.save(tmp_path / "graphs")
    assert sorted(p.name for p in (tmp_path / "graphs").iterdir()) == [
        "first.graph",
        "layers.graph",
        "logits.graph",
    ]
    before = compilations.snapshot()
    loaded = CompiledForward(model, tmp_path / "graphs")
    assert loaded.not_loaded == ""
    assert _greedy(ModelRunner(model, attention, 16, cpu, loaded), blocks, PROMPTS) == expected
    made = compilations.snapshot() - before
    assert (made.traced, made.compiled, made.loaded) == (0, 0, 3)
    loaded.save(tmp_path / "again")  # what was loaded is not written again
    assert not (tmp_path / "again").exists()

    def refused(*args: Any) -> bool:
        raise AssertionError("a trusted graph's guards were checked")

    loaded.trust_guards()  # what a start does after its warm-up
    monkeypatch.setattr(AOTCompiledFunction, "guard_check", refused)
    assert _greedy(ModelRunner(model, attention, 16, cpu, loaded), blocks, PROMPTS) == expected
    assert (compilations.snapshot() - before).traced == 0


def test_saved_graphs_whose_guards_refuse_the_model_are_compiled_anew_and_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Graphs saved for a float32 model, loaded for the same model in float64: their guards
    refuse its tensors at the first call, so each is compiled anew (the start goes on, and
    says why) and the tokens are the eager forward's."""
    from flare.serve import compilations
    from flare.serve.compiled import CompiledForward, warm_up
    from flare.serve.engine.attention_choice import make_attention
    from flare.serve.engine.runner import EagerForward, ModelRunner

    model, attention, blocks = _six_layers(tmp_path, monkeypatch)
    cpu = torch.device("cpu")
    saved = CompiledForward(model)
    warm_up(ModelRunner(model, attention, 16, cpu, saved), blocks)
    saved.save(tmp_path / "graphs")
    model = model.double()
    _, attention = make_attention("torch", model.attention_spec, 64 * 16, 16, torch.float64, cpu)
    before = compilations.snapshot()
    forward = CompiledForward(model, tmp_path / "graphs")
    tokens = _greedy(ModelRunner(model, attention, 16, cpu, forward), blocks, PROMPTS[:2])
    eager = EagerForward(model)
    assert tokens == _greedy(ModelRunner(model, attention, 16, cpu, eager), blocks, PROMPTS[:2])
    assert "guards refuse this model's inputs" in forward.not_loaded
    made = compilations.snapshot() - before
    assert (made.loaded, made.traced) == (3, 3)


def test_a_loaded_graph_that_fails_at_its_first_call_is_compiled_anew_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved graph that loads and whose guards take the inputs, but that raises when
    called (what a graph made by an experimental API can do on a host the build did not run
    on): the start goes on with that graph compiled anew, says why, and answers as eager."""
    from flare.serve import compilations, precompiled
    from flare.serve.compiled import CompiledForward, warm_up
    from flare.serve.engine.runner import EagerForward, ModelRunner

    model, attention, blocks = _six_layers(tmp_path, monkeypatch)
    cpu = torch.device("cpu")
    saved = CompiledForward(model)
    warm_up(ModelRunner(model, attention, 16, cpu, saved), blocks)
    saved.save(tmp_path / "graphs")
    load = precompiled.load

    class Failing:
        """The loaded logits graph, raising where it would run."""

        def __init__(self, graph: Any) -> None:
            self.guard_check = graph.guard_check

        def __call__(self, *args: Any) -> Any:
            raise RuntimeError("CUDA error: an illegal memory access\nmore")

    logits = (tmp_path / "graphs" / "logits.graph").read_bytes()
    monkeypatch.setattr(
        precompiled, "load", lambda data: Failing(load(data)) if data == logits else load(data)
    )
    before = compilations.snapshot()
    forward = CompiledForward(model, tmp_path / "graphs")
    tokens = _greedy(ModelRunner(model, attention, 16, cpu, forward), blocks, PROMPTS[:2])
    eager = EagerForward(model)
    assert tokens == _greedy(ModelRunner(model, attention, 16, cpu, eager), blocks, PROMPTS[:2])
    assert forward.not_loaded == (
        "the saved logits graph failed at its first call: RuntimeError: CUDA error: an illegal "
        "memory access"
    )
    made = compilations.snapshot() - before
    assert (made.loaded, made.traced) == (3, 1)


def _traced_not_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """A six-layer forward run greedily against eager (the same tokens asserted, and that
    `save` writes nothing); the forward and the compilations it made."""
    from flare.serve import compilations, compiled
    from flare.serve.engine.runner import EagerForward, ModelRunner

    model, attention, blocks = _six_layers(tmp_path, monkeypatch)
    cpu = torch.device("cpu")
    before = compilations.snapshot()
    forward = compiled.CompiledForward(model, tmp_path / "none")
    tokens = _greedy(ModelRunner(model, attention, 16, cpu, forward), blocks, PROMPTS)
    eager = _greedy(ModelRunner(model, attention, 16, cpu, EagerForward(model)), blocks, PROMPTS)
    assert tokens == eager
    made = compilations.snapshot() - before
    forward.save(tmp_path / "graphs")
    assert not (tmp_path / "graphs").exists()
    return forward, made


def test_before_torch_2_11_each_graph_is_traced_at_its_first_call_and_none_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch without Dynamo's ahead-of-time compile: the forward traces its three graphs
    as it is first called, answers as eager, and saves nothing."""
    from flare.serve import compiled

    monkeypatch.setattr(compiled, "AHEAD_OF_TIME", False)
    forward, made = _traced_not_saved(tmp_path, monkeypatch)
    assert made.traced == 3
    assert forward.not_ahead == ""


def test_where_the_ahead_of_time_compile_fails_the_graphs_are_traced_and_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ahead-of-time compile is an experimental API: where it raises (another torch's
    internals, a GPU it was never run on), the build does not fail. The forward traces that
    graph and the ones after it (the failing compile is tried once), answers as eager, says
    why, and saves none (a package's graphs are loaded all or none)."""
    from flare.serve import precompiled

    calls = []

    def broken(*args: Any) -> bytes:
        calls.append(args[-1])
        raise RuntimeError("no ahead-of-time compile on this torch\n(second line)")

    monkeypatch.setattr(precompiled, "compile_graph", broken)
    forward, made = _traced_not_saved(tmp_path, monkeypatch)
    assert calls == ["first"]
    assert made.loaded == 0
    assert forward.not_ahead == "RuntimeError: no ahead-of-time compile on this torch"


def test_a_saved_graph_is_the_same_bytes_from_any_cache_folder_and_still_guards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two compiles of a layer's graph, each in a process and Inductor cache of its own, save
    the same bytes (no memory address, random name or compile time in them); loaded, the
    graph still refuses inputs it was not compiled for (float64 for float32)."""
    script = (
        "import sys, torch\n"
        "from flare.serve.compiled import _run_layer, _unbacked, settings, use_cache_folder\n"
        "from flare.serve.engine.attention_op import OperatorAttention\n"
        "from flare.serve.models import empty_model\n"
        "from flare.build.tiny import llama_config\n"
        "from flare.serve import precompiled\n"
        "from pathlib import Path\n"
        "settings()\n"
        "use_cache_folder(Path(sys.argv[1]))\n"
        "model = empty_model('llama', 2, llama_config(96, 32, 2, 4, 2), torch.device('cpu'),"
        " torch.float32)\n"
        "x = torch.ones(5, 32)\n"
        "rotary = model.model.rotary(torch.arange(5))\n"
        "args = (model.model.layers[1], x, x, rotary, OperatorAttention())\n"
        "with torch.inference_mode():\n"
        "    data = precompiled.compile_graph(_run_layer, _unbacked(args, alias=True), 'layers')\n"
        "Path(sys.argv[2]).write_bytes(data)\n"
    )
    env = os.environ | {"PYTHONHASHSEED": "0"}
    for name in ("a", "b"):
        subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / name), str(tmp_path / f"{name}.graph")],
            check=True,
            env=env,
            timeout=600,
        )
    data = (tmp_path / "a.graph").read_bytes()
    assert data == (tmp_path / "b.graph").read_bytes()

    from flare.build.tiny import llama_config
    from flare.serve import precompiled
    from flare.serve.engine.attention_op import OperatorAttention
    from flare.serve.models import empty_model

    model = empty_model(
        "llama", 2, llama_config(96, 32, 2, 4, 2), torch.device("cpu"), torch.float32
    )
    graph = precompiled.load(data)
    with torch.inference_mode():
        x = torch.ones(7, 32, dtype=torch.float64)
        rotary = model.model.rotary(torch.arange(7))
        with pytest.raises(RuntimeError, match="GuardManager check failed"):
            graph(model.model.layers[1], x, x, rotary, OperatorAttention())


def test_saved_graphs_that_do_not_load_are_traced_instead_and_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved graph that does not load here (made by another torch, say: here, bytes that
    are no graph) costs a trace, not the start, and the forward says why."""
    from flare.serve import compilations
    from flare.serve.compiled import CompiledForward
    from flare.serve.engine.runner import EagerForward, ModelRunner

    model, attention, blocks = _six_layers(tmp_path, monkeypatch)
    cpu = torch.device("cpu")
    folder = tmp_path / "graphs"
    folder.mkdir()
    (folder / "layers.graph").write_bytes(b"not a graph")
    before = compilations.snapshot()
    forward = CompiledForward(model, folder)
    assert forward.not_loaded.startswith("UnpicklingError")
    tokens = _greedy(ModelRunner(model, attention, 16, cpu, forward), blocks, PROMPTS[:2])
    assert tokens == _greedy(
        ModelRunner(model, attention, 16, cpu, EagerForward(model)), blocks, PROMPTS[:2]
    )
    made = compilations.snapshot() - before
    assert (made.traced, made.loaded) == (3, 0)


class Server:
    """A `flare serve` process: its ready line, base URL and metrics."""

    def __init__(self, host: Host, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flare", "serve", *args, "--port", "0", "--device", "cpu"],
            env=host.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.ready = self.process.stdout.readline()
        if "http://" not in self.ready:
            self.process.kill()
            pytest.fail(f"flare serve did not start: {self.ready}{self.process.communicate()[1]}")
        self.url = re.search(r"http://\S+/v1", self.ready)[0]  # type: ignore[index]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url.removesuffix("/v1") + "/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])  # type: ignore[index]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.communicate(timeout=60)


@pytest.fixture(scope="module")
def server(host: Host) -> Iterator[Server]:
    running = Server(host, "llamaforcausallm")
    yield running
    running.stop()


def test_ready_says_the_forward_came_from_the_package(server: Server) -> None:
    assert "forward compiled, from the package" in server.ready
    assert "0 traced, 0 compiled (3 loaded), 0 kernels built" in server.ready
    load = r"load [\d.]+ s \(weights [\d.]+ \w+ in [\d.]+ s at [\d.]+ \S+/s\)"
    began = r"\(([\d.]+) s after the command began\)"
    engine = r"(?:engine start [\d.]+ s, )?"  # the engine process's imports left after the pull
    parts = rf"ready in ([\d.]+) s {began}: pull [\d.]+ s, {engine}{load}, artifacts"
    found = re.search(parts, server.ready)
    assert found, server.ready
    assert float(found[2]) > float(found[1])  # the command's imports come before the start


def test_nothing_compiles_after_ready_under_a_mixed_load(server: Server) -> None:
    """Prompts of 1 to 200 tokens, decode batches of every size up to the max concurrency
    (and past it: the scheduler queues), streams, streams dropped mid-way."""
    body = {"model": "llamaforcausallm", "temperature": 0, "ignore_eos": True}
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate([1, 2, 9, 31, 200])]

    def complete(prompt: list[int], tokens: int) -> None:
        reply = httpx.post(
            f"{server.url}/completions",
            json=body | {"prompt": prompt, "max_tokens": tokens},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text

    def stream(prompt: list[int], cancel: bool) -> None:
        request = body | {"prompt": prompt, "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{server.url}/completions", json=request, timeout=120) as r:
            for number, _ in enumerate(r.iter_lines()):
                if cancel and number == 3:
                    break

    for batch in range(1, MAX_CONCURRENCY + 3):
        jobs = [threading.Thread(target=complete, args=(prompts[i % 5], 6)) for i in range(batch)]
        jobs += [threading.Thread(target=stream, args=(prompts[batch % 5], batch % 2 == 0))]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join()
    assert server.metric("flare_generated_tokens_total") > 100
    assert server.metric("flare_compilations_total") == 0


def test_a_batch_invariant_server_answers_each_request_as_it_answers_it_alone(host: Host) -> None:
    """`--batch-invariant`: four greedy prompts asked together get the tokens each got alone,
    and the second asking reused no cached prefix of the first (it computes each prompt
    whole, as alone); nothing compiles for it."""
    server = Server(host, "llamaforcausallm", "--batch-invariant")
    body = {"model": "llamaforcausallm", "temperature": 0, "ignore_eos": True, "max_tokens": 12}
    prompts = [[(5 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 17, 33, 40])]

    def complete(prompt: list[int]) -> str:
        reply = httpx.post(f"{server.url}/completions", json=body | {"prompt": prompt}, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    try:
        alone = [complete(prompt) for prompt in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(complete, prompts))
        assert together == alone
        assert server.metric("flare_kv_prefix_hit_tokens_total") == 0
        assert server.metric("flare_compilations_total") == 0
    finally:
        server.stop()


def test_artifacts_for_another_toolchain_are_refused_unless_compiled_on_start(
    host: Host,
) -> None:
    """A signed package naming another torch: refused at admission with what differs and the
    fix (exit 12); `--compile-on-start` compiles it and serves it, and a second such start
    loads what the first compiled."""
    manifest = latest(host, "llamaforcausallm")
    other = manifest.model_copy(
        update={"toolchain": manifest.toolchain.model_copy(update={"torch": "2.99.0+cpu"})}
    )
    index = host.store.put_bytes(encode_index(other)).digest
    tag_package(host.store, "llamaforcausallm", "other", index)
    host.flare("sign", "llamaforcausallm:other")
    refused = host.flare("serve", "llamaforcausallm:other", "--port", "0", check=False)
    assert refused.returncode == 12
    assert "need torch 2.99.0+cpu; this host has " + torch.__version__ in refused.stderr
    assert "--compile-on-start" in refused.stderr
    server = Server(host, "llamaforcausallm:other", "--compile-on-start")
    try:
        compiled = r"forward compiled at start in [\d.]+ s: 3 traced, 3 compiled"
        assert re.search(compiled, server.ready)
        assert re.search(r"[1-9]\d* kernels built \([\w.]+\.cpp", server.ready), server.ready
        reply = httpx.post(
            f"{server.url}/completions",
            json={"model": "llamaforcausallm", "prompt": [5, 6, 7], "max_tokens": 8},
            timeout=120,
        )
        assert reply.status_code == 200
        assert server.metric("flare_compilations_total") == 0
    finally:
        server.stop()
    again = Server(host, "llamaforcausallm:other", "--compile-on-start")
    try:  # the graphs the first start compiled, loaded: nothing traced or compiled again
        loaded = r"forward compiled at start in [\d.]+ s: 0 traced, 0 compiled \(3 loaded\)"
        assert re.search(loaded, again.ready), again.ready
    finally:
        again.stop()


def test_only_a_cpu_forward_needs_the_compiler(
    host: Host, local_files: Any, tmp_path: Path
) -> None:
    """The start's plan: a CPU's compiled forward runs Inductor's graphs, so its load imports
    Dynamo and Inductor; on CUDA a forward (from the package, or built at start) is flare's
    kernels called directly, and its start imports neither; and the ready line says which."""
    from flare.serve.artifacts import StartReport, runtime_artifacts
    from flare.serve.models.files import PackageFiles

    manifest = latest(host, ARCHITECTURES[0].lower())
    package = PackageFiles(manifest, local_files(manifest))
    plans = {
        (device, mode): runtime_artifacts(package, device, mode, tmp_path)
        for device in ("cpu", "cuda")
        for mode in ("package", "start", "off")
    }
    assert [(p.forward, p.compiler) for p in plans.values()] == [
        ("package", True), ("start", True), ("eager", False),
        ("eager", False), ("start", False), ("eager", False),
    ]  # fmt: skip
    assert "no compiled forward for cuda" in plans["cuda", "package"].why
    kernels = StartReport("package", compiler=False).describe()
    assert (
        kernels
        == "forward on the package's kernels: 0 traced, 0 compiled (0 loaded), 0 kernels built"
    )
    assert (
        StartReport("start", compiler=False, warm_up=2.0)
        .describe()
        .startswith("forward kernels built at start in 2.0 s")
    )


def test_a_package_without_artifacts_serves_uncompiled_and_says_so(host: Host) -> None:
    build = host.build(host.root / "LlamaForCausalLM", "eager", "--target", "none")
    assert not any(a.target for a in host.manifest(build["digest"]).artifacts)
    server = Server(host, "eager")
    try:
        assert "forward uncompiled: the package has no compiled forward for cpu" in server.ready
    finally:
        server.stop()


def test_check_rebuilds_the_artifacts_byte_for_byte(host: Host) -> None:
    """A fresh compile (no kernel cache, no journal) with the package's tuning records."""
    checked = host.flare("build", "--check", "qwen3forcausallm", "--json")
    result = json.loads(checked.stdout)
    assert result["identical"] and result["artifacts"] == []


FAIL_LOGITS_AHEAD = """
import importlib.abc, importlib.machinery, sys

class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "flare.serve.precompiled":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.compile_graph

            def compile_graph(fn, args, kind):
                if kind == "logits":
                    raise RuntimeError("the logits graph cannot be compiled ahead here")
                return real(fn, args, kind)

            module.compile_graph = compile_graph

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Patch())
"""
"""A sitecustomize module that makes the ahead-of-time compile fail at the logits' graph,
the last of the three, in every process of the build."""


def test_a_build_whose_ahead_of_time_compile_fails_partway_says_so_and_rebuilds_identical(
    tmp_path: Path,
) -> None:
    """The first two graphs compiled ahead of time, the third's compile failing: the build
    goes on, says the graphs were traced and why, saves none, and its archive holds nothing
    a compile keys anew (the first two compiles' AOTAutograd entries), so `build --check`
    rebuilds it byte for byte."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAIL_LOGITS_AHEAD)
    host = Host(tmp_path, tmp_path / "kernels")
    host.env["PYTHONPATH"] = os.pathsep.join(
        filter(None, (str(tmp_path / "site"), host.env.get("PYTHONPATH")))
    )
    host.flare("key", "generate", "--publisher", "alice")
    source = make_llama(tmp_path / "ckpt")
    args = ("build", str(source), "--name", "partway", "--target", "cpu", "--json")
    built = host.flare(*args)
    assert (
        "the forward's graphs were traced, not compiled ahead of time (RuntimeError: the "
        "logits graph cannot be compiled ahead here)"
    ) in built.stderr
    manifest = host.manifest(json.loads(built.stdout)["digest"])
    compiled = next(a for a in manifest.artifacts if a.kind == "compiled")
    with tarfile.open(
        fileobj=io.BytesIO(host.store.read_bytes(Digest.parse(compiled.digest)))
    ) as tar:
        names = tar.getnames()
    assert not any(name.startswith("precompiled/") for name in names)
    checked = json.loads(host.flare("build", "--check", "partway", "--json").stdout)
    assert checked["identical"] and checked["artifacts"] == []


def test_bad_runtime_options_are_refused_before_any_work(host: Host) -> None:
    source = str(host.root / "LlamaForCausalLM")
    for option, message in (
        (("--max-concurrency", "0"), "--max-concurrency 0 is not in 1..4096"),
        (("--prefill-chunk", "0"), "--prefill-chunk 0 takes no token"),
        (("--target", "tpu"), "unknown build target 'tpu'"),
    ):
        done = host.flare("build", source, "--name", "bad", *option, check=False)
        assert done.returncode == 4 and message in done.stderr


def test_decode_batch_sizes_are_powers_of_two_then_the_max() -> None:
    assert decode_batch_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert decode_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert decode_batch_sizes(1) == [1]


def test_the_archive_leaves_out_autograd_entries_where_the_graphs_are_precompiled(
    tmp_path: Path,
) -> None:
    """Beside precompiled graphs AOTAutograd's entries are read by nothing (and their keys
    differ from one compile to the next): packed without them, and with the graphs as they are."""
    (tmp_path / "aotautograd" / "akey").mkdir(parents=True)
    (tmp_path / "aotautograd" / "akey" / "entry").write_bytes(b"not read")
    (tmp_path / "precompiled").mkdir()
    (tmp_path / "precompiled" / "layers.graph").write_bytes(b"graph bytes")
    assert pack(tmp_path, tmp_path.parent / "graphs.tar") == ["precompiled/layers.graph"]
    assert unpack((tmp_path.parent / "graphs.tar").read_bytes(), tmp_path.parent / "out") is False
    assert (tmp_path.parent / "out" / "precompiled" / "layers.graph").read_bytes() == b"graph bytes"


def test_the_archive_holds_kernels_and_entries_only_with_fixed_metadata(tmp_path: Path) -> None:
    """Sources, locks and Inductor's rewritten wrappers stay out; the same folder packed
    from another path, at another time, gives the same bytes."""
    for root in (tmp_path / "a", tmp_path / "b" / "elsewhere"):
        (root / "ab").mkdir(parents=True)
        (root / "ab" / "cabc.main.so").write_bytes(b"\x7fELF kernel")
        (root / "ab" / "cabc.main.cpp").write_text("// source")
        (root / "locks").mkdir()
        (root / "locks" / "cabc.lock").write_text("")
        (root / "py").mkdir()
        (root / "py" / "wrapper.py").write_text("# rewritten on load")
        os.utime(root / "ab" / "cabc.main.so", (1e9 if "b" in root.parts else 2e9,) * 2)
    assert pack(tmp_path / "a", tmp_path / "a.tar") == ["ab/cabc.main.so"]
    pack(tmp_path / "b" / "elsewhere", tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert unpack((tmp_path / "a.tar").read_bytes(), tmp_path / "out") is False
    assert (tmp_path / "out" / "ab" / "cabc.main.so").read_bytes() == b"\x7fELF kernel"
    assert unpack((tmp_path / "a.tar").read_bytes(), tmp_path / "out") is True


def test_a_member_name_longer_than_a_tar_header_holds_packs_and_unpacks(tmp_path: Path) -> None:
    """Triton names its cache files after the fused kernel, which passes ustar's 255-byte
    path limit on real models (the H200 compile failed so): the archive still packs them,
    the same bytes each time, and unpacks them where they were."""
    name = f"triton/0/{'A' * 52}/triton_red_fused_{'_'.join(['add_embedding_mean'] * 12)}_9.cubin"
    assert len(name) > 255
    (tmp_path / "cache" / name).parent.mkdir(parents=True)
    (tmp_path / "cache" / name).write_bytes(b"cubin")
    assert pack(tmp_path / "cache", tmp_path / "a.tar") == [name]
    pack(tmp_path / "cache", tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    unpack((tmp_path / "a.tar").read_bytes(), tmp_path / "out")
    assert (tmp_path / "out" / name).read_bytes() == b"cubin"


def _triton_kernel(cache: Path) -> str:
    """A kernel as Triton caches it: its files, and its group file naming them by absolute
    path. Returns the group file's name in the cache."""
    entry = cache / "triton" / "0" / "KEY"
    entry.mkdir(parents=True)
    children = {}
    for file, data in (("_few_rows_kernel.cubin", b"cubin"), ("_few_rows_kernel.json", b"{}")):
        (entry / file).write_bytes(data)
        children[file] = str(entry / file)
    (entry / "__grp___few_rows_kernel.json").write_text(json.dumps({"child_paths": children}))
    return "triton/0/KEY/__grp___few_rows_kernel.json"


def test_triton_kernels_are_found_where_the_archive_is_unpacked(tmp_path: Path) -> None:
    """Triton takes a kernel from its cache only if every file its group file names exists:
    packed from the build's folder, the group names its files relative to the cache (the
    archive's bytes do not depend on where it was built); unpacked, it names them in the
    folder unpacked to. Before, a server built again every kernel Triton had compiled."""
    group = _triton_kernel(tmp_path / "build" / "one")
    _triton_kernel(tmp_path / "elsewhere")
    pack(tmp_path / "build" / "one", tmp_path / "a.tar")
    pack(tmp_path / "elsewhere", tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert str(tmp_path).encode() not in (tmp_path / "a.tar").read_bytes()
    unpack((tmp_path / "a.tar").read_bytes(), tmp_path / "serve" / "compiled")
    children = json.loads((tmp_path / "serve" / "compiled" / group).read_text())["child_paths"]
    assert sorted(children) == ["_few_rows_kernel.cubin", "_few_rows_kernel.json"]
    for path in children.values():
        assert Path(path).is_absolute() and Path(path).exists()
        assert Path(path).is_relative_to(tmp_path / "serve" / "compiled")


@pytest.mark.parametrize("child", ["/etc/passwd", "../../../outside.cubin"])
def test_a_triton_group_naming_a_file_outside_the_archive_is_refused(
    tmp_path: Path, child: str
) -> None:
    buffer = io.BytesIO()
    data = json.dumps({"child_paths": {"k.cubin": child}}).encode()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("triton/0/KEY/__grp__k.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(IntegrityError, match="outside the archive"):
        unpack(buffer.getvalue(), tmp_path / "out" / "compiled")
    assert not (tmp_path / "out" / "compiled").exists()


def test_a_triton_group_naming_files_outside_the_cache_is_left_out(tmp_path: Path) -> None:
    """Its kernel is built again at a server's start (as every one was before), the build
    goes on; the kernel's own files are packed."""
    name = _triton_kernel(tmp_path / "cache")
    group = tmp_path / "cache" / name
    group.write_text(json.dumps({"child_paths": {"k.cubin": str(tmp_path / "k.cubin")}}))
    members = pack(tmp_path / "cache", tmp_path / "a.tar")
    assert name not in members and "triton/0/KEY/_few_rows_kernel.cubin" in members


@pytest.mark.parametrize("kind", ["symlink", "escape"])
def test_an_archive_member_that_is_no_plain_file_inside_is_refused(
    tmp_path: Path, kind: str
) -> None:
    """A signed package's archive is still input: a link or a path out of the folder is
    refused (exit 6) and nothing is left behind."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        if kind == "symlink":
            info = tarfile.TarInfo("ab/cabc.main.so")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info = tarfile.TarInfo("../outside.so")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"\x7fELF"))
    with pytest.raises(IntegrityError, match="is not a plain file in the archive"):
        unpack(buffer.getvalue(), tmp_path / "out" / "compiled")
    assert not (tmp_path / "out" / "compiled").exists()
    assert not (tmp_path / "out" / "outside.so").exists()


def test_an_index_written_before_the_optional_fields_encodes_to_its_own_bytes() -> None:
    """Keyless verification encodes a package's manifest again: fields added to the format
    since (the toolchain's, the artifacts' target and shapes) must not appear in it."""
    old = {
        "format": 1,
        "name": "tiny",
        "model": {"id": "tiny", "revision": None, "files": []},
        "recipe": {"name": "llama", "version": 1, "architecture": "LlamaForCausalLM"},
        "options": {"ranks": 1, "payload_bytes": 268435456},
        "ranks": 1,
        "toolchain": {
            "runtime_abi": 1,
            "torch": None,
            "cuda": None,
            "gpu_archs": [],
            "flashinfer": None,
        },
        "payloads": [],
        "artifacts": [
            {"kind": "config", "path": "config.json", "digest": "blake3:" + "a" * 64, "size": 2}
        ],
        "inputs": "blake3:" + "b" * 64,
    }
    data = encode_header([], {MANIFEST_KEY: canonical_json(old)})
    assert encode_index(decode_index(data, "old index")) == data


def test_a_description_names_the_kernels_built_between_two_snapshots() -> None:
    """What a start built is named in its ready line, the first few of them."""
    before = Compilations(traced=1, kernels=1, built=("old.cpp",))
    after = Compilations(traced=2, kernels=5, built=("old.cpp", "a.cpp", "b", "FlashInfer c", "d"))
    made = after - before
    assert (made.traced, made.kernels, made.built) == (1, 4, ("a.cpp", "b", "FlashInfer c", "d"))
    assert made.describe().endswith("4 kernels built (a.cpp, b, FlashInfer c, …)")
    assert (after - after).describe() == "0 traced, 0 compiled (0 loaded), 0 kernels built"


def test_flashinfer_modules_are_collected_from_the_workspace_layout_it_builds_in(
    tmp_path: Path,
) -> None:
    """FlashInfer 0.6 builds a module at .cache/flashinfer/<version>/<archs>/cached_ops/<name>/
    <name>.so under its workspace; each lands at flashinfer/<name>/<name>.so in the compiled
    forward's folder, where it is loaded at start as a prebuilt module (a module left behind
    was built again by every server: 95 s for a new head size)."""
    ops = tmp_path / "out" / WORKSPACE / ".cache" / "flashinfer" / "0.6.1" / "90" / "cached_ops"
    for name in ("batch_decode_bf16_64", "batch_prefill_bf16_64_sm90"):
        (ops / name).mkdir(parents=True)
        (ops / name / f"{name}.so").write_bytes(name.encode())
        (ops / name / f"{name}.cuda.o").write_bytes(b"object")
    folder = tmp_path / "inductor"
    assert collect(tmp_path / "out", folder) == [
        "batch_decode_bf16_64",
        "batch_prefill_bf16_64_sm90",
    ]
    kept = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert kept == [
        "flashinfer/batch_decode_bf16_64/batch_decode_bf16_64.so",
        "flashinfer/batch_prefill_bf16_64_sm90/batch_prefill_bf16_64_sm90.so",
    ]
