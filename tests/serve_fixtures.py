"""Server fixtures for tests/test_server_*.py, loaded as a plugin (`pytest_plugins`, never imported directly,
so pytest can rewrite its asserts), each process started when a test first needs it and kept for the session:
`server` (no key, local media from `media` and loopback media URLs allowed) and `keyed_server` (--api-key KEY)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import soundfile as sf

from serve_process import KEY, Server


@pytest.fixture(scope="session")
def media(tmp_path_factory):
    """The folder `server` may read local media from: tone.wav."""
    folder = tmp_path_factory.mktemp("media")
    sf.write(folder / "tone.wav", 0.3 * np.sin(np.arange(32000) * 0.2), 16000)
    return folder


def started(tmp_path_factory, name: str, *args: str):
    server = Server(tmp_path_factory.mktemp("serve") / f"{name}.log", *args)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory, media, tiny_dir):  # tiny_dir: the checkpoint is written before the server looks
    yield from started(tmp_path_factory, "main", "--allowed-local-media-path", str(media),
                       "--allow-private-media-urls", "--stage-overrides", '{"thinker": {"max_batch_size": 8}}')


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory, tiny_dir):
    yield from started(tmp_path_factory, "keyed", "--api-key", KEY)


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
