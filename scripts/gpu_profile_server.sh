#!/usr/bin/env bash
# Where the host time of a loaded server goes: `omnistage serve` with its stage worker threads under cProfile
# (OMNISTAGE_PROFILE_DIR; on Python >= 3.12 the first worker's profile covers every thread, the HTTP loop
# included), one bench row against it, then the top functions into $OUT/profile.txt.
# Device call: carry [".whl"], command:  bash scripts/gpu_profile_server.sh   (knobs: PROFILE_C, PROFILE_S,
# PROFILE_K: k x c requests, 10 = mostly steady state)
# Small scale on the CPU (~2 min):  BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_PYTHON=.venv/bin/python PROFILE_C=2 \
#   PROFILE_S=20 OUT=/tmp/prof scripts/gpu_profile_server.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PYTHON:-python3}
OUT=${OUT:-$PWD/profile-out}
mkdir -p "$OUT/prof"
. scripts/device_env.sh
MODEL=/tmp/omnistage-bench-model${BENCH_PRESET:+-$BENCH_PRESET}
"$PY" scripts/bench_model_dir.py "$MODEL" ${BENCH_PRESET:+--preset "$BENCH_PRESET"} > /dev/null || exit 1
OMNISTAGE_PROFILE_DIR=$OUT/prof "$PY" -m omnistage.cli serve "$MODEL" \
  --host 127.0.0.1 --port 8091 --load-format dummy ${BENCH_DEVICE:+--device "$BENCH_DEVICE"} > "$OUT/server.log" 2>&1 &
SERVER=$!
for ((i = 0; i < 240; i++)); do
  "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8091/health').status_code != 200)" 2>/dev/null && break
  sleep 1
done
"$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8091/health').status_code != 200)" 2>/dev/null \
  || { tail -30 "$OUT/server.log"; kill $SERVER; exit 1; }
echo "[$SECONDS s] server up"
"$PY" -m omnistage.cli bench --base-url http://127.0.0.1:8091 --prompt-tokens 160 --concurrency "${PROFILE_C:-64}" \
  --num-prompts "${PROFILE_C:-64}" --prompts-per-concurrency "${PROFILE_K:-1}" --warmup 0 --time-budget "${PROFILE_S:-45}" --workload read-aloud --random-weights \
  --tokenizer "$MODEL" --output-dir "$OUT" ${BENCH_MAX_TOKENS:+--max-tokens "$BENCH_MAX_TOKENS"} \
  ${BENCH_MAX_FRAMES:+--max-frames "$BENCH_MAX_FRAMES"} 2>&1 | grep "omnistage |\|| *[0-9]* | [0-9]* | [a-z2-9]* |"
kill -INT $SERVER
for ((i = 0; i < 60; i++)); do kill -0 $SERVER 2>/dev/null || break; sleep 1; done
echo "[$SECONDS s] server stopped"
"$PY" - "$OUT/prof" > "$OUT/profile.txt" <<'PYEOF'
import glob, os, pstats, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.prof"))):
    print("=" * 30, os.path.basename(f))
    for key in ("tottime", "cumulative"):
        pstats.Stats(f).sort_stats(key).print_stats(22)
PYEOF
grep -A30 "tottime\b" "$OUT/profile.txt" | grep -v "^$" | head -150
