"""The growing packet schedule (2, 2, 4, 8, 16, 25, ...): its rule, and packets of exactly its frames and
samples through the eager stage and the runner, shorter last chunks padded into larger shapes, exact; streams
the talker ran alone at their first frame start with `idle_initial` frames."""

from __future__ import annotations

import numpy as np

from omnistage.pipeline.connector import later_packet_frames, packet_frames

from code2wav_helpers import Run, drive, model, samples, spy, stage
from graph_helpers import EmulatedGraphs, packet_sizes


def test_packet_schedule() -> None:
    assert [packet_frames(e, 2, 25, True) for e in (0, 2, 4, 8, 16, 32, 57)] == [2, 2, 4, 8, 16, 25, 25]
    assert packet_sizes(132, 2, 25, True) == [2, 2, 4, 8, 16, 25, 25, 25, 25]
    assert packet_sizes(79, 4, 25, False) == [4, 25, 25, 25] and packet_sizes(40, 2, 25, True)[-1] == 8
    assert later_packet_frames(2, 25, True) == [2, 4, 8, 16, 25] and later_packet_frames(4, 25, False) == [25]
    assert later_packet_frames(4, 3, True) == [3]


GROWING = {43: [2, 2, 4, 8, 16, 11], 40: [2, 2, 4, 8, 16, 8], 3: [2, 1], 1: [1]}  # frames -> packets


def eager_and_runner(plan: list, shapes: dict, alone: frozenset[int] = frozenset(), **kw) -> tuple[Run, Run, set]:
    """The plan through the eager stage and through the runner (emulated graphs, which must have `shapes`):
    both runs and the runner's padded chunks {(shape, frames)}."""
    eager = drive(stage(False, (1, 2, 4), **kw), plan, alone)
    st = stage(True, (1, 2, 4), **kw)
    st.runner.graphs = EmulatedGraphs()
    assert st.runner.shapes == shapes
    with spy(st.runner) as steps:
        graphed = drive(st, plan, alone)
    return eager, graphed, {(shape, n) for _, _, shape, lens in steps for n in lens if n < shape[0]}


def assert_exact(packets: list[list[int]], a: Run, b: Run) -> None:
    """Both runs' requests got `packets` (frames per packet) of exactly their samples, the same audio, and the
    audio of their codes decoded whole."""
    for expected, x, y, codes in zip(packets, a.reqs, b.reqs, a.codes):
        for req in (x, y):
            assert [d.codes.shape[1] for d in req.deltas] == expected
            assert [d.audio.size for d in req.deltas] == samples(expected) and req.done
        for dx, dy in zip(x.deltas, y.deltas):
            np.testing.assert_allclose(dx.audio, dy.audio, rtol=0, atol=1e-6)  # measured: 3.3e-7
        whole = model()(codes.T[None])[0, 0].numpy()
        np.testing.assert_allclose(np.concatenate([d.audio for d in x.deltas]), whole, rtol=0, atol=1e-6)


def test_growing_packets_are_exact() -> None:
    """Initial 2, cap 25, growth: packets of exactly the schedule's frames and samples, eager and through the
    runner; shorter last chunks (11, 1 later, 1 first) run padded in the next larger shape."""
    eager, graphed, padded = eager_and_runner([(0, n, None) for n in GROWING],
                                              {True: [2], False: [2, 4, 8, 16, 25]}, initial=2, chunk=25)
    assert padded == {((16, False), 11), ((2, False), 1), ((2, True), 1)}
    assert list(GROWING.values()) == [packet_sizes(n, 2, 25, True) for n in GROWING]
    assert_exact(list(GROWING.values()), graphed, eager)


def test_streams_the_talker_ran_alone_start_with_the_idle_initial_packet() -> None:
    """Idle initial 1 beside initial 2: the streams whose first frame came alone get 1, 1, 2, 4, ..., the others
    2, 2, 4, ...; the runner holds both first shapes and the later 1, exact as above."""
    alone = frozenset({0, 2, 3})
    shapes = {True: [1, 2], False: [1, 2, 4, 8, 16, 25]}
    eager, graphed, padded = eager_and_runner([(0, n, None) for n in GROWING], shapes, alone, initial=2, chunk=25,
                                              idle_initial=1)
    packets = [packet_sizes(n, 1 if i in alone else 2, 25, True) for i, n in enumerate(GROWING)]
    assert packets == [[1, 1, 2, 4, 8, 16, 11], [2, 2, 4, 8, 16, 8], [1, 1, 1], [1]]
    assert padded == {((16, False), 11)}
    assert_exact(packets, graphed, eager)
