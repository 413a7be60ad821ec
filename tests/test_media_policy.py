"""The media policy: limits, local files only under the allowed folder (symlinks, `..`), only plain image
and container formats."""

from __future__ import annotations

import argparse
import os

import pytest
from media_samples import check_error, data_url, mp4_bytes, png_bytes, user, wav_bytes

from omnistage.media import MediaError, MediaPolicy, to_conversation

WAV44 = wav_bytes(1.0, 44100, channels=2)


def test_limits():
    small = MediaPolicy(max_audio_seconds=0.5, max_video_seconds=1.0, max_image_pixels=1000, max_items=2)
    check_error(user({"type": "audio", "audio": data_url(WAV44, "a/wav")}), "audio is 1.0 s long, more than 0.5 s",
                small)
    check_error(user({"type": "video", "video": data_url(mp4_bytes(20, 10), "v/mp4")}),
                "(video): video is 2.0 s long, more than 1 s", small)
    check_error(user({"type": "image", "image": data_url(png_bytes(40, 30), "i/png")}),
                "image is 40x30, more than 1000 pixels", small)
    check_error(user(*[{"type": "image", "image": "x"}] * 3), "messages: 3 media items, more than 2", small)
    check_error(user({"type": "video", "video": ["x"] * 5}), "(video): a video given as frames needs 1 to 4",
                MediaPolicy(max_video_frames=4))
    check_error(user({"type": "video", "video": []}), "(video): a video given as frames needs 1 to 768")
    check_error(user({"type": "audio", "audio": data_url(wav_bytes(1.0), "a/wav")}), "larger than 20000 bytes",
                MediaPolicy(max_bytes=20000))
    many = to_conversation(user({"type": "video", "video": data_url(mp4_bytes(8, 4, (640, 480)), "v/mp4")}),
                           MediaPolicy(max_video_pixels=4 * 4800))
    assert many.videos[0].frames.shape == (4, 60, 80, 3)  # 4 frames: scaled down by ffmpeg to 4800 pixels each


@pytest.fixture
def media_dir(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.wav").write_bytes(wav_bytes(0.5))
    (outside / "secret.wav").write_bytes(wav_bytes(0.5))
    os.symlink(outside / "secret.wav", allowed / "link.wav")
    os.symlink(outside, allowed / "sub")
    return allowed, outside


def test_local_files_only_under_the_allowed_folder(media_dir):
    allowed, outside = media_dir
    policy = MediaPolicy(allowed_local_dir=str(allowed))
    for source in (f"file://{allowed}/a.wav", str(allowed / "a.wav"), "a.wav", f"file://{allowed}/../allowed/a.wav"):
        assert to_conversation(user({"type": "audio", "audio": source}), policy).audios[0].size == 8000, source
    for source in (f"file://{outside}/secret.wav", str(outside / "secret.wav"), "../outside/secret.wav",
                   f"file://{allowed}/../outside/secret.wav", "link.wav", "sub/secret.wav", "/etc/hostname"):
        message = check_error(user({"type": "audio", "audio": source}), "outside --allowed-local-media-path", policy)
        assert str(outside) not in message and "secret" not in message and "etc" not in message
    os.mkfifo(allowed / "fifo.wav")
    for name in ("missing.wav", "fifo.wav", "."):  # a FIFO would block a plain open()
        check_error(user({"type": "audio", "audio": name}), "(audio): local file not found", policy)
    check_error(user({"type": "audio", "audio": f"file://{allowed}/a.wav"}), "local files are not allowed")
    check_error(user({"type": "audio", "audio": f"file://host{allowed}/a.wav"}), "must name a local path", policy)


def test_only_plain_image_and_container_formats(tmp_path, monkeypatch):
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n"  # Pillow's EPS plugin would run Ghostscript
    with pytest.raises(MediaError, match=r"\(image\): cannot decode image") as e:
        to_conversation(user({"type": "image", "image": data_url(eps, "image/eps")}))
    assert type(e.value.__cause__).__name__ == "UnidentifiedImageError"
    monkeypatch.chdir(tmp_path)  # ffmpeg's concat demuxer would read these files (relative to the cwd)
    (tmp_path / "tone.wav").write_bytes(wav_bytes())
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes())
    for kind, name in (("audio", "tone.wav"), ("video", "clip.mp4")):
        concat = f"ffconcat version 1.0\nfile {name}\n".encode()
        with pytest.raises(MediaError, match=rf"\({kind}\): cannot decode {kind}"):
            to_conversation(user({"type": kind, kind: data_url(concat, "x")}))


def test_serve_flags(tmp_path):
    from omnistage.server.serve_args import add_serve_args
    from omnistage.server.media_args import media_policy

    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["--allowed-local-media-path", str(tmp_path), "--allowed-media-domains", "A.example",
                              "b.example", "--allow-private-media-urls", "--max-media-items", "3",
                              "--media-fetch-timeout", "2.5", "--max-video-seconds", "60"])
    assert media_policy(args) == MediaPolicy(allowed_local_dir=str(tmp_path), allowed_domains=("a.example", "b.example"),
                                             allow_private_urls=True, max_items=3, fetch_timeout_s=2.5,
                                             max_video_seconds=60.0)
    assert media_policy(parser.parse_args([])) == MediaPolicy()
    with pytest.raises(SystemExit, match="--allowed-local-media-path .*: not a directory"):
        media_policy(parser.parse_args(["--allowed-local-media-path", str(tmp_path / "nope")]))
