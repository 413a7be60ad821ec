#!/usr/bin/env bash
# Issue 22's ablation, each variant on its own server (the full-size model with seeded random weights, as
# scripts/gpu_bench.sh starts it): read-aloud P = BENCH_P (160) at c = BENCH_ABLATION_C (16,32,64), BENCH_K (10) x c
# requests a row, rows labelled with their variant, into $OUT/results.json (+ results.md and the three figures
# ablation_{throughput,rtf,ttfp}.png). The seed's steps, then what omnistage adds:
#   1 batch: stages decomposed and batched, nothing else: no CUDA graphs, no async chunk, no async output, fixed
#     25-frame codec chunks, code2wav's stream at the others' priority (the fused kernels on, as in every row but 6:
#     without them this row served 0.39 req/s at c = 16, far too slow for its 10 x c requests in a call); the
#     stages in the serving process (placement: local) in rows 1-4
#   2 + CUDA graphs   3 + async chunk   4 + async output
#   5 + omnistage's own (packet growth, stream priorities, the stages in a worker process): the shipped deploy config
#   6 the shipped config without the fused kernels (OMNISTAGE_FUSED_OPS=0): what they add
#   7 the shipped config with the stages in the serving process (placement: local): what the worker process adds
# BENCH_VARIANTS picks some ("1 2"; default all); BENCH_STAGE_OVERRIDES (JSON) goes to the servers of rows
# without stage overrides of their own, 5-7 (a layout's A/B, e.g. '{"talker": {"max_batch_size": 64}}').
# At full size one call (600 s) holds 1 alone, or 2-6: run it in parts, each with BENCH_RESUME=FILE (an earlier
# part's results.json, carried) so that the last part's file holds them all.
# Device call: carry [".whl"] (+ the resumed file), command:  OMNISTAGE_COMMIT=<sha> BENCH_VARIANTS=1 bash scripts/gpu_ablation.sh
# Small scale on the CPU (~2 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_ABLATION_C=1,2 BENCH_K=1 BENCH_MAX_TOKENS=4 BENCH_MAX_FRAMES=6 \
#   BENCH_BUDGET=200 BENCH_PYTHON=/work/main/.venv/bin/python OUT=/tmp/ablation scripts/gpu_ablation.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=540
. scripts/bench_start.sh
[[ -n ${BENCH_RESUME:-} ]] && cp "$BENCH_RESUME" "$OUT/results.json"

LOCAL='"placement": "local"'
SERIAL="\"async_chunk\": false, \"async_output\": false, $LOCAL"
FIXED='"connector": {"codec_chunk_growth": false}'
EQUAL='"code2wav": {"stream_priority": 0}'
NAMES=("" "batch" "+ CUDA graphs" "+ async chunk" "+ async output" "+ omnistage's own" "shipped, no fused kernels"
       "shipped, placement: local")
STAGES=("" "{\"thinker\": {\"cuda_graph\": false}, \"talker\": {\"cuda_graph\": false}, \"code2wav\": {\"cuda_graph\": false, \"stream_priority\": 0}}"
        "{$EQUAL}" "{$EQUAL}" "{$EQUAL}" "" "" "")
DEPLOYS=("" "{$SERIAL, $FIXED}" "{$SERIAL, $FIXED}" "{\"async_output\": false, $LOCAL, $FIXED}" "{$LOCAL, $FIXED}" ""
         "" "{$LOCAL}")
read -ra PICK <<< "${BENCH_VARIANTS:-1 2 3 4 5 6}"
read_aloud_rows "${BENCH_ABLATION_C:-16,32,64}" "${BENCH_K:-10}"
todo=${#PICK[@]}
for v in "${PICK[@]}"; do
  name=${NAMES[$v]}
  share=$((($(left) - 10) / todo))
  todo=$((todo - 1))
  fused=1 stages=${STAGES[$v]:-${BENCH_STAGE_OVERRIDES:-}}
  ((v == 6)) && fused=0
  OMNISTAGE_FUSED_OPS=$fused bench_variant "$name" "$OUT/server-$v.log" "$share" \
    ${stages:+--stage-overrides "$stages"} ${DEPLOYS[$v]:+--deploy-overrides "${DEPLOYS[$v]}"}
done
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
[[ -s $OUT/results.json ]]
