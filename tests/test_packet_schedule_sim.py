"""scripts/packet_schedule_sim.py: the modelled stream keeps the packet schedule, and stalls once frames come
slower than the twice real time that growth needs."""

from script_helpers import load_script


def test_growth_needs_twice_real_time():
    sim = load_script("packet_schedule_sim")
    fast = [sim.stream(25.0, 0.02, 60, seed) for seed in range(20)]
    assert all(s == 0 and p == 7 for s, _, p in fast)  # 2 2 4 8 16 25 3: the schedule's packets, none late
    slow = [sim.stream(50.0, 0.02, 60, seed) for seed in range(20)]
    assert all(s > 0 and p == 7 for s, _, p in slow)  # 20 frames a second against the 25 growth needs
