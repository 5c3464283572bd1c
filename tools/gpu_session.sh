#!/usr/bin/env bash
# Device calls of the CUDA work (issue 6), logs and JSON to $OUT. The default model (98 MB) travels in two
# halves, one per call (a call carries at most 64 MiB): stage A carries .dev/A (wheels, model part aa), builds the
# kernels for sm_90 and runs the kernel tests; stage B (same warm machine) carries .dev/B (part ab + manifest),
# joins the model and runs the parity / engine / checkpoint tests on cuda, a `strata serve --device cuda` smoke
# request, and bench/gpu_throughput.py (llama.cpp numbers from $REF unless $LLAMA_BENCH is given); with
# CHECK_ONLY=1, stage B runs only tools/gpu_decode_check.py on the default model. Stage S: one call, no model parts.
stage=${1:?A or B}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts
D=.dev/$stage; [ "$stage" = S ] && D=.dev/A
if [ ! -d /tmp/site/cffi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
cp "$D"/parts/* /tmp/parts/ 2>/dev/null
[ -f strata/_cuda_kernels.so ] && [ -f /tmp/built ] || { python3 native/build_cuda.py --arch 90 2>&1 | tail -2; touch /tmp/built; }
[ -f /tmp/strata_env ] && . /tmp/strata_env
if [ "$stage" = S ]; then   # one call, no default model: kernel tests + benchmark of the synthetic 1.7B model
  timeout 60 python3 -m pytest -q tests/test_cuda_kernels.py 2>&1 | tail -3
  timeout ${BENCH_S:-200} python3 bench/gpu_throughput.py --model none --synthetic /tmp/syn.gguf --tokenizer-from .dev/A/tok.gguf \
    --reference "${REF:?}" --prompts ${PROMPTS:-512,4096,16384} --out "$OUT/gpu_throughput_syn.json" 2>&1 | tee "$OUT/bench_syn.log" | tail -20
  exit 0
fi
if [ "$stage" = A ]; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
  timeout 150 python3 -m pytest -q -rs tests/test_cuda_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -25
  grep -q "FAILED.*dp4a\|FAILED.*matvec" "$OUT/kernels.log" && echo "export STRATA_CUDA_DP4A=0" >> /tmp/strata_env
  if grep -q "FAILED.*paged_attention" "$OUT/kernels.log"; then   # which of the two new attention kernels?
    if STRATA_CUDA_FLASH=0 timeout 60 python3 -m pytest -q tests/test_cuda_kernels.py -k paged_attention > "$OUT/attn.log" 2>&1; then
      echo "export STRATA_CUDA_FLASH=0" >> /tmp/strata_env
    else
      echo "export STRATA_CUDA_FLASH=0 STRATA_CUDA_ATTN_V1=1" >> /tmp/strata_env
    fi
  fi
  cat /tmp/strata_env 2>/dev/null
  exit 0
fi
M=SmolLM2-135M-Instruct.Q4_1.gguf
if [ -n "$CHECK_ONLY" ]; then   # stage B, decode-path check on the default model only
  bash .dev/B/join.sh /tmp/parts $M /tmp/model || exit 3
  timeout 90 python3 tools/gpu_decode_check.py /tmp/model/$M 4 2>&1 | tee "$OUT/decode_check.log"
  exit 0
fi
if bash /work/shared/offline/join.sh /tmp/parts $M /tmp/model 2>/dev/null || bash .dev/B/join.sh /tmp/parts $M /tmp/model; then
  export STRATA_DEFAULT_MODEL=/tmp/model/$M
else
  echo "MODEL JOIN FAILED (fresh machine?)"; exit 3
fi
timeout 240 python3 -m pytest -q -rs -s tests/test_cuda_parity.py tests/test_cuda_device_errors.py 2>&1 \
  | grep -v "it/s]" | tee "$OUT/parity.log" | tail -40
# serve smoke: the daemon on cuda, two identical chat requests (the second resumes from a checkpoint)
python3 -m strata.cli.main serve --device cuda --port 8765 --no-socket > "$OUT/serve_log.txt" 2>&1 &
spid=$!
for i in $(seq 1 90); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 0.5; done
body='{"model":"default","messages":[{"role":"system","content":"You are brief."},{"role":"user","content":"What is a GPU?"}],"max_tokens":32,"temperature":0}'
for i in 1 2; do curl -s -m 60 http://127.0.0.1:8765/v1/chat/completions -H 'Content-Type: application/json' -d "$body"; echo; done | tee "$OUT/serve.txt"
curl -s -m 10 http://127.0.0.1:8765/status | tee -a "$OUT/serve.txt"; echo
kill "$spid"; wait "$spid" 2>/dev/null
LB=${LLAMA_BENCH:+--llama-bench $LLAMA_BENCH}
timeout ${BENCH_S:-220} python3 bench/gpu_throughput.py --model default --synthetic /tmp/syn.gguf $LB --reference "${REF:?}" \
  --out "$OUT/gpu_throughput.json" 2>&1 | tee "$OUT/bench.log" | tail -32
