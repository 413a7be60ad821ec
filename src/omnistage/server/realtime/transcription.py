"""Input audio transcription (the session's `audio.input.transcription`; null, the default: off). Each
committed user audio is transcribed by the served model itself: a text-only request of its own (the thinker,
greedy, at most MAX_TOKENS or the session's max_output_tokens, INSTRUCTION as the system message, the audio
as the user's) that runs beside the turn's response. Its text goes out as
conversation.item.input_audio_transcription.delta events, then .completed (the transcript and the usage), or
.failed with the error; the transcript is kept on the item (its input_audio part's `transcript`), while the
prompt of later turns keeps the audio."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from omnistage.outputs import OutputDelta, Usage
from omnistage.server.errors import OpenAIError
from omnistage.server.protocol import ChatCompletionRequest, thinker_sampling_params
from omnistage.server.realtime.conversation import Item
from omnistage.server.realtime.events import new_id, server_event
from omnistage.server.realtime.response import FAILED, Emit
from omnistage.server.realtime.settings import InputTranscription, SessionSettings
from omnistage.server.serving import check_finished, start_request

if TYPE_CHECKING:
    from omnistage.server.realtime.session import SessionContext

logger = logging.getLogger(__name__)
INSTRUCTION = "Transcribe the user's speech exactly as spoken. Reply with the transcript only."
MAX_TOKENS = 128
EVENT = "conversation.item.input_audio_transcription"


def transcription_messages(audio: dict, config: InputTranscription) -> list[dict]:
    """The request's messages for one user audio part (a chat `audio` part)."""
    text = INSTRUCTION + (f" The speech is in {config.language}." if config.language else "") + (
        f" Context: {config.prompt}" if config.prompt else "")
    return [{"role": "system", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": [audio]}]


def usage_object(usage: Usage) -> dict:
    return {"type": "tokens", "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class Transcriber:
    """A session's transcriptions in flight, each its own task."""

    def __init__(self, ctx: SessionContext, emit: Emit) -> None:
        self.ctx, self._emit = ctx, emit
        self._tasks: set[asyncio.Task] = set()

    def start(self, item: Item, settings: SessionSettings) -> None:
        """Transcribes the committed user audio `item` when the session asks for transcripts."""
        config = settings.audio.input.transcription
        if config is None:
            return
        cap = settings.max_output_tokens
        max_tokens = MAX_TOKENS if cap == "inf" else min(cap, MAX_TOKENS)
        task = asyncio.create_task(self._run(item, config, max_tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """The session is gone: each request is aborted, nothing more is sent."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, item: Item, config: InputTranscription, max_tokens: int) -> None:
        # NOTE: yield first, so the turn's response (started by the same client event) is submitted first
        await asyncio.sleep(0)
        part, where = item.parts[0], {"item_id": item.id, "content_index": 0}
        request_id, text = new_id("transcription"), []
        last = OutputDelta(request_id)
        request = ChatCompletionRequest.model_construct(max_tokens=max_tokens, temperature=0.0)
        sampling = thinker_sampling_params(request, self.ctx.deploy.stages.thinker.sampling)
        try:
            messages = transcription_messages(part.chat_part(), config)
            deltas = await start_request(self.ctx.engine, request_id, messages, sampling, None, None)
            async for last in deltas:
                if last.text:
                    text.append(last.text)
                    await self._emit(server_event(f"{EVENT}.delta", **where, delta=last.text))
            check_finished(last)
        except OpenAIError as e:  # refused (overloaded, ...) or failed in a stage
            return await self._failed(where, {"type": e.type, "code": e.code, "message": e.message,
                                              "param": e.param})
        except Exception:
            logger.exception("transcription of %s failed", item.id)
            return await self._failed(where, {"type": "server_error", "code": None, "message": FAILED})
        finally:
            if not last.finished:
                await asyncio.shield(self.ctx.engine.abort(request_id))
        part.transcript = "".join(text)
        await self._emit(server_event(f"{EVENT}.completed", **where, transcript=part.transcript,
                                      usage=usage_object(last.usage or Usage())))

    async def _failed(self, where: dict, error: dict) -> None:
        await self._emit(server_event(f"{EVENT}.failed", **where, error=error))
