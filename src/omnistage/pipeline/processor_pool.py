"""Prompt processing in worker processes (deploy `mm_processor_workers`): each worker holds its own
`PromptProcessor` and takes whole requests (media fetched and decoded, features, patches, the chat template).

In the serving process the processing runs in the engine client's threads beside the stages' worker threads, all
sharing one GIL; under load the media wait for each other and hold up the stages' host work (on the H200 at
c = 64 a 4 s video's `prompt` phase is 0.7 s against 0.08 s at c = 1, benchmarks/HISTORY.md). Workers are
spawned (the serving process has CUDA and threads: no fork), each answers `PromptInputs` whose tensors come back
through shared memory (torch's reductions: a handle each), or, where /dev/shm has less than 1 GiB free (a
container's is often 64 MB), as numpy arrays through the pipe, whose reading takes the GIL once per 64 KB: on the
2-core CPU beside one busy Python thread a 4 s video took 228 ms the first way, 557 ms the second, 1.3 s in a
thread of the serving process. A worker that dies (a decoder crashing on a file) breaks the pool: it
is started again and the requests it held go once more; one that breaks it twice is refused (400).
The way there and back costs each request time: on the 2-core CPU a 4 s video's 36 ms of processing took 48 ms
through one worker with float32 patches (~4 ms the round trip, ~10 ms its 13.8 MB of tensors), 37 ms with bfloat16
ones (the GPU's case), a photo's 5-7 ms 9-15 ms. On the H200 at c = 64 with 8 workers a video's `prompt` phase
took 666 ms against 740 in threads, a photo's 452 against 59 (photos queue for the workers, and in threads their
Pillow and numpy work releases the GIL). Those workers ran torch's default intra-op team each (as many threads as
cores, spinning between ops); they share the cores now: on the 2-core CPU 64 spoken prompts at once through 2 workers
took 2.1-3.8 s that way, 0.40-0.52 s so, and on a 16-core host 8 workers take every kind of media's burst faster than
the threads (`Orchestrator._process`, which sends them every prompt with media). Served on an H100 at c = 64 (8 against
0, `93d549e`): the `prompt` phase spoken 49 against 82-102 ms, video 196 against 419-472, photo alike; TTFP -5 to -11 %.
Each worker warms its media paths as it starts (`_start`), before its first request.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.media import MediaError, MediaPolicy
from omnistage.media.warm import warm_media
from omnistage.models.qwen3_omni.prompt import PromptInputs, PromptProcessor

logger = logging.getLogger(__name__)
_processor: PromptProcessor | None = None  # a worker's own
_warm = False  # whether this worker's warm-up ran (`_start`)
SHARED_MEMORY_NEEDED = 1 << 30  # /dev/shm free for the prompts in flight (c = 64 videos: ~0.3 GB)


def _start(model_dir: str, policy: MediaPolicy | None, limits: dict | None, dtype: torch.dtype, threads: int) -> None:
    global _processor, _warm
    torch.set_num_threads(threads)
    _processor = PromptProcessor(model_dir, policy, limits, dtype)
    _warm = warm_media(_processor)


def _warmed() -> bool:
    return _warm


def _process(messages: list[dict[str, Any]], use_audio_in_video: bool, pipe: bool) -> PromptInputs:
    assert _processor is not None
    out = _processor(messages, use_audio_in_video)
    return _packed(out, _to_bytes) if pipe else out


def _to_bytes(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype]:
    """A tensor as a numpy array of its bits (bfloat16 has no numpy dtype) and its dtype."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy(), t.dtype


def _from_bytes(packed: tuple[np.ndarray, torch.dtype]) -> torch.Tensor:
    return torch.from_numpy(packed[0]).view(packed[1])


def _packed(p: PromptInputs, convert: Any) -> PromptInputs:
    """`p` with every tensor converted (`_to_bytes` in the worker, `_from_bytes` back)."""
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    return dataclasses.replace(p, **{k: convert(v) for k, v in fields.items()
                                     if v is not None and k not in ("input_ids", "use_audio_in_video", "media_keys")})


def shared_memory_bytes() -> int:
    """Free bytes of /dev/shm, where torch's shared CPU tensors live (0 without one)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class ProcessorPool:
    """Called as a `PromptProcessor` is: (messages, use_audio_in_video) -> `PromptInputs`."""

    def __init__(self, model_dir: str | Path, policy: MediaPolicy | None, limits: dict | None, dtype: torch.dtype,
                 workers: int) -> None:
        """`PromptProcessor(model_dir, policy, limits, dtype)` in each of `workers` processes, this process's
        intra-op threads shared between them."""
        threads = max(1, torch.get_num_threads() // workers)
        self.workers, self._args = workers, (str(model_dir), policy, limits, dtype, threads)
        self.pipe = shared_memory_bytes() < SHARED_MEMORY_NEEDED
        self._lock = threading.Lock()
        self._pool = self._new_pool()
        for _ in range(workers):  # NOTE: a submit with no idle worker spawns one: all start (and warm) now
            self._pool.submit(_warmed)

    def __call__(self, messages: list[dict[str, Any]], use_audio_in_video: bool = False) -> PromptInputs:
        for _ in range(2):  # NOTE: a dead worker breaks the whole pool: the others' requests go again once
            pool = self._pool
            try:
                out = pool.submit(_process, messages, use_audio_in_video, self.pipe).result()
                return _packed(out, _from_bytes) if self.pipe else out
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
