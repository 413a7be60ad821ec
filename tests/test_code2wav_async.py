"""Code2Wav with asynchronous output (deploy `async_output`): a step's chunks are emitted while the next step
runs. Same packets, samples and codes per request as completing each step at once; a request ends (part_done)
only after its last chunk's samples were emitted; an abort with a chunk in flight emits nothing more and its
slot serves the next stream from a clean state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.pipeline.connector import FrameChunk

from code2wav_helpers import CHUNK, INITIAL, MAX_BATCH, PLAN, Req, drive, model, samples, stage
from graph_helpers import packet_sizes


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("plan", [PLAN[:MAX_BATCH], PLAN])
def test_async_output_equals_completing_each_step(graph: bool, plan: list) -> None:
    """Bit-identical while every request has a slot from its first frame; past that (the full plan) a slot
    comes back one step later with async output, so requests join other batches: equal within 1e-6."""
    a, b = drive(stage(graph, async_output=True), plan), drive(stage(graph, async_output=False), plan)
    atol = 0 if len(plan) <= MAX_BATCH else 1e-6  # measured: 1.7e-7
    for (_, frames, abort), x, y in zip(plan, a.reqs, b.reqs, strict=True):
        if abort is None:
            packets = packet_sizes(frames, INITIAL, CHUNK, True)
            assert [d.codes.shape[1] for d in x.deltas] == [d.codes.shape[1] for d in y.deltas] == packets
            assert [d.audio.size for d in x.deltas] == samples(packets)
            assert x.events == y.events == ["audio"] * len(packets) + ["done"]  # ends after its last audio
        else:
            assert "done" not in x.events and 0 < len(x.deltas) <= len(y.deltas)
        for dx, dy in zip(x.deltas, y.deltas):
            assert np.array_equal(dx.codes, dy.codes)
            np.testing.assert_allclose(dx.audio, dy.audio, rtol=0, atol=atol)


def feed(st, req: Req, codes: torch.Tensor, finished: bool = False) -> None:
    for f in codes:
        st.add(FrameChunk(req, f))
    if finished:
        st.add(FrameChunk(req, finished=True))


@pytest.mark.parametrize("graph", [False, True])
def test_a_request_ends_one_step_after_its_last_chunk_launched(graph: bool) -> None:
    st, req = stage(graph, async_output=True), Req("r")
    feed(st, req, torch.randint(0, 2048, (INITIAL + 1, 16), generator=torch.Generator().manual_seed(1)), True)
    assert st.step() and st.seqs["r"].in_flight == 1 and not req.events  # first chunk launched
    assert st.step() and req.events == ["audio"]  # second (last) chunk launched, first emitted
    assert st.seqs["r"].in_flight == 1 and not st.seqs["r"].pending and st.seqs["r"].done
    assert st.step() and req.events == ["audio", "audio", "done"]  # nothing launched: completes the last
    assert st.pending is None and not st.seqs and not st.step()


@pytest.mark.parametrize("graph", [False, True])
def test_an_abort_with_a_chunk_in_flight_emits_nothing_and_frees_its_slot(graph: bool) -> None:
    st, gen = stage(graph, async_output=True), torch.Generator().manual_seed(2)
    a, b = Req("a"), Req("b")
    feed(st, a, torch.randint(0, 2048, (INITIAL, 16), generator=gen))
    assert st.step() and st.pending is not None and st.seqs["a"].in_flight == 1
    slot = st.seqs["a"].state.slot
    st.abort("a")
    assert slot in st.streamer.cache.free_slots
    codes = torch.randint(0, 2048, (INITIAL + 7, 16), generator=gen)
    feed(st, b, codes, True)
    assert st.step() and st.seqs["b"].state.slot == slot  # completed a's chunk; b took its slot
    while st.step():
        pass
    assert not a.events and b.events[-1] == "done" and not st.seqs and st.pending is None
    alone = model()(codes.T[None])[0, 0].numpy()
    np.testing.assert_allclose(np.concatenate([d.audio for d in b.deltas]), alone, rtol=0, atol=1e-5)
