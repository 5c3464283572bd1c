#!/usr/bin/env bash
# Issue 34's device check (MoE layers on the GPU), ~5 minutes on one H200; logs and JSON go to $OUT.
# Run from the repository root on a machine where the tree is built (strata/_native*.so, strata/_cuda_kernels.so for
# sm_90) and PYTHONPATH / STRATA_DEFAULT_MODEL are set as tools/gpu_stages.sh's stages set them (after its A and J).
#   1. writes the medium synthetic qwen35moe (Q4_0, seed 1: the file of issue 34) in the background;
#   2. the MoE GPU tests (tests/test_cuda_moe.py) and the hybrid plan's own (tests/test_cuda_qwen35.py, whose dense
#      path the MoE change touches), and the kernel declarations;
#   3. one bench row on the medium file: prompt 512, decode at depth 0 (64 tokens), beside llama-bench on the same file
#      when $LLAMA_BENCH (default /tmp/lb/bin/llama-bench) exists.
# FULL=1: the whole bench/gpu_throughput.py MoE row instead (prompt 512 / 4096 / 16384, decode at 0 / 4096 / 16384;
# longer than 5 minutes: run it in its own device call, after this one wrote the file; MOE_SIZE=large with
# MOE_GGUF=<another path> for the larger synthetic).
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PY:-python3}
MOE=${MOE_GGUF:-/tmp/moe_medium_q4_0.gguf}
LB=${LLAMA_BENCH:-/tmp/lb/bin/llama-bench}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/moe_gpu.txt" 2>&1
if [ ! -f "$MOE" ]; then
  ($PY tools/synth_gguf.py qwen35moe "$MOE.tmp" --size "${MOE_SIZE:-medium}" --qtype Q4_0 --seed 1 > "$OUT/moe_synth.log" 2>&1 \
    && mv "$MOE.tmp" "$MOE") &
  synth=$!
fi
t() {   # t LOG TIMEOUT PYTEST-ARGS...: the whole output in $OUT/LOG, its summary lines here
  local log=$1 to=$2; shift 2
  timeout "$to" $PY -m pytest -q -rs -s -p timeout --timeout 200 --timeout-method thread "$@" > "$OUT/$log" 2>&1
  echo "$log: rc=$?"
  grep -E "passed|failed|FAILED|rel L2|plan |stage|part at|^E |SKIPPED" "$OUT/$log" | tail -n 40
}
t moe_tests.log 150 tests/test_cuda_moe.py
t moe_qwen35_tests.log 90 tests/test_cuda_qwen35.py tests/test_cuda_declarations.py
[ -n "$synth" ] && { wait $synth; echo "synthetic MoE written rc=$?"; tail -n 2 "$OUT/moe_synth.log"; }
[ -f "$MOE" ] || { echo "no synthetic MoE file at $MOE"; exit 3; }
args=(--model none --synthetic-moe "$MOE" --moe-size "${MOE_SIZE:-medium}" --out "$OUT/gpu_moe.json")
[ -x "$LB" ] && args+=(--llama-bench "$LB") || echo "no llama-bench at $LB: Strata's numbers only"
if [ -z "$FULL" ]; then args+=(--prompts 512 --depths 0 --n-gen 64); fi
[ -n "$FULL" ] && to=${BENCH_TIMEOUT:-580} || to=${BENCH_TIMEOUT:-150}
timeout "$to" $PY bench/gpu_throughput.py "${args[@]}" 2>&1 | tee "$OUT/moe_bench.log" | tail -n 30
