#!/usr/bin/env bash
# A/B of deploy settings, each on its own server (full-size seeded random weights, as gpu_bench.sh starts it), in
# the order given (repeat a setting to alternate them): read-aloud P = BENCH_P (160) at c = BENCH_AB_C (64,64,64:
# three rows, each opening with a burst of c requests), BENCH_K (3) x c requests a row, rows labelled with their
# setting, into $OUT/results.json (+ results.md). Each server's rows get BENCH_VARIANT_S (45) s once it is up (a
# cold machine's first server takes ~130 s to start, a warm one's ~65); a setting starts only with 75 s + that left.
#   BENCH_AB='name|stage overrides JSON|deploy overrides JSON|tree|env;...'  (either JSON may be empty; tree: a commit
#   whose server this is, from bench-trees/py-SHA: scripts/bench_trees.sh SHA here first, carry "bench-trees"; env:
#   variables for that server's processes, e.g. OMP_NUM_THREADS=1)
# Device call: carry [".whl"] (+ "bench-trees"), command (e.g. a tree before a change against the head, twice;
# the talker's prompt rows a step: S='{"talker": {"max_num_batched_tokens": 1024}}', a row 1024|$S|):
#   OMNISTAGE_COMMIT=<sha> BENCH_STEP_TRACE=1 BENCH_AB_C=64,64 \
#   BENCH_AB="before|||<tree>;head||;before|||<tree>;head||" bash scripts/gpu_overrides_ab.sh
# Media rows too on each server (after its read-aloud rows): BENCH_VARIANT_WORKLOADS="spoken-question spoken-question".
# BENCH_TESTS: GPU tests run first (in the bench's environment, into $OUT/pytest.log).
# Small scale on the CPU (~1 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_AB_C=2,2 BENCH_K=1 BENCH_MAX_TOKENS=4 BENCH_MAX_FRAMES=6 \
#   BENCH_VARIANT_S=20 BENCH_AB='a||;b|{"talker": {"max_num_batched_tokens": 64}}|' \
#   BENCH_PYTHON=/work/main/.venv/bin/python OUT=/tmp/ab scripts/gpu_overrides_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=540
. scripts/bench_start.sh
run_tests ${BENCH_TESTS:-}  # GPU tests first, where named

IFS=';' read -ra ROWS <<< "${BENCH_AB:?BENCH_AB names the settings}"
read_aloud_rows "${BENCH_AB_C:-64,64,64}" "${BENCH_K:-3}"
export BENCH_VARIANT_S=${BENCH_VARIANT_S:-45}
HEAD_PY=$PY
for i in "${!ROWS[@]}"; do
  IFS='|' read -r name stage deploy tree env <<< "${ROWS[$i]}"
  name=$(echo "$name" | xargs) tree=$(echo "$tree" | xargs)
  PY=$HEAD_PY
  [[ -n $tree ]] && PY=$PWD/bench-trees/py-$tree
  if [[ -n ${env// /} ]]; then  # NOTE: a wrapper, as "$PY" is one word wherever it is run
    printf '#!/bin/sh\nexec env %s %s "$@"\n' "$env" "$PY" > "/tmp/omnistage-py-$i"
    chmod +x "/tmp/omnistage-py-$i" && PY=/tmp/omnistage-py-$i
  fi
  (($(left) > 75 + BENCH_VARIANT_S)) || { echo "'$name': no time left"; continue; }
  bench_variant "$name" "$OUT/server-$i-${name//[^a-zA-Z0-9]/-}.log" 0 \
    ${stage:+--stage-overrides "$stage"} ${deploy:+--deploy-overrides "$deploy"}
done
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
[[ -s $OUT/results.json ]]
