#!/usr/bin/env bash
# Issue 23's call: the GPU tests (FP8 kernels and paths, the GPU tests BENCH_TESTS names), the full-size logit
# comparison (scripts/fp8_logits.py, fp8 and fp8-all), then an fp8, an fp8-all and a bf16 server (full size, seeded
# random weights) each with its memory at start (nvidia-smi) and read-aloud P = BENCH_P (160) at c = BENCH_FP8_C
# (1,64), BENCH_K (4) x c requests a row, rows labelled by server, into $OUT/results.json (+ results.md).
# Device call: carry [".whl"], command:  OMNISTAGE_COMMIT=<sha> bash scripts/gpu_fp8_bench.sh
# BENCH_FP8_STEPS picks parts ("tests logits fp8 fp8-all bf16" by default; also "fp8-weight-only": the fp8 server with
# OMNISTAGE_FP8_DOTS=0, its prefill weight-only), BENCH_LOGITS the logits' ("fp8 fp8-all"),
# BENCH_LOGITS_ARGS more fp8_logits.py flags ("--tokens 1024 --weight-only"); a server is skipped with fewer than
# BENCH_SERVER_MIN_S (200) of the budget left.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=560
. scripts/bench_start.sh
read -ra STEPS <<< "${BENCH_FP8_STEPS:-tests logits fp8 fp8-all bf16}"
has() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }
TESTS=${BENCH_TESTS:-tests/test_fp8_kernels.py tests/test_fp8_weights.py tests/test_fp8_accuracy.py}
has tests && run_tests $TESTS
if has logits; then
  for q in ${BENCH_LOGITS:-fp8 fp8-all}; do
    timeout 150 "$PY" scripts/fp8_logits.py "$MODEL" --quantization $q ${BENCH_LOGITS_ARGS:-} --json "$OUT/logits-$q.json" \
      > "$OUT/logits-$q.log" 2>&1
    echo "[$((SECONDS - T0)) s] logits $q rc=$?"
    tail -2 "$OUT/logits-$q.log"
  done
fi
pack_out
read_aloud_rows "${BENCH_FP8_C:-1,64}" "${BENCH_K:-4}"
servers=()
for q in fp8 fp8-weight-only fp8-all bf16; do has $q && servers+=("$q"); done
todo=${#servers[@]}
for q in "${servers[@]}"; do
  # NOTE: a full-size start takes 90-130 s; one begun past the call's limit loses every file the end would pack
  (($(left) < ${BENCH_SERVER_MIN_S:-200})) && { echo "$q: skipped, $(left) s left"; todo=$((todo - 1)); continue; }
  flags=()
  [[ $q != bf16 ]] && flags=(--quantization "${q%-weight-only}")
  dots=1
  [[ $q == *-weight-only ]] && dots=0
  OMNISTAGE_FP8_DOTS=$dots start_server "$OUT/server-$q.log" "${flags[@]}" ||
    { echo "$q: no server"; todo=$((todo - 1)); continue; }
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/memory-$q.csv" 2>&1
  grep -iE "weights|KV cache" "$OUT/server-$q.log" | head -8 > "$OUT/memory-$q.log"
  echo "[$((SECONDS - T0)) s] $q: $(tail -1 "$OUT/memory-$q.csv")"
  cat "$OUT/memory-$q.log"
  budget=$(($(left) / todo - 10))
  todo=$((todo - 1))
  "$PY" -m omnistage.cli bench "${COMMON[@]}" --time-budget "$budget" --variant "$q"
  stop_server
  pack_out
done
echo "[$((SECONDS - T0)) s] done"
[[ -s $OUT/results.md ]] && cat "$OUT/results.md"
true
