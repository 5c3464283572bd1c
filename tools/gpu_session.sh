#!/usr/bin/env bash
# Device calls of the CUDA work (issue 6): logs and JSON go to $OUT. Carried folders (see docs/cuda.md):
#   .dev/A = wheels (whl/), the default model's first half (parts/), llamacpp.tar.gz, tok.gguf
#   .dev/B = wheels, the model's second half + its sha256 manifest, join.sh
#   (local folders named in .git/info/exclude, made with ../shared/offline/{wheels,split,llamacpp-src}.sh)
# Stage K (carry .dev/A): install the wheels, start the llama.cpp CUDA build in the background (llama-bench into
#   /tmp/lb/bin), build the kernels for sm_90, run the kernel tests and bench/cuda_kernels.py.
# Stage M (carry .dev/B, same warm machine): join the model, run the parity / device-error tests (and the hybrid and
#   device-sampling GPU tests when present), a `strata serve --device cuda` smoke request, and
#   bench/gpu_throughput.py (llama-bench if its build finished, else llama.cpp numbers stored in $REF).
# Stage P (carry .dev/B, after K): GDN kernel tests, quick hybrid prompt bench, ncu profile of a decode token.
# Stage Q (carry .dev/B, after K): hybrid decode plan tests, quick hybrid bench, ncu profiles (decode, prefill).
# Stages F1 (carry .dev/B, after K) / F2 (same machine): a session's final test subsets; serve smoke + bench (with
#   llama-bench when its build finished within BUILD_WAIT_S, else llama.cpp numbers from $REF).
# Stage T (any carry): run the test files named in $TESTS only.
stage=${1:?K, M, P or T}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4   # torch (the reference) must not fight the llama.cpp build for cores
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts
D=.dev/A; [ "$stage" != K ] && D=.dev/B; [ "$stage" = F2 ] && D=/tmp/none
[ -d /tmp/site/cffi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
cp "$D"/parts/* /tmp/parts/ 2>/dev/null
build() {
  python3 native/build_cuda.py --arch 90 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 2; }
}
# The llama.cpp build competes with the bench's host-bound rows (prefill launches from Python: -30% seen in session
# 4): wait for it up to $1 seconds, then stop it (the bench then takes llama.cpp's numbers from $REF).
settle_build() {
  [ -f /tmp/lc_build.log ] || return 0
  for i in $(seq 1 $(( ${1:-120} / 5 ))); do grep -q '^done' /tmp/lc_build.log && return 0; sleep 5; done
  echo "llama.cpp build not finished after ${1:-120} s: stopping it"
  for p in make gmake cmake cc1plus nvcc cicc ptxas; do pkill -x "$p"; done; sleep 2
}
if [ "$stage" = K ]; then
  if [ -z "$NO_LLAMA" ] && [ ! -x /tmp/lb/bin/llama-bench ] && [ -f .dev/A/llamacpp.tar.gz ]; then
    mkdir -p /tmp/lcsrc && tar xzf .dev/A/llamacpp.tar.gz -C /tmp/lcsrc
    setsid nohup bash -c 'cmake -S /tmp/lcsrc/llama.cpp -B /tmp/lb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
      -DCMAKE_BUILD_TYPE=Release > /tmp/lc_build.log 2>&1 && cmake --build /tmp/lb -j 10 --target llama-bench \
      >> /tmp/lc_build.log 2>&1; echo done >> /tmp/lc_build.log' \
      > /dev/null 2>&1 &
  fi
  cp .dev/A/tok.gguf /tmp/tok.gguf
  { nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; which nsys ncu; ls /usr/local/cuda*/bin 2>/dev/null | tr "\n" " "; } | tee "$OUT/gpu.txt"
  [ -f strata/_cuda_kernels.so ] && [ -n "$PREBUILT" ] || build
  timeout ${KT_S:-200} python3 -m pytest -v -rs -p timeout --timeout 40 --timeout-method thread tests/test_cuda_kernels.py ${KT_K:+-k "$KT_K"} 2>&1 \
    | grep -E "PASS|FAIL|ERROR|Timeout|passed|failed|Error|assert" | tail -60 > "$OUT/kernels.log"
  grep -cE "PASSED" "$OUT/kernels.log"; grep -vE "PASSED" "$OUT/kernels.log" | tail -30
  timeout ${KB_S:-200} python3 bench/cuda_kernels.py --out "$OUT/cuda_kernels.json" 2>&1 | tee "$OUT/cuda_kernels.log"
  [ -f /tmp/lc_build.log ] && tail -3 /tmp/lc_build.log
  if [ -n "$SYN_DECODE" ]; then   # decode of the synthetic 1.7B llama only (no default model needed)
    timeout 150 python3 bench/gpu_throughput.py --model none --synthetic /tmp/syn.gguf --tokenizer-from /tmp/tok.gguf \
      --prompts 512 --depths 0,4096,16384 --reference bench/results/gpu_NVIDIA_H200_40fb58a.json \
      --out "$OUT/gpu_syn.json" 2>&1 | grep -v "it/s" | tail -12
  fi
  exit 0
fi
[ -f strata/_cuda_kernels.so ] || build
M=SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f /tmp/model/$M ]; then
  bash .dev/B/join.sh /tmp/parts $M /tmp/model || { echo "MODEL JOIN FAILED (fresh machine?)"; exit 3; }
fi
export STRATA_DEFAULT_MODEL=/tmp/model/$M
if [ "$stage" = P ]; then   # GDN kernel tests, hybrid prompt rows, ncu decode profile of the synthetic 1.7B llama
  timeout ${HT_S:-150} python3 -m pytest -q -rs -p timeout --timeout 60 --timeout-method thread tests/test_cuda_hybrid.py \
    -k "recurrent or conv or chunked" 2>&1 | grep -E "passed|failed|FAILED|Error|Timeout|assert" | tail -12 | tee "$OUT/gdn_tests.log"
  timeout ${HB_S:-150} python3 bench/gpu_hybrid_model.py --out-gguf /tmp/hyb.gguf --prompts ${HB_PROMPTS:-512,4096} \
    --depths 0 --n-gen 32 --json "$OUT/hybrid_quick.json" 2>&1 | grep -v "it/s" | tail -8
  [ -f /tmp/syn.gguf ] || python3 -c "import sys; sys.path.insert(0, '.'); from bench.gpu_throughput import \
make_synthetic_llama as m; m('/tmp/syn.gguf', '/tmp/model/$M')"
  timeout ${PR_S:-200} python3 bench/decode_profile.py --model /tmp/syn.gguf --depths ${PR_DEPTHS:-0,16384} \
    --out "$OUT/decode_profile.json" 2>&1 | tail -60
  exit 0
fi
if [ "$stage" = Q ]; then   # hybrid decode plan tests, device-sampling kernel check, quick hybrid bench, profiles
  timeout ${QT_S:-180} python3 -m pytest -x -q -rs -s -p timeout --timeout 90 --timeout-method thread \
    tests/test_cuda_qwen35.py 2>&1 | grep -v "it/s]" | tail -25 | tee "$OUT/qwen35_tests.log"
  timeout 90 python3 -m pytest -x -q -p timeout --timeout 60 --timeout-method thread tests/test_device_sampling.py \
    -k kernel_matches 2>&1 | grep -E "passed|failed|Error|step" | tail -6
  timeout ${HB_S:-150} python3 bench/gpu_hybrid_model.py --out-gguf /tmp/hyb.gguf --prompts 512 \
    --depths 0,4096 --n-gen 64 --json "$OUT/hybrid_quick.json" 2>&1 | grep -v "it/s" | tail -8
  [ -f /tmp/syn.gguf ] || python3 -c "import sys; sys.path.insert(0, '.'); from bench.gpu_throughput import \
make_synthetic_llama as m; m('/tmp/syn.gguf', '/tmp/model/$M')"
  timeout ${PR_S:-150} python3 bench/decode_profile.py --model /tmp/syn.gguf --depths 0,16384 \
    --out "$OUT/profile_syn.json" 2>&1 | tail -32
  timeout 120 python3 bench/decode_profile.py --model /tmp/hyb.gguf --depths 0 --prefill 512 \
    --out "$OUT/profile_hyb_prefill.json" 2>&1 | tail -30
  timeout 120 python3 bench/decode_profile.py --model /tmp/hyb.gguf --depths 0 \
    --out "$OUT/profile_hyb_decode.json" 2>&1 | tail -24
  exit 0
fi
if [ "$stage" = F1 ]; then   # final checks of a session's changes (subsets chosen to fit the device budget)
  t() { timeout "$1" python3 -m pytest -q -rs -p timeout --timeout 90 --timeout-method thread "${@:2}" 2>&1 \
          | grep -E "passed|failed|FAILED|Error|Timeout|assert|step " | tail -8; }
  t 100 tests/test_cuda_qwen35.py tests/test_gdn_prefill_kernels.py | tee "$OUT/f_qwen35.log"
  t 80 tests/test_cuda_hybrid.py -k "recurrent or conv or chunked or prefill_logits or greedy_64 or capture" \
    | tee "$OUT/f_hybrid.log"
  t 30 tests/test_device_sampling.py -k "kernel_matches and 49152" | tee "$OUT/f_sampling.log"
  t 130 tests/test_cuda_parity.py -k "plan_prefill or greedy_64 or engine_cuda_greedy or kv_q8_0_greedy or pdl \
or attention_kernels_agree or checkpoint_exactness" | tee "$OUT/f_parity.log"
  exit 0
fi
if [ "$stage" = F2 ]; then   # serve smoke + the throughput bench (llama.cpp numbers from $REF)
  python3 -m strata.cli.main serve --device cuda --port 8765 --no-socket > "$OUT/serve_log.txt" 2>&1 &
  spid=$!
  for i in $(seq 1 90); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 0.5; done
  body='{"model":"default","messages":[{"role":"user","content":"What is a GPU?"}],"max_tokens":24,"temperature":0}'
  for i in 1 2; do curl -s -m 60 http://127.0.0.1:8765/v1/chat/completions -H 'Content-Type: application/json' \
    -d "$body" | head -c 400; echo; done | tee "$OUT/serve.txt"
  kill "$spid"; wait "$spid" 2>/dev/null
  settle_build "${BUILD_WAIT_S:-120}"
  LB="--reference $REF"; [ -x /tmp/lb/bin/llama-bench ] && LB="--llama-bench /tmp/lb/bin/llama-bench"
  timeout ${BENCH_S:-300} python3 bench/gpu_throughput.py --model default --synthetic /tmp/syn.gguf \
    --synthetic-hybrid /tmp/hyb.gguf --tokenizer-from /tmp/model/$M $LB \
    --out "$OUT/gpu_throughput.json" 2>&1 | grep -v "it/s" | tee "$OUT/bench.log" | tail -45
  exit 0
fi
if [ "$stage" = T ]; then
  timeout ${T_S:-400} python3 -m pytest -q -rs -x $TESTS 2>&1 | grep -v "it/s]" | tail -40 | tee "$OUT/tests.log"
  exit 0
fi
timeout ${PT_S:-300} python3 -m pytest -q -rs -s -p timeout --timeout 120 --timeout-method thread \
  tests/test_cuda_parity.py tests/test_cuda_device_errors.py 2>&1 \
  | grep -v "it/s]" | tee "$OUT/parity.log" | tail -30
for f in tests/test_cuda_hybrid.py tests/test_device_sampling.py; do
  [ -f "$f" ] && timeout ${OT_S:-150} python3 -m pytest -q -rs -p timeout --timeout 60 --timeout-method thread "$f" \
    2>&1 | grep -E "passed|failed|FAILED|Error|Timeout" | tail -12 | tee -a "$OUT/other_tests.log"
done
python3 -m strata.cli.main serve --device cuda --port 8765 --no-socket > "$OUT/serve_log.txt" 2>&1 &
spid=$!
for i in $(seq 1 90); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 0.5; done
body='{"model":"default","messages":[{"role":"system","content":"You are brief."},{"role":"user","content":"What is a GPU?"}],"max_tokens":32,"temperature":0}'
for i in 1 2; do curl -s -m 60 http://127.0.0.1:8765/v1/chat/completions -H 'Content-Type: application/json' -d "$body"; echo; done | tee "$OUT/serve.txt"
curl -s -m 10 http://127.0.0.1:8765/status | tee -a "$OUT/serve.txt"; echo
kill "$spid"; wait "$spid" 2>/dev/null
settle_build "${BUILD_WAIT_S:-120}"
LB=""; [ -x /tmp/lb/bin/llama-bench ] && LB="--llama-bench /tmp/lb/bin/llama-bench"
[ -z "$LB" ] && tail -3 /tmp/lc_build.log
[ -f /tmp/syn.gguf ] || cp .dev/A/tok.gguf /tmp/tok.gguf 2>/dev/null
timeout ${BENCH_S:-300} python3 bench/gpu_throughput.py --model default --synthetic /tmp/syn.gguf --synthetic-hybrid /tmp/hyb.gguf --tokenizer-from /tmp/model/$M \
  $LB --reference "${REF:-bench/results/gpu_NVIDIA_H200_40fb58a.json}" --out "$OUT/gpu_throughput.json" 2>&1 | tee "$OUT/bench.log" | tail -40
