#!/usr/bin/env bash
# One server (the shipped deploy config, full size, seeded random weights) with every stage's step trace on
# ($OUT/trace-server/), three rows in one results file, the clock (perf_counter, the trace's) before each in
# $OUT/clock.txt so the trace splits by row (scripts/step_trace_summary.py --clock FILE --row NAME):
#   1. read-aloud P = 160 at c = 64, BENCH_K (10) x 64 requests: where c = 64's stalls fall (`stalls_by_chunk`,
#      `stalls_by_tenth`) against the trace;
#   2. realtime 20 s turns at BENCH_RT_SESSIONS (32) sessions, 2 turns each: where the close's time goes;
#   3. read-aloud at c = 64 with answers BENCH_LONG_SCALE (5) x longer, BENCH_LONG_K (3) x 64 requests: KV taken
#      as answers grow at full size (`kv_block_waits`, `kv_swaps` in the row's stages; /metrics at the end).
# Device call: carry [".whl"], command:  OMNISTAGE_COMMIT=<sha> bash scripts/gpu_load_trace.sh (logs and traces
# come back packed in $OUT/logs.tgz).
# Small scale on the CPU (~1 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_K=1 BENCH_LONG_K=1 BENCH_RT_SESSIONS=1 BENCH_RT_CLIP=question_2s \
#   BENCH_MAX_TOKENS=4 BENCH_MAX_FRAMES=6 BENCH_CONCURRENCY=2 BENCH_PYTHON=.venv/bin/python OUT=/tmp/trace \
#   scripts/gpu_load_trace.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=575
export BENCH_STEP_TRACE=1
. scripts/bench_start.sh
clock() { "$PY" -c "import time; print('$1', time.perf_counter())" >> "$OUT/clock.txt"; }
start_main_server || exit 1
C=${BENCH_CONCURRENCY:-64}
read_aloud_rows "$C" "${BENCH_K:-10}"
clock read-aloud
"$PY" -m omnistage.cli bench "${COMMON[@]}" --time-budget 70 --variant shipped
clock realtime
"$PY" -m omnistage.cli bench --realtime --base-url "$URL" --random-weights --max-frames "${BENCH_MAX_FRAMES:-80}" \
  --concurrency "${BENCH_RT_SESSIONS:-32}" --output-dir "$OUT" --clips "${BENCH_RT_CLIP:-question_20s}" --turns 2 \
  --barge-in-every 0 --warmup 0
clock long-answers
BENCH_WARMUP=0 BENCH_ANSWER_SCALE=${BENCH_LONG_SCALE:-5} read_aloud_rows "$C" "${BENCH_LONG_K:-3}"
"$PY" -m omnistage.cli bench "${COMMON[@]}" --time-budget $(($(left) - 25)) --variant "answers x${BENCH_LONG_SCALE:-5}"
clock end
"$PY" -c "import httpx; print(httpx.get('$URL/metrics').text)" > "$OUT/metrics.txt" 2>&1
stop_server
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
