"""Code2Wav: one-shot parity with transformers, and the stateful stream equal to the one-shot decode.

The random decoder amplifies rounding ~10^4x (pre-clamp signal ~100), so fp32 streaming differs from the
one-shot decode by ~2e-3 through float noise alone; stream-vs-one-shot checks therefore run in fp64,
where that noise is ~1e-11 and the 1e-5 tolerance only passes when the stream computes the same function.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import hf_reference, hf_stage_state

from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamCache, Code2WavStreamer, StreamContext

SAMPLES_PER_FRAME, TAIL = 1920, 555


def _ours(preset: str, dtype: torch.dtype = torch.float32) -> Code2Wav:
    hf = hf_reference(preset)
    model = Code2Wav(hf.code2wav.config).eval()
    model.load_state_dict(hf_stage_state(hf, "code2wav"), strict=True)
    return model.to(dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _codes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, shape, generator=_gen(seed))


def _chunk_samples(schedule: list[int]) -> list[int]:
    """Samples per chunk: the first chunk holds back the 555-sample tail, later ones emit 1920 per frame."""
    return [n * SAMPLES_PER_FRAME - (TAIL if i == 0 else 0) for i, n in enumerate(schedule)]


def _stream(streamer: Code2WavStreamer, codes: torch.Tensor, schedule: list[int]) -> list[torch.Tensor]:
    state, start, chunks = streamer.open(), 0, []
    for n in schedule:
        chunks += streamer.step([(state, codes[:, start:start + n])])
        start += n
    streamer.close(state)
    return chunks


@pytest.mark.parametrize("batch,frames", [(2, 37), (1, 100)])
@torch.no_grad()
def test_one_shot_matches_transformers(preset, batch, frames):
    codes = _codes((batch, 16, frames), seed=frames)
    ref = hf_reference(preset).code2wav(codes)
    out = _ours(preset)(codes)
    assert out.shape == (batch, 1, frames * SAMPLES_PER_FRAME - TAIL)
    assert (out - ref).abs().max().item() <= 1e-4


@torch.no_grad()
def test_pre_transformer_window_matches_transformers(preset):
    """The transformer alone over 100 frames (the 72-frame window cuts in), before the decoder's clamp."""
    x = torch.randn(2, 100, hf_reference(preset).code2wav.config.hidden_size, generator=_gen(2))
    ref = hf_reference(preset).code2wav.pre_transformer(inputs_embeds=x).last_hidden_state
    assert (_ours(preset).pre_transformer(x) - ref).abs().max().item() <= 1e-4


@functools.cache
def _one_shot64(preset: str, frames: int) -> tuple[Code2Wav, torch.Tensor, torch.Tensor]:
    model = _ours(preset, torch.float64)
    codes = _codes((16, frames), seed=1)
    with torch.no_grad():
        return model, codes, model(codes[None])[0, 0]


@pytest.mark.parametrize("schedule", [[4, 25, 25, 26], [1] * 80, [7, 30, 43]])
@torch.no_grad()
def test_stream_equals_one_shot(preset, schedule):
    model, codes, full = _one_shot64(preset, 80)
    chunks = _stream(Code2WavStreamer(model, max_streams=2), codes, schedule)
    assert [c.numel() for c in chunks] == _chunk_samples(schedule)
    wav = torch.cat(chunks)
    assert wav.numel() == full.numel() == 80 * SAMPLES_PER_FRAME - TAIL
    assert (wav - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("schedule", [[1] * 100, [4, 25, 71], [80, 20]])
@torch.no_grad()
def test_stream_kv_window_equals_one_shot(preset, schedule):
    """The attention state across >72 frames, on the transformer alone (before the decoder's clamp)."""
    model = _ours(preset, torch.float64)
    x = torch.randn(1, 100, model.config.hidden_size, dtype=torch.float64, generator=_gen(3))
    cache = Code2WavStreamCache(model, max_streams=1)
    slots, start, chunks = torch.tensor([cache.allocate()]), 0, []
    for n in schedule:
        ctx = StreamContext(cache, slots, first=start == 0)
        chunks.append(model.pre_transformer(x[:, start:start + n], ctx))
        ctx.advance(n)
        start += n
    assert (torch.cat(chunks, dim=1) - model.pre_transformer(x)).abs().max().item() <= 1e-9


@torch.no_grad()
def test_batched_step_equals_each_alone(preset):
    model = _ours(preset, torch.float64)
    # per step: chunk length per request (0 = not in this step); mixes first/later chunks of equal length
    steps = [[4, 4, 0], [25, 1, 25], [1, 1, 4], [7, 30, 3]]
    codes = [_codes((16, sum(s[r] for s in steps)), seed=10 + r) for r in range(3)]
    streamer = Code2WavStreamer(model, max_streams=3)
    _stream(streamer, _codes((16, 9), seed=99), [9])  # request 0 below reuses this slot
    states, starts, got = [streamer.open() for _ in range(3)], [0, 0, 0], [[], [], []]
    for step in steps:
        rows = [r for r in range(3) if step[r]]
        items = [(states[r], codes[r][:, starts[r]:starts[r] + step[r]]) for r in rows]
        for r, wav in zip(rows, streamer.step(items)):
            got[r].append(wav)
            starts[r] += step[r]
    for r in range(3):
        assert [w.numel() for w in got[r]] == _chunk_samples([s[r] for s in steps if s[r]])
        alone = model(codes[r][None])[0, 0]
        assert (torch.cat(got[r]) - alone).abs().max().item() <= 1e-5


@torch.no_grad()
def test_stream_state_is_fixed_size(preset):
    model = _ours(preset)
    streamer = Code2WavStreamer(model, max_streams=2)
    cache = streamer.cache

    def layout():
        return [(tuple(t.shape), t.data_ptr()) for t in [cache.pos, *cache.states.values()]]

    state, codes = streamer.open(), _codes((16, 100), seed=3)
    streamer.step([(state, codes[:, :10])])
    after_10 = layout()
    streamer.step([(state, codes[:, 10:100])])
    assert state.frames == 100 and cache.pos[state.slot].item() == 100
    assert layout() == after_10
    cfg = model.config
    kv = [t for m, t in cache.states.items() if m in set(model.pre_transformer.modules())]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    window_kv = (3, 2, cfg.num_key_value_heads, 71, head_dim)  # [slots + scratch, k|v, heads, frames, hd]
    assert [tuple(t.shape) for t in kv] == [window_kv] * cfg.num_hidden_layers
