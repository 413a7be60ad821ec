"""`Omni.chat` takes the same media parts as the server, decoded under the policy given to `Omni`."""

from __future__ import annotations

import pytest
from media_samples import data_url, wav_bytes

from omnistage import Omni
from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.media import MediaError, MediaPolicy


def test_omni_chat_media_parts(tiny_dir, tmp_path):
    (tmp_path / "tone.wav").write_bytes(wav_bytes(1.0, 22050))
    deploy = load_deploy_config(default_deploy_config(tiny_dir), platform="cpu")
    omni = Omni(tiny_dir, deploy=deploy, device="cpu", media_policy=MediaPolicy(allowed_local_dir=str(tmp_path)))
    sampling = {"temperature": 0.0, "max_tokens": 4}

    def chat(part: dict):
        return omni.chat([{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
                         modalities=["text"], sampling=sampling)

    by_path = chat({"type": "audio", "audio": "tone.wav"})
    inline = chat({"type": "input_audio", "input_audio": {"data": data_url(wav_bytes(1.0, 22050), "x").split(",")[1],
                                                          "format": "wav"}})
    text_only = omni.chat([{"role": "user", "content": "What is it?"}], modalities=["text"], sampling=sampling)
    assert by_path.token_ids == inline.token_ids and by_path.usage.prompt_tokens == inline.usage.prompt_tokens
    assert by_path.usage.prompt_tokens == text_only.usage.prompt_tokens + 13 + 2  # 1 s: 13 audio rows + bos/eos
    with pytest.raises(MediaError, match=r"messages\[0\]\.content\[0\] \(audio\): local file is outside"):
        chat({"type": "audio", "audio": "/etc/hostname"})
