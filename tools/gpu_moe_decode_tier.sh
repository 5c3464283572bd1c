#!/usr/bin/env bash
# Issue 34's decode profile on the large synthetic MoE and issue 38's tier bench with llama.cpp's arms, in one device
# call (logs and JSON in $OUT). Run from the root of this tree (copied to the device; native/cuda as on main) with
#   ONE=<folder with whl/ (wheels), K/ (main's prebuilt sm_90 kernels: _cuda_kernels.so.xz, .h, .stamp), tok.gguf
#   (a tokenizer-only GGUF, tools/tokenizer_gguf.py)>  LCTAR=<llama.cpp source tar.gz>
# Order: the llama.cpp CUDA build (llama-bench only, sm_90, -j16) in the background first; wheels, kernels, the C
# core; the tier bench's file then the profile's file written in the background; bench/moe_tier.py's Strata arms;
# bench/moe_decode_profile.py; then, if the build is done by LLAMA_DEADLINE seconds after the start, llama-bench tg
# at the same depths on the profile's file and the tier bench's llama.cpp arms (--strata-from). Stage 2 (`... 2`,
# same warm machine) runs only the llama.cpp part, for a build that finished late.
# The profile's file is the large synthetic MoE's shapes with LARGE_LAYERS layers (12 by default: 3.5 GB, written in
# about 26 s on 16 cores). In the first lease the 36-layer file (9.3 GB), written niced beside the build, was not done
# after 220 s, and the tier bench's file took 56 s niced; the build had finished by the next call, 9 minutes after it
# started (its time alone was not measured).
stage=${1:-1}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; RES=/tmp/moe3res; mkdir -p "$OUT" "$RES"
ONE=$(cd "${ONE:?}" && pwd); LCTAR=${LCTAR:?}
TIER=/tmp/moe_tier.gguf; LARGE=/tmp/moe_large${LARGE_LAYERS:=12}.gguf; LB=/tmp/lb/bin/llama-bench
export PYTHONPATH=/tmp/site:$PWD STRATA_DEFAULT_MODEL=$ONE/tok.gguf
T0=${T0:-$(date +%s)}; ts() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }

llama_part() {
  ts "llama.cpp: $(tail -n 1 /tmp/lc_build.log)"
  [ -x $LB ] || { ts "no llama-bench"; return 3; }
  timeout 90 python3 bench/moe_decode_profile.py "$LARGE" --strata-from "$RES/decode_strata.json" --llama-bench $LB \
    --out "$OUT/moe_decode_profile.json" 2>&1 | tail -n 4
  ts "decode tg done"
  timeout 120 python3 bench/moe_tier.py --gguf "$TIER" --strata-from "$RES/tier_strata.json" --llama-bench $LB \
    --out "$OUT/moe_tier.json" 2>&1 | tail -n 9
  ts "tier llama arms done"
}

if [ "$stage" = 2 ]; then
  for i in $(seq 1 ${LLAMA_WAIT:-120}); do grep -q '^done' /tmp/lc_build.log 2>/dev/null && break; sleep 1; done
  llama_part; exit $?
fi
mkdir -p /tmp/lcsrc && tar xzf "$LCTAR" -C /tmp/lcsrc
setsid nohup bash -c 'cmake -S /tmp/lcsrc/llama.cpp -B /tmp/lb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_BUILD_TYPE=Release > /tmp/lc_build.log 2>&1 && cmake --build /tmp/lb -j 16 --target llama-bench \
  >> /tmp/lc_build.log 2>&1; echo "done rc=$?" >> /tmp/lc_build.log' > /dev/null 2>&1 &
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ONE"/whl/*.whl; echo "pip rc=$?"
xz -T4 -dc "$ONE/K/_cuda_kernels.so.xz" > strata/_cuda_kernels.so && cp "$ONE"/K/_cuda_kernels.{h,stamp} strata/
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; echo "build rc=$?"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
ts "set up"
(python3 -c "
import dataclasses, os, time
from bench.moe_tier import SPEC
from bench.gpu_throughput import moe_spec
from strata.gguf import synth
large = dataclasses.replace(moe_spec('large'), n_layer=$LARGE_LAYERS)
for out, spec, w in (('$TIER', synth.preset('qwen35moe', 'tiny', **SPEC), 8), ('$LARGE', large, 8)):
    t0 = time.perf_counter()
    synth.write_synthetic(out + '.tmp', spec, progress=False, workers=w)
    os.replace(out + '.tmp', out)
    print(out, 'written in %.0f s' % (time.perf_counter() - t0), flush=True)
") > "$OUT/synth.log" 2>&1 &
synth=$!
for i in $(seq 1 120); do [ -f "$TIER" ] && break; sleep 1; done
ts "tier file: $(head -n 1 "$OUT/synth.log")"
timeout 110 python3 bench/moe_tier.py --gguf "$TIER" --out "$RES/tier_strata.json" > "$OUT/moe_tier_strata.log" 2>&1
echo "moe_tier rc=$?"; grep -v "^wrote" "$OUT/moe_tier_strata.log" | cut -c1-250 | tail -n 14
cp "$RES/tier_strata.json" "$OUT/" 2>/dev/null
ts "tier arms done"
wait $synth; cat "$OUT/synth.log"
timeout 90 python3 bench/moe_decode_profile.py "$LARGE" --out "$RES/decode_strata.json" > "$OUT/decode_profile.log" 2>&1
echo "decode_profile rc=$?"; cut -c1-700 "$OUT/decode_profile.log" | tail -n 8
cp "$RES"/decode_strata.json* "$OUT/" 2>/dev/null
ts "decode profile done"
for i in $(seq 1 400); do grep -q '^done' /tmp/lc_build.log 2>/dev/null && break
  [ $(( $(date +%s) - T0 )) -ge ${LLAMA_DEADLINE:-225} ] && break; sleep 1; done
if grep -q '^done' /tmp/lc_build.log; then llama_part; else ts "llama.cpp build not done: $(tail -n 1 /tmp/lc_build.log | cut -c1-200)"; fi
