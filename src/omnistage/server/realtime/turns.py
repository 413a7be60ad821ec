"""OpenAI server_vad turns from silero's per-window speech probabilities, with silero's hysteresis (as its
VADIterator / get_speech_timestamps)."""

from __future__ import annotations

from dataclasses import dataclass

RATE = 16000  # the probabilities' windows are counted in 16 kHz samples
NEG_THRESHOLD_GAP = 0.15  # silero's VADIterator / get_speech_timestamps: below threshold - 0.15 is silence
PAUSE_MS = 150  # silence before a turn's end is prepared (at most half the silence that ends it)
OURS = ("speech_paused", "speech_resumed")  # not OpenAI's: the session's own


@dataclass
class ServerVad:
    """A session's `turn_detection` settings (OpenAI `server_vad`)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


@dataclass
class TurnEvent:
    type: str  # "speech_started" | "speech_stopped" | ours: "speech_paused" (the turn may end there),
    # "speech_resumed" (it did not: speech after a reported pause)
    audio_ms: int  # from the start of all audio fed to the detector (OpenAI's audio_start_ms / audio_end_ms)


class TurnState:
    """Whether someone speaks, window by window."""

    def __init__(self, params: ServerVad) -> None:
        self.params = params
        self._speaking = False
        self._silence_from: int | None = None  # where the current silence began, while speaking
        self._paused = False  # this silence was reported as a pause

    def step(self, start: int, end: int, prob: float) -> TurnEvent | None:
        """One window's probability (the window spans 16 kHz samples [start, end)) through the turn state."""
        p = self.params
        if prob >= p.threshold:
            self._silence_from = None
            if self._paused:
                self._paused = False
                return TurnEvent("speech_resumed", _ms(start))
            if not self._speaking:
                self._speaking = True
                return TurnEvent("speech_started", max(0, _ms(start) - p.prefix_padding_ms))
        elif self._speaking and prob < max(p.threshold - NEG_THRESHOLD_GAP, 0.01):
            if self._silence_from is None:
                self._silence_from, self._paused = start, False
            heard = _ms(end - self._silence_from)
            if heard >= p.silence_duration_ms:  # heard the whole silence
                end, self._speaking, self._silence_from, self._paused = _ms(self._silence_from), False, None, False
                return TurnEvent("speech_stopped", end)
            if not self._paused and heard >= min(PAUSE_MS, p.silence_duration_ms // 2):
                self._paused = True
                return TurnEvent("speech_paused", _ms(self._silence_from))
        return None


def _ms(samples: int) -> int:
    return samples * 1000 // RATE
