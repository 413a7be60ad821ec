"""Thinker parity with transformers (fp32, CPU) on flat batches with a paged KV cache.

Error measure: rel = max|ours - ref| / max|ref| over the compared tensor (all positions, all vocab)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from conftest import hf_reference, hf_stage_state

from omnistage.layers.attention import allocate_kv_cache
from omnistage.layers.context import StaticBlockAllocator, forward_context
from omnistage.models.qwen3_omni.presets import MM_IDS, SPECIAL_IDS, preset_config
from omnistage.models.qwen3_omni.thinker import Thinker, ThinkerOutput

NL = 198
TOL = 1e-4
DECODE_STEPS = 32


def build_prompt(n_audio: int = 0, n_user_text: int = 6, seed: int = 0) -> list[int]:
    """ChatML system + user (+ audio placeholders) + assistant header, random real text ids."""
    rand = np.random.default_rng(seed).integers(1000, 150000, size=5 + n_user_text).tolist()
    s, a = SPECIAL_IDS, MM_IDS
    seq = [s["im_start_token_id"], s["system_token_id"], NL, *rand[:5], s["im_end_token_id"], NL,
           s["im_start_token_id"], s["user_token_id"], NL]
    if n_audio:
        seq += [a["audio_start_token_id"], *[a["audio_token_id"]] * n_audio, a["audio_end_token_id"]]
    return seq + rand[5:] + [s["im_end_token_id"], NL, s["im_start_token_id"], s["assistant_token_id"], NL]


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@functools.cache
def thinker(preset: str) -> Thinker:
    model = Thinker(preset_config(preset)["thinker_config"]).eval()
    model.load_state_dict(hf_stage_state(hf_reference(preset), "thinker"))  # strict
    return model


def accept_layer(preset: str) -> int:
    return preset_config(preset)["talker_config"]["accept_hidden_layer"]


def run(model: Thinker, alloc: StaticBlockAllocator, new_ids: list[list[int]], seq_ids: list[int] | None = None,
        **kw) -> ThinkerOutput:
    """One flat forward appending `new_ids[j]` to sequence `seq_ids[j]`, 1-D positions."""
    seq_ids = list(range(len(new_ids))) if seq_ids is None else seq_ids
    starts = [alloc.num_computed[i] for i in seq_ids]
    positions = torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, new_ids)])
    ids = torch.tensor([t for seq in new_ids for t in seq])
    with torch.no_grad(), forward_context(alloc.context([len(t) for t in new_ids], seq_ids)):
        return model(ids, positions, **kw)


def fresh(model: Thinker, num_seqs: int, max_len: int, block_size: int = 4) -> StaticBlockAllocator:
    alloc = StaticBlockAllocator(num_seqs, max_len, block_size)
    allocate_kv_cache(model, alloc.num_blocks, block_size, torch.float32, "cpu")
    return alloc


@functools.cache
def hf_text_run(preset: str):
    hf = hf_reference(preset)
    ids = torch.tensor([build_prompt()])
    with torch.no_grad():
        fwd = hf.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        gen = hf.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_STEPS,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True)
    return fwd, gen


def test_prefill_and_greedy_decode_match_transformers(preset):
    model, prompt = thinker(preset), build_prompt()
    assert len(prompt) == 24
    fwd, gen = hf_text_run(preset)
    alloc = fresh(model, 1, len(prompt) + DECODE_STEPS)
    logits = model.compute_logits(run(model, alloc, [prompt]).hidden_states)
    assert rel(logits, fwd.logits[0]) < TOL
    hf_new = gen.sequences[0, len(prompt):].tolist()
    assert len(hf_new) == DECODE_STEPS
    ours = []
    for step in range(DECODE_STEPS):
        assert rel(logits[-1], gen.logits[step][0]) < TOL, step
        ours.append(int(logits[-1].argmax()))
        if step + 1 < DECODE_STEPS:
            logits = model.compute_logits(run(model, alloc, [[ours[-1]]]).hidden_states)
    assert ours == hf_new


def test_accept_hidden_and_input_embeds_match_transformers(preset):
    model, prompt = thinker(preset), build_prompt()
    fwd, _ = hf_text_run(preset)
    layer = accept_layer(preset)
    out = run(model, fresh(model, 1, len(prompt)), [prompt], accept_hidden_layer=layer)
    assert rel(out.accept_hidden, fwd.hidden_states[layer][0]) < TOL
    assert torch.equal(out.inputs_embeds, fwd.hidden_states[0][0])
    # the captured layer is really that layer: neighbouring layers differ by far more than TOL
    assert rel(out.accept_hidden, fwd.hidden_states[layer + 1][0]) > 0.1


def sine_features():
    from transformers import WhisperFeatureExtractor

    sr = 16000
    t = np.arange(2 * sr) / sr
    audio = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=sr)
    f = fe(audio, sampling_rate=sr, return_attention_mask=True, padding=True, return_tensors="pt")
    return f["input_features"], f["attention_mask"]


def test_audio_prompt_matches_transformers(preset):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    model, hf = thinker(preset), hf_reference(preset)
    feats, mask = sine_features()
    n_audio = int(_get_feat_extract_output_lengths(mask.sum(-1), 50)[0])
    assert n_audio == 26
    prompt = build_prompt(n_audio=n_audio, seed=1)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=feats,
                         feature_attention_mask=mask, output_hidden_states=True)
        audio = model.encode_audio(feats, mask)
    layer = accept_layer(preset)
    out = run(model, fresh(model, 1, len(prompt)), [prompt], audio_embeds=audio, accept_hidden_layer=layer)
    assert rel(model.compute_logits(out.hidden_states), ref.logits[0]) < TOL
    assert rel(out.inputs_embeds, ref.hidden_states[0][0]) < TOL
    assert rel(out.accept_hidden, ref.hidden_states[layer][0]) < TOL
    is_audio = ids[0] == MM_IDS["audio_token_id"]
    # the audio rows really came from the encoder, not from the <|audio_pad|> embedding
    assert not torch.allclose(out.inputs_embeds[is_audio], model.model.embed_tokens.weight[MM_IDS["audio_token_id"]])


def test_batched_prefill_and_decode_equal_single_runs(preset):
    model = thinker(preset)
    prompts = [build_prompt(n_user_text=n, seed=10 + n) for n in (1, 9, 4)]
    steps, max_len = 4, max(map(len, prompts)) + 4
    # each sequence alone
    alone = []
    for p in prompts:
        alloc = fresh(model, 1, max_len)
        h = [run(model, alloc, [p]).hidden_states]
        for _ in range(steps):
            h.append(run(model, alloc, [[int(model.compute_logits(h[-1][-1]).argmax())]]).hidden_states)
        alone.append(h)
    # all three in one flat batch per step
    alloc = fresh(model, 3, max_len)
    h = run(model, alloc, prompts).hidden_states
    bounds = np.cumsum([0, *map(len, prompts)])
    for i in range(3):
        assert rel(h[bounds[i]:bounds[i + 1]], alone[i][0]) < 1e-5
    last = h[bounds[1:] - 1]
    for step in range(steps):
        toks = model.compute_logits(last).argmax(-1).tolist()
        last = run(model, alloc, [[t] for t in toks]).hidden_states
        for i in range(3):
            assert rel(last[i], alone[i][step + 1][0]) < 1e-5


def test_image_and_video_prompt_with_deepstack_matches_transformers(preset):
    from omnistage.models.qwen3_omni.encoders import VisualEmbeds

    model, hf = thinker(preset), hf_reference(preset)
    vc = preset_config(preset)["thinker_config"]["vision_config"]
    patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    g = torch.Generator().manual_seed(3)
    grids = {"image": torch.tensor([[1, 4, 6]]), "video": torch.tensor([[2, 4, 4]])}  # 6 and 8 merged tokens
    pixels = {m: torch.randn(int(grid.prod()), patch, generator=g) for m, grid in grids.items()}
    prompt = build_prompt(seed=2)
    k = prompt.index(SPECIAL_IDS["user_token_id"]) + 2
    for m in ("video", "image"):  # image placeholders first, then video
        n = int(grids[m].prod()) // vc["spatial_merge_size"] ** 2
        prompt[k:k] = [MM_IDS["vision_start_token_id"], *[MM_IDS[f"{m}_token_id"]] * n, MM_IDS["vision_end_token_id"]]
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    sec = torch.tensor([0.5])
    with torch.no_grad():
        ref = hf.thinker(input_ids=ids, attention_mask=mask, pixel_values=pixels["image"],
                         image_grid_thw=grids["image"], pixel_values_videos=pixels["video"],
                         video_grid_thw=grids["video"], video_second_per_grid=sec)
        positions = hf.thinker.get_rope_index(ids, grids["image"], grids["video"], mask, False, None, sec)[0]
        positions = positions[:, 0]
        image, video = (model.encode_visual(pixels[m], grids[m]) for m in ("image", "video"))
    assert not torch.equal(positions[0], positions[1])  # real 3-D positions
    logits = model.compute_logits(run3d(model, prompt, positions, image=image, video=video))
    assert rel(logits, ref.logits[0]) < TOL
    # DeepStack matters: dropping it moves the logits far outside the tolerance
    no_deepstack = model.compute_logits(run3d(model, prompt, positions, image=VisualEmbeds(image.embeds, []),
                                              video=VisualEmbeds(video.embeds, [])))
    assert rel(no_deepstack, ref.logits[0]) > 100 * TOL


def run3d(model: Thinker, prompt: list[int], positions: torch.Tensor, **kw) -> torch.Tensor:
    alloc = fresh(model, 1, len(prompt))
    with torch.no_grad(), forward_context(alloc.context([len(prompt)])):
        return model(torch.tensor(prompt), positions, **kw).hidden_states
