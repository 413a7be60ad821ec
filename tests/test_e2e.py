"""End to end: `Omni.chat` against transformers' `generate(return_audio=True)` (greedy, fp32, CPU)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from conftest import hf_reference
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.config_loader import default_deploy_config, load_deploy_config

MESSAGES = [
    [{"role": "system", "content": "You are a helpful voice."}, {"role": "user", "content": "Say hello to Paris."}],
    [{"role": "user", "content": "Count: one, two, three, four, five, six, seven."}],
    [{"role": "user", "content": "Why?"}],
]


@functools.cache
def omni(preset: str) -> Omni:
    d = tiny_checkpoint(preset)
    return Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu")


def hf_generate(preset: str, ids: list[int], voice: str, max_tokens: int, frames: int):
    model = hf_reference(preset)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        seqs, wav = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), speaker=voice,
                                   return_audio=True, thinker_max_new_tokens=max_tokens, thinker_do_sample=False,
                                   talker_max_new_tokens=frames + 1, talker_do_sample=False)
    return seqs[0, len(ids):].tolist(), wav.reshape(-1).numpy()


def capture_codes(preset: str):
    model = hf_reference(preset)
    captured = {}
    orig = model.code2wav.chunked_decode

    def spy(codes, **kw):
        captured["codes"] = codes.clone()
        return orig(codes, **kw)

    return model, captured, orig, spy


@pytest.mark.parametrize("voice", ["Ethan", "Chelsie"])
def test_chat_matches_transformers(preset: str, voice: str) -> None:
    o = omni(preset)
    ids = o.engine.processor(MESSAGES[0]).input_ids
    model, captured, orig, spy = capture_codes(preset)
    model.code2wav.chunked_decode = spy
    try:
        hf_tokens, hf_wav = hf_generate(preset, ids, voice, max_tokens=10, frames=34)
    finally:
        model.code2wav.chunked_decode = orig
    out = o.chat(prompt_token_ids=ids, voice=voice, sampling={"temperature": 0, "max_tokens": 10},
                 talker_sampling={"temperature": 0, "max_frames": 34})
    assert out.token_ids == hf_tokens
    assert np.array_equal(out.codes, captured["codes"][0].numpy())
    assert out.codes.shape[1] >= 32 or out.finish_reason is not None
    assert out.audio.shape == hf_wav.shape == (out.codes.shape[1] * 1920 - 555,)
    err = float(np.abs(out.audio - hf_wav).max())
    print(f"[{preset} {voice}] frames={out.codes.shape[1]} max |wav - hf| = {err:.2e}")
    assert err < 1e-4


def test_batch_equals_alone() -> None:
    o = omni("tiny")
    convs = [MESSAGES[i % 3] for i in range(8)]
    voices = ["Ethan", "Chelsie", "Aiden", "ethan", "AIDEN", "Chelsie", "Ethan", "Aiden"]
    sampling = [{"temperature": 0, "max_tokens": 3 + i} for i in range(8)]
    talker = [{"temperature": 0, "max_frames": 5 + 3 * i} for i in range(8)]
    batch = o.chat(convs, voice=voices, sampling=sampling, talker_sampling=talker)
    for i in range(8):
        alone = o.chat(convs[i], voice=voices[i], sampling=sampling[i], talker_sampling=talker[i])
        assert batch[i].token_ids == alone.token_ids
        assert np.array_equal(batch[i].codes, alone.codes)
        np.testing.assert_allclose(batch[i].audio, alone.audio, atol=1e-5)


def test_text_only_request_skips_audio() -> None:
    out = omni("tiny").chat(MESSAGES[1], modalities=["text"], sampling={"temperature": 0, "max_tokens": 6})
    assert out.audio is None and out.codes is None
    assert len(out.token_ids) <= 6 and out.usage.audio_frames == 0


def _random_shape_overrides(seed: int) -> dict:
    """A seeded architecture not among the presets (other layer, head, expert and width counts)."""
    rng = np.random.default_rng(seed)
    hd = int(rng.choice([8, 16]))
    kv = int(rng.choice([1, 2]))
    heads = kv * int(rng.integers(1, 4))
    h = 8 * int(rng.integers(5, 9))
    th = 8 * int(rng.integers(3, 6))
    half = hd // 2
    mrope = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    experts = int(rng.integers(3, 7))
    return {
        "thinker_config": {"text_config": {
            "hidden_size": h, "num_hidden_layers": int(rng.integers(2, 4)), "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": hd, "num_experts": experts,
            "num_experts_per_tok": int(rng.integers(1, experts)), "moe_intermediate_size": 8 * int(rng.integers(2, 5)),
            "rope_parameters": {"mrope_section": mrope}},
            "audio_config": {"output_dim": h}, "vision_config": {"out_hidden_size": h}},
        "talker_config": {"thinker_hidden_size": h, "accept_hidden_layer": 1, "text_config": {
            "hidden_size": th, "num_hidden_layers": int(rng.integers(1, 3)), "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": hd, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "intermediate_size": 2 * h,
            "rope_parameters": {"mrope_section": mrope}},
            "code_predictor_config": {"hidden_size": th, "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "num_key_value_heads": 2, "head_dim": hd, "intermediate_size": 40}},
        "code2wav_config": {"hidden_size": 24, "num_hidden_layers": 1, "num_attention_heads": 3,
                            "num_key_value_heads": 3, "intermediate_size": 40, "decoder_dim": 32},
    }


@pytest.mark.parametrize("seed", [1, 2])
def test_parity_on_unseen_shapes(tmp_path, seed: int) -> None:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.qwen3_omni.make_tiny import make_tiny
    from omnistage.models.qwen3_omni.weights import init_reference_weights

    d = make_tiny(tmp_path / "ckpt", seed=seed, overrides=_random_shape_overrides(seed))
    hf = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig.from_pretrained(d)).eval()
    init_reference_weights(hf, seed)
    o = Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu", seed=seed)
    try:
        ids = o.engine.processor(MESSAGES[1]).input_ids
        captured = {}
        orig = hf.code2wav.chunked_decode

        def spy(codes, **kw):
            captured["codes"] = codes.clone()
            return orig(codes, **kw)

        hf.code2wav.chunked_decode = spy
        x = torch.tensor([ids])
        with torch.no_grad():
            seqs, wav = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), speaker="Aiden", return_audio=True,
                                    thinker_max_new_tokens=8, thinker_do_sample=False, talker_max_new_tokens=21,
                                    talker_do_sample=False)
        out = o.chat(prompt_token_ids=ids, voice="Aiden", sampling={"temperature": 0, "max_tokens": 8},
                     talker_sampling={"temperature": 0, "max_frames": 20})
    finally:
        o.engine.shutdown()
    assert out.token_ids == seqs[0, len(ids):].tolist()
    assert np.array_equal(out.codes, captured["codes"][0].numpy())
    assert float(np.abs(out.audio - wav.reshape(-1).numpy()).max()) < 1e-4


def test_audio_input_matches_transformers() -> None:
    import base64
    import io

    import soundfile as sf

    o = omni("tiny")
    t = np.arange(int(16000 * 1.5)) / 16000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, format="WAV")
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this sound?"}]}]
    prompt = o.engine.processor(messages)
    assert prompt.input_ids.count(151675) == 20  # 1.5 s of audio -> 20 audio tokens
    model, captured, orig, spy = capture_codes("tiny")
    model.code2wav.chunked_decode = spy
    try:
        x = torch.tensor([prompt.input_ids])
        with torch.no_grad():
            seqs, wav = model.generate(input_ids=x, attention_mask=torch.ones_like(x), speaker="Chelsie",
                                       input_features=prompt.input_features,
                                       feature_attention_mask=prompt.feature_attention_mask, return_audio=True,
                                       thinker_max_new_tokens=6, thinker_do_sample=False, talker_max_new_tokens=13,
                                       talker_do_sample=False)
    finally:
        model.code2wav.chunked_decode = orig
    out = o.chat(messages, voice="Chelsie", sampling={"temperature": 0, "max_tokens": 6},
                 talker_sampling={"temperature": 0, "max_frames": 12})
    assert out.token_ids == seqs[0, x.shape[1]:].tolist()
    assert np.array_equal(out.codes, captured["codes"][0].numpy())
    assert float(np.abs(out.audio - wav.reshape(-1).numpy()).max()) < 1e-4
