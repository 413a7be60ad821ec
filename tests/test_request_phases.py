"""Per-request phase times: `Request.mark`, the six marks through the engine on the tiny checkpoint, and the
`omnistage_request_phase_seconds` histogram of a real server's /metrics."""

from __future__ import annotations

import asyncio
import functools
import re
import time

import httpx
import torch

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.engine.request import Request
from omnistage.entrypoints.async_omni import AsyncOmni
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.prompt import PromptInputs
from omnistage.outputs import OutputDelta
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams
from serve_process import MODEL, USER

pytest_plugins = ["serve_fixtures"]
PHASES = ["encoded", "thinker_start", "first_token", "talker_start", "first_frame", "code2wav_start", "first_audio"]


def test_mark_first_time_wins_and_the_finish_carries_a_copy() -> None:
    deltas: list[OutputDelta] = []
    req = Request("r", PromptInputs([1, 2]), SamplingParams(), TalkerSamplingParams(), 0, deltas.append)
    req.mark("a")
    time.sleep(0.002)
    req.mark("b")
    first = dict(req.phases)
    time.sleep(0.002)
    req.mark("a")
    req.mark("b")
    assert req.phases == first and list(first) == ["a", "b"]
    assert 0 <= first["a"] < first["b"] < time.perf_counter() - req.arrival
    req.part_done()
    assert [d.finished for d in deltas] == [True] and deltas[0].phases == first
    req.mark("c")
    assert "c" not in deltas[0].phases


@functools.cache
def omni() -> Omni:
    d = tiny_checkpoint("tiny")
    return Omni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu")


def run(want_audio: bool) -> list[OutputDelta]:
    o, deltas = omni(), []
    req = o.engine.make_request(f"r{want_audio}", [{"role": "user", "content": "Say hello."}], None,
                                want_audio=want_audio, voice=None, sampling={"temperature": 0, "max_tokens": 5},
                                talker_sampling={"max_frames": 6, "ignore_eos": True}, emit=deltas.append)
    o.engine.add_request(req)
    o.engine.wait([req.request_id])
    return deltas


def test_text_and_audio_reach_every_phase_in_order() -> None:
    deltas = run(want_audio=True)
    phases = deltas[-1].phases
    assert deltas[-1].finished and sorted(phases, key=phases.get) == PHASES, phases
    assert all(d.phases is None for d in deltas[:-1])
    assert 0 <= phases["thinker_start"] and phases["first_audio"] < 60


def test_text_only_has_only_the_thinker_phases() -> None:
    phases = run(want_audio=False)[-1].phases
    assert list(phases) == PHASES[:3] and phases["thinker_start"] <= phases["first_token"]


def test_prompts_are_processed_with_one_intra_op_thread(monkeypatch) -> None:
    """At torch's default each of a burst's processing threads would run a team as large as the machine."""
    torch.set_num_threads(2)  # NOTE: the default of threads yet to run a parallel op (conftest sets 1)
    d = tiny_checkpoint("tiny")
    engine = AsyncOmni(d, deploy=load_deploy_config(default_deploy_config(d), platform="cpu"), device="cpu")
    make, threads = engine.engine.make_request, []

    def recorded(*args, **kwargs) -> Request:
        threads.append(torch.get_num_threads())
        return make(*args, **kwargs)

    monkeypatch.setattr(engine.engine, "make_request", recorded)

    async def main() -> list[OutputDelta]:
        return [d async for d in engine.generate("t", [{"role": "user", "content": "Hi."}],
                                                 SamplingParams(max_tokens=2), None, None)]

    try:
        deltas = asyncio.run(main())
    finally:
        engine.shutdown()
        torch.set_num_threads(1)
    assert deltas[-1].finished and threads == [1]


def phase_counts(url: str) -> dict[str, int]:
    text = httpx.get(url + "/metrics").text
    return {p: int(n) for p, n in re.findall(r'omnistage_request_phase_seconds_count\{phase="(\w+)"\} (\d+)', text)}


def test_server_metrics_count_each_phase(server) -> None:
    before = phase_counts(server.url)
    body = {"model": MODEL, "messages": USER, "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    body |= {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}, "max_audio_frames": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    after = phase_counts(server.url)
    served = ["prompt_start", "prompt", *PHASES]  # the server's requests: their prompt's processing, begun, done
    assert {p: after[p] - before.get(p, 0) for p in served} == {p: 2 if p in served[:5] else 1 for p in served}
