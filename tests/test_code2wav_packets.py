"""The growing packet schedule (2, 2, 4, 8, 16, 25, ...): its rule, and packets of exactly its frames and
samples through the eager stage and the runner, shorter last chunks padded into larger shapes, exact."""

from __future__ import annotations

import numpy as np

from omnistage.pipeline.connector import later_packet_frames, packet_frames

from code2wav_helpers import drive, model, samples, spy, stage
from graph_helpers import EmulatedGraphs, packet_sizes


def test_packet_schedule() -> None:
    assert [packet_frames(e, 2, 25, True) for e in (0, 2, 4, 8, 16, 32, 57)] == [2, 2, 4, 8, 16, 25, 25]
    assert packet_sizes(132, 2, 25, True) == [2, 2, 4, 8, 16, 25, 25, 25, 25]
    assert packet_sizes(79, 4, 25, False) == [4, 25, 25, 25] and packet_sizes(40, 2, 25, True)[-1] == 8
    assert later_packet_frames(2, 25, True) == [2, 4, 8, 16, 25] and later_packet_frames(4, 25, False) == [25]
    assert later_packet_frames(4, 3, True) == [3]


GROWING = {43: [2, 2, 4, 8, 16, 11], 40: [2, 2, 4, 8, 16, 8], 3: [2, 1], 1: [1]}  # frames -> packets


def test_growing_packets_are_exact() -> None:
    """Initial 2, cap 25, growth: packets of exactly the schedule's frames and samples, eager and through the
    runner; shorter last chunks (11, 1 later, 1 first) run padded in the next larger shape."""
    plan = [(0, n, None) for n in GROWING]
    ran = {}
    for graph in (False, True):
        st = stage(graph, (1, 2, 4), initial=2, chunk=25)
        if graph:
            st.runner.graphs = EmulatedGraphs()
            assert st.runner.shapes == {True: [2], False: [2, 4, 8, 16, 25]}
            with spy(st.runner) as steps:
                ran[graph] = drive(st, plan)
        else:
            ran[graph] = drive(st, plan)
    padded = {(shape, n) for _, _, shape, lens in steps for n in lens if n < shape[0]}
    assert padded == {((16, False), 11), ((2, False), 1), ((2, True), 1)}
    for (frames, packets), a, b, codes in zip(GROWING.items(), ran[True].reqs, ran[False].reqs, ran[True].codes):
        for req in (a, b):
            assert [d.codes.shape[1] for d in req.deltas] == packets == packet_sizes(frames, 2, 25, True)
            assert [d.audio.size for d in req.deltas] == samples(packets) and req.done
        for x, y in zip(a.deltas, b.deltas):
            np.testing.assert_allclose(x.audio, y.audio, rtol=0, atol=1e-6)  # measured: 3.3e-7
        alone = model()(codes.T[None])[0, 0].numpy()
        np.testing.assert_allclose(np.concatenate([d.audio for d in a.deltas]), alone, rtol=0, atol=1e-6)
