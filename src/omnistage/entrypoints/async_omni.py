"""Online Python API: many requests in flight, each an async iterator of output deltas. The engine
runs in its own thread; deltas cross to the event loop through `call_soon_threadsafe`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from omnistage.outputs import OutputDelta
from omnistage.pipeline.orchestrator import Orchestrator
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams


class AsyncOmni:
    def __init__(self, model: str | Path | None = None, **engine_kwargs: Any) -> None:
        if model is None:
            from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

            model = tiny_checkpoint()
        self.engine = Orchestrator(model, **engine_kwargs)

    async def generate(self, request_id: str, messages: list[dict], sampling: SamplingParams,
                       talker_sampling: TalkerSamplingParams | None, voice: str | None,
                       use_audio_in_video: bool = False, prompt_token_ids: list[int] | None = None
                       ) -> AsyncIterator[OutputDelta]:
        """Audio is produced when `talker_sampling` is given. Aborts the request if the consumer stops early."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[OutputDelta] = asyncio.Queue()

        def emit(delta: OutputDelta) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, delta)

        req = await loop.run_in_executor(None, lambda: self.engine.make_request(
            request_id, messages, prompt_token_ids, want_audio=talker_sampling is not None, voice=voice,
            sampling=sampling, talker_sampling=talker_sampling, emit=emit))
        self.engine.add_request(req)
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.engine.abort(request_id)

    def chat(self, messages: list[dict] | None = None, *, prompt_token_ids: list[int] | None = None,
             modalities: list[str] = ("text", "audio"), voice: str = "Ethan", sampling: Any = None,
             talker_sampling: Any = None) -> AsyncIterator[OutputDelta]:
        """The offline `Omni.chat` signature, one request, streamed."""
        from omnistage.sampling_params import from_dict

        talker = from_dict(TalkerSamplingParams, talker_sampling) if "audio" in modalities else None
        return self.generate(uuid.uuid4().hex, messages, from_dict(SamplingParams, sampling), talker, voice,
                             prompt_token_ids=prompt_token_ids)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict[str, dict[str, int]]:
        return self.engine.stats()

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    def shutdown(self) -> None:
        self.engine.shutdown()
