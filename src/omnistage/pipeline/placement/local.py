"""Where each stage runs: its model built on its device (replica i of a stage on the deploy config's
`devices[i % len(devices)]`), its KV cache sized to its device (sizing.py), and its worker thread; or, with
`placement: ray`, each replica in a Ray actor (pipeline/placement/ray.py) built by the same code."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.config import DeployConfig, StageConfig
from omnistage.models.qwen3_omni.model import build_stage, resolve_dtype
from omnistage.pipeline.code2wav.stage import Code2WavStage
from omnistage.pipeline.placement.sizing import Key, build_sized, kv_shares, load_modules
from omnistage.pipeline.placement.stage_handle import LocalStage, StageHandles, worker_name
from omnistage.pipeline.talker.stage import TalkerStage
from omnistage.pipeline.thinker.inputs import warm_encoders
from omnistage.pipeline.thinker.stage import ThinkerStage
from omnistage.pipeline.worker import StageWorker
from omnistage.platform import current_platform

logger = logging.getLogger(__name__)


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

    def place(self, name: str, replica: int = 0) -> tuple[torch.device, torch.dtype]:
        sc = self.deploy.stage(name)
        dev = torch.device(self.device) if self.device is not None else current_platform().device(
            sc.replica_devices[replica])
        if dev.type == "cuda" and dev.index is None:  # NOTE: a worker's `torch.cuda.set_device` needs an index
            dev = torch.device("cuda", 0)
        return dev, resolve_dtype(self.dtype or sc.dtype, dev)

    def build(self, name: str, replica: int = 0) -> torch.nn.Module:
        dev, dt = self.place(name, replica)
        return build_stage(self.config, name, model_dir=self.model_dir, load_format=self.load_format,
                           device=dev, dtype=dt, seed=self.seed)


def capture(stage: ThinkerStage | TalkerStage | Code2WavStage, sc: StageConfig) -> None:
    """CUDA graphs now, not in the first requests: code2wav's fixed chunk shapes, the thinker's and the
    talker's at the deploy config's `cuda_graph_capture_widths` and their prefill graphs; the thinker's
    encoders run once."""
    if stage.runner is None:
        return
    if isinstance(stage, ThinkerStage):
        warm_encoders(stage.thinker, stage.device, stage.dtype)
        _capture_encoders(stage)
    if isinstance(stage, Code2WavStage):
        stage.runner.capture()
        return
    if sc.cuda_graph_capture_widths:
        stage.runner.capture(sc.cuda_graph_capture_widths)
    if stage.prefill is not None:
        stage.prefill.capture(with_capture_layer=isinstance(stage, ThinkerStage))


def _capture_encoders(stage: ThinkerStage) -> None:
    """The encoders' graphs; one that fails to capture is dropped (its encoder then runs eagerly: slower, not down)."""
    for name in ("vision", "audio"):
        if getattr(stage, name) is None:
            continue
        try:
            getattr(stage, name).capture()
        except RuntimeError:
            logger.warning("the %s encoder's CUDA graphs failed to capture; it runs eagerly", name, exc_info=True)
            setattr(stage, name, None)


def replica_names(p: Placement) -> list[tuple[str, int, str]]:
    """(stage, replica, worker name) of every stage replica, thinker first (no talker and code2wav
    without audio output)."""
    names = ["thinker", "talker", "code2wav"] if p.config.enable_audio_output else ["thinker"]
    return [(name, i, worker_name(name, i, p.deploy.stage(name).replicas))
            for name in names for i in range(p.deploy.stage(name).replicas)]


def build_replica(p: Placement, name: str, replica: int, module: torch.nn.Module, num_blocks: int,
                  to_next: Callable | None = None, *, tokenizer: Any = None, tts: torch.Tensor | None = None
                  ) -> ThinkerStage | TalkerStage | Code2WavStage:
    """One stage replica of a loaded `module` with `num_blocks` KV blocks, its CUDA graphs captured. `to_next`
    takes its payloads (thinker -> talker -> code2wav); the thinker needs `tokenizer`, the talker the
    thinker's `tts_embeds`."""
    sc, (dev, _) = p.deploy.stage(name), p.place(name, replica)
    # NOTE: graphs are captured on the current device's streams and pool: make it the replica's.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        stage = _stage(p, name, sc, module, num_blocks, to_next, tokenizer, tts)
        capture(stage, sc)
    return stage


def build_sized_replicas(p: Placement, keys: list[Key], shares: dict[Key, float | int],
                         to_next: dict[Any, Callable], *, tokenizer: Any = None,
                         tts: torch.Tensor | None = None
                         ) -> dict[Key, ThinkerStage | TalkerStage | Code2WavStage]:
    """The stage replicas `keys`, their KV caches sized to their devices (`sizing.py`); `to_next` by stage name
    or by (name, replica). `tts`: the talker's (None: taken from a thinker among `keys`)."""
    loaded = load_modules(p, keys)
    thinkers = [m for (name, _), m in loaded.modules.items() if name == "thinker"]
    if tts is None and p.config.enable_audio_output and thinkers:
        tts = tts_embeds(p, thinkers[0])

    def make(name: str, i: int, module: torch.nn.Module, blocks: int) -> Any:
        after = to_next.get((name, i), to_next.get(name))
        return build_replica(p, name, i, module, blocks, after, tokenizer=tokenizer, tts=tts)

    return build_sized(p, loaded, shares, make)


def _stage(p: Placement, name: str, sc: StageConfig, module: torch.nn.Module, num_blocks: int,
           to_next: Callable | None, tokenizer: Any, tts: torch.Tensor | None
           ) -> ThinkerStage | TalkerStage | Code2WavStage:
    if name == "thinker":
        same_process = p.deploy.placement in ("local", "pipeline")  # NOTE: the talker's mark seen, events shared
        stage = ThinkerStage(module, p.config, tokenizer, to_next, max_batch_size=sc.max_batch_size,
                             max_num_batched_tokens=sc.max_num_batched_tokens,
                             num_blocks=num_blocks, block_size=sc.block_size,
                             cuda_graph=sc.cuda_graph, graph_batch_sizes=sc.graph_batch_sizes(),
                             prefill_tokens=sc.cuda_graph_prefill_tokens, async_output=p.deploy.async_output,
                             prefill_context_ratio=sc.cuda_graph_prefill_context_ratio,
                             prefix_caching=p.deploy.enable_prefix_caching,
                             encoder_cache_bytes=p.deploy.encoder_cache_mb << 20, encoder_stream=sc.encoder_stream,
                             max_encoder_tokens=sc.max_num_encoder_input_tokens,
                             hold_first_frame=p.deploy.connector.idle_first_frame_alone and same_process,
                             early_talker_prompt=p.deploy.connector.talker_prompt_at_admission and same_process)
    elif name == "talker":
        stage = TalkerStage(module, p.config, to_next, tts, max_batch_size=sc.max_batch_size,
                            max_num_batched_tokens=sc.max_num_batched_tokens, num_blocks=num_blocks,
                            block_size=sc.block_size, cuda_graph=sc.cuda_graph,
                            graph_batch_sizes=sc.graph_batch_sizes(),
                            prefill_tokens=sc.cuda_graph_prefill_tokens, async_output=p.deploy.async_output,
                            prefix_caching=p.deploy.enable_prefix_caching,
                            prefill_context_ratio=sc.cuda_graph_prefill_context_ratio, kv_lookahead=sc.kv_lookahead,
                            last_prompt_row_in_decode=sc.last_prompt_row_in_decode)
    else:
        conn = p.deploy.connector
        stage = Code2WavStage(module, max_batch_size=sc.max_batch_size,
                              max_num_batched_tokens=sc.max_num_batched_tokens,
                              initial_chunk_frames=conn.initial_codec_chunk_frames,
                              chunk_frames=conn.codec_chunk_frames, chunk_growth=conn.codec_chunk_growth,
                              idle_initial_chunk_frames=conn.idle_initial_codec_chunk_frames,
                              cuda_graph=sc.cuda_graph, graph_batch_sizes=sc.graph_batch_sizes(),
                              async_output=p.deploy.async_output)
    return stage


def tts_embeds(p: Placement, thinker: torch.nn.Module) -> torch.Tensor:
    """The thinker's embeddings of tts_bos, tts_eos and tts_pad, which every talker replica needs."""
    ids = [p.config.tts_bos_token_id, p.config.tts_eos_token_id, p.config.tts_pad_token_id]
    return thinker.model.embed_tokens(torch.tensor(ids, device=next(thinker.parameters()).device))


def build_stages(p: Placement, tokenizer: Any, to_talker: Callable, to_code2wav: Callable,
                 on_error: Callable[[BaseException], None]) -> StageHandles:
    """Every stage replica in this process, each with its worker thread (not started yet)."""
    names = replica_names(p)
    keys = [(name, i) for name, i, _ in names]
    devices = {k: p.place(*k)[0] for k in keys}
    to_next = {"thinker": to_talker, "talker": to_code2wav}
    stages = build_sized_replicas(p, keys, kv_shares(p, devices), to_next, tokenizer=tokenizer)
    workers = [replica_worker(p, name, wname, stages[name, i], devices[name, i], on_error)
               for name, i, wname in names]
    return StageHandles.of([(name, LocalStage(w)) for (name, _, _), w in zip(names, workers)])


def replica_worker(p: Placement, name: str, wname: str, stage: Any, device: torch.device,
                   on_error: Callable[..., None]) -> StageWorker:
    """The worker thread of a stage replica (not started), in this process or in a Ray actor's."""
    sys.setswitchinterval(p.deploy.switch_interval_ms / 1e3)  # NOTE: process-wide (the threads share it)
    return StageWorker(wname, stage, device, on_error, p.deploy.stage(name).stream_priority)
