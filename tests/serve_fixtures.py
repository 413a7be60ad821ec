"""Server fixtures for tests/test_server_*.py, loaded as a plugin (`pytest_plugins`, never imported directly,
so pytest can rewrite its asserts), so one pair of processes serves the whole session: `server` (no key,
local media and loopback media URLs allowed) and the second of `servers` (--api-key KEY)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import soundfile as sf

from serve_process import KEY, Server


@pytest.fixture(scope="session")
def servers(tmp_path_factory, tiny_dir):  # tiny_dir: the checkpoint is written before the servers look for it
    tmp = tmp_path_factory.mktemp("serve")
    media = tmp / "media"
    media.mkdir()
    sf.write(media / "tone.wav", 0.3 * np.sin(np.arange(32000) * 0.2), 16000)
    main = Server(tmp / "main.log", "--allowed-local-media-path", str(media), "--allow-private-media-urls",
                  "--stage-overrides", '{"thinker": {"max_batch_size": 8}}')
    keyed = Server(tmp / "keyed.log", "--api-key", KEY)
    try:
        main.wait_ready()
        keyed.wait_ready()
        yield main, keyed, media
    finally:
        main.stop()
        keyed.stop()


@pytest.fixture(scope="session")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
