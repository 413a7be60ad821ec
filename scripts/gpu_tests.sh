#!/usr/bin/env bash
# The GPU tests: every test file that names CUDA (`grep -l cuda tests/test_*.py`, ~38), half of them a call
# (BENCH_HALF=1 or 2; all of them pass one call's 600 s without pytest-xdist, which the GPU machine lacks), at most
# BENCH_TESTS_S (540) s, into $OUT/pytest.log (with the 30 slowest tests); its summary and failures printed.
# Device call: carry [".whl-rt"],
#   BENCH_WHEELS=.whl-rt BENCH_HALF=1 bash scripts/gpu_tests.sh
# OMNISTAGE_PDL and the rest of the environment apply as set. On the CPU (every GPU test skips):
#   BENCH_PYTHON=.venv/bin/python BENCH_HALF=1 OUT=/tmp/gputests bash scripts/gpu_tests.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
. scripts/device_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD/tests
mapfile -t FILES < <(grep -l cuda tests/test_*.py)
HALF=$(((${#FILES[@]} + 1) / 2))
case ${BENCH_HALF:?BENCH_HALF is 1 or 2} in
  1) FILES=("${FILES[@]:0:HALF}") ;;
  2) FILES=("${FILES[@]:HALF}") ;;
esac
echo "${#FILES[@]} files: ${FILES[*]}"
timeout "${BENCH_TESTS_S:-540}" "$PY" -m pytest -q -p no:cacheprovider -rfE --durations=30 "${FILES[@]}" \
  > "$OUT/pytest.log" 2>&1
echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -30
