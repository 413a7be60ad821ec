"""The thinker's arrivals (`pipeline/thinker/arrivals.py`): with the encoders on a CUDA stream of their own
(`encoder_stream`) an arrival is admitted once its encoders finished, or at once when nothing else runs; the
same tokens, codes and audio as encoders in the thinker's step (GPU)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from mm_samples import TINY, image, tone, video

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.pipeline.thinker.arrivals import Arrival, Arrivals


class Pending:
    """An encoders' event the stream has not reached yet (until `reached`)."""

    def __init__(self) -> None:
        self.reached = False

    def query(self) -> bool:
        return self.reached


def arrival(done: Pending | None) -> Arrival:
    a = Arrival([], [], [], [])
    a.done = done
    return a


def test_arrivals_wait_for_their_encoders_in_order_unless_nothing_else_runs() -> None:
    queue = Arrivals(torch.device("cpu"), encoder_stream=True)
    assert queue.stream is None  # the CPU has no streams: encoders run in the thinker's step
    event = Pending()
    first, second, third = arrival(event), arrival(None), arrival(Pending())
    queue.queue.extend([first, second])
    assert queue.ready(wait=False) == []  # the second waits behind the first
    event.reached = True
    queue.queue.append(third)
    assert queue.ready(wait=False) == [first, second]
    assert queue.ready(wait=True) == [third] and not queue.queue  # the thinker idle: its stream waits instead


@functools.cache
def omni_cuda(encoder_stream: bool) -> Omni:
    """bf16 with graphs (the encoders' graphs are the thinker's `cuda_graph`; float32 experts are not capturable)."""
    d = tiny_checkpoint("tiny")
    small = {"kv_cache_memory": 2**26, "cuda_graph_batch_sizes": [1, 2, 4], "cuda_graph_capture_widths": []}
    cfg = load_deploy_config(default_deploy_config(d), platform="cuda", stage_overrides={
        "thinker": {**small, "encoder_stream": encoder_stream}, "talker": small},
        overrides={"placement": "local"})
    return Omni(d, deploy=cfg, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_the_encoders_stream_gives_the_same_answers() -> None:
    """Each conversation alone: equal answers (one row a step either way). Together: the same lengths (rows
    admitted in other steps may round otherwise in bf16)."""
    convs = [[{"role": "user", "content": [part, "What is this?"]}] for part in (
        {"type": "audio", "audio": tone(1.1)}, {"type": "image", "image": image(3, 30, 44)},
        {"type": "video", "video": video(4, 4, 1.0, 1.5), **TINY}, "Say hello.")]
    kw = dict(sampling={"temperature": 0, "max_tokens": 6, "ignore_eos": True},
              talker_sampling={"temperature": 0, "max_frames": 8, "ignore_eos": True})
    alone = [[omni_cuda(on).chat(c, **kw) for c in convs] for on in (False, True)]
    assert omni_cuda(True).engine.thinker.arrivals.stream is not None
    assert omni_cuda(True).engine.thinker.vision is not None and omni_cuda(True).engine.thinker.audio is not None
    for a, b in zip(*alone):
        assert a.token_ids == b.token_ids and np.array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.audio, b.audio)
    together = omni_cuda(True).chat(convs, **kw)
    assert [len(o.token_ids) for o in together] == [6] * 4 and [o.codes.shape[1] for o in together] == [8] * 4
