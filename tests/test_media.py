"""Media parts decoded by `to_conversation`: each part kind, the items' order and options, frame sampling as
qwen-omni-utils samples, and the errors (each naming its item)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from media_samples import check_error, data_url, m4a_bytes, mp4_bytes, peak_hz, png_bytes, user, wav_bytes
from PIL import Image

from omnistage.media import MediaError, VideoItem, to_conversation
from omnistage.media.video import num_frames


def b64(data: bytes) -> str:
    return data_url(data, "x").split(",", 1)[1]


WAV44 = wav_bytes(1.0, 44100, channels=2)


def test_audio_parts_decode_to_16k_mono():
    mime = base64.encodebytes(WAV44).decode()  # line breaks every 76 characters
    parts = [{"type": "input_audio", "input_audio": {"data": mime, "format": "wav"}},
             {"type": "audio_url", "audio_url": {"url": data_url(WAV44, "audio/wav")}},
             {"type": "audio", "audio": data_url(m4a_bytes(1.0), "audio/mp4")},  # not libsndfile: PyAV
             {"type": "audio", "audio": data_url(WAV44, "audio/wav"), "audio_start": 0.25, "audio_end": 0.75},
             {"type": "audio", "audio": np.ones(16000, np.float32), "audio_start": 0.5},
             "What do you hear?"]
    items = to_conversation(user(*parts))
    lengths = [a.size for a in items.audios]
    assert lengths[:2] == [16000, 16000] and 16000 <= lengths[2] <= 16800 and lengths[3:] == [8000, 8000]
    assert all(a.dtype == np.float32 and a.ndim == 1 for a in items.audios)
    assert [round(peak_hz(a)) for a in items.audios[:4]] == [440] * 4
    np.testing.assert_array_equal(items.audios[0], items.audios[1])
    content = items.conversation[0]["content"]
    assert [p["type"] for p in content] == ["audio"] * 5 + ["text"] and content[3]["audio_start"] == 0.25
    assert content[0]["audio"] is items.audios[0] and content[5] == {"type": "text", "text": "What do you hear?"}


def test_image_parts():
    png = png_bytes(40, 30)
    pil = Image.new("L", (8, 6), 77)
    items = to_conversation(user({"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
                                 {"type": "image", "image": data_url(png_bytes(40, 30, rgba=True), "image/png"),
                                  "max_pixels": 50176, "resized_height": 56},
                                 {"type": "image", "image": pil}))
    first, clear, grey = items.images
    assert first.mode == clear.mode == grey.mode == "RGB" and first.size == (40, 30)
    assert np.asarray(first)[29, 39].tolist() == [195, 203, 0]
    assert np.asarray(clear)[0, 0].tolist() == [255, 255, 255]  # transparent -> white
    assert np.asarray(clear)[29, 39].tolist() == [195, 203, 0]
    assert np.asarray(grey)[0, 0].tolist() == [77, 77, 77]
    assert items.image_options == [{}, {"max_pixels": 50176, "resized_height": 56}, {}]
    assert items.conversation[0]["content"][1] == {"type": "image", "image": clear, "max_pixels": 50176,
                                                   "resized_height": 56}


def test_video_sampling_and_audio_track():
    clip = data_url(mp4_bytes(20, 10, audio_seconds=2.0), "video/mp4")
    items = to_conversation(user({"type": "audio", "audio": data_url(WAV44, "audio/wav")},
                                 {"type": "video_url", "video_url": {"url": clip}},
                                 {"type": "video", "video": clip, "nframes": 6, "video_start": 0.5,
                                  "video_end": 1.5}), use_audio_in_video=True)
    whole, part = items.videos
    assert whole.frames.shape == (4, 48, 64, 3) and whole.frames.dtype == np.uint8  # 2 s at fps 2
    assert whole.frame_indices.tolist() == [0, 6, 13, 19] and whole.fps == 2.0 and whole.total_frames == 20
    np.testing.assert_allclose(whole.timestamps, [0.0, 0.6, 1.3, 1.9])
    assert np.abs(whole.frames[:, 10, 10, 0].astype(int) - [0, 60, 130, 190]).max() <= 4
    assert part.total_frames == 11 and part.frames.shape[0] == 6 and part.fps == pytest.approx(6 / 11 * 10)
    np.testing.assert_allclose(part.timestamps[[0, -1]], [0.5, 1.5])
    assert [a.size for a in items.audios][0] == 16000 and items.audios[1] is whole.audio
    assert items.audios[2] is part.audio and abs(part.audio.size - 16000) <= 400 and round(peak_hz(whole.audio)) == 440
    assert items.video_options == [{"fps": 2.0}, {"nframes": 6, "video_start": 0.5, "video_end": 1.5,
                                                  "fps": part.fps}]
    plain = to_conversation(user({"type": "video", "video": clip}))
    assert plain.videos[0].audio is None and plain.audios == []


def test_video_as_frames():
    frames = [data_url(png_bytes(40, 30), "image/png")] * 3
    video = to_conversation(user({"type": "video", "video": frames, "fps": 4})).videos[0]
    assert video.frames.shape == (4, 30, 40, 3) and video.fps == 4.0  # padded to an even count
    np.testing.assert_allclose(video.timestamps, [0, 0.25, 0.5, 0.75])
    given = VideoItem(video.frames, 1.0, np.arange(4.0), np.arange(4), 1.0, 4)
    assert to_conversation(user({"type": "video", "video": given})).videos[0] is given


@pytest.mark.parametrize("options, total, fps, expected", [
    ({}, 300, 30.0, 20), ({"fps": 1.5}, 300, 30.0, 14), ({}, 5, 10.0, 4), ({}, 7, 30.0, 4), ({"fps": 1}, 90, 30.0, 4), ({"fps": 30}, 91, 30.0, 90),
    ({"nframes": 7}, 50, 25.0, 8), ({"nframes": 9}, 50, 25.0, 8), ({"fps": 2, "max_frames": 9}, 900, 30.0, 8),
    ({"fps": 2, "min_frames": 11}, 100, 25.0, 12), ({}, 100000, 30.0, 768)])
def test_num_frames_as_qwen_omni_utils(options, total, fps, expected):
    assert num_frames(options, total, fps, 768) == expected


@pytest.mark.parametrize("options, total", [({}, 1), ({"nframes": 10}, 8), ({"fps": 1, "nframes": 4}, 90)])
def test_num_frames_refused(options, total):
    with pytest.raises(MediaError):
        num_frames(options, total, 30.0, 768)


@pytest.mark.parametrize("part, needle", [
    ({"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}},
     "messages[0].content[1] (input_audio): invalid base64 data"),
    ({"type": "input_audio", "input_audio": {"data": b64(b"RIFF junk"), "format": "wav"}},
     "messages[0].content[1] (input_audio): cannot decode audio"),
    ({"type": "image_url", "image_url": {"url": data_url(b"\x89PNG junk", "image/png")}},
     "messages[0].content[1] (image_url): cannot decode image"),
    ({"type": "video_url", "video_url": {"url": data_url(b"\x00\x00\x00 ftypisom junk", "video/mp4")}},
     "messages[0].content[1] (video_url): cannot decode video"),
    ({"type": "video", "video": data_url(wav_bytes(), "audio/wav")}, "(video): no video stream"),
    ({"type": "video", "video": data_url(mp4_bytes(), "video/mp4")}, "(video): no audio track"),
    ({"type": "audio_url", "audio_url": {"url": "ftp://host/a.wav"}}, "unsupported URL scheme 'ftp'"),
    ({"type": "audio", "audio": np.zeros((2, 5))}, "(audio): audio arrays must be mono"),
    ({"type": "audio", "audio": data_url(WAV44, "audio/wav"), "audio_start": 2.0}, "audio is empty"),
    ({"type": "image", "image": 5}, "(image): an image is a URL, a path or a PIL image, not int"),
    ({"type": "sticker"}, "messages[0].content[1]: unsupported content part type 'sticker'"),
    ({"type": "image_url", "image_url": {"url": ""}}, "(image_url): no image given"),
])
def test_errors_name_the_item(part, needle):
    check_error(user("Look:", part), needle, use_audio_in_video=True)


def test_the_warm_up_message_takes_every_media_path(caplog):
    from omnistage.media.warm import warm_media, warm_message
    from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
    from omnistage.models.qwen3_omni.prompt import PromptProcessor

    message = warm_message()
    items = to_conversation([message], None, use_audio_in_video=True)
    assert [len(items.audios), len(items.images), len(items.videos)] == [2, 1, 1]  # the clip, the video's track
    assert items.videos[0].frames.shape == (8, 240, 320, 3) and 64000 <= items.videos[0].audio.size <= 65100  # aac pads
    assert items.images[0].size == (640, 480) and items.audios[0].size == 64000 and np.abs(items.audios[0]).max() > 0.05  # 24 kHz resampled
    processor = PromptProcessor(tiny_checkpoint("tiny"))
    with caplog.at_level("INFO", logger="omnistage.media.warm"):
        assert warm_media(processor)
    assert "media path warmed" in caplog.text and "failed" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="omnistage.media.warm"):
        assert not warm_media(lambda *a, **k: 1 / 0)  # a failing warm-up is logged, serving goes on
    assert "warm-up failed" in caplog.text
