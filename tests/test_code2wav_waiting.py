"""Code2Wav with more requests than stream slots (`max_batch_size`): the later ones wait, in arrival order, outside
the inbox. (Put back into the inbox, their chunks woke the stage's own worker at once: a full stage spun, holding
the GIL, and starved the thinker and talker; on an H100 with `--deploy-config 80gb`, 16 slots, c = 64 served
~1 req/s with the GPU idle.)"""

from __future__ import annotations

import threading

import torch

from omnistage.pipeline.connector import FrameChunk

from code2wav_helpers import MAX_BATCH, Req, stage


def frame() -> torch.Tensor:
    return torch.zeros(16, dtype=torch.long)


def test_requests_past_the_slots_wait_in_order_without_waking_the_stage() -> None:
    st, reqs = stage(False), [Req(f"r{i}") for i in range(MAX_BATCH + 3)]
    st.inbox.wake = wake = threading.Event()
    for req in reqs:
        st.add(FrameChunk(req, frame()))
    wake.clear()  # NOTE: as the worker clears it before a step
    st.step()
    assert list(st.seqs) == [r.request_id for r in reqs[:MAX_BATCH]]
    assert list(st.waiting) == [r.request_id for r in reqs[MAX_BATCH:]]
    assert not wake.is_set() and st.inbox.drain() == []  # nothing put back: the worker sleeps until new input
    assert st.num_active == MAX_BATCH + 3
    st.add(FrameChunk(reqs[-1], frame()))  # a waiting request's later chunk joins its earlier one
    st.step()
    assert [len(c) for c in st.waiting.values()] == [1, 1, 2] and st.stats()["queue_depth"] >= 4
    reqs[MAX_BATCH].aborted = True
    st.abort(reqs[MAX_BATCH].request_id)
    st.add(FrameChunk(reqs[0], finished=True))
    for _ in range(20):
        st.step()
        if reqs[0].done:
            break
    st.step()  # the freed slot goes to the longest waiting request left
    assert reqs[0].done and list(st.waiting) == [reqs[-1].request_id]
    assert reqs[MAX_BATCH].request_id not in st.seqs and len(st.seqs[reqs[MAX_BATCH + 1].request_id].pending) == 1
