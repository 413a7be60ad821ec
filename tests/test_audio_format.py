from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from omnistage.outputs import SAMPLE_RATE
from omnistage.server.audio_format import (
    SUPPORTED_FORMATS,
    AudioStreamEncoder,
    check_format,
    encode,
    to_pcm16,
    wav_stream_header,
)
from omnistage.server.errors import OpenAIError

N = 12345  # not a multiple of any codec frame size


def speech_like(n: int = N, seed: int = 0) -> np.ndarray:
    t = np.arange(n) / SAMPLE_RATE
    noise = np.random.default_rng(seed).standard_normal(n) * 0.02
    return (0.4 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1330 * t) + noise).astype(np.float32)


def test_to_pcm16_scales_rounds_and_clips():
    x = np.array([0.0, 1.0, -1.0, 1.7, -3.0, 0.5, -0.25, 1e-5, np.nan, np.inf], dtype=np.float32)
    assert to_pcm16(x).tolist() == [0, 32767, -32767, 32767, -32767, 16384, -8192, 0, 0, 32767]
    assert to_pcm16(x).dtype == np.dtype("<i2")


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_files_decode_exactly(fmt):
    x = speech_like()
    info = sf.info(io.BytesIO(encode(x, fmt)))
    assert (info.samplerate, info.channels, info.frames, info.subtype) == (SAMPLE_RATE, 1, N, "PCM_16")
    decoded, sr = sf.read(io.BytesIO(encode(x, fmt)), dtype="int16")
    assert sr == SAMPLE_RATE
    np.testing.assert_array_equal(decoded, to_pcm16(x))


@pytest.mark.parametrize("fmt", ["pcm16", "pcm"])
def test_raw_pcm_is_s16le(fmt):
    x = speech_like()
    data = encode(x, fmt)
    assert len(data) == 2 * N
    np.testing.assert_array_equal(np.frombuffer(data, "<i2"), to_pcm16(x))


@pytest.mark.parametrize("fmt, subtype", [("mp3", "MPEG_LAYER_III"), ("opus", "OPUS")])
def test_lossy_files_when_available(fmt, subtype):
    if fmt not in SUPPORTED_FORMATS:
        with pytest.raises(OpenAIError, match=f"'{fmt}' is not supported"):
            encode(speech_like(), fmt)
        return
    x = speech_like(SAMPLE_RATE)
    data = encode(x, fmt)
    info = sf.info(io.BytesIO(data))
    assert (info.samplerate, info.channels, info.subtype) == (SAMPLE_RATE, 1, subtype)
    decoded, _ = sf.read(io.BytesIO(data), dtype="float32")
    assert decoded.shape == (SAMPLE_RATE,)
    # the tones survive: correlation with the input, not just any audio
    assert np.corrcoef(decoded, x)[0, 1] > 0.9


def test_aac_is_a_400_naming_the_supported_formats():
    assert "aac" not in SUPPORTED_FORMATS  # libsndfile has no AAC encoder
    with pytest.raises(OpenAIError) as err:
        check_format("aac")
    e = err.value
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", "audio.format")
    assert e.message.endswith("supported: " + ", ".join(SUPPORTED_FORMATS))
    assert {"wav", "flac", "pcm16", "pcm"} <= set(SUPPORTED_FORMATS)


def test_streams_only_pcm_and_wav():
    assert check_format("wav", stream=True) == "wav"
    with pytest.raises(OpenAIError, match="response_format: 'flac' is not supported for streamed audio; "
                                          "supported: wav, pcm16, pcm"):
        AudioStreamEncoder("flac", param="response_format")


def test_wav_stream_concatenates_to_one_exact_file():
    n = 1920 * 60 + 77  # 4 codec frames, 25, 25, then a partial tail
    x = speech_like(n)
    encoder = AudioStreamEncoder("wav")
    chunks = [encoder.encode(c) for c in np.array_split(x, [1920 * 4, 1920 * 29, 1920 * 54])]
    assert chunks[0][:44] == wav_stream_header() and len(chunks[0]) == 44 + 2 * 1920 * 4
    assert [len(c) for c in chunks[1:]] == [2 * 1920 * 25, 2 * 1920 * 25, 2 * (1920 * 6 + 77)]
    decoded, sr = sf.read(io.BytesIO(b"".join(chunks)), dtype="int16")
    assert sr == SAMPLE_RATE and decoded.shape == (n,)
    np.testing.assert_array_equal(decoded, to_pcm16(x))
    # and the streamed body equals the whole-file body's samples
    whole, _ = sf.read(io.BytesIO(encode(x, "wav")), dtype="int16")
    assert b"".join(chunks)[44:] == encode(x, "pcm16") == whole.tobytes()


def test_pcm_stream_has_no_header():
    encoder = AudioStreamEncoder("pcm16")
    x = speech_like(100)
    assert encoder.encode(x[:60]) + encoder.encode(x[60:]) == encode(x, "pcm16")


def test_empty_audio():
    assert encode(np.zeros(0, np.float32), "pcm16") == b""
    assert sf.info(io.BytesIO(encode(np.zeros(0, np.float32), "wav"))).frames == 0
