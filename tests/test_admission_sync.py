"""A request joining a loaded thinker must not wait for the step in flight: admission (its encoders, prompt
embeddings and positions) and its talker prompt launch work without a host sync (CUDA only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from mm_samples import image, tone
from test_prefill_graph import PROMPTS, omni_cuda

from omnistage.engine.request import Request

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")


def request(o, request_id: str, content) -> Request:
    return o.engine.make_request(request_id, [{"role": "user", "content": content}], None, want_audio=True,
                                 voice="Ethan", sampling={"max_tokens": 4}, talker_sampling={"max_frames": 4},
                                 emit=lambda d: None)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """A host sync inside raises (the device idle first, so nothing in flight is waited on by accident)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_admission_and_talker_prompt_do_not_sync_the_device() -> None:
    # a request joining a loaded stage must not wait for the step in flight: its ids stay on the host
    from omnistage.models.qwen3_omni.talker_prompt_rows import (
        prompt_embeds,
        prompt_embeds_batch,
        prompt_source,
    )

    o = omni_cuda()
    thinker, talker = o.engine.thinker, o.engine.talkers[0]  # idle workers: nothing else admits meanwhile
    req = request(o, "sync", PROMPTS[1])
    with no_host_sync():
        seq = thinker._admit(req, media=(None, None, None))
        slot = thinker.penalties.acquire(seq.prompt_ids)
        embeds = seq.embeds.to(talker.dtype)
        rows = prompt_embeds(talker.talker, talker.tokens, seq.prompt_ids, embeds, None, embeds[-1], "Ethan")
        source = prompt_source(talker.tokens, seq.prompt_ids, embeds, None, embeds[-1], "Chelsie")
        pair = prompt_embeds_batch(talker.talker, talker.tokens, [source, source])
    thinker.penalties.release(slot)
    assert not seq.prompt_ids.is_cuda and not seq.has_mm and rows.is_cuda and rows.shape[0] > 9
    assert pair[0].shape == rows.shape and torch.equal(pair[0], pair[1]) and not torch.equal(pair[0], rows)


def test_an_early_talker_prompt_does_not_sync_the_device() -> None:
    # sent at admission (connector.talker_prompt_at_admission): an event orders the embeddings, not a sync
    from omnistage.models.qwen3_omni.talker_prompt_rows import first_token_row, prompt_embeds, prompt_embeds_batch
    from omnistage.pipeline.thinker.early_prompt import early_prompt

    o = omni_cuda()
    thinker, talker = o.engine.thinker, o.engine.talkers[0]
    req = request(o, "sync-early", PROMPTS[1])
    with no_host_sync():
        seq = thinker._admit(req, media=(None, None, None))
        chunk = early_prompt(seq)
        rows = prompt_embeds_batch(talker.talker, talker.tokens, [talker._source(chunk)])[0][:-1]
        first = seq.embeds[-1].to(talker.dtype)
        row = first_token_row(talker.talker, talker.tokens, first)
    whole = prompt_embeds(talker.talker, talker.tokens, seq.prompt_ids, seq.embeds.to(talker.dtype), None, first,
                          "Ethan")
    assert isinstance(chunk.prompt.ready, torch.cuda.Event) and chunk.embed is None
    assert torch.equal(rows, whole[:-1]) and row.shape == (1, whole.shape[1])
    torch.testing.assert_close(row[0].float(), whole[-1].float(), rtol=0.02, atol=0.02)  # one row's GEMM, bf16


@pytest.mark.parametrize("part", [{"type": "audio", "audio": tone(1.1)}, {"type": "image", "image": image(5, 30, 44)}],
                         ids=["audio", "image"])
def test_media_admission_does_not_sync_the_device(part: dict) -> None:
    # the encoders' inputs go up without waiting; the rows' placeholder positions come from the host ids
    from omnistage.pipeline.thinker.inputs import encode_media

    o = omni_cuda()
    thinker = o.engine.thinker
    req = request(o, "sync-media", [part, "What is this?"])
    with no_host_sync():
        media = encode_media(thinker.thinker, [req.prompt], thinker.device, thinker.dtype, None, thinker.vision)[0]
        seq = thinker._admit(req, media=media)
    assert seq.has_mm and seq.embeds.is_cuda and seq.embeds.shape[0] == len(req.prompt.input_ids)
