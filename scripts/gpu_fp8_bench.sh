#!/usr/bin/env bash
# Issue 23's call: the GPU tests (FP8 kernels and paths, the GPU tests BENCH_TESTS names), the full-size logit
# comparison (scripts/fp8_logits.py), then a bf16 and an fp8 server (full size, seeded random weights) each with
# its memory at start (nvidia-smi) and read-aloud P = BENCH_P (160) at c = BENCH_FP8_C (1,64), BENCH_K (4) x c
# requests a row, rows labelled bf16 / fp8, into $OUT/results.json (+ results.md).
# Device call: carry [".whl-rt"], command:  OMNISTAGE_COMMIT=<sha> BENCH_WHEELS=.whl-rt bash scripts/gpu_fp8_bench.sh
# BENCH_FP8_STEPS picks parts ("tests logits bf16 fp8"; default all).
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=560
. scripts/bench_start.sh
read -ra STEPS <<< "${BENCH_FP8_STEPS:-tests logits fp8 bf16}"
has() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }
TESTS=${BENCH_TESTS:-tests/test_fp8_kernels.py tests/test_fp8_weights.py tests/test_fp8_accuracy.py}
if has tests; then
  timeout "${BENCH_TESTS_S:-200}" "$PY" -m pytest -q -p no:cacheprovider $TESTS > "$OUT/pytest.log" 2>&1
  echo "[$((SECONDS - T0)) s] tests rc=$?: $(tail -1 "$OUT/pytest.log")"
fi
if has logits; then
  timeout 150 "$PY" scripts/fp8_logits.py "$MODEL" --json "$OUT/fp8_logits.json" > "$OUT/fp8_logits.log" 2>&1
  echo "[$((SECONDS - T0)) s] logits rc=$?"
  tail -2 "$OUT/fp8_logits.log"
fi
read_aloud_rows "${BENCH_FP8_C:-1,64}" "${BENCH_K:-4}"
for q in fp8 bf16; do
  has $q || continue
  flags=()
  [[ $q == fp8 ]] && flags=(--quantization fp8)
  start_server "$OUT/server-$q.log" "${flags[@]}" || { echo "$q: no server"; continue; }
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/memory-$q.csv" 2>&1
  grep -iE "weights|KV cache" "$OUT/server-$q.log" | head -8 > "$OUT/memory-$q.log"
  echo "[$((SECONDS - T0)) s] $q: $(tail -1 "$OUT/memory-$q.csv")"
  cat "$OUT/memory-$q.log"
  share=1
  [[ $q == fp8 ]] && has bf16 && share=2
  budget=$(($(left) / share - 10))
  "$PY" -m omnistage.cli bench "${COMMON[@]}" --time-budget "$budget" --variant "$q"
  stop_server
done
echo "[$((SECONDS - T0)) s] done"
[[ -s $OUT/results.md ]] && cat "$OUT/results.md"
true
