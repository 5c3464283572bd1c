#!/bin/bash
# The thin turn on a GPU, in one device call: the CUDA tests the branch touches (the checkpoint capture without a
# drain, a read's checkpoints kept inside one prefill), then bench/thin_turn.py against the reference tree.
#
# Run from the branch's tree (a copy under .gpu/NAME, carried with .gpu/one), with the reference (main) as a second
# tree whose C core this script builds:
#   git -C /work/wt-thinturn archive HEAD | tar -x -C /work/main/.gpu/thinturn
#   git -C /work/main archive main | tar -x -C /work/main/.gpu/thinturn-base
#   run: cd .gpu/thinturn && bash tools/gpu_thin_turn.sh ../thinturn-base tests     (carry .gpu/thinturn,
#        .gpu/thinturn-base, .gpu/one; ~6 min), then the same with `bench` (~8 min; the machine still warm: /tmp/site)
# Results (JSON, logs) go to $OUT. The branch does not change native/cuda: one/K's prebuilt kernels serve both trees.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
BASE=${1:?the reference tree}; WHAT=${2:-tests}
O=$(cd ../one && pwd); R=$PWD; t0=$(date +%s); n=0
p() { n=$((n+1)); timeout "$1" python3 -m pytest -q -rf -p no:cacheprovider "${@:2}" 2>&1 | tee $OUT/log.$n | grep -E "^FAILED|^ERROR|passed|failed|no tests ran" | cut -c1-240; echo "  [$n] t=$(( $(date +%s) - t0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $O/whl/*.whl; echo "pip rc=$?"
nvidia-smi --query-gpu=name --format=csv,noheader
for T in "$R" "$(cd $BASE && pwd)"; do
  (cd $T && xz -T8 -dc $O/K/_cuda_kernels.so.xz > strata/_cuda_kernels.so && cp $O/K/_cuda_kernels.h $O/K/_cuda_kernels.stamp strata/ \
   && PYTHONPATH=/tmp/site python3 setup.py build_ext --inplace > $OUT/build_$(basename $T).log 2>&1); echo "build $T rc=$?"
done
export PYTHONPATH=/tmp/site:$R STRATA_DEFAULT_MODEL=$O/tok.gguf
if [ "$WHAT" = tests ]; then
p 120 tests/test_cuda_qwen35.py -k "marks or prefill or snapshot or resident"
p 150 tests/test_cuda_parity.py -k "checkpoint or replay or truncate"
p 150 tests/test_cuda_hybrid.py tests/test_cuda_stages.py -k "not greedy_64 and not bench_hybrid"
p 90 tests/test_cuda_spec.py
else
# the bench: the tiny synthetic hybrid (what is outside the model shows) and the synthetic 1.5B hybrid (issue 33's
# model), this tree's after / after_pc0 arms and the reference tree's before arm side by side
python3 bench/thin_turn.py --device cuda --synthetic qwen3next --sizes 4096 16384 65536 --turns 6 \
  --before-tree $BASE --out $OUT/thin_turn_cuda_tiny.json 2>&1 | grep -v Warn | tee $OUT/bench_tiny.log | tail -40
python3 -c "
import sys; sys.path.insert(0, 'bench')
from gpu_hybrid_model import make_synthetic_hybrid
from strata.gguf.default_model import default_model_path
print(make_synthetic_hybrid('/tmp/hybrid_1_5b.gguf', default_model_path()))" > $OUT/hybrid.log 2>&1
python3 bench/thin_turn.py --device cuda --model /tmp/hybrid_1_5b.gguf --sizes 4096 16384 65536 --turns 6 \
  --before-tree $BASE --out $OUT/thin_turn_cuda_hybrid_1_5b.json 2>&1 | grep -v Warn | tee $OUT/bench_1_5b.log | tail -40
fi
echo "all done t=$(( $(date +%s) - t0 ))s"
