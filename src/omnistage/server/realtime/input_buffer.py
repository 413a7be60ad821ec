"""A session's input audio buffer: 24 kHz s16le appended by the client, bounded, addressed by session sample
(samples appended since the session began), so turn detection's times map onto it."""

from __future__ import annotations

from omnistage.outputs import SAMPLE_RATE
from omnistage.server.realtime.events import RealtimeError

MIN_COMMIT_MS = 100  # as OpenAI: a shorter buffer cannot be committed


class InputAudioBuffer:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pcm = bytearray()
        self.origin = 0  # the session sample of pcm[0]
        self.end = 0  # samples appended in this session

    def append(self, pcm: bytes) -> None:
        """A RealtimeError (and the buffer unchanged) when it would outgrow `max_bytes`."""
        if len(self.pcm) + len(pcm) > self.max_bytes:
            seconds = self.max_bytes / 2 / SAMPLE_RATE
            raise RealtimeError(f"audio: the input audio buffer would hold more than this server's "
                                f"{seconds:g} s (commit or clear it); this append was not added.", "audio",
                                "input_audio_buffer_full")
        self.pcm += pcm
        self.end += len(pcm) // 2

    def drop_until(self, sample: int) -> None:
        """Forget the audio before session sample `sample`."""
        if sample > self.origin:
            del self.pcm[:(min(sample, self.end) - self.origin) * 2]
            self.origin = min(sample, self.end)

    def take_until(self, sample: int) -> bytes:
        """The audio before session sample `sample`, taken out of the buffer."""
        pcm = bytes(self.pcm[:max(sample - self.origin, 0) * 2])
        self.drop_until(sample)
        return pcm

    def take_all(self) -> bytes:
        """Everything, for a manual commit (at least MIN_COMMIT_MS of it)."""
        if len(self.pcm) < MIN_COMMIT_MS * SAMPLE_RATE // 1000 * 2:
            ms = len(self.pcm) // 2 * 1000 // SAMPLE_RATE
            raise RealtimeError(f"Error committing input audio buffer: buffer too small. Expected at least "
                                f"{MIN_COMMIT_MS}ms of audio, but buffer only has {ms}ms of audio.", None,
                                "input_audio_buffer_commit_empty")
        return self.take_until(self.end)

    def clear(self) -> None:
        self.drop_until(self.end)
