"""Deploy `connector.talker_prompt_at_admission` (pipeline/thinker/early_prompt.py, pipeline/talker/admission.py): a
text prompt's talker rows but the last go to the talker at the thinker's admission and are prefilled for their KV
alone; the first token brings the last row, a one-row step. The same frames, tokens and audio as without it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_talker import IM_START, NL, USER
from test_talker_admission import PROMPTS, VOICES, stage_and_requests, talker_and_tokens

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.rope_index import mrope_positions
from omnistage.pipeline.connector import TextChunk
from omnistage.pipeline.thinker.early_prompt import early_prompt
from omnistage.sampling_params import TalkerSamplingParams

GREEDY_TALKER = TalkerSamplingParams(temperature=0, max_frames=6, ignore_eos=True)


def early(chunk: TextChunk) -> TextChunk:
    """The chunk the thinker sends at admission: the prompt, no token."""
    return TextChunk(chunk.request, prompt=chunk.prompt)


def frames_of(stage, chunk: TextChunk, sent: list, at_admission: bool) -> tuple[list, list[tuple[int, ...]]]:
    """(the early seq's state after its KV step, or [], the talker's frames) for one request, its first token with its
    prompt or after an early prompt."""
    chunk.request.talker_sampling = GREEDY_TALKER
    rows = []
    if at_admission:
        stage.add(early(chunk))
        stage.step()  # the prompt's rows but the last: their KV, no frame
        seq = stage.seqs[chunk.request.request_id]
        rows = [seq.num_computed, seq.prompt_rows.shape[0], seq.awaiting, len(sent)]
    stage.add(chunk)
    g = torch.Generator().manual_seed(7)
    for _ in range(8):
        stage.add(TextChunk(chunk.request, torch.randn(chunk.embed.shape, generator=g)))
        stage.step()
    assert not stage.faults.drain()
    return rows, [tuple(c.frame.tolist()) for c in sent if c.frame is not None]


@torch.no_grad()
@pytest.mark.parametrize("prompt", [0, 2])
def test_the_same_frames_with_the_prompt_at_admission(prompt: int) -> None:
    got = {}
    for at_admission in (False, True):
        sent = []
        stage, chunks = stage_and_requests(PROMPTS[prompt:prompt + 1], VOICES[:1], sent.append)
        got[at_admission] = frames_of(stage, chunks[0], sent, at_admission)
    user_rows = {0: 12, 2: 25 + 7}[prompt]
    assert got[True][0] == [user_rows + 8, user_rows + 8, True, 0]  # all but the first token's row, no frame
    assert len(got[False][1]) == 6 and got[True][1] == got[False][1]


@torch.no_grad()
@pytest.mark.parametrize("prompt", [0, 1, 2])  # 1: audio rows (accept-layer hidden)
def test_the_same_frames_with_the_last_prompt_row_in_the_decode_graph(prompt: int) -> None:
    """Stage key `last_prompt_row_in_decode` (the runner, eager on the CPU): a prompt's rows but the last for their
    KV, the last with the decodes; with and without an early prompt."""
    got, kv = {}, []
    for split, at_admission in ((False, False), (True, False), (True, True)):
        sent = []
        stage, chunks = stage_and_requests(PROMPTS[prompt:prompt + 1], VOICES[:1], sent.append, cuda_graph=True,
                                           last_prompt_row_in_decode=split)
        prefill_kv, runs = stage.frame_step.prefill_kv, []
        stage.frame_step.prefill_kv = lambda fb: (kv.append(fb.lens), prefill_kv(fb))[1]
        stage.runner.run = lambda fb, run=stage.runner.run: (runs.append(fb.lens), run(fb))[1]
        if prompt == 1 and at_admission:
            continue  # NOTE: a prompt with media is never sent early
        got[split, at_admission] = frames_of(stage, chunks[0], sent, at_admission)[1], runs
    rows = {0: 12, 1: 14, 2: 32}[prompt] + 9
    assert len(got[False, False][0]) == 6 and got[True, False][0] == got[False, False][0]
    assert [r for r, _ in got.values()] == [got[False, False][0]] * len(got)
    assert got[False, False][1] == [[1]] * 5 and all(runs == [[1]] * 6 for _, runs in list(got.values())[1:])
    assert kv == [[rows - 1]] + ([[rows - 1]] if prompt != 1 else [])


def test_a_prompts_last_row_sits_at_index_plus_delta() -> None:
    """The decode graph puts a prompt's last row at index + the M-RoPE delta on every axis: the position the prompt's
    own 3-D layout gives it (its trailing text after the media), so `last_prompt_row_in_decode` keeps image prompts'
    positions."""
    tokens = talker_and_tokens()[1]
    spec, vision_end = tokens.rope, 999
    grid = torch.tensor([[1, 2 * spec.spatial_merge_size, 3 * spec.spatial_merge_size]])  # 6 image tokens
    ids = [IM_START, USER, NL, spec.vision_start, *[spec.image_token] * 6, vision_end, 7, 8, *[tokens.tts_pad] * 9]
    m = mrope_positions(ids, spec, grid)
    # 4 text rows at 0-3, the image at 4 + its (t, h, w) offsets (h < 2, w < 3), then 12 text rows at 7-18
    assert m.positions[:, -1].tolist() == [len(ids) - 1 + m.delta] * 3 == [18.0] * 3
    assert m.positions[:, 4:10].unique(dim=1).shape[1] == 6 and len(set(m.positions[:, 5].tolist())) > 1


@torch.no_grad()
def test_an_early_prompt_drained_with_its_first_token_is_admitted_once() -> None:
    stage, chunks = stage_and_requests(PROMPTS[:2], VOICES[:2])
    whole, _ = stage_and_requests(PROMPTS[:2], VOICES[:2])
    for s, cs in ((stage, [early(chunks[0]), early(chunks[1]), chunks[0]]), (whole, chunks)):
        for c in cs:
            s.add(c)
        s._receive()
    assert [(s.req.request_id, s.awaiting) for s in stage.waiting] == [("r0", False), ("r1", True)]
    torch.testing.assert_close(stage.seqs["r0"].prompt_rows, whole.seqs["r0"].prompt_rows, rtol=0, atol=0)
    torch.testing.assert_close(stage.seqs["r1"].prompt_rows, whole.seqs["r1"].prompt_rows[:-1], rtol=0, atol=0)
    stage.add(chunks[1])
    stage._receive()  # the first token's row, one text_projection of one row: equal to fp32 rounding
    torch.testing.assert_close(stage.seqs["r1"].prompt_rows, whole.seqs["r1"].prompt_rows, rtol=1e-6, atol=1e-6)
    assert not stage.seqs["r1"].awaiting and len(stage.seqs) == 2


@torch.no_grad()
def test_an_abort_before_the_first_token_frees_the_talker() -> None:
    stage, chunks = stage_and_requests(PROMPTS[:1], VOICES[:1])
    free, slots = len(stage.blocks.free), stage.penalties.num_free
    stage.add(early(chunks[0]))
    stage.step()
    assert len(stage.blocks.free) < free and stage.penalties.num_free == slots - 1
    stage.abort("r0")
    chunks[0].request.aborted = True
    stage.add(chunks[0])
    stage.step()
    assert (len(stage.blocks.free), stage.penalties.num_free, len(stage.seqs)) == (free, slots, 0)


def thinker_seq(audio: bool = True, mm: bool = False, growing: bool = False) -> SimpleNamespace:
    req = SimpleNamespace(want_audio=audio)
    return SimpleNamespace(req=req, has_mm=mm, open=growing, prompt_ids=torch.tensor([1, 2]),
                           embeds=torch.zeros(2, 4))


def test_only_a_final_text_prompt_that_wants_audio_goes_early() -> None:
    seq = thinker_seq()
    chunk = early_prompt(seq)
    assert chunk.request is seq.req and chunk.embed is None and chunk.prompt.embeds is seq.embeds
    assert chunk.prompt.mm_hidden is None and chunk.prompt.ready is None  # a CPU tensor: no event
    assert [early_prompt(thinker_seq(**kw)) for kw in ({"audio": False}, {"mm": True}, {"growing": True})] == \
        [None] * 3


def early_chunks(monkeypatch, thinker) -> list[TextChunk]:
    """What the thinker sends its talker at admission (the worker's thread reads the patched attribute)."""
    sent, to_talker = [], thinker.to_talker
    monkeypatch.setattr(thinker, "to_talker", lambda c: (c.embed is None and not c.finished and sent.append(c),
                                                         to_talker(c))[1])
    return sent


GREEDY = dict(sampling={"temperature": 0, "max_tokens": 9},
              talker_sampling={"temperature": 0, "max_frames": 12, "ignore_eos": True})


def test_same_outputs_through_the_engine(monkeypatch) -> None:
    # NOTE: whether the talker drains the early prompt before the first token is a matter of timing (drained
    # together, it admits the whole prompt); the stage tests above take each path on purpose.
    d = tiny_checkpoint("tiny")
    out = {}
    for on in (False, True):
        deploy = load_deploy_config(default_deploy_config(d), platform="cpu",
                                    overrides={"connector": {"talker_prompt_at_admission": on}})
        o = Omni(d, deploy=deploy, device="cpu")
        sent = early_chunks(monkeypatch, o.engine.thinker)
        try:
            out[on] = o.chat([{"role": "user", "content": "Tell me about the sea and the sky."}], **GREEDY), sent
        finally:
            o.engine.shutdown()
    (a, none), (b, sent) = out[False], out[True]
    assert none == [] and len(sent) == 1 and sent[0].prompt.ready is None and sent[0].prompt.mm_hidden is None
    assert b.token_ids == a.token_ids and len(b.token_ids) == 9
    assert np.array_equal(a.codes, b.codes) and b.codes.shape == (16, 12) and np.array_equal(a.audio, b.audio)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the thinker's event and the talker's graphs: CUDA")
def test_an_early_prompt_through_the_engine_on_cuda(monkeypatch) -> None:
    from test_prefill_graph import omni_cuda

    out = {}
    for on in (False, True):
        o = omni_cuda(on)  # NOTE: cached, shared with other tests: not shut down here
        sent = early_chunks(monkeypatch, o.engine.thinker)
        # NOTE: prompts no other test sends: the shared engine's prefix cache holds none of their blocks
        out[on] = [o.chat([{"role": "user", "content": text}], **GREEDY)
                   for text in ("Whistle a tune about autumn leaves.", "Describe a lighthouse at dawn.")], sent
    (a, none), (b, sent) = out[False], out[True]
    assert none == [] and len({c.request.request_id for c in sent}) == len(sent) == 2
    assert all(isinstance(c.prompt.ready, torch.cuda.Event) for c in sent)
    # NOTE: codes are not compared: the first frame's hidden comes from the decode graph's attention, not the
    # prefill's, so bf16 last bits differ and a greedy code flips where two logits nearly tie, and every later
    # frame with it (the CPU tests above hold them equal in fp32; test_admission_sync.py the rows on CUDA)
    for x, y in zip(a, b):
        assert y.token_ids == x.token_ids and y.codes.shape == x.codes.shape == (16, 12)
        assert y.finish_reason == x.finish_reason and len(y.audio) == len(x.audio) > 0
