#!/usr/bin/env bash
# One call on the GPU machine (one H200, BENCH_BUDGET s, default 500): the full-size server with seeded random
# weights (`omnistage serve --load-format dummy`, as scripts/gpu_bench.sh starts it) and issue 19's realtime
# rows into $OUT (results.json results.md server.log bench.log), answers of 80 frames (BENCH_FRAMES):
#   1. a 2 s turn at 1 and 32 sessions, 6 turns each, turns 3 and 6 barging into the answer before them;
#   1b. the same at 32 sessions started over 10 s (BENCH_STAGGER_S), so turns are not in lockstep;
#   2. a 20 s turn at 1 and 32 sessions, 2 turns each (end-of-turn latency against the 2 s turn's);
#   3. a chat row (P=160, c=16) alone, then the same row beside 64 idle realtime sessions (decode cost).
# BENCH_RT_ROWS picks rows ("2s stagger 20s chat"; default all), BENCH_VARIANT labels them (one server of an A/B:
# BENCH_STAGE_OVERRIDES), BENCH_TESTS runs those GPU tests first (into $OUT/pytest.log), BENCH_PYSPY=1
# records the server's processes with py-spy during the chat row beside idle sessions
# ($OUT/pyspy-idle{,-gil}.txt, raw stacks).
# Wheels as scripts/gpu_bench.sh (silero-vad and websockets among them):  scripts/gpu_bench.sh prepare
# Device call: carry [".whl"], command:  OMNISTAGE_COMMIT=<sha> bash scripts/gpu_realtime_bench.sh
# Small scale on the CPU (~4 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_SESSIONS=1,2 BENCH_IDLE=4 BENCH_FRAMES=8 BENCH_CHAT_C=2 \
#   BENCH_CHAT_PROMPTS=4 BENCH_PYTHON=/work/main/.venv/bin/python OUT=/tmp/rtbench scripts/gpu_realtime_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=500
. scripts/bench_start.sh
run_tests ${BENCH_TESTS:-}
start_main_server || exit 1  # no server: spend no more device time
read -ra ROWS <<< "${BENCH_RT_ROWS:-2s stagger 20s chat}"
has() { [[ " ${ROWS[*]} " == *" $1 "* ]]; }

SESSIONS=${BENCH_SESSIONS:-1,32}
pyspy() {  # py-spy (a carried wheel) of the server and its worker processes: all threads, then the GIL's
  local bin; bin=$(command -v py-spy || echo /tmp/site/bin/py-spy)
  local rec=("$bin" record -p "$SERVER" --subprocesses -r 100 -d 10 -f raw --nonblocking)
  sleep "$((ROW_S > 40 ? (ROW_S - 20) / 2 : 5))"
  "${rec[@]}" -o "$OUT/pyspy-$1.txt" > /dev/null 2>&1
  "${rec[@]}" --gil -o "$OUT/pyspy-$1-gil.txt" > /dev/null 2>&1 || echo "py-spy failed" >&2
}
RT=(--realtime --base-url "$URL" --random-weights --max-frames "${BENCH_FRAMES:-80}" --concurrency "$SESSIONS"
    --output-dir "$OUT" ${BENCH_VARIANT:+--variant "$BENCH_VARIANT"})
if has 2s; then
  echo "[$((SECONDS - T0)) s] realtime, 2 s turns with barge-in"
  "$PY" -m omnistage.cli bench "${RT[@]}" --clips question_2s --turns 6 --barge-in-every 3 --warmup 1
fi
if has stagger; then
  echo "[$((SECONDS - T0)) s] realtime, 2 s turns, 32 sessions started over 10 s (turns not in lockstep)"
  "$PY" -m omnistage.cli bench "${RT[@]}" --concurrency 32 --clips question_2s --turns 6 --barge-in-every 3 \
    --warmup 0 --stagger-s "${BENCH_STAGGER_S:-10}"  # the later --concurrency wins
fi
if has 20s && (($(left) > ${BENCH_20S_S:-120})); then  # its rows' time (120 s: 1 and 32 sessions)
  echo "[$((SECONDS - T0)) s] realtime, 20 s turns"
  "$PY" -m omnistage.cli bench "${RT[@]}" --clips question_20s --turns 2 --barge-in-every 0 --warmup 0
fi

CHAT=(--base-url "$URL" --workload read-aloud --random-weights --tokenizer "$MODEL" --prompt-tokens 160
      --concurrency "${BENCH_CHAT_C:-16}" --num-prompts "${BENCH_CHAT_PROMPTS:-64}" --max-frames "${BENCH_FRAMES:-80}"
      --output-dir "$OUT")
IDLE=${BENCH_IDLE:-64}
ROW_S=$((($(left) - 20) / 2))
if has chat && ((ROW_S > 20)); then
  echo "[$((SECONDS - T0)) s] chat c=${BENCH_CHAT_C:-16} alone, then beside $IDLE idle sessions (${ROW_S} s each)"
  "$PY" -m omnistage.cli bench "${CHAT[@]}" --warmup 4 --time-budget "$ROW_S" --variant "no idle sessions"
  SPY=
  [[ -n ${BENCH_PYSPY:-} ]] && { pyspy idle & SPY=$!; }  # NOTE: the row's middle 20 s, the server's processes
  "$PY" -m omnistage.cli bench "${CHAT[@]}" --warmup 0 --time-budget "$ROW_S" --idle-sessions "$IDLE" \
    --variant "$IDLE idle realtime sessions"
  [[ -n $SPY ]] && wait "$SPY"
fi
"$PY" -c "import httpx; print(httpx.get('$URL/metrics').text)" > "$OUT/metrics.txt" 2>&1
stop_server
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
