"""Shared by the placement tests: an engine of a remote placement and its local twin on the same deploy config,
greedy requests on them, their results compared."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from omnistage.config import DeployConfig
from omnistage.entrypoints.omni import ChatResult, Omni

from graph_helpers import settle
from test_engine import conv, greedy
from test_prompt_stream import HISTORY, assert_same, speech, streamed, whole

VOICES = ["Ethan", "Aiden", "Chelsie"]


@contextlib.contextmanager
def twins(d: Path, deploy: DeployConfig, placement: str, device: str = "cpu",
          local_deploy: DeployConfig | None = None) -> Iterator[tuple[Omni, Omni]]:
    """(the engine with `placement`, the local one on `local_deploy`, default `deploy`), both shut down afterwards."""
    remote = local = None
    try:
        remote = Omni(d, deploy=deploy, device=device, placement=placement)
        local = Omni(d, deploy=local_deploy or deploy, device=device)
        yield remote, local
    finally:
        for o in (remote, local):
            if o is not None:
                o.engine.shutdown()


def start(o: Omni, ids: list[str], tokens: int, frames: int, session: str | None = None) -> list[ChatResult]:
    """Greedy requests (every fourth one text only; all with `frames` 0), added to the engine; their streams
    fill the results."""
    results = [ChatResult() for _ in ids]
    for i, (rid, r) in enumerate(zip(ids, results)):
        o.engine.add_request(o.engine.make_request(
            rid, conv(i), None, want_audio=i % 4 != 3 and frames > 0, voice=VOICES[i % 3], emit=r.add,
            session=session, **greedy(tokens, max(frames, 1))))
    return results


def run(o: Omni, ids: list[str], tokens: int, frames: int, session: str | None = None) -> list[ChatResult]:
    results = start(o, ids, tokens, frames, session)
    settle(lambda: check(all(r.finish_reason is not None for r in results)), 60)
    return results


def check(flag: bool) -> None:
    assert flag


def same(x: ChatResult, y: ChatResult, audio_atol: float = 1e-6) -> None:
    assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason == "length"
    assert x.usage == y.usage
    if y.codes is not None:
        assert np.array_equal(x.codes, y.codes)
        np.testing.assert_allclose(x.audio, y.audio, atol=audio_atol)


def gpu_twins(placement: str) -> contextlib.AbstractContextManager[tuple[Omni, Omni]]:
    """`twins` on the GPU: the tiny checkpoint in float32 without graphs, KV caches of 16 MiB (in bytes: the remote
    engine's share of the GPU would otherwise leave its local twin nothing)."""
    import torch

    from omnistage.config_loader import default_deploy_config, load_deploy_config
    from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint

    torch.cuda.empty_cache()  # NOTE: memory this process keeps cached counts as another process's to its children
    d, small, kv = tiny_checkpoint("tiny"), {"cuda_graph": False, "dtype": "float32"}, 16 << 20
    stages = {"thinker": {**small, "kv_cache_memory": kv}, "talker": {**small, "kv_cache_memory": kv},
              "code2wav": small}
    # NOTE: the twin is local whatever the default file's placement
    cfg = load_deploy_config(default_deploy_config(d), platform="cuda",
                             overrides={"placement": "local", "stages": stages})
    return twins(d, cfg, placement, "cuda")


def streamed_turn(remote: Omni, local: Omni, thinkers: list[str]) -> None:
    """Streaming input across the process boundary: the turn's prefix and windows go to a thinker in another
    process while it is spoken, which runs steps on them before close (`thinkers`: their stats' names). An
    earlier audio that ends off the hop makes the turn's prefix inexact: at the pause the request starts over
    from the whole prompt, which goes with the restarting piece (the far copy of the request starts from it),
    and closes with one row; the answer is the whole clip's on the local engine (the local case:
    test_prompt_stream_history.py)."""
    audio = speech()[:9 * 16000]
    earlier = {"role": "user", "content": [{"type": "audio", "audio": speech()[16000:56077]}, "Hi."]}
    messages = [*HISTORY, earlier, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "And this?"}]
    before = remote.engine.stats()

    def steps() -> int:
        after = remote.engine.stats()
        return sum(after[t]["steps"] - before[t]["steps"] for t in thinkers)

    def prefilled(stream) -> int:
        settle(lambda: check(steps() > 0), 30)
        stream.req.mark("turn_end")  # NOTE: as the realtime session marks it, in this process
        return steps()

    out, stream, sent, early_steps = streamed(messages, np.concatenate([audio, np.zeros(4000, np.float32)]),
                                              close_with=audio, paused=(len(audio),), o=remote,
                                              before_close=prefilled)
    assert_same(out, whole(messages, audio, local))
    assert early_steps > 0 and stream.closed_prepared
    # the finishing delta's phases: this process's mark and the far stages' (one host, one clock), in order
    order = ["turn_end", "first_token", "talker_start", "first_frame", "first_audio"]
    assert set(order) <= set(out.phases) and sorted(order, key=out.phases.get) == order
    assert [(p.restart, p.closed) for p in sent[-2:]] == [(True, False), (False, True)]
