"""`omnistage serve`'s flags (read by `launch.serve`; `launch.deploy_overrides` makes deploy keys of some)."""

from __future__ import annotations

import argparse
import os

from omnistage.config_rules import PLACEMENTS, QUANTIZATIONS
from omnistage.server.media_args import add_media_args

DEFAULT_PORT = 8091


def add_serve_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face Hub id (default: the built-in tiny random one)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: MODEL)")
    p.add_argument("--deploy-config", default=None,
                   help="deploy YAML, or a packaged layout: 80gb (one 80 GB GPU), 2x80gb (two), 4x80gb "
                        "(two pipelines of 2x80gb), 2gpu / 4gpu (a pipeline per H200-class GPU), 3gpu (the "
                        "seed's) "
                        "(default: the packaged one for config.json's model_type: one H200 / B200)")
    p.add_argument("--stage-overrides", default=None,
                   help='JSON keyed by stage, e.g. \'{"talker": {"max_batch_size": 16}}\'')
    p.add_argument("--deploy-overrides", default=None,
                   help='JSON of top-level deploy keys, e.g. \'{"async_chunk": false}\' (ablations)')
    p.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="default sampling from MODEL/generation_config.json (auto), "
                        "FOLDER/generation_config.json, or none (vllm: the built-in defaults); the deploy "
                        "config's stage sampling keys and the request's fields win over it")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: seeded random weights for the checkpoint's architecture")
    p.add_argument("--device", default=None,
                   help="one torch device for every stage (default: each stage's deploy `devices`)")
    p.add_argument("--dtype", default=None,
                   help="bfloat16 | float16 | float32 (default: the deploy config's)")
    p.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help="local: every stage replica in this process; pipeline: each data-parallel pipeline in a "
                        "worker process of its own; process: each device's stage replicas in one; ray: each in a Ray actor, "
                        "GPUs from the deploy `devices`, on the cluster at RAY_ADDRESS or a new local one "
                        "(default: the deploy config's placement)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="N pipelines (thinker, talker, code2wav), the deploy layout repeated on the next GPUs, "
                        "behind one server: requests to the least loaded, a realtime session's (a chat "
                        "prompt_cache_key's) to one (default: the deploy config's data_parallel_size, 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of each GPU's memory this process may use, less what other processes hold; "
                        "what weights and CUDA graphs leave goes to the KV caches (default: the deploy "
                        "config's gpu_memory_utilization, 0.90)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: the thinker's and talker's routed experts quantised at load, FP8 weights with "
                        "per-row scales; fp8-all: their attention and dense projections too (smaller, slower on "
                        "the H200) (default: the deploy config's stage `quantization`, none)")
    p.add_argument("--api-key", default=os.environ.get("OMNISTAGE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $OMNISTAGE_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=64 << 20, help="larger request bodies get a 413")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests waiting for their first outputs before new ones get a 429 "
                        "(default: the deploy config's max_waiting_requests)")
    p.add_argument("--max-waiting-tokens", type=int, default=None,
                   help="prompt tokens of waiting requests before new ones get a 429 (default: the deploy "
                        "config's max_waiting_tokens)")
    add_media_args(p)
    return p
