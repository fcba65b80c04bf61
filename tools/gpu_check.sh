#!/usr/bin/env bash
# One call on the GPU machine: install offline, GPU + CPU tests, compute-sanitizer, benchmark,
# optional tile sweep. Full logs go to OUTDIR; a short summary is printed last.
#   tools/gpu_check.sh OUTDIR [precompile] [tests] [sanitize] [bench] [bench-fp16] [decode] [ncu-decode] [trace] [ab]
#                      [abfill] [tune] [profile] [quick]
# With no step named, runs precompile tests sanitize bench. precompile: every variant for this GPU,
# 16 NVRTC processes at once (the suite then loads instead of compiling: ~2.5 instead of ~5 minutes).
# ab: this tree's decode kernels next to the cuda_src copy in OLD_SRC (carried along, e.g.
# .old/cuda_src) and cuDNN, in one run (tools/ab_decode.py). abfill: the decode plans with and without
# the filled grid, next to cuDNN (tools/ab_fill_decode.py). Environment: PRECOMPILE_ARGS (e.g.
# "--kernels decode"), TESTS (pytest paths / -k, default the whole suite), TEST_TIMEOUT, BENCH_ARGS
# (extra `cuflash bench` options, e.g. "--op all"), BENCH_TIMEOUT, SANITIZE_TOOLS (default "memcheck
# racecheck"), SANITIZE_ARGS (e.g. "--only filled"), SANITIZE_TIMEOUT, TUNE_ARGS, ABFILL_ARGS,
# DECODE_ARGS, NCU_SHAPES (ncu-decode: batch,cache_len,kv_heads ...), TRACE_ARGS (tools/trace_decode.py options, e.g. "--shapes 1,65536,8"), OLD_SRC, AB_ARGS.
set -u
OUT=${1:?usage: tools/gpu_check.sh OUTDIR [steps...]}
shift
STEPS=${*:-precompile tests sanitize bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache}
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader > "$OUT/gpu.txt" 2>&1
note "GPU: $(head -1 "$OUT/gpu.txt")"
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { note "INSTALL FAILED"; tail -20 "$OUT/install.log"; exit 1; }
$PY -m cuflash info > "$OUT/info.txt" 2>&1; note "info: $(tr '\n' ' ' < "$OUT/info.txt" | cut -c1-300)"

if has precompile; then
  timeout ${PRECOMPILE_TIMEOUT:-200} $PY -m cuflash precompile --all -j 16 ${PRECOMPILE_ARGS:-} > "$OUT/precompile.log" 2>&1
  note "precompile (rc=$?): $(tail -1 "$OUT/precompile.log")"
fi

if has tests; then
  EX=60; has quick && EX=15
  CUFLASH_HYPOTHESIS_EXAMPLES=$EX timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q --no-header -p no:cacheprovider \
      --junitxml="$OUT/junit.xml" ${TESTS:-} > "$OUT/pytest.log" 2>&1
  note "pytest (rc=$?): $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -8 | cut -c1-400 | tee -a "$SUMMARY"
fi

if has sanitize; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 3 $PY tools/sanitize_cases.py ${SANITIZE_ARGS:-} > "$OUT/sanitize-$tool.log" 2>&1
    note "compute-sanitizer $tool (rc=$?): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -1)"
  done
fi

if has tune; then
  timeout 300 $PY tools/tune_fwd.py ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1
  rc=$?; note "tune (rc=$rc):"; grep -E "median ratio|BEST" "$OUT/tune.log" | tee -a "$SUMMARY"
  [ $rc -ne 0 ] && tail -15 "$OUT/tune.log" | tee -a "$SUMMARY"
fi

if has profile; then  # ncu: cuflash next to torch's FA2 on the same inputs
  $PY tools/nvrtc_report.py > "$OUT/nvrtc.txt" 2>&1
  for cfg in "256 1024" "128 4096" "64 4096"; do
    set -- $cfg
    timeout 120 ncu --clock-control none -k regex:flash_fwd --section SpeedOfLight --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section InstructionStats --section SchedulerStats $PY tools/profile_pair.py --hd $1 --seqlen $2 > "$OUT/ncu_hd$1.txt" 2>&1
    note "ncu hd$1 s$2 (rc=$?): $(grep -E 'Duration' "$OUT/ncu_hd$1.txt" | tr -s ' ' | tr '\n' ';')"
  done
fi

if has bench; then
  DT=bf16; has bench-fp16 && DT=both
  timeout ${BENCH_TIMEOUT:-400} $PY -m cuflash bench --dtype $DT ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.txt" 2> "$OUT/bench.err"
  note "bench (rc=$?):"; cat "$OUT/bench.txt" >> "$SUMMARY"
fi

if has decode; then  # cuflash bench --decode: KV TB/s next to torch FA2 and cuDNN, prefill vs decode
  timeout ${DECODE_TIMEOUT:-300} $PY -m cuflash bench --decode ${DECODE_ARGS:-} --json "$OUT/decode.json" > "$OUT/decode.txt" 2> "$OUT/decode.err"
  note "bench --decode (rc=$?):"; cat "$OUT/decode.txt" >> "$SUMMARY"
fi
if has ab; then  # decode kernels of this tree vs OLD_SRC, cuDNN alongside (tools/ab_decode.py)
  timeout ${AB_TIMEOUT:-250} $PY tools/ab_decode.py --old "${OLD_SRC:?ab needs OLD_SRC}" ${AB_ARGS:-} > "$OUT/ab.txt" 2> "$OUT/ab.err"
  note "ab_decode (rc=$?):"; cat "$OUT/ab.txt" >> "$SUMMARY"
fi
if has abfill; then  # decode plans with and without the filled grid, cuDNN alongside (tools/ab_fill_decode.py)
  timeout ${ABFILL_TIMEOUT:-300} $PY tools/ab_fill_decode.py ${ABFILL_ARGS:-} > "$OUT/abfill.txt" 2> "$OUT/abfill.err"
  note "ab_fill_decode (rc=$?):"; cat "$OUT/abfill.txt" >> "$SUMMARY"; tail -3 "$OUT/abfill.err" >> "$SUMMARY"
fi
if has ncu-decode; then  # ncu (full set) of one decode call of cuflash, FA2 and cuDNN per shape; SASS with counters
  NS=${NCU_SHAPES:-8,4096,32 1,32768,32}
  timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --profile-from-start off --set full --import-source no \
    -o "$OUT/ncu_decode" $PY tools/profile_decode.py --ncu --shapes $NS > "$OUT/ncu_decode.log" 2>&1
  note "ncu-decode (rc=$?) shapes $NS"
  ncu -i "$OUT/ncu_decode.ncu-rep" --page details > "$OUT/ncu_decode_details.txt" 2>&1
  ncu -i "$OUT/ncu_decode.ncu-rep" --page raw --csv > "$OUT/ncu_decode_raw.csv" 2>&1
  ncu -i "$OUT/ncu_decode.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_decode_sass.csv" 2>&1
  rm -f "$OUT/ncu_decode.ncu-rep"
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|L2 Hit Rate|L1/TEX Hit|Achieved Occupancy|Registers Per|Mem Busy|Max Bandwidth" \
    "$OUT/ncu_decode_details.txt" | tr -s ' ' | cut -c1-150 | tee -a "$SUMMARY"
fi
if has trace; then  # CTA timeline of the split-KV kernel next to cuDNN (tools/trace_decode.py)
  timeout ${TRACE_TIMEOUT:-200} $PY tools/trace_decode.py ${TRACE_ARGS:-} > "$OUT/trace.txt" 2> "$OUT/trace.err"
  note "trace_decode (rc=$?):"; cat "$OUT/trace.txt" >> "$SUMMARY"
fi
# The device tool returns at most 8 files: keep the summary, bench.json/png, and one archive of logs.
(cd "$OUT" && tar czf logs.tgz --remove-files $(ls | grep -v -E '^(summary.txt|bench.json|bench.png|decode.json|logs.tgz)$'))
echo "================ summary ================"
cat "$SUMMARY"
