"""Where each stage runs: its model built on its device (replica i of a stage on the deploy config's
`devices[i % len(devices)]`), its KV cache sized from the deploy config, and its worker thread; or, with
`placement: ray`, each replica in a Ray actor (pipeline/placement/ray.py) built by the same `build_replica`."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.config import DeployConfig, StageConfig
from omnistage.models.qwen3_omni.model import build_stage, resolve_dtype
from omnistage.pipeline.code2wav.stage import Code2WavStage
from omnistage.pipeline.placement.stage_handle import LocalStage, StageHandles
from omnistage.pipeline.talker.stage import TalkerStage
from omnistage.pipeline.thinker.stage import ThinkerStage
from omnistage.pipeline.worker import StageWorker
from omnistage.platform import current_platform


@dataclass
class Placement:
    """`device` (if given) places every stage there; `dtype` (if given) overrides the deploy config's."""

    config: Any
    deploy: DeployConfig
    model_dir: str | Path
    load_format: str = "auto"
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    seed: int = 0

    def build(self, name: str, replica: int = 0) -> tuple[StageConfig, torch.device, torch.dtype, torch.nn.Module]:
        sc = self.deploy.stage(name)
        dev = torch.device(self.device) if self.device is not None else current_platform().device(
            sc.replica_devices[replica])
        dt = resolve_dtype(self.dtype or sc.dtype, dev)
        module = build_stage(self.config, name, model_dir=self.model_dir, load_format=self.load_format,
                             device=dev, dtype=dt, seed=self.seed)
        return sc, dev, dt, module


def num_blocks(stage: StageConfig, module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    cfg = module.model.config
    per_block = 2 * cfg.num_hidden_layers * stage.block_size * cfg.num_key_value_heads * cfg.head_dim
    per_block *= torch.tensor([], dtype=dtype).element_size()
    budget = stage.kv_cache_memory
    if isinstance(budget, float):
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 8 << 30
        budget = int(total * budget)
    return max(8, budget // per_block)


def capture(stage: ThinkerStage | TalkerStage | Code2WavStage, sc: StageConfig) -> None:
    """CUDA graphs now, not in the first requests: code2wav's fixed chunk shapes, the thinker's and the
    talker's at the deploy config's `cuda_graph_capture_widths` and their prefill graphs."""
    if stage.runner is None:
        return
    if isinstance(stage, Code2WavStage):
        stage.runner.capture()
        return
    if sc.cuda_graph_capture_widths:
        stage.runner.capture(sc.cuda_graph_capture_widths)
    if stage.prefill is not None:
        stage.prefill.capture()


def worker_name(stage: str, replica: int, replicas: int) -> str:
    return stage if replicas == 1 else f"{stage}{replica}"


def replica_names(p: Placement) -> list[tuple[str, int, str]]:
    """(stage, replica, worker name) of every stage replica, thinker first (no talker and code2wav
    without audio output)."""
    names = ["thinker", "talker", "code2wav"] if p.config.enable_audio_output else ["thinker"]
    return [(name, i, worker_name(name, i, p.deploy.stage(name).replicas))
            for name in names for i in range(p.deploy.stage(name).replicas)]


def build_replica(p: Placement, name: str, replica: int = 0, to_next: Callable | None = None, *,
                  tokenizer: Any = None, tts: torch.Tensor | None = None
                  ) -> tuple[ThinkerStage | TalkerStage | Code2WavStage, torch.device]:
    """One stage replica on its device, its CUDA graphs captured. `to_next` takes its payloads (thinker ->
    talker -> code2wav); the thinker needs `tokenizer`, the talker the thinker's `tts_embeds`."""
    sc, dev, dt, module = p.build(name, replica)
    # NOTE: graphs are captured on the current device's streams and pool: make it the replica's.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        stage = _stage(p, name, sc, dev, dt, module, to_next, tokenizer, tts)
        capture(stage, sc)
    return stage, dev


def _stage(p: Placement, name: str, sc: StageConfig, dev: torch.device, dt: torch.dtype,
           module: torch.nn.Module, to_next: Callable | None, tokenizer: Any, tts: torch.Tensor | None
           ) -> ThinkerStage | TalkerStage | Code2WavStage:
    if name == "thinker":
        stage = ThinkerStage(module, p.config, tokenizer, to_next, max_batch_size=sc.max_batch_size,
                             max_num_batched_tokens=sc.max_num_batched_tokens,
                             num_blocks=num_blocks(sc, module, dev, dt), block_size=sc.block_size,
                             cuda_graph=sc.cuda_graph, graph_batch_sizes=sc.graph_batch_sizes(),
                             prefill_tokens=sc.cuda_graph_prefill_tokens, async_output=p.deploy.async_output)
    elif name == "talker":
        stage = TalkerStage(module, p.config, to_next, tts, max_batch_size=sc.max_batch_size,
                            num_blocks=num_blocks(sc, module, dev, dt), block_size=sc.block_size,
                            cuda_graph=sc.cuda_graph, graph_batch_sizes=sc.graph_batch_sizes(),
                            prefill_tokens=sc.cuda_graph_prefill_tokens, async_output=p.deploy.async_output)
    else:
        conn = p.deploy.connector
        stage = Code2WavStage(module, max_batch_size=sc.max_batch_size,
                              initial_chunk_frames=conn.initial_codec_chunk_frames,
                              chunk_frames=conn.codec_chunk_frames, chunk_growth=conn.codec_chunk_growth,
                              cuda_graph=sc.cuda_graph, graph_batch_sizes=sc.graph_batch_sizes(),
                              async_output=p.deploy.async_output)
    return stage


def tts_embeds(p: Placement, thinker: ThinkerStage) -> torch.Tensor:
    """The thinker's embeddings of tts_bos, tts_eos and tts_pad, which every talker replica needs."""
    ids = [p.config.tts_bos_token_id, p.config.tts_eos_token_id, p.config.tts_pad_token_id]
    return thinker.thinker.model.embed_tokens(torch.tensor(ids, device=thinker.device))


def build_stages(p: Placement, tokenizer: Any, to_talker: Callable, to_code2wav: Callable,
                 on_error: Callable[[BaseException], None]) -> StageHandles:
    """Every stage replica in this process, each with its worker thread (not started yet)."""
    handles: list[tuple[str, LocalStage]] = []
    tts = None
    for name, i, wname in replica_names(p):
        to_next = {"thinker": to_talker, "talker": to_code2wav}.get(name)
        stage, dev = build_replica(p, name, i, to_next, tokenizer=tokenizer, tts=tts)
        if name == "thinker" and p.config.enable_audio_output:
            tts = tts_embeds(p, stage)
        handles.append((name, LocalStage(replica_worker(p, name, wname, stage, dev, on_error))))
    return StageHandles.of(handles)


def replica_worker(p: Placement, name: str, wname: str, stage: Any, device: torch.device,
                   on_error: Callable[..., None]) -> StageWorker:
    """The worker thread of a stage replica (not started), in this process or in a Ray actor's."""
    sys.setswitchinterval(p.deploy.switch_interval_ms / 1e3)  # NOTE: process-wide (the threads share it)
    return StageWorker(wname, stage, device, on_error, p.deploy.stage(name).stream_priority)
