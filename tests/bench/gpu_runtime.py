"""GPU check of the serving runtime: parity with transformers on CUDA, and batching.

Two steps, because a GPU host may lack flare's build dependencies (SQLAlchemy, ...):

    python tests/bench/gpu_runtime.py prepare DIR   # here: build a tiny package, export it
    python tests/bench/gpu_runtime.py run DIR       # on the GPU host: needs torch, transformers

`run` checks prompt logits (fp32, TF32 off) against transformers on CUDA, a 32-token greedy
continuation through the whole engine against `generate`, and that 64 concurrent bf16
requests (FlashInfer attention where it is installed) give the same tokens as the first 8 run
alone; it prints the figures as JSON and exits non-zero when a parity check fails.
"""

import json
import sys
import time
from pathlib import Path


def prepare(folder: Path) -> None:
    """Build the seeded tiny Llama (hidden 512: 8 heads of 64, which FlashInfer's kernels
    take; 2 layers) and export its package files."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from registry_helpers import Quiet

    from flare.build.pipeline import Build, BuildRequest
    from flare.build.tiny import make_tiny_llama
    from flare.registry.registry import Registry

    source = make_tiny_llama(folder / "tiny", hidden=512, layers=2)
    with tempfile.TemporaryDirectory() as work:
        registry = Registry(f"{work}/registry", f"sqlite:///{work}/index.db")
        request = BuildRequest(
            source=str(source), name="tiny", staging=Path(work, "staging"), hub_cache=Path(work)
        )
        result = Build(request, registry, Quiet()).run()
        (folder / "pkg").mkdir(parents=True, exist_ok=True)
        registry.store.get(result.digest, folder / "pkg" / "index")
        for digest in result.manifest.blobs():
            registry.store.get(digest, folder / "pkg" / digest.hex)
    print(f"exported {result.digest} to {folder}")


def run(root: Path) -> int:
    from gpu_package import require

    require("transformers")
    import torch

    from flare.serve.engine.attention import TorchPagedAttention
    from flare.serve.engine.block_manager import BlockManager
    from flare.serve.engine.runner import ModelRunner
    from flare.serve.engine.sequence import Sequence
    from flare.serve.models import load_model
    from flare.serve.models.files import PackageFiles
    from flare.serve.runtime import SamplingParams, load_runtime
    from flare.store.package import decode_index

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    manifest = decode_index((root / "pkg/index").read_bytes(), "index")
    files = {str(d): root / "pkg" / d.hex for d in manifest.blobs()}
    cuda = torch.device("cuda")
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}

    from transformers import AutoModelForCausalLM

    ref32 = AutoModelForCausalLM.from_pretrained(root / "tiny", dtype=torch.float32).to(cuda).eval()

    # 1. prompt logits, fp32 on CUDA
    model = load_model(PackageFiles(manifest, files), cuda, torch.float32)
    prompt = torch.randint(0, model.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    seq = Sequence(prompt.tolist(), SamplingParams(temperature=0), max_tokens=1)
    BlockManager(8, 16).allocate(seq)
    attention = TorchPagedAttention(model.attention_spec, 8 * 16, torch.float32, cuda)
    runner = ModelRunner(model, attention, 16, cuda)
    input_ids, positions, meta = runner.prepare([seq], prefill=True)
    attention.plan(meta)
    with torch.inference_mode():
        ours = model.compute_logits(model.forward(input_ids, positions, attention))
        theirs = ref32(prompt[None].to(cuda)).logits[0]
    report["logits_max_abs_diff_fp32_cuda"] = (ours - theirs).abs().max().item()

    def greedy(runtime, ids, n=32):
        handle = runtime.submit(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return [t for d in handle for t in d.token_ids]

    # 2. greedy continuation vs generate, fp32 on CUDA, through the whole engine
    rt32 = load_runtime(manifest, files, "cuda", kv_cache_tokens=8192, dtype=torch.float32)
    rt32.start()
    ids = rt32.tokenizer.encode("the registry keeps packages on a shared folder").ids
    ours = greedy(rt32, ids)
    out = ref32.generate(
        torch.tensor([ids], device=cuda), do_sample=False, max_new_tokens=32, min_new_tokens=32
    )
    report["greedy_32_equal_fp32_cuda"] = ours == out[0, len(ids) :].tolist()
    report["attention_fp32"] = rt32.attention
    rt32.stop()

    # 3. bf16 default runtime: 64 concurrent requests, each equal to its solo run?
    rt = load_runtime(manifest, files, "cuda")
    rt.start()
    report["attention_bf16"] = rt.attention
    report["kv"] = rt.kv_stats()
    prompts = [
        rt.tokenizer.encode(f"request {i}: " + "the quick brown fox " * (i % 7)).ids
        for i in range(64)
    ]
    solo = [greedy(rt, p, 64) for p in prompts[:8]]
    started = time.perf_counter()
    handles = [
        rt.submit(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)) for p in prompts
    ]
    results = [[t for d in h for t in d.token_ids] for h in handles]
    elapsed = time.perf_counter() - started
    matches = sum(a == b for a, b in zip(solo, results[:8], strict=True))
    report["batch64_equal_solo_first8"] = matches
    report["batch64_tokens_per_s"] = round(sum(map(len, results)) / elapsed, 1)
    report["stats"] = rt.stats()
    rt.stop()
    print(json.dumps(report, indent=2))
    parity = report["logits_max_abs_diff_fp32_cuda"] <= 1e-4
    return 0 if parity and report["greedy_32_equal_fp32_cuda"] else 1


if __name__ == "__main__":
    action, where = sys.argv[1], Path(sys.argv[2])
    if action == "prepare":
        prepare(where)
    else:
        sys.exit(run(where))
