#!/usr/bin/env bash
# Issue 24's runs: each layout on its own server (full-size seeded random weights, as gpu_bench.sh starts it),
# read-aloud P = BENCH_P (160) at c = BENCH_MULTI_C (64,128), BENCH_K (5) x c requests a row, rows labelled with
# their layout, into $OUT/results.json (+ results.md); meta.gpus is the GPUs the machine shows.
#   1gpu: the default deploy config (one pipeline, this process's threads); 1gpu-process: the same, each stage in a
#     worker process (the handoff's cost on one GPU)
#   2gpu / 4gpu: 2 / 4 pipelines, one per GPU, each pipeline in a worker process (deploy/qwen3_omni_moe_2gpu.yaml)
#   3gpu: the seed's layout (thinker on GPU 0, two talkers and two code2wavs on GPUs 1-2, worker processes)
# BENCH_LAYOUTS picks some ("1gpu 2gpu"; default: those the machine's GPUs allow). Targets: 2gpu >= 1.8x and 4gpu
# >= 3.5x 1gpu's c = 128 req/s; 3gpu >= 35.1 req/s at c = 64 (3 x vLLM-Omni's 11.7).
# Device call (kind nvidia-h200-x2 or -x4): carry [".whl"], command:
#   OMNISTAGE_COMMIT=<sha> BENCH_LAYOUTS="1gpu 2gpu" bash scripts/gpu_multi_bench.sh
# Small scale on the CPU (~2 min):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_LAYOUTS="1gpu 2gpu" BENCH_MULTI_C=2 BENCH_K=1 BENCH_MAX_TOKENS=4 \
#   BENCH_MAX_FRAMES=6 BENCH_BUDGET=240 BENCH_PYTHON=/work/main/.venv/bin/python OUT=/tmp/multi scripts/gpu_multi_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_BUDGET=560
. scripts/bench_start.sh
[[ -n ${BENCH_RESUME:-} ]] && cp "$BENCH_RESUME" "$OUT/results.json"

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
default="1gpu"
((gpus >= 2)) && default+=" 2gpu"
((gpus >= 3)) && default+=" 3gpu"
((gpus >= 4)) && default+=" 4gpu"
read -ra PICK <<< "${BENCH_LAYOUTS:-$default}"
read_aloud_rows "${BENCH_MULTI_C:-64,128}" "${BENCH_K:-5}"
todo=${#PICK[@]}
for layout in "${PICK[@]}"; do
  share=$((($(left) - 10) / todo))
  todo=$((todo - 1))
  case $layout in
    1gpu) config=() ;;
    1gpu-process) config=(--placement process) ;;
    *) config=(--deploy-config "$layout") ;;
  esac
  BENCH_START_TIMEOUT=${BENCH_START_TIMEOUT:-400} bench_variant "$layout" "$OUT/server-$layout.log" "$share" \
    "${config[@]}"
done
echo "[$((SECONDS - T0)) s] done"
cat "$OUT/results.md"
[[ -s $OUT/results.json ]]
