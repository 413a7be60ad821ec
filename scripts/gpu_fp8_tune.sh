#!/usr/bin/env bash
# Issue 23's tiles: the FP8 skinny GEMMs (scripts/linear_bench.py --fp8) and the FP8 fused MoE (scripts/moe_tune.py
# --fp8) on the H200, each against its bf16 peer, into $OUT (linear_fp8.json, moe_fp8.json + their logs); paste
# the printed FP8_CONFIGS into layers/triton_linear.py and the best tile per shape into triton_fused_moe.FP8_TILES.
# Device call (no wheels needed): OMNISTAGE_COMMIT=<sha> bash scripts/gpu_fp8_tune.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PYTHON:-python3}
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout "${TUNE_LINEAR_S:-300}" "$PY" scripts/linear_bench.py --fp8 --rows "${TUNE_ROWS:-1,16,64}" \
  --out "$OUT/linear_fp8.json" > "$OUT/linear_fp8.log" 2>&1
echo "linear rc=$?"; tail -30 "$OUT/linear_fp8.log"
timeout "${TUNE_MOE_S:-200}" "$PY" scripts/moe_tune.py --fp8 --batches "${TUNE_BATCHES:-1,16,64}" \
  --out "$OUT/moe_fp8.json" > "$OUT/moe_fp8.log" 2>&1
echo "moe rc=$?"; tail -8 "$OUT/moe_fp8.log"
