# Sourced by the one-call GPU benches (gpu_media_bench.sh, gpu_realtime_bench.sh, ...) after `cd` to the repository
# and BENCH_BUDGET's default (DEFAULT_BUDGET): the time budget (`left`), $OUT and its bench.log, the wheels, the model
# folder, and the full-size server started (`bench_server.sh`; the caller exits when it did not start); `run_tests`.
PY=${BENCH_PYTHON:-python3}
T0=$SECONDS
BUDGET=${BENCH_BUDGET:-$DEFAULT_BUDGET}
left() { echo $((BUDGET - (SECONDS - T0))); }
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench.log") 2>&1
. scripts/device_env.sh
MODEL=/tmp/omnistage-bench-model${BENCH_PRESET:+-$BENCH_PRESET}
"$PY" scripts/bench_model_dir.py "$MODEL" ${BENCH_PRESET:+--preset "$BENCH_PRESET"} || exit 1
PORT=${BENCH_PORT:-8091}
URL=http://127.0.0.1:$PORT
. scripts/bench_server.sh

# run_tests TESTS...: pytest on them in this environment (the carried wheels), into $OUT/pytest.log, at most
# BENCH_TESTS_S (200) s; nothing without TESTS
run_tests() {
  (($#)) || return 0
  timeout "${BENCH_TESTS_S:-200}" "$PY" -m pytest -q -p no:cacheprovider "$@" > "$OUT/pytest.log" 2>&1
  echo "[$((SECONDS - T0)) s] tests rc=$?: $(tail -1 "$OUT/pytest.log")"
}
