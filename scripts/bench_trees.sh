#!/usr/bin/env bash
# Earlier commits' src/ for a same-call A/B on the GPU machine (a row that spreads between calls, as the realtime
# rows' +-100 ms, ranks builds only within one call). Here, before the call:  scripts/bench_trees.sh SHA...
# writes bench-trees/SHA/src (git archive) and bench-trees/py-SHA, a python3 that imports omnistage from it
# (no uvloop is carried: every tree's uvicorn runs asyncio's loop);
# bench-trees/ is ignored: carry it (carry [".whl", "bench-trees"]). There, one server per tree:
#   for v in SHA HEAD; do py=python3; [[ $v != HEAD ]] && py=$PWD/bench-trees/py-$v
#     OMNISTAGE_COMMIT=$v BENCH_PYTHON=$py BENCH_VARIANT=$v OUT=$OUT/$v bash scripts/gpu_realtime_bench.sh; done
set -euo pipefail
cd "$(dirname "$0")/.."
for sha in "$@"; do
  rm -rf "bench-trees/$sha"
  mkdir -p "bench-trees/$sha"
  git archive "$sha" src | tar -x -C "bench-trees/$sha"
  printf '#!/bin/sh\nhere="$(cd "$(dirname "$0")" && pwd)"\nPYTHONPATH="$here/%s/src${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$@"\n' \
    "$sha" > "bench-trees/py-$sha"
  chmod +x "bench-trees/py-$sha"
done
du -sh bench-trees
