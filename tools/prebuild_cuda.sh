#!/usr/bin/env bash
# Build the CUDA kernels for sm_90 on this machine (nvcc 13, as the GPU image has) into .dev/K with the sha256 of
# native/cuda's files, so tools/gpu_stages.sh A copies them instead of spending device minutes on nvcc (it builds
# them there when the sources changed since). .dev/ is named in .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .dev/K   # carried with .dev/B1 (the carry limit is 64 MiB a call)
python3 native/build_cuda.py --arch 90 --out .dev/K/_cuda_kernels.so
export LC_ALL=C
cat native/cuda/* | sha256sum | cut -d' ' -f1 > .dev/K/src.sha256
ls -la .dev/K
