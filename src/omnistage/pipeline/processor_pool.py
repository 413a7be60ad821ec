"""Prompt processing in worker processes (deploy `mm_processor_workers`): each worker holds its own
`PromptProcessor` and takes whole requests (media fetched and decoded, features, patches, the chat template).

In the serving process the processing runs in the engine client's threads beside the stages' worker threads, all
sharing one GIL; under load the media wait for each other and hold up the stages' host work (on the H200 at
c = 64 a 4 s video's `prompt` phase is 0.7 s against 0.08 s at c = 1, benchmarks/HISTORY.md). Workers are
spawned (the serving process has CUDA and threads: no fork), each answers `PromptInputs` whose tensors come back
through shared memory (torch's reductions). A worker that dies (a decoder crashing on a file) breaks the pool: it
is started again and the requests it held go once more; one that breaks it twice is refused (400).
The way there and back costs each request time: on the 2-core CPU a 4 s video's 36 ms of processing took 48 ms
through one worker with float32 patches (~4 ms the round trip, ~10 ms its 13.8 MB of tensors), 37 ms with bfloat16
ones (the GPU's case), a photo's 5-7 ms 13-15 ms; so it pays only where requests' processing overlaps (off by
default: not yet measured on the H200).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch

from omnistage.media import MediaError, MediaPolicy
from omnistage.media.warm import warm_message
from omnistage.models.qwen3_omni.prompt import PromptInputs, PromptProcessor

logger = logging.getLogger(__name__)
_processor: PromptProcessor | None = None  # a worker's own


def _start(model_dir: str, policy: MediaPolicy | None, limits: dict | None, dtype: torch.dtype) -> None:
    global _processor
    _processor = PromptProcessor(model_dir, policy, limits, dtype)


def _process(messages: list[dict[str, Any]], use_audio_in_video: bool) -> PromptInputs:
    assert _processor is not None
    return _processor(messages, use_audio_in_video)


def _warmed(future: Future) -> None:
    if future.exception() is not None:
        logger.warning("a prompt-processing worker's warm-up failed: %r", future.exception())


class ProcessorPool:
    """Called as a `PromptProcessor` is: (messages, use_audio_in_video) -> `PromptInputs`."""

    def __init__(self, model_dir: str | Path, policy: MediaPolicy | None, limits: dict | None, dtype: torch.dtype,
                 workers: int) -> None:
        """`PromptProcessor(model_dir, policy, limits, dtype)` in each of `workers` processes."""
        self.workers, self._args = workers, (str(model_dir), policy, limits, dtype)
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        for _ in range(workers):  # NOTE: every worker starts and pays its first uses now, beside the stages' start
            self._pool.submit(_process, [warm_message()], True).add_done_callback(_warmed)

    def __call__(self, messages: list[dict[str, Any]], use_audio_in_video: bool = False) -> PromptInputs:
        for _ in range(2):  # NOTE: a dead worker breaks the whole pool: the others' requests go again once
            pool = self._pool
            try:
                return pool.submit(_process, messages, use_audio_in_video).result()
            except BrokenProcessPool:
                self._restart(pool)
        raise MediaError("the request's media could not be processed (its worker process died twice)")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start, initargs=self._args)

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:  # NOTE: the first of the requests that saw it broken starts the new one
                logger.error("a prompt-processing worker died; starting the pool again")
                broken.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
