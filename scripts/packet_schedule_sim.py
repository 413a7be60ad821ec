"""A listener's stalls under the packet schedule, modelled: one stream's frames come a talker step apart (steps of
`--step-ms`, +-35 % normal jitter), code2wav looks every 8 ms and sends what `connector.PacketSchedule` (as the
stage) says, a chunk reaches the listener `--latency-ms` after it goes; playback starts at the first chunk.
Growth (each packet as long as all the audio before it) needs frames at twice real time, 25 a second: a model to
predict with, not a measurement (benchmarks/HISTORY.md, thirty-third and thirty-fourth sections).

    python scripts/packet_schedule_sim.py [--step-ms 25,40,50] [--frames 60] [--streams 200]"""

from __future__ import annotations

import argparse
import random

from omnistage.pipeline.connector import PacketSchedule

FRAME_S, FIRST_TRIM_S, LOOK_S = 0.08, 555 / 24000, 0.008


def stream(step_ms: float, latency_s: float, frames: int, seed: int, initial: int = 2,
           cap: int = 25) -> tuple[int, float, int]:
    """(stalls, seconds waited, packets) of one stream."""
    rnd, schedule = random.Random(seed), PacketSchedule.of([initial], cap, True)
    t, arrivals = 0.0, []
    for _ in range(frames):
        t += max(0.005, rnd.gauss(step_ms, 0.35 * step_ms)) / 1e3
        arrivals.append(t)
    now, emitted, play_end, stalls, waited, packets = 0.0, 0, None, 0, 0.0, 0
    while emitted < frames:
        now += LOOK_S
        got = sum(a <= now for a in arrivals)
        n, _ = schedule.next_chunk(emitted, initial, got - emitted, got == frames)
        if not n:
            continue
        reach = now + latency_s
        if play_end is not None and reach > play_end:
            stalls, waited = stalls + 1, waited + reach - play_end
        play_end = max(play_end or reach, reach) + n * FRAME_S - (FIRST_TRIM_S if not emitted else 0.0)
        emitted, packets = emitted + n, packets + 1
    return stalls, waited, packets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", default="25,35,40,45,50,55,65")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--streams", type=int, default=200)
    args = ap.parse_args()
    for step in map(float, args.step_ms.split(",")):
        runs = [stream(step, args.latency_ms / 1e3, args.frames, s) for s in range(args.streams)]
        print(f"steps {step:4.0f} ms: {sum(r[0] > 0 for r in runs)} of {len(runs)} streams stalled, "
              f"{1e3 * sum(r[1] for r in runs) / len(runs):5.0f} ms waited a stream, "
              f"{sum(r[2] for r in runs) / len(runs):4.1f} packets")


if __name__ == "__main__":
    main()
