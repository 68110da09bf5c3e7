#!/usr/bin/env bash
# The GPU checks, one call of at most 9.5 minutes on a CUDA machine with torch, transformers and triton installed
# (nothing else is needed: vase runs from src/). Results go to $OUT (else runs/gpu/):
#   1. the GPU-only tests (FlashAttention-2 when flash-attn is installed, no host-device sync in the decode path,
#      compiled and not, the learned score x guard x confidence budget against the CPU) and the Triton kernel's cases
#      on the GPU (one program per (row, KV head) and split slots);
#   2. benchmarks/gpu_qwen3_4b.py: Qwen3-4B's shape, batch 16, a 16K-token prompt then 2,048 new tokens, full cache
#      against vase at budget 4096;
#   3. benchmarks/gpu_codes_attention.py: decode attention over 4-bit codes against dequantize-then-sdpa and dense;
#   4. benchmarks/gpu_qwen3_4b.py --compile at batch 1 with the time left (CUDA graphs; small batches are
#      launch-bound, where graphs should pay): a 4K prompt, budget 1024, 1,024 new tokens per mode.
#
#     bash benchmarks/gpu_checks.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
LIMIT="${GPU_CHECKS_SECONDS:-560}"
left() { echo $((LIMIT - SECONDS)); }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>/dev/null || echo "flash_attn: not installed"
} 2>&1 | tee "$OUT/env.txt"

echo "== 1. GPU tests ($(left) s left)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/hf/test_cache.py::test_flash_attention_2_on_gpu \
  tests/hf/test_cache.py::test_no_host_device_sync_in_decode_path_on_gpu \
  tests/hf/test_compile.py::test_compiled_decode_no_sync_on_gpu \
  tests/core/test_learned.py::test_the_stack_on_gpu_equals_cpu \
  tests/core/triton_cases.py 2>&1 | tee "$OUT/tests.log"

echo "== 2. Qwen3-4B shape, 16K prompt + 2,048 tokens ($(left) s left)"
timeout 240 python3 benchmarks/gpu_qwen3_4b.py --prompt-tokens 16384 --tokens 2048 --time-limit 200 \
  --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/qwen3.log"

echo "== 3. attention over quantized codes ($(left) s left)"
timeout 100 python3 benchmarks/gpu_codes_attention.py --out "$OUT/gpu_codes.json" 2>&1 | tee "$OUT/codes.log"

REST=$(left)
echo "== 4. compiled decoding at batch 1 ($REST s left)"
if [ "$REST" -gt 120 ]; then
  timeout "$REST" python3 benchmarks/gpu_qwen3_4b.py --compile --batch 1 --prompt-tokens 4096 --budget 1024 \
    --tokens 1024 --time-limit $((REST - 20)) --out "$OUT/gpu_bench_compile_b1.json" 2>&1 | tee "$OUT/compile_b1.log"
fi
echo "== done in $SECONDS s"
