"""A listener's stalls under the packet schedule, modelled: one stream's frames come a step apart (steps of
`--step-ms`, +-35 % normal jitter), code2wav looks every 8 ms and sends what `connector.PacketSchedule` (as the
stage) says, a chunk reaches the listener `--latency-ms` after it goes; playback starts at the first chunk.
Growth (each packet as long as all the audio before it) needs frames at twice real time, 25 a second.
A burst's ramp (`--ramp-s` > 0): for its first seconds the steps are `--ramp-step-ms` (a running stream's frame
waits for the thinker's next text row, and the thinker's steps carry the burst's prompts), and `--ramp-share`
of the streams make their first frame within it (uniformly), the rest after it. A model to predict with, not a
measurement (benchmarks/HISTORY.md, thirty-third, thirty-fourth and thirty-sixth sections).

    python scripts/packet_schedule_sim.py [--step-ms 25,40,50] [--initial 2,4] [--frames 60] [--streams 200]
    python scripts/packet_schedule_sim.py --step-ms 25 --ramp-s 0.6 --ramp-step-ms 100 --ramp-share 0.25"""

from __future__ import annotations

import argparse
import itertools
import random

from omnistage.pipeline.connector import PacketSchedule

FRAME_S, FIRST_TRIM_S, LOOK_S = 0.08, 555 / 24000, 0.008


def arrivals(rnd: random.Random, step_ms: float, frames: int, ramp: tuple[float, float, float]) -> list[float]:
    """When each of a stream's frames is there: its first step starts inside the ramp for `share` of streams."""
    ramp_s, ramp_ms, share = ramp
    t = rnd.uniform(0, ramp_s / share) if ramp_s else 0.0
    out = []
    for _ in range(frames):
        step = ramp_ms if t < ramp_s else step_ms
        t += max(0.005, rnd.gauss(step, 0.35 * step)) / 1e3
        out.append(t)
    return out


def stream(step_ms: float, latency_s: float, frames: int, seed: int, initial: int = 2, cap: int = 25,
           ramp: tuple[float, float, float] = (0.0, 0.0, 1.0)) -> tuple[int, float, int, float]:
    """(stalls, seconds waited, packets, seconds from the first step's start to the first chunk's arrival)."""
    rnd, schedule = random.Random(seed), PacketSchedule.of([initial], cap, True)
    arrived = arrivals(rnd, step_ms, frames, ramp)
    begin = arrived[0] - (arrived[1] - arrived[0] if frames > 1 else 0.0)
    now, emitted, play_end, stalls, waited, packets, first = begin, 0, None, 0, 0.0, 0, 0.0
    while emitted < frames:
        now += LOOK_S
        got = sum(a <= now for a in arrived)
        n, _ = schedule.next_chunk(emitted, initial, got - emitted, got == frames)
        if not n:
            continue
        reach = now + latency_s
        if play_end is not None and reach > play_end:
            stalls, waited = stalls + 1, waited + reach - play_end
        first = first or reach - begin
        play_end = max(play_end or reach, reach) + n * FRAME_S - (FIRST_TRIM_S if not emitted else 0.0)
        emitted, packets = emitted + n, packets + 1
    return stalls, waited, packets, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", default="25,35,40,45,50,55,65")
    ap.add_argument("--initial", default="2", help="first packets' frames, comma-separated")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--ramp-s", type=float, default=0.0)
    ap.add_argument("--ramp-step-ms", type=float, default=100.0)
    ap.add_argument("--ramp-share", type=float, default=0.25)
    args = ap.parse_args()
    ramp = (args.ramp_s, args.ramp_step_ms, args.ramp_share)
    for initial, step in itertools.product(map(int, args.initial.split(",")), map(float, args.step_ms.split(","))):
        runs = [stream(step, args.latency_ms / 1e3, args.frames, s, initial, ramp=ramp) for s in range(args.streams)]
        print(f"initial {initial}, steps {step:4.0f} ms: {sum(r[0] > 0 for r in runs)} of {len(runs)} stalled, "
              f"{1e3 * sum(r[1] for r in runs) / len(runs):5.0f} ms waited a stream, "
              f"{sum(r[2] for r in runs) / len(runs):4.1f} packets, "
              f"first chunk {1e3 * sum(r[3] for r in runs) / len(runs):4.0f} ms after the first step began")


if __name__ == "__main__":
    main()
