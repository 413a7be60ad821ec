"""A burst of requests joins the talker with one batched prompt build: rows equal to one-at-a-time builds,
arrival order kept, a bad prompt failing alone."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import hf_reference
from test_talker import (
    ASSISTANT,
    AUDIO,
    AUDIO_END,
    AUDIO_START,
    IM_END,
    IM_START,
    NL,
    SYSTEM,
    USER,
    load_talker,
)

from omnistage.engine.request import Request
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.models.qwen3_omni.talker_prompt import TalkerTokens, user_mask
from omnistage.models.qwen3_omni.talker_prompt_rows import prompt_embeds, prompt_embeds_batch, prompt_source
from omnistage.pipeline.connector import TalkerPrompt, TextChunk
from omnistage.pipeline.talker import admission as talker_admission
from omnistage.pipeline.talker.stage import TalkerStage
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams

NO_ASSISTANT = "the prompt has no '<|im_start|>assistant' turn to speak"


def turn(role: int, body: list[int]) -> list[int]:
    return [IM_START, role, NL, *body, IM_END, NL]


def audio(n: int) -> list[int]:
    return [AUDIO_START] + [AUDIO] * n + [AUDIO_END]


# user turns of different lengths, audio in user turns (and one in a system turn: not kept), two user turns
PROMPTS = [
    turn(USER, list(range(1000, 1007))) + [IM_START, ASSISTANT, NL],
    turn(SYSTEM, [5, 6]) + turn(USER, audio(4) + [7, 8, 9]) + [IM_START, ASSISTANT, NL],
    turn(USER, [11] * 20) + turn(ASSISTANT, [12, 13]) + turn(USER, [14, 15]) + [IM_START, ASSISTANT, NL],
    turn(SYSTEM, audio(5)) + turn(USER, [21, 22] + audio(6) + [23]) + [IM_START, ASSISTANT, NL],
]
VOICES = ["Ethan", "Chelsie", "Aiden", "Ethan"]


@functools.cache
def talker_and_tokens():
    hf = hf_reference("tiny")
    return load_talker(hf), TalkerTokens.from_config(hf.config)


def inputs(ids: list[int], seed: int, width: int) -> tuple:
    """(prompt ids, thinker embeds, accept-layer rows or None, first token's embed) of one request."""
    g = torch.Generator().manual_seed(seed)
    n_mm = sum(i == AUDIO for i in ids)
    mm = torch.randn(n_mm, width, generator=g) if n_mm else None
    return torch.tensor(ids), torch.randn(len(ids), width, generator=g), mm, torch.randn(width, generator=g)


def test_user_mask_of_concatenated_prompts():
    tokens = talker_and_tokens()[1]
    prompts = {  # prompt: its user mask
        (IM_START, USER, NL, 8, IM_START): [1, 1, 1, 1, 0],  # the last position reads its own id
        (USER, IM_START, USER, NL): [0, 1, 1, 1],
        (NL, USER, 7, IM_START, ASSISTANT, NL): [1, 1, 1, 0, 0, 0],  # before any <|im_start|>: the role of 1
        (5, IM_START, USER, 9): [0, 1, 1, 1],
    }
    for ids, want in prompts.items():
        assert user_mask(torch.tensor(ids), tokens).tolist() == [bool(w) for w in want]
    joined = user_mask(torch.tensor(sum(prompts, ())), tokens, torch.tensor([len(p) for p in prompts]))
    assert joined.tolist() == [bool(w) for want in prompts.values() for w in want]


@torch.no_grad()
def test_batched_prompt_rows_equal_one_at_a_time():
    talker, tokens = talker_and_tokens()
    width = talker.text_projection.linear_fc1.in_features
    reqs = [inputs(ids, i, width) + (v,) for i, (ids, v) in enumerate(zip(PROMPTS, VOICES))]
    batch = prompt_embeds_batch(talker, tokens, [prompt_source(tokens, *r) for r in reqs])
    # user rows (system and earlier assistant turns dropped) + 9 assistant rows
    assert [b.shape[0] for b in batch] == [12 + 9, 14 + 9, 25 + 7 + 9, 16 + 9]
    # NOTE: a GEMM may take another kernel for another row count (last-bit differences; bit-equal here, not
    # on the GPU machine's CPU), so the rows match to fp32 rounding: a wrong row or offset is off by O(1)
    for r, rows in zip(reqs, batch):
        torch.testing.assert_close(rows, prompt_embeds(talker, tokens, *r), rtol=1e-6, atol=1e-6)
    # the audio rows of the second request come from its accept-layer rows, its system-turn ones are dropped
    with_embeds = reqs[1][:2] + (reqs[1][1][torch.tensor(PROMPTS[1]) == AUDIO],) + reqs[1][3:]
    assert not torch.equal(prompt_embeds(talker, tokens, *with_embeds), batch[1])


def stage_and_requests(ids_list: list[list[int]], voices: list[str], to_code2wav=lambda f: None,
                       **stage_kwargs) -> tuple[TalkerStage, list[TextChunk]]:
    hf = hf_reference("tiny")
    talker, config = load_talker(hf), hf.config
    tts = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
    with torch.no_grad():
        stage = TalkerStage(talker, config, to_code2wav, hf.thinker.get_input_embeddings()(tts), num_blocks=64,
                            **stage_kwargs)
    width = talker.text_projection.linear_fc1.in_features
    chunks = []
    for i, (ids, voice) in enumerate(zip(ids_list, voices)):
        req = Request(f"r{i}", PromptInputs(ids), SamplingParams(), TalkerSamplingParams(), i, lambda d: None,
                      voice=voice, want_audio=True)
        p, embeds, mm, first = inputs(ids, i, width)
        chunks.append(TextChunk(req, first, TalkerPrompt(p, embeds, mm)))
    return stage, chunks


def spy_builds(monkeypatch) -> list[int]:
    sizes, real = [], prompt_embeds_batch
    monkeypatch.setattr(talker_admission, "prompt_embeds_batch",
                        lambda t, k, s: (sizes.append(len(s)), real(t, k, s))[1])
    return sizes


@torch.no_grad()
def test_a_burst_is_admitted_together_and_a_bad_prompt_fails_alone(monkeypatch):
    # r1: no assistant turn, r4: an unknown voice, r5: the prompt ends inside its assistant head
    ids = [PROMPTS[0], PROMPTS[1][:-3], PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[0][:-1]]
    voices = ["Ethan", "Ethan", "Aiden", "Chelsie", "Nobody", "Ethan"]
    stage, chunks = stage_and_requests(ids, voices)
    builds = spy_builds(monkeypatch)
    next_token = torch.randn_like(chunks[2].embed)
    for chunk in chunks[:3] + [TextChunk(chunks[2].request, next_token)] + chunks[3:]:
        stage.add(chunk)
    stage._receive()
    failed = stage.faults.drain()
    assert [(r.request_id, type(e), str(e)) for r, e in failed] == [
        ("r1", ValueError, NO_ASSISTANT),
        ("r4", ValueError, "unknown voice 'Nobody'; choose from ['aiden', 'chelsie', 'ethan']"),
        ("r5", ValueError, NO_ASSISTANT)]
    with pytest.raises(ValueError, match=NO_ASSISTANT):  # the same error as a build alone
        prompt_embeds(stage.talker, stage.tokens, chunks[1].prompt.prompt_ids, chunks[1].prompt.embeds, None,
                      chunks[1].embed, "Ethan")
    assert builds == [3] and [s.req.request_id for s in stage.waiting] == ["r0", "r2", "r3"]
    for seq, c in zip(stage.waiting, [chunks[0], chunks[2], chunks[3]]):
        p = c.prompt
        alone = prompt_embeds(stage.talker, stage.tokens, p.prompt_ids, p.embeds, p.mm_hidden, c.embed,
                              c.request.voice)
        torch.testing.assert_close(seq.prompt_rows, alone, rtol=1e-6, atol=1e-6)  # see the NOTE above
        assert "talker_start" in c.request.phases
    # the next token, drained with its request's first chunk, waits for the talker's second frame
    assert stage.seqs["r2"].num_texts == 2 and torch.equal(stage.seqs["r2"].texts[0], next_token)


@torch.no_grad()
def test_a_failed_batched_build_admits_each_alone(monkeypatch):
    stage, chunks = stage_and_requests(PROMPTS[:3], VOICES[:3])
    bad = chunks[1].prompt
    bad.mm_hidden = torch.zeros(bad.mm_hidden.shape[0], bad.mm_hidden.shape[1] + 1)  # fails in the projection
    builds = spy_builds(monkeypatch)
    for chunk in chunks:
        stage.add(chunk)
    stage._receive()
    failed = stage.faults.drain()
    assert [(r.request_id, type(e)) for r, e in failed] == [("r1", RuntimeError)]
    assert "mat1 and mat2" in str(failed[0][1])
    assert builds == [3, 1, 1, 1] and [s.req.request_id for s in stage.waiting] == ["r0", "r2"]


@torch.no_grad()
def test_a_first_frame_says_whether_the_talker_ran_its_request_alone():
    """`FrameChunk.talker_alone` (code2wav's idle first packet): r0 alone at its first frame; r1 and r2, admitted
    while r0 still runs (waiting for its next token), not."""
    sent = []
    stage, chunks = stage_and_requests(PROMPTS[:3], VOICES[:3], sent.append)
    stage.add(chunks[0])
    stage.step()  # r0's prefill and first frame
    stage.add(chunks[1])
    stage.add(chunks[2])
    stage.step()  # r1's and r2's; r0 waits for its next token
    assert [(c.request.request_id, c.talker_alone) for c in sent] == [("r0", True), ("r1", False), ("r2", False)]
    assert all(c.frame is not None and not c.finished for c in sent)
