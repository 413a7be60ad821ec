"""Online Python API: many requests in flight, each an async iterator of output deltas. The engine
runs in its own threads; deltas cross to the event loop through an `Outbox` (outbox.py: one
`call_soon_threadsafe` for all that came since the loop last took them).

Admission is bounded (deploy `max_waiting_requests`, `max_waiting_tokens`): a request waits from its
arrival until it has produced every output it asked for (its first text, and its first audio when it
wants audio); past the bound `generate` raises EngineOverloaded, so memory stays bounded under overload."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.engine.request import Request
from omnistage.entrypoints.outbox import Outbox
from omnistage.outputs import OutputDelta
from omnistage.pipeline.faults import EngineOverloaded
from omnistage.pipeline.orchestrator import Orchestrator
from omnistage.pipeline.prompt_stream import PromptStream
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams


class Admission:
    """Requests waiting for their first outputs and their prompt tokens; touched on the event loop only."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.requests = self.tokens = 0

    def enter(self) -> None:
        if self.requests >= self.max_requests:
            raise EngineOverloaded(f"the server is overloaded: {self.requests} requests are waiting; "
                                   "retry later")
        self.requests += 1

    def add_tokens(self, n: int) -> None:
        if n > self.max_tokens:
            raise ValueError(f"the prompt ({n} tokens) exceeds the server's limit of {self.max_tokens} "
                             "tokens")
        if self.tokens + n > self.max_tokens:
            raise EngineOverloaded(f"the server is overloaded: {self.tokens} prompt tokens are waiting; "
                                   "retry later")
        self.tokens += n

    def leave(self, tokens: int) -> None:
        self.requests, self.tokens = self.requests - 1, self.tokens - tokens


class AsyncOmni:
    def __init__(self, model: str | Path | None = None, **engine_kwargs: Any) -> None:
        """As `Omni`: `engine_kwargs` go to `Orchestrator` (placement "ray": each stage replica in a Ray
        actor)."""
        if model is None:
            from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

            model = tiny_checkpoint()
        self.engine = Orchestrator(model, **engine_kwargs)
        deploy = self.engine.deploy
        self.admission = Admission(deploy.max_waiting_requests, deploy.max_waiting_tokens)
        self._outboxes: dict[asyncio.AbstractEventLoop, Outbox] = {}
        # NOTE: one intra-op thread each: at torch's default every thread's feature extraction runs a team as large
        # as the machine, a burst's threads then oversubscribing the cores. (set_num_threads also becomes the
        # default of this process's threads that have yet to run a parallel op, as silero's import makes it.)
        self.executor = ThreadPoolExecutor(thread_name_prefix="prompt", initializer=torch.set_num_threads,
                                           initargs=(1,))

    def _channel(self, loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Queue[OutputDelta], Any]:
        """A request's delta queue on `loop`, and the `emit` the engine's threads fill it with."""
        if loop not in self._outboxes:
            self._outboxes = {lp: box for lp, box in self._outboxes.items() if not lp.is_closed()}
            self._outboxes[loop] = Outbox(loop)
        queue: asyncio.Queue[OutputDelta] = asyncio.Queue()
        return queue, self._outboxes[loop].emitter(queue)

    async def generate(self, request_id: str, messages: list[dict], sampling: SamplingParams,
                       talker_sampling: TalkerSamplingParams | None, voice: str | None,
                       use_audio_in_video: bool = False, prompt_token_ids: list[int] | None = None,
                       session: str | None = None) -> AsyncIterator[OutputDelta]:
        """Audio is produced when `talker_sampling` is given; `session`: its conversation (the thinker replica
        of the session's last request takes it). Aborts the request if the consumer stops early.
        Raises EngineOverloaded (admission full) or ValueError (refused) before the first item."""
        loop = asyncio.get_running_loop()
        queue, emit = self._channel(loop)
        self.admission.enter()

        def process() -> tuple[Request, float]:
            began = time.perf_counter()
            return self.engine.make_request(
                request_id, messages, prompt_token_ids, want_audio=talker_sampling is not None, voice=voice,
                sampling=sampling, talker_sampling=talker_sampling, emit=emit,
                use_audio_in_video=use_audio_in_video, session=session), began

        async def start() -> int:
            received = time.perf_counter()
            req, began = await loop.run_in_executor(self.executor, process)
            req.arrival = received  # NOTE: its phases count from here, the prompt's processing (media) first
            req.phases["prompt_start"] = began - received  # a thread took it (a burst's prompts queue for one)
            req.mark("prompt")
            self.admission.add_tokens(len(req.prompt.input_ids))
            self.engine.add_request(req)
            return len(req.prompt.input_ids)

        async for delta in self._follow(request_id, queue, start, talker_sampling is not None):
            yield delta

    async def _follow(self, request_id: str, queue: asyncio.Queue[OutputDelta], start: Any, audio: bool
                      ) -> AsyncIterator[OutputDelta]:
        """The request's deltas once `await start()` (its prompt tokens) has sent it; it holds its
        admission place (taken by the caller) until its first outputs, and is aborted if the consumer stops
        early."""
        tokens, waiting_for = 0, {"text", "audio"} if audio else {"text"}
        finished = False
        try:
            tokens = await start()
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                if waiting_for and _produced(delta, waiting_for):
                    self.admission.leave(tokens)
                yield delta
        finally:
            if waiting_for:
                self.admission.leave(tokens)
            if not finished:
                self.engine.abort(request_id)

    async def open_request(self, request_id: str, messages: list[dict], sampling: SamplingParams,
                           talker_sampling: TalkerSamplingParams | None, voice: str | None,
                           session: str | None = None) -> StreamingPrompt:
        """A request whose last user message ends with an audio still arriving (see `StreamingPrompt`):
        the prompt before it is prefilled now, the audio's encoder windows as they complete. It takes its
        admission place now. Raises EngineOverloaded or ValueError (refused)."""
        loop = asyncio.get_running_loop()
        queue, emit = self._channel(loop)
        self.admission.enter()
        try:
            stream = await loop.run_in_executor(self.executor, lambda: self.engine.open_request(
                request_id, messages, want_audio=talker_sampling is not None, voice=voice, sampling=sampling,
                talker_sampling=talker_sampling, emit=emit, session=session))
        except BaseException:
            self.admission.leave(0)
            raise
        return StreamingPrompt(self, stream, queue, talker_sampling is not None)

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

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def stats(self) -> dict[str, dict[str, int]]:
        return self.engine.stats()

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.executor.shutdown(wait=False)


class StreamingPrompt:
    """An open request: `await append_audio(pcm)` (each awaited before the next), then `close()`, an async
    iterator of its deltas as `AsyncOmni.generate`'s; `abort()` (or leaving `close()` early) frees it."""

    def __init__(self, omni: AsyncOmni, stream: PromptStream, queue: asyncio.Queue[OutputDelta],
                 audio: bool) -> None:
        self.omni, self.stream, self.queue, self.audio = omni, stream, queue, audio
        self.request_id = stream.req.request_id
        self.closed = False

    @property
    def early_audio_rows(self) -> int:
        """Rows of the audio's complete encoder windows sent to the thinker before close (after close: those
        close kept, i.e. not encoded again)."""
        return self.stream.rows * len(self.stream.sent)

    async def append_audio(self, pcm16k: np.ndarray) -> None:
        """16 kHz mono float samples (the feature extraction of a completed window runs off the loop)."""
        await asyncio.get_running_loop().run_in_executor(self.omni.executor, self.stream.append_audio, pcm16k)

    @property
    def prepared(self) -> bool:
        """Whether close found the whole prompt already sent by `prepare`."""
        return self.stream.closed_prepared

    def mark(self, phase: str) -> None:
        """`Request.mark` on the open request (e.g. "turn_end", where the session's VAD ended the turn)."""
        self.stream.req.mark(phase)

    async def prepare(self, audio: np.ndarray) -> None:
        """The clip if the turn ends now (`PromptStream.prepare`), off the loop."""
        await asyncio.get_running_loop().run_in_executor(self.omni.executor, self.stream.prepare, audio)

    async def close(self, audio: np.ndarray | None = None) -> AsyncIterator[OutputDelta]:
        """The audio is complete (`audio`: see `PromptStream.close`): the request's deltas. Raises
        ValueError (e.g. the prompt got too long for the KV cache or the admission's limit) before the first."""
        if self.closed:
            raise RuntimeError("this streaming prompt was closed already")
        self.closed = True
        if self.stream.req.aborted:
            return
        loop = asyncio.get_running_loop()
        self.mark("close")

        async def start() -> int:
            await loop.run_in_executor(self.omni.executor, self.stream.close, audio)
            self.mark("closed")
            n = len(self.stream.req.prompt.input_ids)
            self.omni.admission.add_tokens(n)
            return n

        async for delta in self.omni._follow(self.request_id, self.queue, start, self.audio):
            yield delta

    async def abort(self) -> None:
        """Frees what the request holds in every stage (an open one: its prefilled KV blocks)."""
        if not self.closed:
            self.closed = True
            self.omni.admission.leave(0)
        self.stream.req.aborted = True  # NOTE: also when it was never sent (`close` then sends nothing)
        self.omni.engine.abort(self.request_id)


def _produced(delta: OutputDelta, waiting_for: set[str]) -> bool:
    """Takes the kinds of output `delta` carries out of `waiting_for`; True when that empties it."""
    if delta.text or delta.token_ids:
        waiting_for.discard("text")
    if delta.audio is not None:
        waiting_for.discard("audio")
    if delta.finished:
        waiting_for.clear()
    return not waiting_for
