#!/usr/bin/env bash
# Issue 22's ablation, each variant on its own server (the full-size model with seeded random weights, as
# scripts/gpu_bench.sh starts it): read-aloud P = BENCH_P (160) at c = BENCH_ABLATION_C (16,32,64), BENCH_K (10) x c
# requests a row, rows labelled with their variant, into $OUT/results.json (+ results.md and the three figures
# ablation_{throughput,rtf,ttfp}.png). The seed's steps, then what omnistage adds:
#   1 batch: stages decomposed and batched, nothing else: no CUDA graphs, no async chunk, no async output, and
#     none of omnistage's own (fused kernels off: OMNISTAGE_FUSED_OPS=0; fixed 25-frame codec chunks; code2wav's
#     stream at the others' priority)
#   2 + CUDA graphs   3 + async chunk   4 + async output
#   5 + omnistage's own (fused kernels, packet growth, stream priorities): the shipped deploy config
# BENCH_VARIANTS picks some ("1 2"; default all). At full size one call (600 s) holds about two: run it in parts,
# each with BENCH_RESUME=FILE (an earlier part's results.json, carried) so that the last part's file holds them all.
# Device call: carry [".whl"] (+ the resumed file), command:  OMNISTAGE_COMMIT=<sha> BENCH_VARIANTS="1 2" bash scripts/gpu_ablation.sh
# Small scale on the CPU (~2 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_ABLATION_C=1,2 BENCH_K=1 BENCH_MAX_TOKENS=4 BENCH_MAX_FRAMES=6 \
#   BENCH_BUDGET=200 BENCH_PYTHON=/work/main/.venv/bin/python OUT=/tmp/ablation scripts/gpu_ablation.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=540
. scripts/bench_start.sh
[[ -n ${BENCH_RESUME:-} ]] && cp "$BENCH_RESUME" "$OUT/results.json"

SERIAL='"async_chunk": false, "async_output": false'
FIXED='"connector": {"codec_chunk_growth": false}'
EQUAL='"code2wav": {"stream_priority": 0}'
NAMES=("" "batch" "+ CUDA graphs" "+ async chunk" "+ async output" "+ omnistage's own")
STAGES=("" "{\"thinker\": {\"cuda_graph\": false}, \"talker\": {\"cuda_graph\": false}, \"code2wav\": {\"cuda_graph\": false, \"stream_priority\": 0}}"
        "{$EQUAL}" "{$EQUAL}" "{$EQUAL}" "")
DEPLOYS=("" "{$SERIAL, $FIXED}" "{$SERIAL, $FIXED}" "{\"async_output\": false, $FIXED}" "{$FIXED}" "")
read -ra PICK <<< "${BENCH_VARIANTS:-1 2 3 4 5}"
read_aloud_rows "${BENCH_ABLATION_C:-16,32,64}" "${BENCH_K:-10}"
todo=${#PICK[@]}
for v in "${PICK[@]}"; do
  name=${NAMES[$v]}
  share=$((($(left) - 10) / todo))
  todo=$((todo - 1))
  fused=1
  ((v < 5)) && fused=0
  OMNISTAGE_FUSED_OPS=$fused bench_variant "$name" "$OUT/server-$v.log" "$share" \
    ${STAGES[$v]:+--stage-overrides "${STAGES[$v]}"} ${DEPLOYS[$v]:+--deploy-overrides "${DEPLOYS[$v]}"}
done
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
[[ -s $OUT/results.json ]]
