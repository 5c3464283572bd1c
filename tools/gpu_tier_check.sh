#!/usr/bin/env bash
# Issue 38's device check (the MoE expert tier), one call on one H100/H200; logs and JSON go to $OUT.
# Carry the tree with $CARRY (default .carry, git-ignored) holding whl/ (the wheels of .dev/A), tok.gguf (the default
# model's tokenizer metadata only: what the synthetic models copy) and the prebuilt kernels (tools/prebuild_cuda.sh:
# _cuda_kernels.so / .h / .stamp), so that no model parts and no nvcc run are needed:
#   1. the MoE GPU tests of issue 34 (tests/test_cuda_moe.py), the hybrid plan's (tests/test_cuda_qwen35.py, whose
#      decode step the tier ticks) and the kernel declarations; the tier's (tests/test_cuda_moe_tier.py);
#   2. bench/moe_tier.py (its synthetic file is written first; SKIP_BENCH=1 skips it). ONLY_TIER=1: the tier's tests only.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 STRATA_NO_CUDA=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=${CARRY:-.carry}
PY=${PY:-python3}
[ -d /tmp/site/cffi ] || $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$C"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD STRATA_DEFAULT_MODEL=$PWD/$C/tok.gguf
cp "$C"/_cuda_kernels.* strata/
$PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
t() {   # t LOG TIMEOUT PYTEST-ARGS...: the whole output in $OUT/LOG, its summary lines here
  local log=$1 to=$2; shift 2
  timeout "$to" $PY -m pytest -q -rs -s -p timeout --timeout 200 --timeout-method thread "$@" > "$OUT/$log" 2>&1
  echo "$log: rc=$?"
  grep -E "passed|failed|FAILED|--moe-vram|^E |SKIPPED|Error" "$OUT/$log" | tail -n 30
}
[ -n "$ONLY_TIER" ] || t moe_tests.log ${MOE_TO:-150} tests/test_cuda_moe.py
[ -n "$ONLY_TIER" ] || t qwen35_tests.log ${Q35_TO:-100} tests/test_cuda_qwen35.py tests/test_cuda_declarations.py
t tier_tests.log ${TIER_TO:-150} tests/test_cuda_moe_tier.py
[ -n "$SKIP_BENCH" ] && exit 0
timeout ${BENCH_TO:-240} $PY bench/moe_tier.py --out "$OUT/moe_tier.json" ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" | tail -n 20
