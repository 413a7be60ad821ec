#!/usr/bin/env bash
# One call on the GPU machine (one H200, ~6-7 minutes; MEM_BUDGET, default 500 s): the memory budget at full
# size (Qwen3-Omni-30B-A3B, seeded random weights, `omnistage serve --load-format dummy`), into $OUT:
#   (a) another process holds 61.5 GB (what an 80 GB card leaves, less), the server starts with
#       `--deploy-config 80gb`: its start-up KV lines, the smoke request (text + audio), one read-aloud row
#       at c = 16 (P = 160);
#   (b) nothing held, the default deploy config: its KV lines (they must show more tokens than (a));
#   (c) if time is left: 61.5 GB held and the default config: it must exit at start with the budget's
#       message (bytes needed and available, the options), not a CUDA traceback.
# Files: memory_check.json (the KV lines parsed, per run), server-*.log, kv-*.txt, bench-80gb/results.json,
# memory_check.log.
# MEM_FLAGS: more serve flags for (a) (e.g. "--quantization fp8"); MEM_ONLY_80GB=1: (a) alone.
# Device call: carry [".whl"], command:  bash scripts/gpu_memory_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PYTHON:-python3}
T0=$SECONDS
BUDGET=${MEM_BUDGET:-500}
left() { echo $((BUDGET - (SECONDS - T0))); }
OUT=${OUT:-$PWD/memory-check-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/memory_check.log") 2>&1
. scripts/device_env.sh
MODEL=/tmp/omnistage-bench-model
"$PY" scripts/bench_model_dir.py "$MODEL" || exit 1
PORT=${BENCH_PORT:-8091}
URL=http://127.0.0.1:$PORT
KV_PATTERN=': KV cache |: budget |omnistage serve: '

SERVER= HOLDER=
stop() {  # stop PID: TERM, then KILL after 60 s
  [[ -n ${1:-} ]] || return 0
  kill "$1" 2>/dev/null
  for ((i = 0; i < 60; i++)); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -9 "$1" 2>/dev/null
}
trap 'stop "$SERVER"; stop "$HOLDER"' EXIT

hold() {  # another process holding 61.5 GB of the GPU until stopped
  "$PY" -c "import time, torch; x = torch.empty(int(61.5e9), dtype=torch.uint8, device='cuda'); \
torch.cuda.synchronize(); print('held', flush=True); time.sleep(3600)" > "$OUT/holder.log" 2>&1 &
  HOLDER=$!
  for ((i = 0; i < 60; i++)); do grep -q held "$OUT/holder.log" && break; sleep 1; done
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/nvidia-smi-held.csv" 2>&1
  echo "[$((SECONDS - T0)) s] holder up: $(tail -1 "$OUT/nvidia-smi-held.csv")"
}

# serve NAME [serve flags]: 0 once /health answers and the smoke request comes back whole; the KV lines of
# its log into kv-NAME.txt either way
serve() {
  local name=$1 log=$OUT/server-$1.log
  shift
  "$PY" -m omnistage.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" --load-format dummy "$@" > "$log" 2>&1 &
  SERVER=$!
  local ok=1
  for ((i = 0; i < ${BENCH_START_TIMEOUT:-240}; i++)); do
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('$URL/health').status_code != 200)" 2>/dev/null; then
      "$PY" scripts/smoke.py "$URL" && ok=0
      break
    fi
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 1
  done
  grep -E "$KV_PATTERN" "$log" > "$OUT/kv-$name.txt"
  echo "[$((SECONDS - T0)) s] server $name: rc=$ok"; cat "$OUT/kv-$name.txt"
  return $ok
}

hold
# shellcheck disable=SC2086
if serve 80gb --deploy-config 80gb ${MEM_FLAGS:-}; then
  "$PY" -m omnistage.cli bench --base-url "$URL" --workload read-aloud --random-weights --tokenizer "$MODEL" \
    --prompt-tokens 160 --concurrency 16 --num-prompts 32 --warmup 2 --time-budget 90 --seed 0 \
    --variant "80gb layout, 61.5 GB held" --output-dir "$OUT/bench-80gb"
  echo "[$((SECONDS - T0)) s] bench done"
fi
stop "$SERVER"; SERVER=
stop "$HOLDER"; HOLDER=
[[ -n ${MEM_ONLY_80GB:-} ]] || { serve default; stop "$SERVER"; SERVER=; }
if [[ -z ${MEM_ONLY_80GB:-} && $(left) -gt 120 ]]; then
  hold
  serve default-held && echo "default config with 61.5 GB held: started (its KV lines above)"
  stop "$SERVER"; SERVER=
  tail -3 "$OUT/server-default-held.log"
  stop "$HOLDER"; HOLDER=
fi

"$PY" - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
line = re.compile(r"(\w+) on (\S+): KV cache ([\d.]+) GiB, (\d+) blocks x (\d+) = (\d+) tokens; "
                  r"one request may hold (\d+) tokens")
runs = {}
for f in sorted(out.glob("kv-*.txt")):
    text = f.read_text()
    stages = {m[1]: {"device": m[2], "kv_gib": float(m[3]), "blocks": int(m[4]), "block_size": int(m[5]),
                     "tokens": int(m[6]), "one_request_tokens": int(m[7])} for m in line.finditer(text)}
    runs[f.stem[3:]] = {"stages": stages, "lines": text.splitlines()}
(out / "memory_check.json").write_text(json.dumps(runs, indent=2) + "\n")
print(json.dumps({k: {s: v["tokens"] for s, v in r["stages"].items()} for k, r in runs.items()}))
EOF
ls -la "$OUT"
[[ -s $OUT/kv-80gb.txt && ( -n ${MEM_ONLY_80GB:-} || -s $OUT/kv-default.txt ) ]]
