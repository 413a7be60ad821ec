"""One realtime session's state machine: its settings, input audio buffer (with turn detection), conversation
and the response playing (player.py). Client events are handled one at a time, in order (`handle`); a
response plays as its own task (response.py), so appends, cancels and barge-in are handled while it plays.

Turns with server_vad: speech_started (cancels a playing response when interrupt_response) and
speech_stopped from the session's TurnDetector, fed by a TurnFeed (turn_feed.py: appends do not wait for it;
any other client event waits until the audio before it has been scored); speech_stopped commits the audio
from speech start (the detector's audio_start_ms already includes prefix_padding_ms) to speech end, and the
audio after it stays in the buffer. While nobody speaks the buffer keeps only the last prefix_padding_ms +
KEEP_MS of audio before what server VAD has scored (a manual commit then commits those). A turn that server
VAD will answer is prefilled while it is spoken
(early_prefill.py). Committed audio is transcribed beside its answer when the session asks (transcription.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from omnistage.config import DeployConfig
from omnistage.media import MediaPolicy
from omnistage.outputs import SAMPLE_RATE
from omnistage.server.realtime import events as ev
from omnistage.server.realtime.conversation import Conversation, Item, Part, decode_pcm, item_from
from omnistage.server.realtime.early_prefill import EarlyPrefill
from omnistage.server.realtime.events import RealtimeError, new_id, server_event
from omnistage.server.realtime.input_buffer import InputAudioBuffer
from omnistage.server.realtime.player import Player
from omnistage.server.realtime.response import Emit
from omnistage.server.realtime.settings import TurnDetection, initial, session_object, updated
from omnistage.server.realtime.transcription import Transcriber
from omnistage.server.realtime.transcripts import TranscriptStore
from omnistage.server.realtime.turn_feed import TurnFeed
from omnistage.server.realtime.vad import TurnDetector, TurnEvent
from omnistage.server.metrics import ServerMetrics
from omnistage.server.serving import EngineClient

KEEP_MS = 2000  # audio kept before the prefix padding while silent: the detector reports a start this late


@dataclass
class SessionContext:
    """What every session of a server shares."""

    engine: EngineClient
    model_name: str
    deploy: DeployConfig
    voices: Sequence[str]
    transcripts: TranscriptStore
    detector: Callable[[TurnDetection], TurnDetector]  # a new turn detector with these settings
    max_buffer_bytes: int  # the input audio buffer's bound (the server's --max-audio-seconds)
    metrics: ServerMetrics  # the app's: answers' latencies, prompt rows prefilled while spoken
    media: MediaPolicy  # the server's: user images are decoded under it


class RealtimeSession:
    def __init__(self, ctx: SessionContext, emit: Emit) -> None:
        self.ctx, self._emit = ctx, ev.EventSender(emit)
        self.id = new_id("sess")
        self.settings = initial(ctx.voices, ctx.model_name)
        self.conversation = Conversation()
        self._input = InputAudioBuffer(ctx.max_buffer_bytes)
        self._feed: TurnFeed | None = None  # the audio's way to server VAD (turn_feed.py)
        self._detector_base = 0  # the session sample where the detector's clock starts
        self._speech: str | None = None  # the item id of the speech going on
        self._early = EarlyPrefill(ctx.engine, ctx.voices, ctx.deploy, ctx.metrics, self.id)
        self._player = Player(ctx, self._early, self._emit, self.id)
        self._transcriber = Transcriber(ctx, self._emit)

    async def start(self) -> None:
        self._new_detector()
        await self._emit(server_event("session.created", session=self._session()))

    async def handle(self, data: str | bytes) -> None:
        """One client event; whatever is wrong with it becomes an `error` event (echoing its event_id)."""
        event, event_id, err = ev.parse_event(data)
        if self._feed is not None and not isinstance(event, ev.AudioAppend):
            await self._feed.drain()  # NOTE: any other event sees the turns of the audio appended before it
        try:
            if err is not None:
                raise err
            await _HANDLERS[type(event)](self, event)
        except RealtimeError as e:
            await self._emit(ev.error_event(e, event_id))

    @property
    def closed(self) -> bool:
        return self._emit.closed

    @closed.setter
    def closed(self, value: bool) -> None:
        self._emit.closed = value

    async def close(self) -> None:
        """The socket is gone: stop the response (aborting its request), send nothing more."""
        self.closed = True
        if self._feed is not None:
            self._feed.close()
            self._feed = None  # NOTE: it calls back into the session (a cycle: see ev.EventSender)
        await self._player.cancel("client_cancelled")
        await self._transcriber.close()

    # -- input audio --------------------------------------------------------------------------------------

    async def _append(self, event: ev.AudioAppend) -> None:
        pcm = decode_pcm(event.audio, "audio")
        self._input.append(pcm)
        if self._feed is not None:
            self._feed.push(np.frombuffer(pcm, "<i2"))

    async def _fed(self, turns: list[TurnEvent], fed: int) -> None:
        """Server VAD scored the audio up to `fed` samples past the detector's start and found `turns`."""
        try:
            for turn in turns:
                await self._on_turn(turn)
        except RealtimeError as e:
            await self._emit(ev.error_event(e, None))
        if self._speech is None:
            padding = self.settings.audio.input.turn_detection.prefix_padding_ms
            self._input.drop_until(self._detector_base + fed - (padding + KEEP_MS) * SAMPLE_RATE // 1000)
        else:
            self._early.feed(self._input)

    async def _on_turn(self, turn: TurnEvent) -> None:
        at = self._detector_base + turn.audio_ms * SAMPLE_RATE // 1000
        vad = self.settings.audio.input.turn_detection
        if turn.type == "speech_started":
            self._speech = new_id("item")
            self._input.drop_until(at)
            await self._emit(server_event("input_audio_buffer.speech_started", audio_start_ms=turn.audio_ms,
                                          item_id=self._speech))
            if vad.interrupt_response:
                await self._player.cancel("turn_detected")
            if vad.create_response and not self._player.playing:
                await self._early.open(self.settings, self.conversation, self._speech, self._input)
        elif turn.type == "speech_paused":
            if self._speech is not None:
                self._early.prepare(self._input, at)
        elif turn.type == "speech_resumed":
            if self._speech is not None:
                await self._early.resume(self.settings, self.conversation, self._speech, self._input)
        elif self._speech is not None:
            item_id, self._speech = self._speech, None
            await self._emit(server_event("input_audio_buffer.speech_stopped", audio_end_ms=turn.audio_ms,
                                          item_id=item_id))
            decided = time.perf_counter()
            self._early.turn_ended()
            try:
                audio16k = await self._early.clip(at)
                await self._commit(self._input.take_until(at), item_id, audio16k)
                if vad.create_response and not self._player.playing:
                    await self._respond(ev.ResponseParams(), decided)
            finally:
                await self._early.abort()  # not taken by the response

    async def _commit_event(self, event: ev.AudioCommit) -> None:
        item_id = self._speech or new_id("item")
        pcm = self._input.take_all()
        await self._reset_turn()
        await self._commit(pcm, item_id)

    async def _commit(self, pcm: bytes, item_id: str, audio16k: np.ndarray | None = None) -> None:
        """Committed user audio becomes a conversation item (the next response's prompt holds it);
        `audio16k`: its pcm_to_16k, made already."""
        item = Item(item_id, "user", [Part("input_audio", pcm=pcm, _audio16k=audio16k)])
        await item.parts[0].decode()
        previous = self.conversation.add(item)
        await self._emit(server_event("input_audio_buffer.committed", previous_item_id=previous,
                                      item_id=item_id))
        await self._item_added(item, previous)
        self._transcriber.start(item, self.settings)

    async def _clear(self, event: ev.AudioClear) -> None:
        self._input.clear()
        await self._reset_turn()
        await self._emit(server_event("input_audio_buffer.cleared"))

    async def _reset_turn(self) -> None:
        self._speech = None
        await self._early.abort()
        if self._feed is not None:
            self._feed.detector.reset()  # NOTE: drained: every event but an append drains the feed first

    def _new_detector(self) -> None:
        vad = self.settings.audio.input.turn_detection
        self._feed = None if vad is None else TurnFeed(self.ctx.detector(vad), self._fed)
        self._detector_base, self._speech = self._input.end, None

    # -- session and conversation -------------------------------------------------------------------------

    async def _update(self, event: ev.SessionUpdate) -> None:
        new = updated(self.settings, event.session, self.ctx.voices, self.ctx.model_name)
        await self._early.abort()  # the turn's prompt or sampling may have changed
        vad_changed = new.audio.input.turn_detection != self.settings.audio.input.turn_detection
        self.settings = new
        if vad_changed:
            self._new_detector()
        await self._emit(server_event("session.updated", session=self._session()))

    def _session(self) -> dict:
        return session_object(self.settings, self.id, self.ctx.model_name)

    async def _create_item(self, event: ev.ItemCreate) -> None:
        item = item_from(event.item, self.ctx.media)
        await self._item_added(item, self.conversation.add(item, event.previous_item_id))

    async def _item_added(self, item: Item, previous: str | None) -> None:
        for kind in ("conversation.item.added", "conversation.item.done"):
            await self._emit(server_event(kind, previous_item_id=previous, item=item.api()))

    async def _delete_item(self, event: ev.ItemDelete) -> None:
        self.conversation.delete(event.item_id)
        await self._emit(server_event("conversation.item.deleted", item_id=event.item_id))

    async def _retrieve_item(self, event: ev.ItemRetrieve) -> None:
        item = self.conversation.get(event.item_id)
        await self._emit(server_event("conversation.item.retrieved", item=item.api()))

    async def _truncate(self, event: ev.ItemTruncate) -> None:
        """Cut an answer to what the user heard: `audio_end_ms` of its audio and the matching transcript."""
        item = self.conversation.get(event.item_id)
        samples = item.audio_cut(event.content_index, event.audio_end_ms)
        if self._player.response is not None and self._player.response.item is item:
            await self._player.cancel("client_cancelled")
        item.truncate(samples)
        self.ctx.transcripts.put(item.id, item.parts[0].text)
        await self._emit(server_event("conversation.item.truncated", item_id=item.id,
                                      content_index=event.content_index, audio_end_ms=event.audio_end_ms))

    # -- responses ----------------------------------------------------------------------------------------

    async def _create_response(self, event: ev.ResponseCreate) -> None:
        await self._respond(event.response or ev.ResponseParams())

    async def _respond(self, params: ev.ResponseParams, decided: float | None = None) -> None:
        await self._player.respond(self.settings, params, self.conversation, decided)

    async def _cancel_event(self, event: ev.ResponseCancel) -> None:
        response = self._player.response
        if event.response_id is not None and (response is None or event.response_id != response.id):
            raise RealtimeError(f"response_id: no response {event.response_id!r} is in progress.",
                                "response_id", "response_cancel_not_active")
        if not await self._player.cancel("client_cancelled"):
            raise RealtimeError("Cancellation failed: no active response found.", None,
                                "response_cancel_not_active")


_HANDLERS: dict[type, Callable[[RealtimeSession, ev.ClientEvent], Awaitable[None]]] = {
    ev.SessionUpdate: RealtimeSession._update, ev.AudioAppend: RealtimeSession._append,
    ev.AudioCommit: RealtimeSession._commit_event, ev.AudioClear: RealtimeSession._clear,
    ev.ItemCreate: RealtimeSession._create_item, ev.ItemDelete: RealtimeSession._delete_item,
    ev.ItemRetrieve: RealtimeSession._retrieve_item, ev.ItemTruncate: RealtimeSession._truncate,
    ev.ResponseCreate: RealtimeSession._create_response, ev.ResponseCancel: RealtimeSession._cancel_event}
