from __future__ import annotations

import functools

import pytest
import torch
from conftest import hf_reference, hf_stage_state
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnistage.layers.attention import allocate_kv_cache
from omnistage.layers.context import build_context, contiguous_block_tables, forward_context
from omnistage.layers.sampling import SamplingTensors
from omnistage.models.qwen3_omni import talker_prompt as tp
from omnistage.models.qwen3_omni.code_predictor import predictor_sampling
from omnistage.models.qwen3_omni.talker import Talker, generate_codes
from omnistage.models.qwen3_omni.talker_prompt_rows import prompt_embeds
from omnistage.sampling_params import TalkerSamplingParams

IM_START, IM_END, SYSTEM, USER, ASSISTANT, NL = 151644, 151645, 8948, 872, 77091, 198
AUDIO_START, AUDIO, AUDIO_END = 151669, 151675, 151670
VOICES = ["Ethan", "Chelsie", "Aiden"]
GREEDY = TalkerSamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # NOTE: ~20 000 tiny ops per test; a second intra-op thread only adds sync cost (10x under CPU contention).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompt(seed: int, n_audio: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1000, 150000, (n,), generator=g).tolist()  # noqa: E731
    audio = [AUDIO_START] + [AUDIO] * n_audio + [AUDIO_END] if n_audio else []
    return ([IM_START, SYSTEM, NL] + rand(5) + [IM_END, NL, IM_START, USER, NL] + audio + rand(6) + [IM_END, NL]
            + [IM_START, ASSISTANT, NL, *rand(4), IM_END, NL]  # an earlier assistant turn: dropped
            + [IM_START, USER, NL] + rand(3) + [IM_END, NL, IM_START, ASSISTANT, NL])


@functools.cache
def hf_capture(preset: str, voice: str, audio: bool = False, talker_tokens: int = 40, no_eos: bool = True,
               penalty: float = 1.05) -> dict:
    """Run transformers' generate(return_audio=True), greedy, and keep what its talker saw and made.
    `no_eos`: codec_eos suppressed too (what our `ignore_eos` does), so it makes talker_tokens - 1 frames."""
    hf = hf_reference(preset)
    vocab = hf.config.talker_config.text_config.vocab_size
    kw: dict = dict(talker_repetition_penalty=penalty)
    if no_eos:
        kw["talker_suppress_tokens"] = list(range(vocab - 1024, vocab))
    n_audio = 0
    if audio:
        mask = torch.ones(1, 200, dtype=torch.long)
        kw |= dict(input_features=torch.randn(1, 128, 200, generator=torch.Generator().manual_seed(5)),
                  feature_attention_mask=mask)
        n_audio = int(_get_feat_extract_output_lengths(mask.sum(-1), 50)[0])
    ids = torch.tensor([_prompt(1, n_audio)])
    cap: dict = {}
    orig = hf.thinker.generate, hf.talker.generate, hf.code2wav.chunked_decode

    def thinker_spy(**k):
        cap["thinker"] = orig[0](**k)
        return cap["thinker"]

    def talker_spy(**k):
        cap["talker_kwargs"] = k
        return orig[1](**k)

    def decode_spy(codes, **k):  # the waveform is not needed: skip the vocoder
        cap["codes"] = codes[0].clone()
        return codes.new_zeros(1, 1, 1, dtype=torch.float32)

    hf.thinker.generate, hf.talker.generate, hf.code2wav.chunked_decode = thinker_spy, talker_spy, decode_spy
    try:
        seqs, _ = hf.generate(input_ids=ids, speaker=voice, return_audio=True, thinker_max_new_tokens=12,
                              thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=talker_tokens,
                              **kw)
    finally:
        hf.thinker.generate, hf.talker.generate, hf.code2wav.chunked_decode = orig
    hs = cap["thinker"].hidden_states
    layer = hf.config.talker_config.accept_hidden_layer
    return dict(ids=ids[0], seqs=seqs[0], embeds=torch.cat([h[0] for h in hs], 1)[0],
                hidden=torch.cat([h[layer] for h in hs], 1)[0], prompt=cap["talker_kwargs"]["inputs_embeds"][0],
                trailing=cap["talker_kwargs"]["trailing_text_hidden"][0], codes=cap["codes"])


@functools.cache
def our_talker(preset: str) -> Talker:
    return load_talker(hf_reference(preset))


def load_talker(hf) -> Talker:
    talker = Talker(hf.config.talker_config).eval()
    talker.load_state_dict(hf_stage_state(hf, "talker"), strict=True)
    c = hf.config
    tts = torch.tensor([c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id])
    with torch.no_grad():
        talker.set_tts_embeds(hf.thinker.get_input_embeddings()(tts))
    return talker


@torch.no_grad()
def our_rows(preset: str, cap: dict, voice: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Talker prompt and per-frame text rows from the thinker's ids / embeddings, streaming-style."""
    talker, tokens = our_talker(preset), tp.TalkerTokens.from_config(hf_reference(preset).config)
    ids, emb = cap["ids"], cap["embeds"]
    length, n_gen = ids.numel(), cap["seqs"].numel() - cap["ids"].numel()
    mm = torch.isin(ids, torch.tensor(tokens.multimodal))
    prompt = prompt_embeds(talker, tokens, ids, emb[:length], cap["hidden"][:length][mm], emb[length], voice)
    rows = [tp.next_text_row(talker, emb[length + j] if j < n_gen - 1 else None, final=j == n_gen - 1)
            for j in range(1, n_gen)]
    return prompt, torch.stack(rows)


@pytest.mark.parametrize("voice", VOICES)
def test_prompt_rows_and_codes_match_transformers(preset, voice):
    cap = hf_capture(preset, voice)
    prompt, rows = our_rows(preset, cap, voice)
    # user turns (11 + 8 rows) + 9 assistant rows; the system and the earlier assistant turn are dropped
    assert prompt.shape[0] == 11 + 8 + 9 == cap["prompt"].shape[0]
    assert (prompt - cap["prompt"]).abs().max() <= 1e-5
    assert rows.shape == cap["trailing"].shape and (rows - cap["trailing"]).abs().max() <= 1e-5
    ref = cap["codes"]
    assert ref.shape == (16, 39)
    codes = generate_codes(our_talker(preset), prompt, rows, GREEDY, max_frames=39)
    assert torch.equal(codes, ref)


def test_strong_repetition_penalty_matches_transformers():
    cap = hf_capture("tiny", "Ethan", penalty=1.6)
    assert not torch.equal(cap["codes"], hf_capture("tiny", "Ethan")["codes"])  # the penalty matters here
    prompt, rows = our_rows("tiny", cap, "Ethan")
    params = TalkerSamplingParams(temperature=0.0, repetition_penalty=1.6, ignore_eos=True)
    assert torch.equal(generate_codes(our_talker("tiny"), prompt, rows, params, max_frames=39), cap["codes"])


def test_audio_prompt_uses_hidden_projection(preset):
    cap = hf_capture(preset, "Aiden", audio=True, talker_tokens=9)
    prompt, rows = our_rows(preset, cap, "Aiden")
    assert (prompt - cap["prompt"]).abs().max() <= 1e-5
    assert (rows - cap["trailing"]).abs().max() <= 1e-5
    assert torch.equal(generate_codes(our_talker(preset), prompt, rows, GREEDY, max_frames=8), cap["codes"])
    # the audio rows really come from the accept-layer hidden: the embeddings would give other rows
    no_hidden = cap | {"hidden": cap["embeds"]}
    assert (our_rows(preset, no_hidden, "Aiden")[0] - cap["prompt"]).abs().max() > 1e-2


@torch.no_grad()
def test_code_predictor_matches_transformers(preset):
    hf, talker = hf_reference(preset), our_talker(preset)
    g = torch.Generator().manual_seed(3)
    past = torch.randn(3, talker.codec_head.in_features, generator=g)
    c0 = torch.randint(0, 2048, (3,), generator=g)
    c0_embed = talker.model.codec_embedding(c0)
    ref = hf.talker.code_predictor.generate(inputs_embeds=torch.stack([past, c0_embed], 1), max_new_tokens=15,
                                            do_sample=False)
    st = predictor_sampling(SamplingTensors.build([GREEDY] * 3, [0, 1, 2]))
    codes, frame_embed = talker.code_predictor.predict(past, c0_embed, st, torch.zeros(3, dtype=torch.int64))
    assert torch.equal(codes, ref)
    embeds = [c0_embed] + [talker.code_predictor.model.codec_embedding[g](codes[:, g]) for g in range(15)]
    assert torch.equal(frame_embed, torch.stack(embeds, 1).sum(1))
    # sampled: a row draws the same codes alone as inside a batch (lockstep static cache, per-row seeds)
    sampled = predictor_sampling(SamplingTensors.build([TalkerSamplingParams()] * 3, [7, 8, 9]))
    steps = torch.tensor([16, 32, 48])
    batch, _ = talker.code_predictor.predict(past, c0_embed, sampled, steps)
    alone = predictor_sampling(SamplingTensors.build([TalkerSamplingParams()], [8]))
    one, _ = talker.code_predictor.predict(past[1:2], c0_embed[1:2], alone, steps[1:2])
    assert torch.equal(one[0], batch[1]) and not torch.equal(batch, codes)


@torch.no_grad()
def test_batched_steps_equal_single_requests():
    talker = our_talker("tiny")
    caps = [hf_capture("tiny", "Ethan"), hf_capture("tiny", "Chelsie")]
    rows = [our_rows("tiny", c, v) for c, v in zip(caps, ["Ethan", "Chelsie"])]
    frames, block = 6, 16
    tables = contiguous_block_tables(2, 64, block)
    allocate_kv_cache(talker, 2 * len(tables[0]), block, torch.float32, "cpu")
    st = SamplingTensors.build([GREEDY, TalkerSamplingParams(seed=4)], [0, 4])
    seen = torch.zeros(2, talker.codec_head.out_features, dtype=torch.bool)
    lens = [r[0].shape[0] for r in rows]
    inputs, positions = torch.cat([r[0] for r in rows]), torch.cat([torch.arange(n) for n in lens])
    done, new, out = [0, 0], lens, []
    for t in range(frames):
        last = torch.tensor(new).cumsum(0) - 1
        with forward_context(build_context(done, new, tables, block)):
            frame, codec = talker.step(inputs, positions, last, st, torch.tensor([t, t]), seen)
        out.append(frame)
        done = [d + n for d, n in zip(done, new)]
        new = [1, 1]
        inputs = codec + torch.stack([r[1][t] for r in rows])
        positions = torch.tensor(done)
    out = torch.stack(out, -1)
    assert torch.equal(out[0], caps[0]["codes"][:, :frames])
    # the repetition penalty sees exactly each request's own codebook-0 codes
    expect = torch.zeros_like(seen)
    expect.scatter_(1, out[:, 0], True)
    assert torch.equal(seen, expect)
    # the sampled request draws the same codes alone, valid ones, and others with another seed
    alone = generate_codes(talker, *rows[1], TalkerSamplingParams(seed=4), max_frames=frames)
    other = generate_codes(talker, *rows[1], TalkerSamplingParams(seed=5), max_frames=frames)
    assert torch.equal(out[1], alone) and out[1].max() < 2048 and (other != alone).float().mean() > 0.5


def test_stops_at_eos_like_transformers():
    hf, free = hf_reference("tiny"), hf_capture("tiny", "Aiden")["codes"]
    # make codec_eos a scaled copy of the code greedy picks (first time) at frame k >= 20: it wins there or earlier
    k = next(t for t in range(20, 39) if free[0, t] not in free[0, :t])
    head, eos = hf.talker.codec_head.weight, hf.config.talker_config.codec_eos_token_id
    saved = head[eos].clone()
    try:
        with torch.no_grad():
            head[eos] = head[free[0, k]] * 1.05
        cap = hf_capture.__wrapped__("tiny", "Aiden", no_eos=False)
        talker = load_talker(hf)
    finally:
        with torch.no_grad():
            head[eos] = saved
    assert 0 < cap["codes"].shape[1] <= k
    prompt, rows = our_rows("tiny", cap, "Aiden")
    codes = generate_codes(talker, prompt, rows, TalkerSamplingParams(temperature=0.0), max_frames=39)
    assert torch.equal(codes, cap["codes"])
    # with ignore_eos the same request runs on, identical up to where it stopped
    longer = generate_codes(talker, prompt, rows, GREEDY, max_frames=39)
    assert longer.shape[1] == 39 and torch.equal(longer[:, :codes.shape[1]], codes)
