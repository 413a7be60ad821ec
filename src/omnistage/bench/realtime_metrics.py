"""Per-turn timings of a realtime session on the client, and one result row per (sessions, clip).

All times are perf_counter() seconds. A turn: its speech's last append went out (`speech_end`), the server's
`input_audio_buffer.speech_stopped` came (`vad_stop`), then its answer's `response.output_audio.delta`s
(time, samples) and `response.done` (status). Playback starts at the first delta and plays in real time;
a stall is a delta that comes after everything before it has played (metrics.playback_stalls). A barge-in
turn's answer is interrupted by the next turn's speech, whose first append went out at `barge_send`:
barge-in -> silence is the answer's last delta after that (0 when none came after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage.bench.metrics import _stats, playback_stalls
from omnistage.outputs import SAMPLE_RATE

# metric -> (unit scale from seconds, row key stem)
TURN_METRICS = {"speech_end_to_vad": (1e3, "speech_end_to_vad_ms"),
                "vad_to_first_audio": (1e3, "vad_to_first_audio_ms"),
                "speech_end_to_first_audio": (1e3, "speech_end_to_first_audio_ms"),
                "rtf": (1.0, "rtf"), "stall_s": (1e3, "stall_ms"), "stalls": (1.0, "stalls"),
                "barge_in_to_silence": (1e3, "barge_in_to_silence_ms")}


@dataclass
class Turn:
    speech_end: float | None = None
    vad_stop: float | None = None
    deltas: list[tuple[float, int]] = field(default_factory=list)  # (arrival, samples)
    done: float | None = None
    status: str | None = None  # response.done's status
    barge_send: float | None = None  # the interrupting speech's first append (barge-in turns)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.done is not None and bool(self.deltas)

    @property
    def audio_s(self) -> float:
        return sum(n for _, n in self.deltas) / SAMPLE_RATE

    def stalls(self) -> tuple[int, float]:
        """(count, seconds) of playback stalls (the first delta starts playback: never a stall)."""
        return playback_stalls(*zip(*self.deltas))

    def values(self) -> dict[str, list[float]]:
        first = self.deltas[0][0]
        out = {"speech_end_to_vad": [self.vad_stop - self.speech_end],
               "vad_to_first_audio": [first - self.vad_stop],
               "speech_end_to_first_audio": [first - self.speech_end]}
        if self.barge_send is None:
            count, stalled = self.stalls()
            rtf = (self.deltas[-1][0] - self.vad_stop) / self.audio_s
            out.update(rtf=[rtf], stall_s=[stalled], stalls=[count])
        else:
            out["barge_in_to_silence"] = [max(0.0, self.deltas[-1][0] - self.barge_send)]
        return out


def summarize_turns(turns: list[Turn], *, sessions: int, clip: str, turn_s: float, idle_sessions: int,
                    start: float, end: float) -> dict:
    """One row (workload "realtime"): counts and mean/p50/p90/p99 of every turn metric."""
    done = [t for t in turns if t.ok]
    barge = [t for t in done if t.barge_send is not None]
    row: dict = {"backend": "omnistage", "workload": "realtime", "concurrency": sessions, "clip": clip,
                 "turn_s": turn_s, "idle_sessions": idle_sessions, "num_turns": len(done),
                 "failed": len(turns) - len(done), "duration_s": end - start,
                 "mean_audio_s": sum(t.audio_s for t in done) / len(done) if done else None,
                 "barge_in_turns": len(barge), "barge_in_cancelled": sum(t.status == "cancelled" for t in barge)}
    per_turn = [t.values() for t in done]
    for name, (scale, stem) in TURN_METRICS.items():
        row.update(_stats([v for vals in per_turn for v in vals.get(name, [])], scale, stem))
    errors = sorted({t.error for t in turns if t.error})
    if errors:
        row["errors"] = errors[:5]
    return row


def is_realtime(row: dict) -> bool:
    return row.get("workload") == "realtime"
