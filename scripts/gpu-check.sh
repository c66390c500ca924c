#!/usr/bin/env bash
# The checks a lent NVIDIA GPU is for, as device calls of under 10 minutes each, results under $OUT:
#   here:   scripts/gpu-deps.sh   (the wheels the device's image lacks, into .gpu_deps)
#   device: bash scripts/gpu-check.sh [all|serving]   with `.gpu_deps` carried, timeout 600 s
# `all` (the default): 1. device.txt: the card, driver, torch and Triton versions. 2. tests.log: the CUDA tests (the
# Triton kernels compiled, decode graphs, fp8/int4, KV dtypes) and the engine tests that run on the GPU when there
# is one (speculation, LoRA, chunked prefill over cached prefixes), then `kettle launch` end to end (with prefix
# caching, --speculate and LoRA adapters). 3. serving.json / serving.log: `python -m bench serving` on
# Llama-3.1-8B's shape in bf16, cut to 300 requests a row and 128 for transformers so that it fits the call.
# `serving`: the benchmark alone, whole (1,000 offline requests); SERVING_ARGS adds flags (e.g. "--quantize fp8").
# Each part has its own time limit, so a slow one leaves the others their time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_deps/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

part=${1:-all}
if [ "$part" = all ]; then
    tests=(tests/models/test_triton_attention.py tests/models/test_cuda_path.py tests/models/test_cuda_fused.py
        tests/models/test_cuda_quant.py tests/models/test_cuda_kv_dtype.py tests/unit/test_cuda_graphs.py
        tests/models/test_speculation.py tests/models/test_lora.py tests/models/test_chunked_engine.py)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 "${tests[@]}" 2>&1 | tee "$OUT/tests.log" | tail -15
    e2e=(tests/e2e/test_gpu_e2e.py tests/e2e/test_prefix_cache_e2e.py tests/e2e/test_speculation_e2e.py
        tests/e2e/test_lora_e2e.py)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 "${e2e[@]}" 2>&1 | tee -a "$OUT/tests.log" | tail -8
    limit=270 cut="--requests 300 --floor-requests 128"
else
    limit=560 cut=""
fi
# shellcheck disable=SC2086  # flags lists
timeout "$limit" python3 -m bench serving --json "$OUT/serving.json" $cut ${SERVING_ARGS:-} 2>&1 \
    | tee "$OUT/serving.log" | tail -30
