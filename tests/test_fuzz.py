"""Fuzzing /v1/chat/completions and /v1/audio/speech from the server's own OpenAPI schema (schemathesis +
hypothesis, derandomized: the same examples every run) against the real engine on the tiny checkpoint.
Positive cases (schema-valid; for chat, most get a valid conversation so sampling, modalities and audio
fields reach the engine) and negative cases (schema-invalid): never a 5xx, every error in OpenAI's shape,
and afterwards the engine is healthy and holds nothing."""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from starlette.testclient import TestClient

from omnistage.config import DEPLOY_DIR
from omnistage.config_loader import load_deploy_config
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.server.app import create_app

EXAMPLES = 100  # per endpoint and mode
CONVERSATIONS = [
    [{"role": "user", "content": "Say hello."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Again, in French."}],
]
EXPECTED = {200, 400, 404, 413, 429}
SEEN: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def api():
    """The app on a small engine: 128-token KV caches (larger asks are 400s) and short default answers."""
    overrides = {"thinker": {"kv_cache_memory": 2, "sampling": {"max_tokens": 8}},
                 "talker": {"kv_cache_memory": 2, "sampling": {"max_frames": 8}}}
    deploy = load_deploy_config(DEPLOY_DIR / "qwen3_omni_moe.yaml", "cpu", overrides)
    engine = AsyncOmni(tiny_checkpoint("tiny"), deploy=deploy, device="cpu")
    app = create_app(engine, "qwen3-omni-tiny", deploy, engine.engine.voices)
    yield engine, app, schemathesis.openapi.from_asgi("/openapi.json", app)
    engine.shutdown()


def with_conversation(case, conversation, keep: bool):
    if not keep and isinstance(case.body, dict):
        case.body = {**case.body, "messages": conversation}
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/speech"])
def test_no_5xx_from_fuzzed_requests(api, path, mode):
    engine, _, schema = api
    cases = schema[path]["POST"].as_strategy(generation_mode=mode)
    if path.endswith("completions") and mode == GenerationMode.POSITIVE:
        keep = st.integers(0, 3).map(bool)  # 1 in 4 keeps its generated messages
        cases = st.builds(with_conversation, cases, st.sampled_from(CONVERSATIONS), keep)

    @given(case=cases)
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    def call(case) -> None:
        response = case.call()
        SEEN[path, mode.value, response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code in EXPECTED, (response.status_code, response.text)
        if response.status_code != 200:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    call()
    statuses = {s: n for (p, m, s), n in SEEN.items() if (p, m) == (path, mode.value)}
    assert sum(statuses.values()) >= EXAMPLES // 2, statuses
    if mode == GenerationMode.POSITIVE:
        assert statuses.get(200, 0) >= 10, statuses  # the engine really ran many of them
    assert engine.error is None and engine.admission.requests == 0
    for name, s in engine.stats().items():
        assert s["active"] == 0 and s.get("kv_blocks_used", 0) == 0, (name, s)


USER = '"messages": [{"role": "user", "content": "Hi"}]'
BY_HAND = [  # what attacking the server by hand found (each was a 500 before its fix), and its neighbours
    ("/v1/chat/completions", '{%s, "seed": 18446744073709551616}' % USER, "seed must fit in 64 bits"),
    ("/v1/chat/completions", '{%s, "top_k": 1180591620717411303424}' % USER, "top_k must fit in 64 bits"),
    ("/v1/chat/completions", '{%s, "modalities": ["audio"], "talker": {"seed": -%d}}' % (USER, 2**63 + 1),
     "seed must fit in 64 bits"),
    ("/v1/audio/speech", '{"input": "Hi", "seed": 36893488147419103232}', "seed must fit in 64 bits"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    ("/v1/audio/speech", '{"input": "a\\udfff"}', "valid string"),
    ("/v1/chat/completions", "[" * 50000, "error parsing the body"),
    ("/v1/chat/completions", '{%s, "max_tokens": %d}' % (USER, 10**30), "exceeds the thinker's KV cache"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}' % ("word " * 200),
     "exceeds the thinker's KV cache"),
    ("/v1/audio/speech", '{"input": "Hi", "max_audio_frames": %d}' % 2**70, "exceeds the talker's KV cache"),
    ("/v1/chat/completions", '{"messages": 1e999}', "messages"),
]


@pytest.mark.parametrize("path, body, message", BY_HAND)
def test_hostile_requests_found_by_hand(api, path, body, message):
    engine, app, _ = api
    r = TestClient(app).post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert engine.error is None
