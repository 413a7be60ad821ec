#!/usr/bin/env bash
# Kernel checks without a server (HISTORY 47's next calls 2-4): the GPU tests of the Triton kernels, then
# the same with programmatic dependent launch off (OMNISTAGE_PDL=0, graphs included: test_prefill_graph.py), the
# sampler's warps (sample_bench.py), PDL on the full-size talker's frame head (pdl_bench.py) and code2wav's conv table
# over every chunk length and batch (conv_bench.py); each step's log and JSON in $OUT, at most BENCH_STEP_S (300) s a
# step. Two device calls (all of it passes 600 s): carry [".whl-rt"], timeout 600, commands
#   BENCH_WHEELS=.whl-rt BENCH_CHECKS="tests tests-nopdl" bash scripts/gpu_kernel_checks.sh
#   BENCH_WHEELS=.whl-rt BENCH_CHECKS="sample pdl conv" bash scripts/gpu_kernel_checks.sh
# Small scale on the CPU (the tests in Triton's interpreter): BENCH_PYTHON=.venv/bin/python BENCH_CHECKS=tests ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench.log") 2>&1
. scripts/device_env.sh
export PYTHONPATH=$PYTHONPATH:$PWD/scripts
T0=$SECONDS
read -ra CHECKS <<< "${BENCH_CHECKS:?BENCH_CHECKS names the steps: tests tests-nopdl sample pdl conv}"
# the kernels that take PDL, alone and in the decoder and the prefill / decode graphs
TESTS=(tests/test_triton_pdl.py tests/test_triton_linear.py tests/test_triton_norm.py tests/test_triton_sampling.py
       tests/test_triton_moe.py tests/test_triton_fused_moe.py tests/test_triton_attention.py
       tests/test_fused_projections.py tests/test_decoder_fusion.py tests/test_prefill_graph.py)

# step NAME COMMAND...: COMMAND's output into $OUT/NAME.log, its last line here
step() {
  local name=$1
  shift
  timeout "${BENCH_STEP_S:-300}" "$@" > "$OUT/$name.log" 2>&1
  echo "[$((SECONDS - T0)) s] $name rc=$?: $(tail -1 "$OUT/$name.log")"
}
for c in "${CHECKS[@]}"; do
  case $c in
    tests) step tests "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" ;;
    tests-nopdl) step tests-nopdl env OMNISTAGE_PDL=0 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" ;;
    sample) step sample "$PY" scripts/sample_bench.py --out "$OUT/sample.json" ;;
    pdl) step pdl "$PY" scripts/pdl_bench.py --out "$OUT/pdl.json" ;;
    conv) step conv "$PY" scripts/conv_bench.py --out "$OUT/conv.json" --batches 1,2,4,8,16,32,64 \
            --frames 2,4,8,16,25 --channels 192,384 --tiles 2 ;;
  esac
done
grep -hE "same|PDL|DIRECT_CONVS|^[0-9]+ [0-9]+ " "$OUT"/{sample,pdl,conv}.log 2>/dev/null | tail -60
