#!/usr/bin/env bash
# One GPU call for a decode kernel change: install, precompile the decode variants, the decode GPU
# tests, racecheck and memcheck on the sanitizer cases, then this tree's decode kernels next to an
# older copy of cuda_src and cuDNN (tools/ab_decode.py). Logs under OUTDIR.
#   tools/gpu_decode_ab.sh OUTDIR OLD_CUDA_SRC     (e.g. .old/cuda_src, carried to the GPU machine)
set -u
OUT=${1:?usage: tools/gpu_decode_ab.sh OUTDIR OLD_CUDA_SRC}
OLD=${2:?usage: tools/gpu_decode_ab.sh OUTDIR OLD_CUDA_SRC}
mkdir -p "$OUT"
export CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { echo "INSTALL FAILED"; exit 1; }
timeout 100 python3 -m cuflash precompile --kernels decode --all -j 16 > "$OUT/precompile.log" 2>&1
echo "precompile: $(tail -1 "$OUT/precompile.log")"
CUFLASH_HYPOTHESIS_EXAMPLES=${EXAMPLES:-60} timeout 150 python3 -m pytest -q --no-header -p no:cacheprovider \
  tests/test_decode_gpu.py > "$OUT/pytest.log" 2>&1
echo "pytest (rc=$?): $(tail -1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -5 | cut -c1-300
for t in racecheck memcheck; do
  timeout 120 compute-sanitizer --tool $t --error-exitcode 3 python3 tools/sanitize_cases.py > "$OUT/$t.log" 2>&1
  echo "$t (rc=$?): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$t.log" | tail -1)"
done
timeout 200 python3 tools/ab_decode.py --old "$OLD" --repeats ${REPEATS:-15} ${SHAPES:+--shapes $SHAPES} 2>&1 \
  | grep -v "^\[cuflash\]" | tee "$OUT/ab.log"
