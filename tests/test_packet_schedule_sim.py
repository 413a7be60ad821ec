"""scripts/packet_schedule_sim.py: the modelled stream keeps the packet schedule, and stalls once frames come
slower than the twice real time that growth needs; a burst's slow ramp stalls the streams that start in it,
fewer with a longer first packet."""

from script_helpers import load_script


def test_growth_needs_twice_real_time():
    sim = load_script("packet_schedule_sim")
    fast = [sim.stream(25.0, 0.02, 60, seed) for seed in range(20)]
    assert all(s == 0 and p == 7 for s, _, p, _ in fast)  # 2 2 4 8 16 25 3: the schedule's packets, none late
    slow = [sim.stream(50.0, 0.02, 60, seed) for seed in range(20)]
    assert all(s > 0 and p == 7 for s, _, p, _ in slow)  # 20 frames a second against the 25 growth needs


def test_a_slow_ramp_stalls_the_streams_that_start_in_it():
    sim = load_script("packet_schedule_sim")
    inside = (0.6, 100.0, 1.0)  # every stream's first frame inside a 0.6 s ramp of 100 ms steps
    runs = {n: [sim.stream(25.0, 0.02, 80, seed, n, ramp=inside) for seed in range(40)] for n in (2, 4)}
    stalled = {n: sum(r[0] > 0 for r in rs) for n, rs in runs.items()}
    assert stalled[2] >= 20 and stalled[4] < stalled[2] / 2, stalled
    first = {n: sum(r[3] for r in rs) / len(rs) for n, rs in runs.items()}
    assert first[4] > first[2] + 0.1, first  # two more frames at 100 ms steps before the first chunk
