#!/usr/bin/env bash
# Device calls of the stages-and-memory work (issue 19); logs and JSON go to $OUT. Carried folders (local, named in
# .git/info/exclude; made with ../shared/offline/{wheels,split,llamacpp-src}.sh and `git archive`):
#   .dev/A = wheels (whl/), two of the default model's parts (parts/), llamacpp.tar.gz, before.tar.gz (main's tree)
#   .dev/B = the model's other parts + its sha256 manifest (parts/), join.sh
# Order on a fresh machine: J (carry .dev/B1 and .dev/K, when tools/prebuild_cuda.sh made it), A, J (.dev/B2).
# Stage A (carry .dev/A): install the wheels, start the llama.cpp CUDA build (llama-bench) in the background, build
#   this tree and main's tree (/tmp/before) for sm_90 (NO_BEFORE=1: this tree only; LLAMA_FIRST=llama-server: that
#   target first).
# Stage B (carry .dev/B, same warm machine): join the model; the GPU tests (stages, parity, step, qwen35, hybrid,
#   device sampling); a `strata serve --device cuda:0,cuda:0 --layer-split 15` smoke request.
# Stage C (same machine): bench/gpu_throughput.py before / after alternating (the plan rows, llama-bench in the same
#   run), bench/engine_ab.py before / after / after with two stages on cuda:0.
# Stage D (same machine): bench/park_session.py (2K/16K/64K, the default model and the 1.5B hybrid) and
#   bench/stage_link.py (main and worker as two processes on cuda:0), and the GPU remote-stage test.
# Stage E (carry .dev/B): the grammar tests (the token mask on device logits), bench/constrained.py on the default
#   model and the synthetic 1.7B llama, and park_session's 16K / 64K rows again.
# Issue 20's check (after A and the model join): T and U the whole GPU test set, G greedy tokens before / after on
#   the default model and the synthetic 1.7B llama / 1.5B hybrid, C the throughput A/B; F issue 23's later turns on
#   the H200 end to end beside llama-server, then a profile of the switch back at 64K.
# Issue 26 (kind nvidia-h200-x2, after A and the model join): X the two-GPU tests, engine_ab 1 vs 2 GPUs, llama-bench
#   -sm none / layer on the same file.
stage=${1:?A, J (model parts), B, C, D, E, T, U, G, F or X}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts
if [ "$stage" = A ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .dev/A/whl/*.whl || exit 1
  cp .dev/A/parts/* /tmp/parts/
  mkdir -p /tmp/lcsrc && tar xzf .dev/A/llamacpp.tar.gz -C /tmp/lcsrc
  [ -n "$NO_LLAMA" ] || setsid nohup bash -c 'cmake -S /tmp/lcsrc/llama.cpp -B /tmp/lb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_TYPE=Release > /tmp/lc_build.log 2>&1 && cmake --build /tmp/lb -j 8 --target ${LLAMA_FIRST:-llama-bench} \
    >> /tmp/lc_build.log 2>&1; cmake --build /tmp/lb -j 8 --target llama-server >> /tmp/lc_build.log 2>&1; \
    echo done >> /tmp/lc_build.log' > /dev/null 2>&1 &
  rm -rf /tmp/before && tar xzf .dev/A/before.tar.gz -C /tmp
  export PYTHONPATH=/tmp/site
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
  # kernels prebuilt here (tools/prebuild_cuda.sh: .dev/K, carried with .dev/B1 in a J call before this one, which
  # copies them to /tmp/K) when they match native/cuda
  KB="python3 native/build_cuda.py --arch 90"
  K=/tmp/K; [ -f .dev/K/_cuda_kernels.so ] && K=.dev/K
  if [ -f $K/_cuda_kernels.so ] && [ "$(export LC_ALL=C; cat native/cuda/* | sha256sum | cut -d" " -f1)" = "$(cat $K/src.sha256)" ]; then
    cp $K/_cuda_kernels.so $K/_cuda_kernels.h strata/ && KB="echo kernels: prebuilt ($K)"
  fi
  (python3 setup.py build_ext --inplace && $KB) > "$OUT/build_after.log" 2>&1 &
  a=$!
  [ -n "$NO_BEFORE" ] || (cd /tmp/before && python3 setup.py build_ext --inplace && python3 native/build_cuda.py \
    --arch 90) > "$OUT/build_before.log" 2>&1 &
  b=$!
  wait $a; echo "after build rc=$?"; [ -n "$NO_BEFORE" ] || { wait $b; echo "before build rc=$?"; }
  tail -n 3 "$OUT/build_after.log"; tail -n 2 /tmp/lc_build.log
  mkdir -p /tmp/built && cp strata/_cuda_kernels.so strata/_native*.so /tmp/built/
  exit 0
fi
export PYTHONPATH=/tmp/site:$PWD
[ -d .dev/K ] && rm -rf /tmp/K && cp -r .dev/K /tmp/K      # prebuilt kernels for a stage A after this call
[ -f strata/_cuda_kernels.so ] || cp /tmp/built/* strata/ 2>/dev/null
M=SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f /tmp/model/$M ]; then      # the parts come in .dev/B, or in .dev/B1 then .dev/B2 (the carry limit)
  for b in B B1 B2; do cp .dev/$b/parts/* /tmp/parts/ 2>/dev/null; cp .dev/$b/join.sh /tmp/join.sh 2>/dev/null; done
  if [ "$stage" = J ] && [ ! -f /tmp/parts/$M.part-ac ]; then echo "parts so far: $(ls /tmp/parts | tr '\n' ' ')"; exit 0; fi
  bash /tmp/join.sh /tmp/parts $M /tmp/model || { echo "MODEL JOIN FAILED (fresh machine?)"; exit 3; }
fi
[ "$stage" = J ] && { ls -la /tmp/model; exit 0; }
export STRATA_DEFAULT_MODEL=/tmp/model/$M
t() { timeout "$1" python3 -m pytest -q -rs -p timeout --timeout 240 --timeout-method thread "${@:2}" 2>&1 \
        | grep -vE "it/s\]" | grep -E "passed|failed|FAILED|Error|Timeout|assert|split|^E " | tail -25; }
if [ "$stage" = T ]; then     # issue 20: the whole GPU test set on this tree
  t 280 tests/test_cuda_kernels.py tests/test_cuda_declarations.py tests/test_cuda_policy.py tests/test_cuda_device_errors.py \
    tests/test_gdn_prefill_kernels.py tests/test_cuda_hybrid.py | tee "$OUT/t_kernels.log"
  t 280 tests/test_cuda_parity.py tests/test_cuda_qwen35.py tests/test_cuda_stages.py | tee "$OUT/t_plans.log"
  exit 0
fi
if [ "$stage" = U ]; then     # the rest of the GPU set: device sampling, grammar on device logits, serve on cuda
  t 250 tests/test_device_sampling.py tests/test_grammar.py | tee "$OUT/t_sampling.log"
  t 120 tests/test_serve.py -k "cuda" | tee "$OUT/t_serve.log"
  tail -2 /tmp/lc_build.log
  exit 0
fi
if [ "$stage" = G ]; then     # issue 20: greedy tokens before / after on the same files
  cp tools/greedy_tokens.py /tmp/before/tools/greedy_tokens.py
  for tree in before after; do
    dir=$PWD; [ $tree = before ] && dir=/tmp/before
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 250 python3 tools/greedy_tokens.py --dir /tmp/gm \
      $STRATA_DEFAULT_MODEL syn_llama_1_7b syn_hybrid_1_5b 2>&1 | grep '^{' > "$OUT/greedy_$tree.jsonl")
  done
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {t: {r["model"]: r for r in map(json.loads, open(f"{out}/greedy_{t}.jsonl"))} for t in ("before", "after")}
for m in rows["after"]:
    a, b = rows["after"][m], rows["before"].get(m)
    print(m, a["runner"], "identical" if b and a["tokens"] == b["tokens"] else f"DIFFER before={b and b['tokens'][:12]} after={a['tokens'][:12]}")
PY
  exit 0
fi
if [ "$stage" = F ]; then     # issue 23: later turns on the H200 (llama-server beside), the switch back profiled
  LS=""; [ -x /tmp/lb/bin/llama-server ] && LS="--llama-server /tmp/lb/bin/llama-server"
  echo "llama-server: ${LS:-not built}"
  # end to end (the openai client: its wheels are in .dev/A/whl since session 14) with llama-server beside,
  # else in process
  MODE="--e2e $LS"; python3 -c "import openai" 2>/dev/null || MODE=""
  timeout 330 python3 bench/prompt_cache.py $MODE --device cuda --synthetic hybrid_1_5b --sizes ${PC_SIZES:-4096 16384 65536} \
    --label h200 --out "$OUT/prompt_cache_cuda.json" 2>&1 | tr '\r' '\n' | grep -vE "it/s|^\s*$|loading" | tail -40
  # where the switch back's time goes (issue 23), at 64K
  timeout 150 python3 tools/profile_turn.py --size 65536 --step switch --top 20 2>&1 | grep -vE "it/s|loading" \
    | cut -c1-160 | head -50
  exit 0
fi
if [ "$stage" = X ]; then     # issue 26 on nvidia-h200-x2 (after A and the model join): the two-GPU tests, 1 vs 2 GPUs
  nvidia-smi --query-gpu=index,name --format=csv | tee "$OUT/gpus.txt"
  t 500 tests/test_cuda_two_gpus.py tests/test_cuda_stages.py | tee "$OUT/t_two_gpus.log"
  timeout 500 python3 bench/engine_ab.py --device cuda --model $STRATA_DEFAULT_MODEL --arm one_gpu=. \
    --arm 'two_gpus=.?layer_split=auto&device=cuda:0,cuda:1' --rounds 2 --prompts 512,4096,16384 \
    --depths 0,4096,16384 --out "$OUT/engine_ab_two_gpus.json" 2>&1 | grep -vE "it/s" | tail -12
  timeout 120 python3 bench/p2p_copy.py --engine-ab "$OUT/engine_ab_two_gpus.json" --out "$OUT/p2p_copy.json" 2>&1 | tail -8
  [ -x /tmp/lb/bin/llama-bench ] && for sm in none layer; do timeout 300 /tmp/lb/bin/llama-bench \
    -m $STRATA_DEFAULT_MODEL -ngl 99 -fa 1 -sm $sm -p 512,4096,16384 -n 128 -d 0,4096,16384 -r 2 -o json \
    > "$OUT/llama_bench_sm_$sm.json" 2>/dev/null; echo "llama-bench -sm $sm rc=$?"; done
  exit 0
fi
if [ "$stage" = B ]; then
  t 200 -s tests/test_cuda_stages.py | tee "$OUT/t_stages.log"
  t 200 tests/test_cuda_parity.py tests/test_cuda_device_errors.py | tee "$OUT/t_parity.log"
  [ -n "$QUICK" ] || t 120 tests/test_cuda_qwen35.py tests/test_gdn_prefill_kernels.py | tee "$OUT/t_qwen35.log"
  t 200 tests/test_cuda_hybrid.py tests/test_device_sampling.py | tee "$OUT/t_hybrid.log"
  t 60 tests/test_serve.py -k "cuda" | tee "$OUT/t_serve.log"
  # main's tree on the same machine: does its CUDA-vs-CPU greedy test part the same way?
  (cd /tmp/before && export PYTHONPATH=/tmp/site:/tmp/before && t 100 tests/test_cuda_parity.py -k matches_cpu_backend) \
    | tee "$OUT/t_before_matches_cpu.log"
  python3 -m strata.cli.main serve --device cuda:0,cuda:0 --layer-split 15 --port 8765 --no-socket \
    > "$OUT/serve_log.txt" 2>&1 &
  spid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 0.5; done
  body='{"model":"default","messages":[{"role":"user","content":"What is a GPU?"}],"max_tokens":24,"temperature":0}'
  for i in 1 2; do curl -s -m 60 http://127.0.0.1:8765/v1/chat/completions -H 'Content-Type: application/json' \
    -d "$body" | head -c 500; echo; done | tee "$OUT/serve.txt"
  curl -s -m 10 http://127.0.0.1:8765/status | head -c 1500 | tee -a "$OUT/serve.txt"; echo
  kill "$spid"; wait "$spid" 2>/dev/null
  tail -2 /tmp/lc_build.log
  exit 0
fi
if [ "$stage" = D ]; then     # issue 21 / 22: parking and session files, the stage link (main + worker on cuda:0)
  timeout ${PARK_T:-300} python3 bench/park_session.py --device cuda --tokens ${PARK_TOKENS:-2048,16384,65536} \
    --hybrid-1_5b --out "$OUT/park_session_cuda.json" 2>&1 | grep -vE "it/s|^\s*$" | tail -12
  timeout 240 python3 bench/stage_link.py --device cuda --prompt 2048 --decode 128 --rounds 3 \
    --out "$OUT/stage_link_cuda.json" 2>&1 | grep -vE "it/s|^\s*$" | tail -12
  t 240 tests/test_cuda_stages.py -k remote | tee "$OUT/t_remote.log"
  exit 0
fi
if [ "$stage" = E ]; then     # issue 24 (constrained output on the device) and 21 (session files, checksum beside I/O)
  t 200 tests/test_grammar.py | tee "$OUT/t_grammar.log"
  timeout 300 python3 bench/constrained.py --device cuda --skip-libraries --model default --synthetic-1_7b \
    --out "$OUT/constrained_cuda.json" 2>&1 | grep -vE "it/s|^\s*$" | tail -8
  timeout 200 python3 bench/park_session.py --device cuda --tokens 16384,65536 --synthetic-hybrid '' \
    --out "$OUT/park_session_cuda_crc.json" 2>&1 | grep -vE "it/s|^\s*$" | tail -4
  exit 0
fi
if [ "$stage" = C ]; then
  [ -f /tmp/before/strata/_cuda_kernels.so ] || { echo "no before build"; exit 4; }
  cp bench/gpu_throughput.py /tmp/before/bench/gpu_throughput.py      # the same bench (its --quick) for both trees
  [ -f /tmp/lc_build.log ] && for i in $(seq 1 60); do grep -q '^done' /tmp/lc_build.log && break; sleep 5; done
  LB=""; [ -x /tmp/lb/bin/llama-bench ] && LB="--llama-bench /tmp/lb/bin/llama-bench"
  echo "llama-bench: ${LB:-not built}"
  for r in $(seq 1 ${ROUNDS:-2}); do
    for tree in before after; do
      dir=$PWD; [ $tree = before ] && dir=/tmp/before
      extra=""; [ $r = 1 ] && [ $tree = after ] && extra="$LB"
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python3 bench/gpu_throughput.py --quick --model $STRATA_DEFAULT_MODEL \
        --prompts 512,4096,16384 --depths 0,4096,16384 $extra --out "$OUT/gpu_${tree}_$r.json" 2>&1 \
        | grep -E "strata|llama|pp|tg" | grep -v "it/s" | tail -12)
    done
  done
  [ -n "$NO_AB" ] || timeout 400 python3 bench/engine_ab.py --device cuda --model $STRATA_DEFAULT_MODEL --arm before=/tmp/before \
    --arm after=. --arm 'after_2stages=.?layer_split=15&device=cuda:0,cuda:0' --rounds ${AB_ROUNDS:-3} --prompts 512,4096 \
    --depths 0,4096 --n-gen 256 --out "$OUT/engine_ab_cuda.json" 2>&1 | tail -12
  exit 0
fi
