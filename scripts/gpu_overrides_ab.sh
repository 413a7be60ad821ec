#!/usr/bin/env bash
# A/B of deploy settings, each on its own server (full-size seeded random weights, as gpu_bench.sh starts it), in
# the order given (repeat a setting to alternate them): read-aloud P = BENCH_P (160) at c = BENCH_AB_C (64,64,64:
# three rows, each opening with a burst of c requests), BENCH_K (3) x c requests a row, rows labelled with their
# setting, into $OUT/results.json (+ results.md).
#   BENCH_AB='name|stage overrides JSON|deploy overrides JSON;...'  (either JSON may be empty)
# Device call: carry [".whl"], command (e.g. the talker's prompt rows a step):
#   OMNISTAGE_COMMIT=<sha> BENCH_STEP_TRACE=1 BENCH_AB='t4096|{"talker": {"max_num_batched_tokens": 4096}}|;
#   t1024|{"talker": {"max_num_batched_tokens": 1024}}|' bash scripts/gpu_overrides_ab.sh
# Small scale on the CPU (~2 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_AB_C=2,2 BENCH_K=1 BENCH_MAX_TOKENS=4 BENCH_MAX_FRAMES=6 BENCH_BUDGET=200 \
#   BENCH_AB='a||;b|{"talker": {"max_num_batched_tokens": 64}}|' BENCH_PYTHON=/work/main/.venv/bin/python \
#   OUT=/tmp/ab scripts/gpu_overrides_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=540
. scripts/bench_start.sh

IFS=';' read -ra ROWS <<< "${BENCH_AB:?BENCH_AB names the settings}"
read_aloud_rows "${BENCH_AB_C:-64,64,64}" "${BENCH_K:-3}"
todo=${#ROWS[@]}
for i in "${!ROWS[@]}"; do
  IFS='|' read -r name stage deploy <<< "${ROWS[$i]}"
  name=$(echo "$name" | xargs)
  share=$((($(left) - 10) / todo))
  todo=$((todo - 1))
  bench_variant "$name" "$OUT/server-$i-${name//[^a-zA-Z0-9]/-}.log" "$share" \
    ${stage:+--stage-overrides "$stage"} ${deploy:+--deploy-overrides "$deploy"}
done
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
[[ -s $OUT/results.json ]]
