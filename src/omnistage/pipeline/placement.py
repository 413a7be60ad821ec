"""Where each stage runs: its model built on its device (replica i of a stage on the deploy config's
`devices[i % len(devices)]`), its KV cache sized from the deploy config, and its worker thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.config import DeployConfig, StageConfig
from omnistage.models.qwen3_omni.model import build_stage, resolve_dtype
from omnistage.pipeline.code2wav_stage import Code2WavStage
from omnistage.pipeline.talker_stage import TalkerStage
from omnistage.pipeline.thinker_stage import ThinkerStage
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


def capture(stage: ThinkerStage | TalkerStage, sc: StageConfig) -> None:
    """CUDA graphs for the deploy config's `cuda_graph_capture_widths` now, not in the first requests."""
    if stage.runner is not None and sc.cuda_graph_capture_widths:
        stage.runner.capture(sc.cuda_graph_capture_widths)


def worker_name(stage: str, replica: int, replicas: int) -> str:
    return stage if replicas == 1 else f"{stage}{replica}"


def build_stages(p: Placement, tokenizer: Any, to_talker: Callable, to_code2wav: Callable,
                 on_error: Callable[[BaseException], None]
                 ) -> tuple[ThinkerStage, list[TalkerStage], list[Code2WavStage], list[StageWorker]]:
    """The thinker, the talker and code2wav replicas (none without audio output), and their workers."""
    th, th_dev, th_dt, thinker = p.build("thinker")
    thinker_stage = ThinkerStage(thinker, p.config, tokenizer, to_talker, max_batch_size=th.max_batch_size,
                                 max_num_batched_tokens=th.max_num_batched_tokens,
                                 num_blocks=num_blocks(th, thinker, th_dev, th_dt), block_size=th.block_size,
                                 cuda_graph=th.cuda_graph, graph_batch_sizes=th.graph_batch_sizes())
    capture(thinker_stage, th)
    workers = [StageWorker("thinker", thinker_stage, th_dev, on_error)]
    talkers: list[TalkerStage] = []
    code2wavs: list[Code2WavStage] = []
    if not p.config.enable_audio_output:
        return thinker_stage, talkers, code2wavs, workers
    ids = [p.config.tts_bos_token_id, p.config.tts_eos_token_id, p.config.tts_pad_token_id]
    tts = thinker.model.embed_tokens(torch.tensor(ids, device=th_dev))
    for i in range(p.deploy.stages.talker.replicas):
        tk, dev, dt, talker = p.build("talker", i)
        talkers.append(TalkerStage(talker, p.config, to_code2wav, tts, max_batch_size=tk.max_batch_size,
                                   num_blocks=num_blocks(tk, talker, dev, dt), block_size=tk.block_size,
                                   cuda_graph=tk.cuda_graph, graph_batch_sizes=tk.graph_batch_sizes()))
        capture(talkers[-1], tk)
        workers.append(StageWorker(worker_name("talker", i, tk.replicas), talkers[-1], dev, on_error))
    conn = p.deploy.connector
    for i in range(p.deploy.stages.code2wav.replicas):
        cw, dev, _, code2wav = p.build("code2wav", i)
        code2wavs.append(Code2WavStage(code2wav, max_batch_size=cw.max_batch_size,
                                       initial_chunk_frames=conn.initial_codec_chunk_frames,
                                       chunk_frames=conn.codec_chunk_frames, cuda_graph=cw.cuda_graph,
                                       graph_batch_sizes=cw.graph_batch_sizes()))
        if code2wavs[-1].runner is not None:
            code2wavs[-1].runner.capture()
        workers.append(StageWorker(worker_name("code2wav", i, cw.replicas), code2wavs[-1], dev, on_error))
    return thinker_stage, talkers, code2wavs, workers
