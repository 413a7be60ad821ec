"""Images, videos and videos with their audio track through the engine (`Omni.chat`) against transformers'
`generate(return_audio=True)`: greedy, fp32, CPU; identical text tokens and codec codes, waveform within
1e-4. Both sides get the same processor output (`PromptProcessor`, our engine's)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import hf_reference
from mm_samples import TINY, TWO_TURNS, image, video

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.prompt import PromptInputs

_ENGINES: dict[tuple, Omni] = {}


@pytest.fixture(scope="module", autouse=True)
def _release_engines():
    """The engines of this module (~0.7 GB each, mostly KV caches) go when its tests are done."""
    yield
    for o in _ENGINES.values():
        o.engine.shutdown()
    _ENGINES.clear()


def omni(preset: str = "tiny", graphs: bool = False, budget: int = 8192) -> Omni:
    """`graphs`: the decode runners on (on the CPU their static-buffer path, run eagerly; set past the
    config's validation); `budget`: the thinker's token budget per step (prompts prefill in chunks)."""
    key = (preset, graphs, budget)
    if key not in _ENGINES:
        _ENGINES[key] = _build(preset, graphs, budget)
    return _ENGINES[key]


def _build(preset: str, graphs: bool, budget: int) -> Omni:
    d = tiny_checkpoint(preset)
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu")
    stages = {k: replace(getattr(cfg.stages, k), cuda_graph=graphs, cuda_graph_batch_sizes=[1, 2])
              for k in ("thinker", "talker")}
    stages["thinker"] = replace(stages["thinker"], max_num_batched_tokens=budget)
    return Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, **stages)), device="cpu")


@contextlib.contextmanager
def talker_audio_window(hf):
    """NOTE: transformers' talker reads `config.audio_config.n_window` for prompts with audio AND images or
    videos, but its config has no audio_config (AttributeError). Lend it the thinker's, as the engine does."""
    hf.talker.config.audio_config = hf.config.thinker_config.audio_config
    try:
        yield
    finally:
        del hf.talker.config.audio_config


def hf_generate(preset: str, prompt: PromptInputs, voice: str, max_tokens: int, frames: int, hf=None):
    """transformers' tokens, codes [16, F] and waveform for the processor's output `prompt`."""
    hf = hf or hf_reference(preset)
    x = torch.tensor([prompt.input_ids])
    kw = {k: getattr(prompt, k) for k in ("input_features", "feature_attention_mask", "pixel_values",
                                          "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                          "video_second_per_grid") if getattr(prompt, k) is not None}
    captured, orig = {}, hf.code2wav.chunked_decode

    def spy(codes, **k):
        captured["codes"] = codes.clone()
        return orig(codes, **k)

    hf.code2wav.chunked_decode = spy
    try:
        with torch.no_grad(), talker_audio_window(hf):
            seqs, wav = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), speaker=voice, return_audio=True,
                                    use_audio_in_video=prompt.use_audio_in_video, thinker_max_new_tokens=max_tokens,
                                    thinker_do_sample=False, talker_max_new_tokens=frames + 1,
                                    talker_do_sample=False, **kw)
    finally:
        hf.code2wav.chunked_decode = orig
    return seqs[0, x.shape[1]:].tolist(), captured["codes"][0].numpy(), wav.reshape(-1).numpy()


def check_parity(o: Omni, preset: str, messages: list, *, voice: str = "Ethan", max_tokens: int = 8,
                 frames: int = 12, audio_in_video: bool = False, hf=None, **chat_kw) -> float:
    """`audio_in_video`: how transformers' side is processed; `chat_kw` says it to `Omni.chat`."""
    prompt = o.engine.processor(messages, audio_in_video)
    tokens, codes, wav = hf_generate(preset, prompt, voice, max_tokens, frames, hf)
    out = o.chat(messages, voice=voice, sampling={"temperature": 0, "max_tokens": max_tokens},
                 talker_sampling={"temperature": 0, "max_frames": frames}, **chat_kw)
    assert out.token_ids == tokens
    assert np.array_equal(out.codes, codes) and out.codes.shape[1] >= 2
    assert out.audio.shape == wav.shape == (out.codes.shape[1] * 1920 - 555,)
    err = float(np.abs(out.audio - wav).max())
    assert err < 1e-4
    return err


def test_image_input_matches_transformers(preset: str) -> None:
    # 224 x 320 px: inside the real preprocessor_config's [3136, 12845056] pixels, 14 x 20 patches
    messages = [{"role": "user", "content": [{"type": "image", "image": image(0, 224, 320)},
                                             "What is in the picture?"]}]
    prompt = omni(preset).engine.processor(messages)
    assert prompt.image_grid_thw.tolist() == [[1, 14, 20]] and prompt.input_ids.count(151655) == 70
    err = check_parity(omni(preset), preset, messages, voice="Chelsie")
    print(f"[{preset} image] max |wav - hf| = {err:.2e}")


def test_video_input_matches_transformers() -> None:
    messages = [{"role": "user", "content": ["Describe:", {"type": "video", "video": video(1), **TINY}]}]
    prompt = omni().engine.processor(messages)
    # 5 frames at fps 2 -> 3 temporal groups of 2 (last frame repeated); 1 s per group
    assert prompt.video_grid_thw.tolist() == [[3, 4, 6]] and prompt.video_second_per_grid.tolist() == [1.0]
    err = check_parity(omni(), "tiny", messages)
    print(f"[video] max |wav - hf| = {err:.2e}")


@pytest.mark.parametrize("how", ["flag", "mm_processor_kwargs"])
def test_video_with_its_audio_matches_transformers(how: str) -> None:
    messages = [{"role": "user", "content": [{"type": "video", "video": video(2, 4, 2.0, 1.6), **TINY},
                                             "What happens?"]}]
    prompt = omni().engine.processor(messages, True)
    ids = prompt.input_ids
    vs = ids.index(151652)
    assert ids[vs + 1] == 151669 and ids.count(151656) == 12 and ids.count(151675) == 21
    assert ids[vs + 2:vs + 2 + 7] == [151656] * 6 + [151675]  # group 0 at t=0, then audio until t=13
    kw = {"use_audio_in_video": True} if how == "flag" else {"mm_processor_kwargs": {"use_audio_in_video": True}}
    err = check_parity(omni(), "tiny", messages, audio_in_video=True, **kw)
    print(f"[video+audio {how}] max |wav - hf| = {err:.2e}")


@pytest.mark.parametrize("graphs, budget", [(False, 8192), (True, 24)])
def test_two_turn_mixed_conversation_matches_transformers(graphs: bool, budget: int) -> None:
    """Images, an audio, a video with its audio track over two user turns; also with the decode runners
    and the prompt prefilled in chunks of 24 (DeepStack rows and 3-D positions split across chunks)."""
    o = omni(graphs=graphs, budget=budget)
    prompt = o.engine.processor(TWO_TURNS, True)
    assert (o.engine.thinker.runner is not None) == graphs
    assert budget > 1000 or len(prompt.input_ids) > 4 * budget
    assert prompt.image_grid_thw.shape == (2, 3) and prompt.feature_attention_mask.shape[0] == 2
    err = check_parity(o, "tiny", TWO_TURNS, voice="Aiden", max_tokens=10, frames=16, audio_in_video=True,
                       use_audio_in_video=True)
    print(f"[two turns graphs={graphs}] max |wav - hf| = {err:.2e}")


def test_requests_together_equal_alone() -> None:
    """Media of requests admitted together go through each encoder in one call; results equal alone."""
    convs = [[{"role": "user", "content": [{"type": "image", "image": image(10 + i)}, {"type": "image",
                                           "image": image(20 + i, 24, 64)}, "Compare."]}] for i in range(2)]
    convs += [[{"role": "user", "content": [{"type": "video", "video": video(30, 6, 3.0), **TINY}, "Hm?"]}],
              TWO_TURNS, [{"role": "user", "content": "Just text."}]]
    uav = [False, False, False, True, False]
    sampling = [{"temperature": 0, "max_tokens": 4 + i} for i in range(len(convs))]
    talker = [{"temperature": 0, "max_frames": 6 + 2 * i} for i in range(len(convs))]
    o = omni()
    batch = o.chat(convs, sampling=sampling, talker_sampling=talker, use_audio_in_video=uav)
    for i, conv in enumerate(convs):
        alone = o.chat(conv, sampling=sampling[i], talker_sampling=talker[i], use_audio_in_video=uav[i])
        assert batch[i].token_ids == alone.token_ids and np.array_equal(batch[i].codes, alone.codes)
        np.testing.assert_allclose(batch[i].audio, alone.audio, atol=1e-5)


def test_parity_on_unseen_shapes(tmp_path) -> None:
    """A seeded architecture not among the presets (other widths, heads, layers, experts, accept layer)."""
    from test_e2e import _random_shape_overrides
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omnistage.models.qwen3_omni.make_tiny import make_tiny
    from omnistage.models.qwen3_omni.weights import init_reference_weights

    overrides = _random_shape_overrides(5)
    overrides["thinker_config"]["vision_config"].update(depth=3, deepstack_visual_indexes=[0, 2], hidden_size=24,
                                                        num_heads=2)
    d = make_tiny(tmp_path / "ckpt", seed=5, overrides=overrides)
    hf = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig.from_pretrained(d)).eval()
    init_reference_weights(hf, 5)
    o = Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu", seed=5)
    talker, sent = o.engine.talkers[0], []
    admit = talker._admit
    talker._admit = lambda chunk, *rest: (sent.append(chunk.prompt), admit(chunk, *rest))[1]
    try:
        err = check_parity(o, "", TWO_TURNS, max_tokens=6, frames=10, audio_in_video=True, hf=hf,
                           use_audio_in_video=True)
        prompt = o.engine.processor(TWO_TURNS, True)
    finally:
        o.engine.shutdown()
    # the accept-layer rows the talker got (layer 1 here: between this config's two DeepStack additions)
    x = torch.tensor([prompt.input_ids])
    with torch.no_grad():
        ref = hf.thinker(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True,
                         **{k: v for k, v in vars(prompt).items() if k not in ("input_ids", "use_audio_in_video")
                            and v is not None}, use_audio_in_video=True).hidden_states
    mm = torch.isin(x[0], torch.tensor([151655, 151656, 151675]))
    want = ref[hf.config.talker_config.accept_hidden_layer][0][mm]
    assert hf.config.talker_config.accept_hidden_layer == 1 and len(sent) == 1
    rel = float((sent[0].mm_hidden - want).abs().max() / want.abs().max())
    assert sent[0].mm_hidden.shape == want.shape and rel < 1e-5
    print(f"[unseen shapes] max |wav - hf| = {err:.2e}, accept-layer rows rel err {rel:.1e}")


#END
