"""Builds the stages from a checkpoint and a deploy config, moves requests through them, and drives
them from one loop (offline: `run_until_done`; online: a background thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omnistage.config import DeployConfig, StageConfig, default_deploy_config, load_deploy_config
from omnistage.engine.request import Request
from omnistage.layers.sampling import request_seed
from omnistage.models.qwen3_omni.model import build_stage, load_config, resolve_dtype
from omnistage.models.qwen3_omni.prompt import PromptInputs, PromptProcessor
from omnistage.outputs import OutputDelta
from omnistage.pipeline.code2wav_stage import Code2WavStage
from omnistage.pipeline.talker_stage import TalkerStage
from omnistage.pipeline.thinker_stage import ThinkerStage
from omnistage.platform import current_platform
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams, from_dict


def _num_blocks(stage: StageConfig, module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    cfg = module.model.config
    per_block = 2 * cfg.num_hidden_layers * stage.block_size * cfg.num_key_value_heads * cfg.head_dim
    per_block *= torch.tensor([], dtype=dtype).element_size()
    budget = stage.kv_cache_memory
    if isinstance(budget, float):
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 8 << 30
        budget = int(total * budget)
    return max(8, budget // per_block)


class Orchestrator:
    def __init__(self, model_dir: str | Path, *, deploy: DeployConfig | None = None, load_format: str = "auto",
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 seed: int = 0) -> None:
        self.config = load_config(model_dir)
        self.deploy = deploy or load_deploy_config(default_deploy_config(model_dir))
        self.processor = PromptProcessor(model_dir)
        device = torch.device(device or ("cuda" if current_platform() == "cuda" else "cpu"))
        dtype = resolve_dtype(dtype or self.deploy.stages.thinker.dtype, device)
        self.device, self.dtype = device, dtype

        def build(stage: str) -> torch.nn.Module:
            return build_stage(self.config, stage, model_dir=model_dir, load_format=load_format, device=device,
                               dtype=dtype, seed=seed)

        th = self.deploy.stages.thinker
        thinker = build("thinker")
        self.thinker = ThinkerStage(thinker, self.config, self.processor.tokenizer, self._to_talker,
                                    max_batch_size=th.max_batch_size, max_num_batched_tokens=th.max_num_batched_tokens,
                                    num_blocks=_num_blocks(th, thinker, device, dtype), block_size=th.block_size)
        self.talker = self.code2wav = None
        if self.config.enable_audio_output:
            tk, cw, conn = self.deploy.stages.talker, self.deploy.stages.code2wav, self.deploy.connector
            talker = build("talker")
            ids = [self.config.tts_bos_token_id, self.config.tts_eos_token_id, self.config.tts_pad_token_id]
            tts = thinker.model.embed_tokens(torch.tensor(ids, device=device))
            self.talker = TalkerStage(talker, self.config, self._to_code2wav, tts, max_batch_size=tk.max_batch_size,
                                      num_blocks=_num_blocks(tk, talker, device, dtype), block_size=tk.block_size)
            self.code2wav = Code2WavStage(build("code2wav"), max_batch_size=cw.max_batch_size,
                                          initial_chunk_frames=conn.initial_codec_chunk_frames,
                                          chunk_frames=conn.codec_chunk_frames)
        self.requests: dict[str, Request] = {}
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False

    @property
    def stages(self) -> list:
        return [s for s in (self.thinker, self.talker, self.code2wav) if s is not None]

    @property
    def voices(self) -> list[str]:
        return sorted(self.config.talker_config.speaker_id)

    def _to_talker(self, chunk) -> None:
        self.talker.add(chunk)

    def _to_code2wav(self, chunk) -> None:
        self.code2wav.add(chunk)

    def make_request(self, request_id: str, messages: list[dict] | None, prompt_token_ids: list[int] | None, *,
                     want_audio: bool, voice: str | None, sampling: Any, talker_sampling: Any,
                     emit: Callable[[OutputDelta], None]) -> Request:
        """A request from chat messages (through the processor) or prompt ids; sampling as objects or dicts."""
        if (messages is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of messages and prompt_token_ids")
        prompt = PromptInputs(list(prompt_token_ids)) if messages is None else self.processor(messages)
        sp = from_dict(SamplingParams, sampling)
        voice = voice or "Ethan"
        if want_audio and voice.lower() not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; choose from {self.voices}")
        return Request(request_id, prompt, sp, from_dict(TalkerSamplingParams, talker_sampling),
                       request_seed(sp.seed), emit, voice=voice, want_audio=want_audio)

    def add_request(self, req: Request) -> None:
        if req.want_audio and self.talker is None:
            raise ValueError("this checkpoint has no audio output (enable_audio_output is false)")
        emit = req.emit

        def emit_and_forget(delta) -> None:
            if delta.finished:
                self.requests.pop(req.request_id, None)
            emit(delta)

        req.emit = emit_and_forget
        self.requests[req.request_id] = req
        self.thinker.add(req)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Frees what the request holds in every stage; its stream gets no further items."""
        with self._lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return
            req.aborted = True
            for stage in self.stages:
                stage.abort(request_id)

    def step(self) -> bool:
        with self._lock:
            worked = False
            for stage in self.stages:
                worked |= stage.step()
            return worked

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def run_until_done(self) -> None:
        while self.has_unfinished():
            if not self.step() and self.has_unfinished():
                raise RuntimeError(f"engine stalled with unfinished requests {sorted(self.requests)}")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="omnistage-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop:
            if not self.step():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
