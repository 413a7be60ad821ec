"""`omnistage serve`: find the checkpoint, load the deploy config, start the engine, run the HTTP server."""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from omnistage.config import ConfigError, DeployConfig
from omnistage.config_loader import default_deploy_config, load_deploy_config, resolve_deploy_config
from omnistage.config_rules import QUANTIZED_STAGES
from omnistage.gc_heap import settle_heap
from omnistage.media.warm import warm_media
from omnistage.pipeline.placement.memory import ONE_80GB_LAYOUT, GiB, MemoryBudgetError
from omnistage.platform import detect_platform
from omnistage.utils import deep_merge

if TYPE_CHECKING:
    from fastapi import FastAPI

    from omnistage.entrypoints.async_omni import AsyncOmni

logger = logging.getLogger("omnistage.serve")

SMALL_GPU_BYTES = 100 * GiB  # under it (80-96 GB cards) no --deploy-config means the 80gb layout
TINY_MODEL_NAME = "qwen3-omni-tiny-random"
RANDOM_WEIGHTS_NOTE = ("the weights are RANDOM: text and speech are noise; use it to try the API, "
                       "not to judge quality")


class LaunchError(SystemExit):
    """A start-up problem the user can fix; the message says what."""

    def __init__(self, message: str) -> None:
        super().__init__(f"omnistage serve: {message}")


@dataclass(frozen=True)
class ModelSource:
    path: Path
    name: str  # what clients send as `model`
    random_weights: bool


def resolve_model(model: str | None, served_model_name: str | None = None,
                  load_format: str = "auto") -> ModelSource:
    """No `model`: the built-in tiny random-weight checkpoint. A local directory is used as it is; any other
    string that is not path-like is a Hugging Face Hub id, downloaded (needs internet)."""
    if model is None:
        return ModelSource(_tiny_checkpoint(), served_model_name or TINY_MODEL_NAME, True)
    path = Path(model).expanduser()
    if not path.is_dir():
        if path.exists() or model.startswith(("/", ".", "~")) or model.count("/") > 1:
            raise LaunchError(f"{model}: not a checkpoint directory")
        path = download(model)
    return ModelSource(path, served_model_name or model, load_format == "dummy")


def _tiny_checkpoint() -> Path:
    from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

    start = time.time()
    path = tiny_checkpoint()
    fresh = path.stat().st_mtime >= start
    done = "written now (first start only)" if fresh else "written at an earlier start"
    logger.info("no MODEL given: the built-in tiny random-weight checkpoint at %s, %s; OMNISTAGE_CACHE_DIR "
                "moves the cache", path, done)
    return path


def download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    logger.info("%s is not a local directory: downloading it from the Hugging Face Hub", repo_id)
    try:
        return Path(snapshot_download(repo_id))
    except Exception as e:  # offline, unknown repo, gated, ...: all end the start-up the same way
        raise LaunchError(f"{repo_id!r} is not a local directory and the Hugging Face Hub download failed "
                          f"({type(e).__name__}: {e}). Without internet, copy the checkpoint to this machine "
                          "and pass its directory.") from None


def deploy_config(model_dir: Path, path: str | None, stage_overrides: str | None,
                  device: str | None, overrides: dict | None = None) -> DeployConfig:
    """The packaged config for the checkpoint's model_type (on a GPU of under 100 GiB its `80gb` layout:
    `fitting_layout`) unless `path` (a YAML, or a packaged layout name: "80gb", "2x80gb", "2gpu", ...:
    `serve_args`); its platform entry follows `device` (cpu when the user asks for the CPU on an accelerator
    machine)."""
    platform = "cpu" if device is not None and device.startswith("cpu") else detect_platform()
    try:
        path = resolve_deploy_config(model_dir, path or fitting_layout(model_dir, platform, device))
        return load_deploy_config(path, platform, stage_overrides, overrides)
    except ConfigError as e:
        raise LaunchError(str(e)) from None


def fitting_layout(model_dir: Path, platform: str, device: str | None) -> str | None:
    """The packaged layout for the GPU when none is named: `80gb` on one of under 100 GiB (H100, A100, H20: the
    default layout's graph sets and caches need an H200's 141 GB), where the model type has one."""
    if platform not in ("cuda", "rocm"):
        return None
    index = torch.device(device).index if device and device.startswith("cuda") else None
    total = torch.cuda.get_device_properties(index or 0).total_memory
    if total >= SMALL_GPU_BYTES:
        return None
    try:
        default_deploy_config(model_dir, ONE_80GB_LAYOUT)
    except ConfigError:
        return None
    logger.info("a GPU of %.1f GiB: the packaged %s layout (--deploy-config names another)", total / GiB,
                ONE_80GB_LAYOUT)
    return ONE_80GB_LAYOUT


def generation_defaults(deploy: DeployConfig, model_dir: Path, source: str) -> DeployConfig:
    """`deploy` with the default sampling of `--generation-config` (see `omnistage.generation_config`),
    each stage's effective defaults logged."""
    from omnistage.generation_config import (
        describe_defaults,
        read_generation_config,
        with_generation_defaults,
    )

    try:
        generation = read_generation_config(model_dir, source)
        for line in describe_defaults(deploy, generation):
            logger.info("%s", line)
        return with_generation_defaults(deploy, generation)
    except ConfigError as e:
        raise LaunchError(str(e)) from None


def json_object(text: str | None, flag: str) -> dict:
    """A CLI flag's JSON object ({} when not given)."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise LaunchError(f"{flag}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise LaunchError(f"{flag}: expected a JSON object")
    return value


def deploy_overrides(args: argparse.Namespace) -> dict:
    """Deploy keys from the flags: --deploy-overrides, then the flags named after keys over it
    (--quantization: the thinker's and the talker's; --stage-overrides still wins over these)."""
    keys = ("max_waiting_requests", "max_waiting_tokens", "placement", "gpu_memory_utilization",
            "data_parallel_size")
    flags = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.quantization is not None:
        flags["stages"] = {name: {"quantization": args.quantization} for name in QUANTIZED_STAGES}
    return deep_merge(json_object(args.deploy_overrides, "--deploy-overrides"), flags)


def build(args: argparse.Namespace) -> tuple[FastAPI, AsyncOmni]:
    """The app and its running engine, from `omnistage serve` arguments."""
    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.server.app import create_app
    from omnistage.server.media_args import media_policy

    policy = media_policy(args)
    source = resolve_model(args.model, args.served_model_name, args.load_format)
    deploy = deploy_config(source.path, args.deploy_config, args.stage_overrides, args.device,
                           deploy_overrides(args))
    deploy = generation_defaults(deploy, source.path, args.generation_config)
    logger.info("serving %s from %s", source.name, source.path)
    if source.random_weights:
        logger.warning("%s: %s", source.name, RANDOM_WEIGHTS_NOTE)
    logger.info("deploy config: %s", deploy.describe())
    try:
        engine = AsyncOmni(source.path, deploy=deploy, device=args.device, dtype=args.dtype,
                           load_format=args.load_format, media_policy=policy)
    except MemoryBudgetError as e:
        raise LaunchError(str(e)) from None
    warm_media(engine.engine.processor)  # NOTE: so that the first media request pays no first uses
    voices = engine.engine.voices
    logger.info("voices: %s", ", ".join(voices) or "none (no audio output: a thinker-only checkpoint)")
    info = {"root": str(source.path), "random_weights": source.random_weights, "voices": voices,
            "audio_output": bool(voices)}
    if source.random_weights:
        info["note"] = RANDOM_WEIGHTS_NOTE
    app = create_app(engine, source.name, deploy, voices, api_key=args.api_key, model_info=info,
                     max_body_bytes=args.max_body_bytes, media_policy=policy)
    return app, engine


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from omnistage.server.websocket import WebSocketProtocol

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, engine = build(args)
    settle_heap("serving process")
    try:
        # NOTE: no permessage-deflate: it saves a third of the bytes of base64 audio (34 % of 20 ms
        # appends of speech) for zlib calls in the event loop, each giving the GIL up to the stage threads
        # (websocket.py).
        # asyncio's loop, not uvloop: uvloop takes the GIL back for every libuv callback and measured no
        # better on the H200 (a chat row beside 64 idle realtime sessions: 10.0 req/s on it, 11.1 without;
        # benchmarks/HISTORY.md, 2026-12-04).
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", ws=WebSocketProtocol,
                    ws_per_message_deflate=False, loop="asyncio")
    finally:
        app.state.realtime_vad.close()
        engine.shutdown()
