"""Multi-rank packages served: each rank's part of the model, the ranks as processes on one
host behind the API, and the refusal of KV heads that the ranks do not divide.

Numerics: a rank's part loads in a thread with a real gloo group to its peers; the ranks
together must give the one-rank package's logits within 1e-4 (fp32) and transformers' greedy
tokens. Serving: `flare serve` on a 2- and 4-rank package starts the other ranks as processes
and answers the official openai client as the one-rank runtime does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import cpu_runner, greedy_answer
from multirank_serving import (
    RANKS,
    TIMEOUT,
    Server,
    alive,
    build_home,
    flare,
    flare_env,
    in_threads,
    make_llama,
    package,
)

from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.sequence import SamplingParams
from flare.serve.models import load_model
from flare.serve.models.files import PackageFiles
from flare.serve.models.shard import Shard
from flare.serve.runtime import GenerateRuntime, load_runtime

CASES = [(name, ranks) for name in ("llama", "qwen3") for ranks in RANKS[1:]]
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_home(tmp_path_factory.mktemp("tp"))


def prompt(length: int = 64) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(1)).tolist()


def rank_runner(manifest, files, rank: int, group) -> ModelRunner:  # type: ignore[no-untyped-def]
    return cpu_runner(manifest, files, Shard(rank, manifest.ranks, group))


@pytest.mark.parametrize(("name", "ranks"), CASES)
def test_the_ranks_parts_give_the_one_rank_logits_and_transformers_tokens(
    home: Path, tmp_path: Path, name: str, ranks: int
) -> None:
    whole = package(home, f"{name}:r1", tmp_path / "r1")
    parts = package(home, f"{name}:r{ranks}", tmp_path / f"r{ranks}")
    assert all(len(p.ranks) in (1, ranks) for p in parts[0].payloads)
    assert parts[0].recipe.fused  # each rank's q, k, v parts in turn, as one qkv_proj
    ids = prompt()
    expected, _ = greedy_answer(rank_runner(*whole, 0, None), ids, 1)
    results = in_threads(
        ranks, lambda rank, group: greedy_answer(rank_runner(*parts, rank, group), ids, 32)
    )
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(home / f"{name}-checkpoint").eval()
    generated = reference.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=32, eos_token_id=None
    )[0, len(ids) :].tolist()
    for logits, tokens in results:
        assert (logits - expected).abs().max().item() <= 1e-4
        assert tokens == generated


def test_a_rank_reads_only_the_shared_payloads_and_its_own(home: Path, tmp_path: Path) -> None:
    """Rank 1 of 2 loads without rank 0's payloads on the host at all."""
    manifest, files = package(home, "llama:r2", tmp_path)
    own = {str(d) for d in manifest.blobs((1,))}
    assert len(own) < len(files)
    mine = {digest: path for digest, path in files.items() if digest in own}

    def load(rank: int, group) -> int:  # type: ignore[no-untyped-def]
        chosen = mine if rank == 1 else files
        model = load_model(
            PackageFiles(manifest, chosen), CPU, torch.float32, Shard(rank, 2, group)
        )
        return sum(p.numel() for p in model.parameters())

    counts = in_threads(2, load)
    assert counts[0] == counts[1]


@pytest.mark.parametrize(("name", "ranks"), CASES)
def test_served_ranks_answer_as_the_one_rank_runtime(
    home: Path, tmp_path: Path, name: str, ranks: int
) -> None:
    """Completions (whole and streamed, with logprobs), seeded sampling, prefix reuse and
    per-rank /metrics through the official client; a drained stop exits every rank 0."""
    manifest, files = package(home, f"{name}:r1", tmp_path)
    one = load_runtime(manifest, files)
    assert isinstance(one, GenerateRuntime)
    ids = prompt(40)
    one.start()
    expected = one.submit(ids, SamplingParams(temperature=0, max_tokens=32, logprobs=2))
    want_text, want_logprobs = "", []
    for delta in expected:
        want_text += delta.text
        want_logprobs += delta.logprobs or []
    one.stop()

    server = Server(flare_env(home), f"{name}:r{ranks}", "--timeout", TIMEOUT)
    try:
        assert f"{ranks} ranks: rank 0 load" in server.ready
        assert all(f"rank {r} load" in server.ready for r in range(ranks))
        pids = server.ranks()
        assert len(pids) == ranks - 1
        client = server.client()
        got = client.completions.create(
            model=name, prompt=ids, max_tokens=32, temperature=0, logprobs=2
        )
        choice = got.choices[0]
        assert choice.text == want_text and got.usage.completion_tokens == 32
        for ours, theirs in zip(choice.logprobs.token_logprobs, want_logprobs, strict=True):
            assert abs(ours - theirs.logprob) <= 1e-4
        streamed = client.completions.create(
            model=name, prompt=ids, max_tokens=32, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == want_text
        sampled = [
            client.completions.create(
                model=name, prompt=ids, max_tokens=16, temperature=1.0, seed=7
            )
            .choices[0]
            .text
            for _ in range(2)
        ]
        assert sampled[0] == sampled[1]
        metrics = server.metrics()
        assert _value(metrics, "flare_kv_prefix_hit_tokens_total") > 0
        for rank in range(ranks):
            assert f'flare_rank_weight_bytes{{rank="{rank}"}}' in metrics
        assert _value(metrics, 'flare_rank_collective_seconds_total{rank="0"}') > 0
        rank_zero = _value(metrics, 'flare_rank_weight_bytes{rank="0"}')
        assert _value(metrics, 'flare_memory_bytes{part="weights"}') == rank_zero
    finally:
        code, stderr = server.stop()
    assert code == 0, stderr
    assert f"memory plan on cpu (rank 0 of {ranks}): weights " in stderr
    assert not any(alive(pid) for pid in pids)


def test_batch_invariant_serving_of_a_multi_rank_package_is_refused_before_any_rank_starts(
    home: Path,
) -> None:
    """Each rank runs products of its own: the one-rank promise cannot hold, so the server
    says so in one line, before it starts a rank or loads a weight."""
    done = flare(flare_env(home), "serve", "llama:r2", "--batch-invariant", "--port", "0", ok=False)
    assert done.returncode == 4, done.stderr
    assert "runs on 2 ranks: --batch-invariant serves one-rank packages" in done.stderr
    assert "rank 1" not in done.stderr and "memory plan" not in done.stderr


def _value(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in {metrics}")


def test_kv_heads_the_ranks_do_not_divide_are_refused_at_build(tmp_path: Path) -> None:
    """flare keeps whole KV heads on every rank and does not replicate them: 2 KV heads over 4
    ranks is refused at build, naming the count and the rank counts that fit."""
    env = flare_env(tmp_path / "home")
    folder = make_llama(tmp_path / "ckpt", heads=8, kv_heads=2)
    done = flare(env, "build", folder, "--name", "mqa", "--ranks", "4", ok=False)
    assert done.returncode == 4, done.stderr
    assert "--ranks 4 does not divide num_key_value_heads=2" in done.stderr
    assert "use one of: 1, 2" in done.stderr
