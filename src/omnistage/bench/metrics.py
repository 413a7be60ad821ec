"""Per-request timings on the client, and one result row per (backend, prompt length, concurrency).

Times are seconds after the request was sent. TTFT = first text delta, TTFP = first audio chunk,
RTF = last audio chunk / audio seconds (below 1 is faster than real time), E2E = end of the stream,
ITL = gaps between text deltas, ICG = gaps between audio chunks (both pooled over a row's requests).
Stalls are a listener's: playback starts at the first audio chunk and plays in real time; a chunk that comes
after all the audio before it has played out is a stall, of the time the listener waited (`playback_stalls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omnistage.outputs import SAMPLE_RATE

PERCENTILES = (50, 90, 99)
MAX_STALL_EVENTS = 500
# metric -> (unit scale from seconds, row key stem)
_METRICS = {"ttft": (1e3, "ttft_ms"), "ttfp": (1e3, "ttfp_ms"), "e2e": (1e3, "e2e_ms"), "rtf": (1.0, "rtf"),
            "itl": (1e3, "itl_ms"), "icg": (1e3, "icg_ms"), "stall": (1e3, "stall_ms")}


def late_chunks(times: Sequence[float], samples: Sequence[int]) -> list[tuple[int, float]]:
    """(index, seconds waited) of each chunk of `samples` arriving at `times` (seconds) after all the audio
    before it played out, played from the first one on (which is never late)."""
    late, play_end = [], times[0] if times else 0.0
    for i, (t, n) in enumerate(zip(times, samples, strict=True)):
        if t > play_end:
            late.append((i, t - play_end))
            play_end = t
        play_end += n / SAMPLE_RATE
    return late


def playback_stalls(times: Sequence[float], samples: Sequence[int]) -> tuple[int, float]:
    """(count, seconds) of the stalls of `late_chunks`."""
    late = late_chunks(times, samples)
    return len(late), sum(wait for _, wait in late)


@dataclass
class RequestResult:
    send: float = 0.0  # perf_counter() when the request went out
    ok: bool = False
    error: str = ""
    text_times: list[float] = field(default_factory=list)
    audio_times: list[float] = field(default_factory=list)
    audio_samples: int = 0
    audio_chunks: list[int] = field(default_factory=list)  # samples of each audio chunk (audio_times')
    end: float = 0.0
    prompt_tokens: int | None = None  # as the server counted them (usage)
    output_tokens: int | None = None  # text tokens (usage)

    @property
    def audio_s(self) -> float:
        return self.audio_samples / SAMPLE_RATE

    @property
    def finish(self) -> float:
        """perf_counter() at the end of the stream."""
        return self.send + self.end

    def values(self) -> dict[str, list[float]]:
        """Each metric's values in seconds (RTF unitless); lists, since a request has many gaps."""
        out: dict[str, list[float]] = {"e2e": [self.end], "itl": list(np.diff(self.text_times)),
                                       "icg": list(np.diff(self.audio_times))}
        out["ttft"] = self.text_times[:1]
        out["ttfp"] = self.audio_times[:1]
        out["rtf"] = [self.audio_times[-1] / self.audio_s] if self.audio_times and self.audio_samples else []
        out["stall"] = [playback_stalls(self.audio_times, self.audio_chunks)[1]] if self.audio_chunks else []
        return out


def stall_spread(results: Sequence[RequestResult], start: float, duration: float) -> dict[str, list]:
    """Where a row's stalls fall: counts by the late chunk's index (1, 2, 3, 4 and later) and by the tenth of
    the row's duration it arrived in (a burst's start against steady load); and each stall as [perf_counter()
    when the audio ran out, ms waited, chunk index], in time order (the first `MAX_STALL_EVENTS`): the server's
    step trace (OMNISTAGE_STEP_TRACE) on the same host has the same clock."""
    by_chunk, by_tenth, events = [0] * 4, [0] * 10, []
    for r in results:
        for i, wait in late_chunks(r.audio_times, r.audio_chunks) if r.audio_chunks else ():
            by_chunk[min(i, 4) - 1] += 1
            at = (r.send + r.audio_times[i] - start) / duration if duration > 0 else 0.0
            by_tenth[min(max(int(10 * at), 0), 9)] += 1
            events.append([round(r.send + r.audio_times[i] - wait, 4), round(1e3 * wait, 1), i])
    return {"stalls_by_chunk": by_chunk, "stalls_by_tenth": by_tenth,
            "stall_events": sorted(events)[:MAX_STALL_EVENTS]}


def _stats(values: list[float], scale: float, stem: str) -> dict[str, float | None]:
    if not values:
        return {f"mean_{stem}": None, **{f"p{p}_{stem}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * scale
    return {f"mean_{stem}": float(a.mean()), **{f"p{p}_{stem}": float(np.percentile(a, p)) for p in PERCENTILES}}


def _mean(values: list[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def summarize(results: list[RequestResult], *, backend: str, concurrency: int, prompt_tokens: int,
              start: float, cancelled: int = 0) -> dict:
    """One row: counts, throughput over [start, last finish], mean/p50/p90/p99 of every metric (stall_ms:
    each stream's stalled seconds, over all streams), the streams that stalled and their seconds and where the
    stalls fall (`stall_spread`), and the TTFP of the request sent first (against the mean: what a cold start costs)."""
    done = [r for r in results if r.ok]
    duration = max((r.finish for r in done), default=start) - start
    audio_s = sum(r.audio_s for r in done)
    row: dict = {
        "backend": backend, "concurrency": concurrency, "prompt_tokens": prompt_tokens,
        "num_requests": len(done), "failed": len(results) - len(done), "cancelled": cancelled,
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "audio_throughput": audio_s / duration if duration > 0 else None,
        "total_audio_s": audio_s,
        "mean_audio_s": audio_s / len(done) if done else None,
        "mean_server_prompt_tokens": _mean([r.prompt_tokens for r in done]),
        "mean_output_tokens": _mean([r.output_tokens for r in done]),
    }
    per_request = [r.values() for r in done]
    for name, (scale, stem) in _METRICS.items():
        row.update(_stats([v for vals in per_request for v in vals[name]], scale, stem))
    stalls = [vals["stall"][0] for vals in per_request if vals["stall"]]
    row.update(stalled_streams=sum(s > 0 for s in stalls), stall_s=sum(stalls),
               max_stall_ms=1e3 * max(stalls) if stalls else None, **stall_spread(done, start, duration))
    first = min(done, key=lambda r: r.send, default=None)
    row["first_ttfp_ms"] = 1e3 * first.audio_times[0] if first and first.audio_times else None
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        row["errors"] = errors[:5]
    return row
