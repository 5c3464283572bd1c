#!/usr/bin/env bash
# One device call of the CUDA work (issue 6). Stage A: wheels, model part 1, llama.cpp build (background), kernel
# build + unit tests, synthetic model + Strata bench on it. Stage B: model part 2 + join, parity, full benchmark
# with llama-bench. Logs and JSON go to $OUT.
stage=${1:?A or B}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts
D=.dev/$stage
if [ ! -d /tmp/site/cffi ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$D"/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
cp "$D"/parts/* /tmp/parts/
[ -f "$D/tok.gguf" ] && cp "$D/tok.gguf" /tmp/tok.gguf
if [ -z "$QUICK" ] && [ -f "$D/llamacpp.tar.gz" ] && [ ! -d /tmp/llama.cpp ]; then
  tar xzf "$D/llamacpp.tar.gz" -C /tmp
  setsid nohup bash -c "cmake -S /tmp/llama.cpp -B /tmp/lb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF && cmake --build /tmp/lb -j 14 --target llama-bench; echo BUILD_DONE" > /tmp/llbuild.log 2>&1 < /dev/null &
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu_$stage.txt"
python3 native/build_cuda.py --arch 90 2>&1 | tail -3
python3 -c "import cupy, cffi, gguf; print('cupy', cupy.__version__, 'gguf ok')"
if [ "$stage" = A ]; then
  timeout 200 python3 -m pytest -q -rs tests/test_cuda_kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -40
  [ -n "$QUICK" ] && exit 0
  python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_throughput as g; g.make_synthetic_llama('/tmp/syn.gguf', '/tmp/tok.gguf')"
  ls -la /tmp/syn.gguf
  tail -3 /tmp/llbuild.log
else
  bash .dev/B/join.sh /tmp/parts SmolLM2-135M-Instruct.Q4_1.gguf /tmp/model || exit 1
  export STRATA_DEFAULT_MODEL=/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 200 python3 -m pytest -q -rs -s tests/test_cuda_parity.py tests/test_cuda_kernels.py 2>&1 | tee "$OUT/parity.log" | tail -30
  [ -n "$QUICK" ] && exit 0
  for i in $(seq 1 60); do grep -q BUILD_DONE /tmp/llbuild.log && break; sleep 5; done
  tail -2 /tmp/llbuild.log; LB=/tmp/lb/bin/llama-bench
  timeout 330 python3 bench/gpu_throughput.py --model default --synthetic /tmp/syn.gguf --llama-bench $LB \
      --out "$OUT/gpu_throughput.json" 2>&1 | tee "$OUT/bench_B.log" | tail -30
fi
