#!/usr/bin/env bash
# One call on the GPU machine (one H200, BENCH_BUDGET s, default 540): issue 20's rows against ONE server (the
# full-size model with seeded random weights, `omnistage serve --load-format dummy`, as scripts/gpu_bench.sh
# starts it), all into $OUT/results.json (+ results.md, plots, server.log, bench.log, metrics.txt):
#   1. text (read-aloud, P=BENCH_P: 160) at c = BENCH_CONCURRENCY (1,16,64), after BENCH_WARMUP text requests;
#   2. spoken-question (the 12 clips, 2-15 s), visual-question (4 photos at their sizes + 1280x720), video and
#      video-audio (4 s, 320x240, without / with use_audio_in_video) at the same concurrencies, no warm-up:
#      each workload's first request is the first of its kind after start (the table's "TTFP 1st");
#   3. a phone photo (4032x3024 JPEG) alone and four at once (BENCH_PHONE=0: none).
# Every row answers at the same lengths: request i forces the text tokens and audio frames of read-aloud's
# request i (its sentence, capped by BENCH_MAX_TOKENS / BENCH_MAX_FRAMES when set). Requests per row:
# max(BENCH_NUM_PROMPTS (8), BENCH_K (2) x c). Media bytes differ per request (no server cache hit).
# Wheels as scripts/gpu_bench.sh, av (PyAV) among them for the video rows:  scripts/gpu_bench.sh prepare
# Device call: carry [".whl"], command:  OMNISTAGE_COMMIT=<sha> bash scripts/gpu_media_bench.sh
# Small scale on the CPU (~3 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_CONCURRENCY=1,2 BENCH_NUM_PROMPTS=2 BENCH_K=1 BENCH_MAX_TOKENS=4 \
#   BENCH_MAX_FRAMES=6 BENCH_WARMUP=1 BENCH_PYTHON=/work/main/.venv/bin/python OUT=/tmp/mmbench scripts/gpu_media_bench.sh
# Other knobs: BENCH_WORKLOADS (the media workloads, space-separated), BENCH_SEED, BENCH_PORT, BENCH_STAGE_OVERRIDES,
# BENCH_DEPLOY_OVERRIDES (e.g. '{"mm_processor_workers": 0}'), BENCH_TESTS (GPU tests first, into $OUT/pytest.log).
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=540
. scripts/bench_start.sh
run_tests ${BENCH_TESTS:-}  # GPU tests first, where named
"$PY" -c "import av" 2>/dev/null || echo "no PyAV (av): the video rows will fail; carry its wheel (gpu_bench.sh prepare)"
start_main_server || exit 1  # no server: spend no more device time

COMMON=(--base-url "$URL" --random-weights --tokenizer "$MODEL" --seed "${BENCH_SEED:-0}" --output-dir "$OUT"
        --concurrency "${BENCH_CONCURRENCY:-1,16,64}" --num-prompts "${BENCH_NUM_PROMPTS:-8}"
        --prompts-per-concurrency "${BENCH_K:-2}"
        ${BENCH_MAX_TOKENS:+--max-tokens "$BENCH_MAX_TOKENS"} ${BENCH_MAX_FRAMES:+--max-frames "$BENCH_MAX_FRAMES"})
read -ra WORKLOADS <<< "${BENCH_WORKLOADS:-spoken-question visual-question video video-audio}"
PHONE=${BENCH_PHONE:-1}
RUNS=$((1 + ${#WORKLOADS[@]} + PHONE))
bench() {  # bench ARGS...: one `omnistage bench` with an even share of the time left (10 s kept to stop)
  local share=$((($(left) - 10) / RUNS))
  RUNS=$((RUNS - 1))
  ((share > 5)) || { echo "no time left for: $*"; return 0; }
  echo "[$((SECONDS - T0)) s] $* (${share} s)"
  "$PY" -m omnistage.cli bench "${COMMON[@]}" --time-budget "$share" "$@"
}
bench --workload read-aloud --prompt-tokens "${BENCH_P:-160}" --warmup "${BENCH_WARMUP:-5}"
for w in "${WORKLOADS[@]}"; do
  bench --workload "$w" --warmup 0
done
((PHONE)) && bench --workload visual-question --media phone --concurrency 1,4 --num-prompts 4 \
  --prompts-per-concurrency 1 --warmup 0
"$PY" -c "import httpx; print(httpx.get('$URL/metrics').text)" > "$OUT/metrics.txt" 2>&1
stop_server
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
[[ -s $OUT/results.json ]]
