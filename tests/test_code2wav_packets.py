"""The growing packet schedule (2, 2, 4, 8, 16, 25, ...): its rule, and packets of exactly its frames and
samples through the eager stage and the runner, shorter last chunks padded into larger shapes, exact; streams
the talker ran alone at their first frame start with `idle_initial` frames; a stream about to run dry sends the
frames it has (`dry_chunk_s`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.pipeline.code2wav import stage as code2wav_stage
from omnistage.pipeline.connector import FrameChunk, later_packet_frames, packet_frames

from code2wav_helpers import Req, Run, drive, model, samples, spy, stage
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


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("dry_chunk_s", [0.0, 0.1])
def test_a_stream_about_to_run_dry_sends_the_frames_it_has(graph: bool, dry_chunk_s: float,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Packets 2 and 2 play until 100.297 s; 3 frames of the next (4) wait while that is more than `dry_chunk_s`
    away, then 2 go (the longest later length they fill); the next packet is 4 (the longest within 6), the last
    the rest; exact. Off (0), the schedule's packets whenever the frames come."""
    now = [100.0]
    monkeypatch.setattr(code2wav_stage, "monotonic", lambda: now[0])
    st, req = stage(graph, (1, 2, 4), initial=2, chunk=25, dry_chunk_s=dry_chunk_s), Req("a")
    if graph:
        st.runner.graphs = EmulatedGraphs()
    codes = torch.randint(0, 2048, (12, 16), generator=torch.Generator().manual_seed(0))

    def step(a: int, b: int, at: float) -> list[int]:
        for f in codes[a:b]:
            st.add(FrameChunk(req, f))
        if b == len(codes):
            st.add(FrameChunk(req, finished=True))
        now[0] = at
        st.step()
        return [d.codes.shape[1] for d in req.deltas]

    assert step(0, 2, 100.0) == [2] and step(2, 4, 100.0) == [2, 2] and step(4, 7, 100.19) == [2, 2]
    assert step(7, 7, 100.2) == ([2, 2, 2] if dry_chunk_s else [2, 2])
    step(7, 12, 100.3)
    while not req.done:
        step(0, 0, 100.3)
    packets = [2, 2, 2, 4, 2] if dry_chunk_s else [2, 2, 4, 4]
    assert [d.codes.shape[1] for d in req.deltas] == packets and [d.audio.size for d in req.deltas] == samples(packets)
    whole = model()(codes.T[None])[0, 0].numpy()
    np.testing.assert_allclose(np.concatenate([d.audio for d in req.deltas]), whole, rtol=0, atol=1e-6)


def test_no_dry_chunk_while_the_stream_s_last_chunk_is_on_its_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asynchronous output: a step schedules before the previous step's chunks are emitted, so a stream's run-dry
    time then lacks its chunk in flight; its frames wait for that chunk's emit, then go as a dry chunk if still
    due."""
    now = [100.0]
    monkeypatch.setattr(code2wav_stage, "monotonic", lambda: now[0])
    st, req = stage(False, initial=2, chunk=25, dry_chunk_s=0.1, async_output=True), Req("a")
    codes = torch.randint(0, 2048, (7, 16), generator=torch.Generator().manual_seed(0))

    def step(a: int, b: int, at: float) -> list[int]:
        for f in codes[a:b]:
            st.add(FrameChunk(req, f))
        now[0] = at
        st.step()
        return [d.codes.shape[1] for d in req.deltas]

    assert step(0, 2, 100.0) == [] and step(2, 4, 100.0) == [2]  # the first emitted: it plays until 100.137
    # the second (2) on its way and 100.137 within 0.1 s: 3 frames wait rather than go; that one's emit: 100.297
    assert step(4, 7, 100.1) == [2, 2] and st.last_batch == 0
    assert step(7, 7, 100.2) == [2, 2] and st.last_batch == 1 and step(7, 7, 100.21) == [2, 2, 2]
