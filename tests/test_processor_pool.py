"""Prompt processing in worker processes (`ProcessorPool`, deploy `mm_processor_workers`): the same prompt as the
in-process processor, media errors with their message and item, a dead worker's pool started again, and the
engine's chat requests through it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from media_samples import data_url, mp4_bytes, png_bytes, wav_bytes

from omnistage.media import MediaError
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.prompt import PromptInputs, PromptProcessor
from omnistage.pipeline.processor_pool import ProcessorPool, _warmed

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
    {"type": "input_audio", "input_audio": {"data": data_url(wav_bytes(1.5, 24000), "x").split(",")[1],
                                            "format": "wav"}},
    {"type": "image_url", "image_url": {"url": data_url(png_bytes(70, 50), "image/png")}},
    {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(20, 10, audio_seconds=2.0), "video/mp4")}},
    {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def pool():
    p = ProcessorPool(tiny_checkpoint("tiny"), None, {"image": {"max_pixels": 64 * 64}}, torch.float32, 2)
    yield p
    p.close()


def assert_same(a: PromptInputs, b: PromptInputs) -> None:
    assert a.input_ids == b.input_ids and a.media_keys == b.media_keys
    for name in ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
                 "video_grid_thw", "video_second_per_grid"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name


@pytest.mark.parametrize("pipe", [False, True])  # the tensors back through shared memory / the pipe
def test_the_same_prompt_as_in_process(pool: ProcessorPool, pipe: bool) -> None:
    local = PromptProcessor(tiny_checkpoint("tiny"), None, {"image": {"max_pixels": 64 * 64}})
    shared, pool.pipe = pool.pipe, pipe
    try:
        for use_audio_in_video in (False, True):
            ours = pool(MESSAGES, use_audio_in_video)
            assert ours.pixel_values is not None and ours.pixel_values_videos is not None
            assert_same(ours, local(MESSAGES, use_audio_in_video))
    finally:
        pool.pipe = shared


def test_workers_share_the_intra_op_threads(pool: ProcessorPool) -> None:
    """At torch's default each worker would run a team as large as the machine."""
    threads = {pool._pool.submit(torch.get_num_threads).result() for _ in range(8)}
    assert threads == {max(1, torch.get_num_threads() // 2)}


def test_every_worker_warms_before_its_first_request(pool: ProcessorPool) -> None:
    """A worker left cold pays PyAV's import and the decoders' first uses in a request (suspected in an H100's c = 64
    video burst through 8 workers: its first request's TTFP 1.8 s, against ~0.45 in threads)."""
    warm = {pool._pool.submit(_warmed).result() for _ in range(8)}
    assert warm == {True} and len(pool._pool._processes) == 2


def test_bfloat16_patches_through_the_pipe() -> None:
    half = ProcessorPool(tiny_checkpoint("tiny"), None, None, torch.bfloat16, 1)
    try:
        half.pipe = True
        ours = half(MESSAGES)
        assert ours.pixel_values.dtype == torch.bfloat16
        assert_same(ours, PromptProcessor(tiny_checkpoint("tiny"), patch_dtype=torch.bfloat16)(MESSAGES))
    finally:
        half.close()


def test_media_errors_keep_their_message_and_item(pool: ProcessorPool) -> None:
    bad = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(MediaError) as e:
        pool(bad)
    assert e.value.param == "messages[0].content[1]" and "image" in str(e.value)


def test_a_dead_worker_is_replaced(pool: ProcessorPool) -> None:
    before = pool._pool
    pool(MESSAGES)  # every worker up
    for pid in list(before._processes):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not before._broken and time.monotonic() < deadline:
        time.sleep(0.05)
    assert before._broken
    assert pool(MESSAGES).pixel_values is not None and pool._pool is not before  # went again on a new pool


def test_the_engine_processes_chat_prompts_in_workers() -> None:
    from omnistage.config_loader import default_deploy_config, load_deploy_config
    from omnistage.entrypoints.omni import Omni

    d = tiny_checkpoint("tiny")
    deploy = load_deploy_config(default_deploy_config(d), platform="cpu", overrides={"mm_processor_workers": 1})
    omni = Omni(d, deploy=deploy, device="cpu")
    try:
        assert isinstance(omni.engine.process, ProcessorPool)
        req = omni.engine.make_request("w", MESSAGES, None, want_audio=False, voice=None,
                                       sampling={"temperature": 0, "max_tokens": 2}, talker_sampling={},
                                       emit=lambda d: None)
        assert_same(req.prompt, omni.engine.processor(MESSAGES))
        calls, pool = [], omni.engine.process
        omni.engine.process = lambda *a: calls.append(1) or pool(*a)
        photo, spoken = ([{"role": "user", "content": [MESSAGES[1]["content"][i], MESSAGES[1]["content"][3]]}]
                         for i in (1, 0))
        assert [p["type"] for p in photo[0]["content"] + spoken[0]["content"]] == [
            "image_url", "text", "input_audio", "text"]
        for messages in (MESSAGES, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], photo, spoken):
            omni.engine.make_request("t", messages, None, want_audio=False, voice=None, sampling={"max_tokens": 2},
                                     talker_sampling={}, emit=lambda d: None)
        assert calls == [1, 1, 1]  # the video's, the photo's and the clip's go there; text stays in the process
    finally:
        omni.engine.shutdown()
