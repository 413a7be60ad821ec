# Sourced by scripts/gpu_bench.sh and scripts/gpu_realtime_bench.sh (after PY, MODEL, PORT, URL, OUT, T0 are set):
# start_server LOG [serve flags], stop_server, and start_main_server (the shipped deploy config, with fallbacks); at
# exit the server stopped and $OUT packed (`pack_out`).
SERVER=
stop_server() {
  [[ -n $SERVER ]] || return 0
  kill "$SERVER" 2>/dev/null
  for ((i = 0; i < 60; i++)); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
  kill -9 "$SERVER" 2>/dev/null
  SERVER=
}
# NOTE: a device call returns at most 8 files from $OUT (the first 8 by name when there are more): at exit all but
# the results and bench.log (figures, logs, traces) go into $OUT/logs.tgz, leaving the caller room for its own
# (BENCH_PACK=0 leaves them). A script may pack between steps too, so a call cut off at its limit still brings back
# what was done: each pack adds to logs.tgz (its files come out first, those of the same name written since win).
pack_out() {
  [[ ${BENCH_PACK:-1} != 0 && -d $OUT ]] || return 0
  local extra
  [[ -f $OUT/logs.tgz ]] && (cd "$OUT" && tar xzf logs.tgz --skip-old-files)
  mapfile -t extra < <(cd "$OUT" && ls -A | grep -vxE 'results\.(json|md)|bench\.log|logs\.tgz')
  ((${#extra[@]})) || return 0
  (cd "$OUT" && tar czf logs.tgz "${extra[@]}" && rm -rf "${extra[@]}")
}
trap 'stop_server; pack_out' EXIT
# start_server LOG [serve flags]: up when /health answers and one text+audio request comes back whole
# (BENCH_DEPLOY_CONFIG: a deploy YAML or packaged layout; without it the server's own choice, 80gb on an H100)
start_server() {
  local log=$1
  shift
  local trace=${BENCH_STEP_TRACE:+$OUT/trace-$(basename "$log" .log)}  # OMNISTAGE_STEP_TRACE per server
  [[ -n $trace ]] && mkdir -p "$trace"
  OMNISTAGE_STEP_TRACE=$trace "$PY" -m omnistage.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" --load-format dummy \
    ${BENCH_DEVICE:+--device "$BENCH_DEVICE"} ${BENCH_DEPLOY_CONFIG:+--deploy-config "$BENCH_DEPLOY_CONFIG"} "$@" \
    > "$log" 2>&1 &
  SERVER=$!
  for ((i = 0; i < ${BENCH_START_TIMEOUT:-300}; i++)); do
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('$URL/health').status_code != 200)" 2>/dev/null; then
      "$PY" scripts/smoke.py "$URL" && { echo "[$((SECONDS - T0)) s] server up: $*"; return 0; }
      break
    fi
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 1
  done
  tail -30 "$log"
  stop_server
  return 1
}

# read_aloud_rows CONCURRENCY K: COMMON, the bench arguments of read-aloud rows (P = BENCH_P, 160) at CONCURRENCY
# ("16,64"), K x c requests a row, after BENCH_WARMUP (3) requests; BENCH_ANSWER_SCALE: answers that many times
# longer
read_aloud_rows() {
  COMMON=(--base-url "$URL" --workload read-aloud --random-weights --tokenizer "$MODEL" --seed "${BENCH_SEED:-0}"
          --output-dir "$OUT" --prompt-tokens "${BENCH_P:-160}" --concurrency "$1" --prompts-per-concurrency "$2"
          --num-prompts 1 --warmup "${BENCH_WARMUP:-3}"
          ${BENCH_MAX_TOKENS:+--max-tokens "$BENCH_MAX_TOKENS"} ${BENCH_MAX_FRAMES:+--max-frames "$BENCH_MAX_FRAMES"}
          ${BENCH_ANSWER_SCALE:+--answer-scale "$BENCH_ANSWER_SCALE"})
}

# bench_variant NAME LOG SECONDS [serve flags]: a server with those flags, then `omnistage bench "${COMMON[@]}"` against
# it for what is left of SECONDS (BENCH_VARIANT_S: that many seconds once up), then as long for each workload of
# BENCH_VARIANT_WORKLOADS (e.g. "spoken-question spoken-question": media rows, no warm-up), its rows labelled NAME;
# then the server stops
bench_variant() {
  local name=$1 log=$2 end=$((SECONDS + $3))
  shift 3
  start_server "$log" "$@" || { echo "variant '$name': no server"; return 1; }
  local budget=${BENCH_VARIANT_S:-$((end - SECONDS))}
  ((budget > 10)) || { echo "variant '$name': no time left"; stop_server; return 1; }
  echo "[$((SECONDS - T0)) s] variant '$name' (${budget} s)"
  "$PY" -m omnistage.cli bench "${COMMON[@]}" --time-budget "$budget" --variant "$name"
  local workload
  for workload in ${BENCH_VARIANT_WORKLOADS:-}; do
    "$PY" -m omnistage.cli bench "${COMMON[@]}" --workload "$workload" --warmup 0 --time-budget "$budget" \
      --variant "$name"
  done
  stop_server
}

# The deploy config as shipped (BENCH_DEPLOY_OVERRIDES: top-level keys, e.g. '{"mm_processor_workers": 8}');
# should it fail its smoke request, the newest graphs go first, then all graphs.
NO_GRAPHS='{"thinker": {"cuda_graph": false}, "talker": {"cuda_graph": false}, "code2wav": {"cuda_graph": false}}'
start_main_server() {
  for overrides in "${BENCH_STAGE_OVERRIDES:-}" '{"code2wav": {"cuda_graph": false}}' "$NO_GRAPHS"; do
    start_server "$OUT/server.log" ${overrides:+--stage-overrides "$overrides"} \
      ${BENCH_DEPLOY_OVERRIDES:+--deploy-overrides "$BENCH_DEPLOY_OVERRIDES"} && return 0
    cp "$OUT/server.log" "$OUT/server-failed-$((SECONDS - T0)).log"
  done
  return 1
}
