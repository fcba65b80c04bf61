#!/usr/bin/env bash
# One call on the GPU machine: install offline, then the steps named (default: precompile tests).
#   tools/gpu_check.sh OUTDIR [precompile] [tests] [sanitize] [bench] [decode] [e2e] [varlen] [variants] [ab] [trace] [ablation] [hopper] [host] [ring] [quick]
#   precompile  every variant for this GPU, 16 NVRTC processes at once (the tests then load kernels
#               instead of compiling them)
#   tests       the whole suite, CPU and GPU, with pytest-xdist (-n 8; conftest.py splits the BLAS threads); junit and the 40 slowest tests
#               in the logs. TESTS narrows it (pytest paths / -k), HYPOTHESIS_EXAMPLES sets the property
#               tests' examples (default 60; quick: 15), PYTEST_MARK a marker expression (e.g. "gpu or not slow")
#   sanitize    compute-sanitizer (SANITIZE_TOOLS, default "memcheck racecheck") over
#               tests/sanitize_cases.py (SANITIZE_ARGS, e.g. "--only filled", "--only variants" or "--only varlen")
#   bench       cuflash bench --op all (prefill forward, backward, forward+backward; BENCH_ARGS adds
#               options, e.g. --varlen for packed batches) -> bench.json, bench.png
#   decode      cuflash bench --decode (DECODE_ARGS) -> decode.json, decode.png
#   e2e         cuflash bench --e2e (E2E_ARGS; ~2-3 minutes on the H200) -> e2e.json, e2e.png (the loss
#               curves go into the logs)
#   varlen      cuflash bench --varlen with docs/results' arguments (~70 s) -> varlen.json
#   variants    cuflash bench --variant all with docs/results' arguments (~220 s; VARIANTS_OP=bwd halves it)
#               -> variants.json
#   host        tools/torch_host_overhead.py: host us per call of the PyTorch layer, CuPy API and SDPA
#   ring        tools/bench_ring.py (RING_ARGS, e.g. "--seqlen 131072"; a machine with 2 or more GPUs): ring
#               attention over every GPU against one GPU, forward + backward -> ring.json
#   ab          tools/ab_sources.py run ab (AB_ARGS, e.g. "--op fwd --head-dim 128"): the source trees
#               exported under ab/ (carry it), timed side by side -> ab.txt (the table goes into the summary)
#   trace       tools/trace_fwd.py (TRACE_POINTS, default "128:512 128:512:causal 64:512 256:512"; head dim:tokens[:causal[:tile]],
#               the tile as trace_fwd.py's --tile, e.g. 64:512:causal:128,128,persistent,notma,strided):
#               where the TMA forward's time goes per work item, from a diagnostic build's timeline marks
#               -> trace-*.txt, trace-*.png (in logs.tgz)
#   ablation    tools/ablation.py (ABLATION_ARGS, e.g. "--op fwd --hd 64 128"): each technique of the TMA kernels
#               switched off at every point, cuDNN and FA2 in the same run -> ablation.json, its tables in the summary
#   hopper      the TMA kernels' own checks (issue 30): tools/check_sm90.py --ws, their GPU tests, the forward and
#               backward property tests at HOPPER_EXAMPLES Hypothesis examples (default 400), compute-sanitizer
#               memcheck, racecheck and synccheck on tests/sanitize_cases.py --only hopper (HOPPER_TIMEOUT per part)
# Timeouts: PRECOMPILE_TIMEOUT, TEST_TIMEOUT, SANITIZE_TIMEOUT, BENCH_TIMEOUT, DECODE_TIMEOUT,
# E2E_TIMEOUT, VARLEN_TIMEOUT, VARIANTS_TIMEOUT, AB_TIMEOUT, TRACE_TIMEOUT, ABLATION_TIMEOUT, RING_TIMEOUT (s). Full logs go to OUTDIR/logs.tgz; a short summary
# is printed last; the result files stay beside it (summary.txt, bench.json, bench.png, decode.json,
# decode.png, e2e.json, e2e.png, varlen.json, variants.json, ring.json, ablation.json, logs.tgz).
set -u
OUT=${1:?usage: tools/gpu_check.sh OUTDIR [steps...]}
shift
STEPS=${*:-precompile tests}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache}
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
t0=$SECONDS
took() { echo "$((SECONDS - t0))s"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader > "$OUT/gpu.txt" 2>&1
note "GPU: $(head -1 "$OUT/gpu.txt")"
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { note "INSTALL FAILED"; tail -20 "$OUT/install.log"; exit 1; }
$PY -m cuflash info > "$OUT/info.txt" 2>&1; note "info: $(tr '\n' ' ' < "$OUT/info.txt" | tr -s ' ' | cut -c1-300)"

if has precompile; then
  timeout ${PRECOMPILE_TIMEOUT:-240} $PY -m cuflash precompile --all -j 16 ${PRECOMPILE_ARGS:-} > "$OUT/precompile.log" 2>&1
  note "precompile (rc=$?, $(took)): $(tail -1 "$OUT/precompile.log")"
fi

if has tests; then
  EX=${HYPOTHESIS_EXAMPLES:-60}; has quick && EX=15
  # (tests/conftest.py gives each of the 8 workers 16 / 8 = 2 BLAS threads)
  CUFLASH_HYPOTHESIS_EXAMPLES=$EX timeout ${TEST_TIMEOUT:-480} $PY -m pytest -q --no-header -p no:cacheprovider -n 8 \
      --durations=40 --junitxml="$OUT/junit.xml" ${PYTEST_MARK:+-m "$PYTEST_MARK"} ${TESTS:-} > "$OUT/pytest.log" 2>&1
  note "pytest (rc=$?, $(took)): $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -12 | cut -c1-400 | tee -a "$SUMMARY"
fi

if has sanitize; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 3 $PY tests/sanitize_cases.py ${SANITIZE_ARGS:-} > "$OUT/sanitize-$tool.log" 2>&1
    note "compute-sanitizer $tool (rc=$?, $(took)): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -1)"
  done
fi

if has bench; then
  timeout ${BENCH_TIMEOUT:-420} $PY -m cuflash bench --op all ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.txt" 2> "$OUT/bench.err"
  note "bench (rc=$?, $(took)):"; grep -E "median|note" "$OUT/bench.txt" >> "$SUMMARY"
fi

if has decode; then
  timeout ${DECODE_TIMEOUT:-300} $PY -m cuflash bench --decode ${DECODE_ARGS:-} --json "$OUT/decode.json" --plot "$OUT/decode.png" > "$OUT/decode.txt" 2> "$OUT/decode.err"
  note "bench --decode (rc=$?, $(took)):"; grep -E "median|min|note" "$OUT/decode.txt" >> "$SUMMARY"
fi
if has e2e; then
  timeout ${E2E_TIMEOUT:-420} $PY -m cuflash bench --e2e ${E2E_ARGS:-} --json "$OUT/e2e.json" --plot "$OUT/e2e.png" > "$OUT/e2e.txt" 2> "$OUT/e2e.err"
  note "bench --e2e (rc=$?, $(took)):"; grep -E "median|n/a" "$OUT/e2e.txt" >> "$SUMMARY"
fi

if has varlen; then
  timeout ${VARLEN_TIMEOUT:-150} $PY -m cuflash bench --varlen --op all --head-dim 64 --head-dim 128 --repeats 10 \
      --json "$OUT/varlen.json" > "$OUT/varlen.txt" 2> "$OUT/varlen.err"
  note "bench --varlen (rc=$?, $(took)):"; grep -E "over" "$OUT/varlen.txt" >> "$SUMMARY"
fi
if has variants; then
  timeout ${VARIANTS_TIMEOUT:-300} $PY -m cuflash bench --variant all --op ${VARIANTS_OP:-all} --head-dim 64 --head-dim 128 \
      --seqlen 1024 --seqlen 4096 --seqlen 16384 --causal --repeats 10 --json "$OUT/variants.json" > "$OUT/variants.txt" 2> "$OUT/variants.err"
  note "bench --variant all (rc=$?, $(took)):"; grep -E "over|window 4096" "$OUT/variants.txt" >> "$SUMMARY"
fi

if has ab; then
  timeout ${AB_TIMEOUT:-300} $PY tools/ab_sources.py run ab ${AB_ARGS:-} > "$OUT/ab.txt" 2> "$OUT/ab.err"
  note "tools/ab_sources.py run ab (rc=$?, $(took)):"; cat "$OUT/ab.txt" >> "$SUMMARY"
fi

if has trace; then
  for point in ${TRACE_POINTS:-128:512 128:512:causal 64:512 256:512}; do
    IFS=: read -r hd sl c tile <<< "$point"
    name="trace-hd$hd-$sl${c:+-causal}${tile:+-${tile//,/-}}"
    timeout ${TRACE_TIMEOUT:-120} $PY tools/trace_fwd.py --hd "$hd" --seqlen "$sl" ${c:+--causal} ${tile:+--tile "$tile"} \
        --plot "$OUT/$name.png" > "$OUT/$name.txt" 2>&1
    note "trace hd$hd $sl${c:+ causal}${tile:+ $tile} (rc=$?, $(took)):"; grep -E "ms|outside|^  " "$OUT/$name.txt" >> "$SUMMARY"
  done
fi

if has ablation; then
  timeout ${ABLATION_TIMEOUT:-540} $PY tools/ablation.py ${ABLATION_ARGS:-} --json "$OUT/ablation.json" > "$OUT/ablation.txt" 2>&1
  note "ablation (rc=$?, $(took)):"; sed -n '/^fwd (\|^bwd (/,$p' "$OUT/ablation.txt" >> "$SUMMARY"
  grep -E "Error|Traceback" "$OUT/ablation.txt" | tail -3 >> "$SUMMARY"
fi

if has hopper; then
  HT=${HOPPER_TIMEOUT:-200}
  timeout $HT $PY tools/check_sm90.py --ws > "$OUT/check-ws.txt" 2>&1
  note "check_sm90 --ws (rc=$?, $(took)): $(grep -c ' ok' "$OUT/check-ws.txt") ok, $(grep -c WRONG "$OUT/check-ws.txt") wrong"
  CUFLASH_HYPOTHESIS_EXAMPLES=${HOPPER_EXAMPLES:-400} timeout $HT $PY -m pytest -q --no-header -p no:cacheprovider -n 8 \
      tests/test_hopper_ws_gpu.py tests/test_hopper_ws_bwd_gpu.py "tests/test_forward_gpu.py::test_forward_property" \
      "tests/test_backward_gpu.py::test_backward_property" > "$OUT/pytest-hopper.log" 2>&1
  note "hopper tests at ${HOPPER_EXAMPLES:-400} examples (rc=$?, $(took)): $(grep -E '(passed|failed|error)' "$OUT/pytest-hopper.log" | tail -1)"
  for tool in memcheck racecheck synccheck; do
    timeout $HT compute-sanitizer --tool $tool --error-exitcode 3 $PY tests/sanitize_cases.py --only hopper > "$OUT/sanitize-hopper-$tool.log" 2>&1
    note "compute-sanitizer $tool, hopper (rc=$?, $(took)): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-hopper-$tool.log" | tail -1)"
  done
fi

if has host; then
  timeout 120 $PY tools/torch_host_overhead.py ${HOST_ARGS:-} > "$OUT/host.txt" 2>&1
  note "host time per call (rc=$?, $(took)):"; grep -v "compiled" "$OUT/host.txt" | sed '/^profile of/,$d' >> "$SUMMARY"  # (the profile stays in the logs)
fi
if has ring; then
  timeout ${RING_TIMEOUT:-400} $PY tools/bench_ring.py ${RING_ARGS:-} --json "$OUT/ring.json" > "$OUT/ring.txt" 2>&1
  note "tools/bench_ring.py (rc=$?, $(took)):"; grep -E "ring|single|speedup|Error" "$OUT/ring.txt" >> "$SUMMARY"
fi
(cd "$OUT" && tar czf logs.tgz --remove-files $(ls | grep -v -E '^(summary.txt|bench.json|bench.png|decode.json|decode.png|e2e.json|e2e.png|varlen.json|variants.json|ring.json|ablation.json|logs.tgz)$'))
echo "================ summary ================"
cat "$SUMMARY"
