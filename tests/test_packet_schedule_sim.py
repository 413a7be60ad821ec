"""scripts/packet_schedule_sim.py: the modelled stream keeps the packet schedule, and dry chunks take the stalls
that growth alone has once frames come slower than twice real time."""

from script_helpers import load_script


def test_growth_needs_twice_real_time_and_dry_chunks_do_not():
    sim = load_script("packet_schedule_sim")
    fast = [sim.stream(25.0, 0.0, 0.02, 60, seed) for seed in range(20)]
    assert all(s == 0 and p == 7 for s, _, p in fast)  # 2 2 4 8 16 25 3: the schedule's packets, none late
    slow, dry = ([sim.stream(50.0, d, 0.02, 60, seed) for seed in range(20)] for d in (0.0, 0.1))
    assert all(s > 0 for s, _, _ in slow)  # 20 frames a second against the 25 growth needs
    assert sum(s > 0 for s, _, _ in dry) <= 4 and all(p > 7 for _, _, p in dry)
