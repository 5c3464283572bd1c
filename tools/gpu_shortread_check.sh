#!/usr/bin/env bash
# The short read's device check (issue 33), about 5 minutes on one H200, after the tree is built there and PYTHONPATH
# / STRATA_DEFAULT_MODEL are set as for tools/gpu_stages.sh's stages (its stage A and the model join): the short-read
# tests (every column launcher against the decode launcher it mirrors, then the default model and a synthetic hybrid
# read 2..16 tokens bit-identically to decoding them one at a time), the decode kernels and plan tests the shared
# header and the routing touch, then a quick bench/short_read.py (the default model, and the synthetic 1.7B llama /
# 1.5B hybrid when their files are in $GM, e.g. from gpu_stages.sh's stage G; llama-bench beside when built at
# /tmp/lb/bin/llama-bench). Logs and JSON go to $OUT.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GM=${GM:-/tmp/gm}
M=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf     # where gpu_stages.sh joins the default model
[ -z "$STRATA_DEFAULT_MODEL" ] && [ -f $M ] && export STRATA_DEFAULT_MODEL=$M
[ -f strata/_cuda_kernels.so ] || cp /tmp/built/* strata/ 2>/dev/null   # gpu_stages.sh stage A's build
t() { timeout "$1" python3 -m pytest -q -rs "${@:2}" 2>&1 | grep -vE "it/s\]" \
        | grep -E "passed|failed|FAILED|Error|assert|skipped|SKIP|^E " | tail -30; }
python3 -c "from strata.backend import cuda as C; print('CUDA:', C.unavailable_reason() or 'ok')" | tee "$OUT/sr_env.log"
echo "== short-read tests" | tee "$OUT/sr_tests.log"
t 240 tests/test_cuda_short_read.py | tee -a "$OUT/sr_tests.log"
echo "== decode kernels and plans (shared header, routing)" | tee -a "$OUT/sr_tests.log"
t 90 tests/test_cuda_declarations.py tests/test_cuda_kernels.py -k "q8w or q8b or handoff or glu or fused_norm or decode or rms_norm or swiglu or attention" \
  | tee -a "$OUT/sr_tests.log"
t 60 tests/test_cuda_qwen35.py -k "plan_logits_match_generic or graphs_vs_eager or bad_token" | tee -a "$OUT/sr_tests.log"
echo "== bench" | tee "$OUT/sr_bench.log"
MODELS=${MODELS:-default}
for m in syn_llama_1_7b syn_hybrid_1_5b; do [ -f "$GM/$m.gguf" ] && MODELS="$MODELS,$m"; done
LB=""; [ -x /tmp/lb/bin/llama-bench ] && LB="--llama-bench /tmp/lb/bin/llama-bench"
timeout 120 python3 bench/short_read.py --device cuda --dir "$GM" --models "$MODELS" $LB --reps 2 \
  --depths ${SR_DEPTHS:-0,4096} --out "$OUT/short_read_cuda.json" 2>&1 | grep -vE "it/s" | tail -60 \
  | tee -a "$OUT/sr_bench.log"
