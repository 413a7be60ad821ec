"""Offline Python API: `Omni(model_dir).chat(...)`; a list of requests runs batched through the engine."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.outputs import SAMPLE_RATE, OutputDelta, Usage
from omnistage.pipeline.orchestrator import Orchestrator


@dataclass
class ChatResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    codes: np.ndarray | None = None  # [num_code_groups, frames]
    audio: np.ndarray | None = None  # float32 mono
    sample_rate: int = SAMPLE_RATE
    finish_reason: str | None = None
    usage: Usage | None = None
    phases: dict[str, float] | None = None  # seconds from arrival to each phase the request reached

    def add(self, delta: OutputDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.audio is not None:
            self.audio = delta.audio if self.audio is None else np.concatenate([self.audio, delta.audio])
            self.codes = delta.codes if self.codes is None else np.concatenate([self.codes, delta.codes], 1)
        if delta.finished:
            self.finish_reason, self.usage, self.phases = delta.finish_reason, delta.usage, delta.phases


def _per_request(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} requests")
        return list(value)
    return [value] * n


class Omni:
    def __init__(self, model: str | Path | None = None, **engine_kwargs: Any) -> None:
        """`model`: a checkpoint directory (default: the built-in tiny random-weight checkpoint).
        `engine_kwargs` go to `Orchestrator` (deploy, load_format, device, dtype, seed, media_policy,
        placement: "local", "pipeline", "process" or "ray")."""
        if model is None:
            from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

            model = tiny_checkpoint()
        # NOTE: the stages in this process whatever the deploy config says: a worker process (spawned) would run
        # the caller's script again unless it has an `if __name__ == "__main__":` guard
        self.engine = Orchestrator(model, **{**engine_kwargs, "placement": engine_kwargs.get("placement") or "local"})

    def chat(self, messages: list | None = None, *, prompt_token_ids: list | None = None,
             modalities: list[str] = ("text", "audio"), voice: str | list[str] = "Ethan", sampling: Any = None,
             talker_sampling: Any = None, use_audio_in_video: bool | list[bool] = False,
             mm_processor_kwargs: dict | list[dict] | None = None) -> ChatResult | list[ChatResult]:
        """One conversation (or a list of them, run batched). Media parts as `omnistage.media` reads them;
        `use_audio_in_video` (or `mm_processor_kwargs={"use_audio_in_video": ...}`): videos bring their
        audio track. Per-request values may be lists."""
        batched = (messages is not None and messages and isinstance(messages[0], list)) or (
            prompt_token_ids is not None and prompt_token_ids and isinstance(prompt_token_ids[0], list))
        convs = (messages if batched else [messages]) if messages is not None else None
        ids = (prompt_token_ids if batched else [prompt_token_ids]) if prompt_token_ids is not None else None
        n = len(convs if convs is not None else ids)
        results = [ChatResult() for _ in range(n)]
        per = [_per_request(v, n, name) for v, name in (
            (voice, "voice"), (sampling, "sampling"), (talker_sampling, "talker_sampling"),
            (use_audio_in_video, "use_audio_in_video"), (mm_processor_kwargs, "mm_processor_kwargs"))]
        reqs = [self.engine.make_request(uuid.uuid4().hex, None if convs is None else convs[i],
                                         None if ids is None else ids[i], want_audio="audio" in modalities,
                                         voice=v, sampling=s, talker_sampling=t, emit=results[i].add,
                                         use_audio_in_video=_audio_in_video(u, mm))
                for i, (v, s, t, u, mm) in enumerate(zip(*per))]
        for req in reqs:
            self.engine.add_request(req)
        self.engine.wait([r.request_id for r in reqs])
        return results if batched else results[0]


def _audio_in_video(flag: bool, mm_processor_kwargs: dict | None) -> bool:
    mm = dict(mm_processor_kwargs or {})
    unknown = set(mm) - {"use_audio_in_video"}
    if unknown:
        raise ValueError(f"mm_processor_kwargs: unsupported keys {sorted(unknown)} (only use_audio_in_video)")
    return bool(mm.get("use_audio_in_video", flag))
