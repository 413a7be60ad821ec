"""What the server measured of one response (time.perf_counter, where the events go out), sent in
response.done's `response.metadata` (a string -> string map in the API) beside the client's own keys:

- `omnistage_vad_to_first_audio_ms`: input_audio_buffer.speech_stopped -> the first
  response.output_audio.delta (server VAD's turns only);
- `omnistage_first_audio_ms`: response.created -> the first audio delta;
- `omnistage_rtf`: (the last audio delta - response.created) / the seconds of audio sent (the metrics' RTF).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from omnistage.outputs import SAMPLE_RATE


@dataclass
class ResponseTimes:
    decided: float | None = None  # speech_stopped of the turn this response answers
    created: float | None = None
    first_audio: float | None = None
    last_audio: float | None = None
    samples: int = 0

    def audio(self, samples: int) -> None:
        """An audio delta goes out now."""
        now = time.perf_counter()
        self.first_audio = now if self.first_audio is None else self.first_audio
        self.last_audio, self.samples = now, self.samples + samples

    def metadata(self) -> dict[str, str]:
        if self.first_audio is None or self.created is None:
            return {}
        out = {"omnistage_first_audio_ms": _ms(self.first_audio - self.created),
               "omnistage_rtf": f"{(self.last_audio - self.created) * SAMPLE_RATE / self.samples:.4f}"}
        if self.decided is not None:
            out["omnistage_vad_to_first_audio_ms"] = _ms(self.first_audio - self.decided)
        return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"
