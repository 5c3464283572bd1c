#!/usr/bin/env bash
# Issue 34's MoE prefill check on the device, two calls on one warm machine; logs and JSON in $OUT.
# Run from the root of this tree (copied to the device, strata/_cuda_kernels.so not built there) with
#   WHL=<wheels folder>  NEWK=<this tree's kernels: _cuda_kernels.so.xz + .h (tools/prebuild_cuda.sh, xz)>
#   OLDK=<main's kernels, the same two files>  TOK=<a GGUF with the default model's tokenizer (tools/tokenizer_gguf.py;
#   the synthetic files copy it)>  LCTAR=<llama.cpp source tar.gz>
# 1: the llama.cpp CUDA build (llama-bench) in the background; wheels, kernels, the C core; the medium and large
#    synthetic qwen35moe (bench/gpu_throughput.make_synthetic_moe) written in the background; tests/test_cuda_moe.py;
#    bench/moe_prefill_profile.py on the medium file with this tree's kernels (lanes 32 / 16 / 8) and main's;
#    bench/gpu_throughput.py's Strata rows on both files (prompt 512 / 4096 / 16384, decode at 0 / 4096 / 16384).
# 2 (same warm machine, the same carry; a carried tree arrives without stage 1's builds, which it copies back from
#    /tmp/moe_built): llama-bench on both files (gpu_throughput --strata-from stage 1's rows), and where nsys exists,
#    llama-bench pp4096 on the medium file under nsys (its kernels' time: MUL_MAT_ID and the rest).
stage=${1:?1 or 2}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; RES=/tmp/moe_res; mkdir -p "$OUT" "$RES"
MED=/tmp/moe_medium_q4_0.gguf; LARGE=/tmp/moe_large_q4_0.gguf
LB=/tmp/lb/bin/llama-bench
export PYTHONPATH=/tmp/site:$PWD STRATA_DEFAULT_MODEL=$TOK
if [ "$stage" = 1 ]; then
  mkdir -p /tmp/lcsrc && tar xzf "$LCTAR" -C /tmp/lcsrc
  setsid nohup bash -c 'cmake -S /tmp/lcsrc/llama.cpp -B /tmp/lb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_TYPE=Release > /tmp/lc_build.log 2>&1 && cmake --build /tmp/lb -j 12 --target llama-bench \
    >> /tmp/lc_build.log 2>&1; echo done >> /tmp/lc_build.log' > /dev/null 2>&1 &
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl; echo "pip rc=$?"
  xz -dc "$NEWK/_cuda_kernels.so.xz" > strata/_cuda_kernels.so && cp "$NEWK/_cuda_kernels.h" strata/
  mkdir -p /tmp/oldK && xz -dc "$OLDK/_cuda_kernels.so.xz" > /tmp/oldK/_cuda_kernels.so \
    && cp "$OLDK/_cuda_kernels.h" /tmp/oldK/
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; echo "build rc=$?"
  mkdir -p /tmp/moe_built && cp strata/_cuda_kernels.so strata/_cuda_kernels.h strata/_native*.so /tmp/moe_built/
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  (for f in "$MED:medium" "$LARGE:large"; do
     p=${f%:*}; s=${f#*:}; t0=$(date +%s)
     [ -f "$p" ] || python3 -c "from bench.gpu_throughput import make_synthetic_moe as m; m('$p.tmp', '$s')" \
       && mv -f "$p.tmp" "$p" 2>/dev/null; echo "$s written in $(( $(date +%s) - t0 )) s: $(ls -la "$p")"
   done) > "$OUT/synth.log" 2>&1 &
  synth=$!
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_moe.py > "$OUT/moe_tests.log" 2>&1
  echo "test_cuda_moe rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/moe_tests.log" | tail -8
  for i in $(seq 1 120); do [ -f "$MED" ] && break; sleep 1; done
  timeout 120 python3 bench/moe_prefill_profile.py "$MED" --lanes 32,16,8 --label this_tree \
    --out "$OUT/profile_this_tree.json" 2>&1 | tail -n 45
  STRATA_CUDA_LIB=/tmp/oldK/_cuda_kernels.so timeout 90 python3 bench/moe_prefill_profile.py "$MED" \
    --label main_kernels --out "$OUT/profile_main_kernels.json" 2>&1 | tail -n 16
  wait $synth; cat "$OUT/synth.log"
  timeout 300 python3 bench/gpu_throughput.py --model none --synthetic-moe "$MED:medium" \
    --synthetic-moe "$LARGE:large" --skip-generic --out "$RES/strata.json" 2>&1 | grep -v "it/s" | tail -n 30
  cp "$RES/strata.json" "$OUT/" 2>/dev/null
  tail -n 2 /tmp/lc_build.log
  exit 0
fi
[ -f strata/_cuda_kernels.so ] || cp /tmp/moe_built/* strata/
for i in $(seq 1 ${LLAMA_WAIT:-240}); do grep -q '^done' /tmp/lc_build.log 2>/dev/null && break; sleep 1; done
tail -n 2 /tmp/lc_build.log
[ -x $LB ] || { echo "no llama-bench"; exit 3; }
timeout 300 python3 bench/gpu_throughput.py --model none --synthetic-moe "$MED:medium" --synthetic-moe "$LARGE:large" \
  --strata-from "$RES/strata.json" --llama-bench $LB --out "$OUT/gpu_moe.json" 2>&1 | grep -v "it/s" | tail -n 30
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)
if [ -n "$NSYS" ] && [ -z "$NO_NSYS" ]; then
  timeout 120 "$NSYS" profile -t cuda -o /tmp/lb_prof -f true $LB -m "$MED" -ngl 99 -fa 1 -ub 512 -b 2048 -r 1 \
    -p 4096 -n 0 > "$OUT/nsys_run.log" 2>&1
  timeout 60 "$NSYS" stats -r cuda_gpu_kern_sum -f csv -o "$OUT/llama_pp4096" /tmp/lb_prof.nsys-rep > /dev/null 2>&1
  head -n 25 "$OUT"/llama_pp4096*.csv | cut -c1-220
else
  echo "nsys: none here"
fi
