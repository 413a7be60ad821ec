"""Drives one stage in its own thread, on its own CUDA stream when on a GPU.

A stage's state is touched only by its worker's thread: inputs arrive through the stage's inbox and
aborts through `controls`, both thread-safe; a stage never waits on another.
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.faults import MAX_UNBLAMED_FAILURES, is_fatal

logger = logging.getLogger(__name__)


class StageWorker:
    def __init__(self, name: str, stage: Any, device: torch.device,
                 on_error: Callable[..., None], priority: int = 0) -> None:
        """`on_error(error, requests)`: those requests failed (the stage has let go of them);
        `on_error(error)`: the stage is dead. `priority`: its CUDA stream's (negative runs first)."""
        self.name, self.stage, self.device, self.on_error = name, stage, device, on_error
        self.priority = priority
        self._unblamed = 0  # consecutive failed steps with no request to blame
        self.failed_requests = 0  # requests this stage failed (for the metrics)
        self.steps, self.busy_seconds, self.step_rows = 0, 0.0, 0  # steps that ran rows, busy wall time, rows
        self.wake = threading.Event()
        self.stage.inbox.wake = self.wake
        self.controls: Inbox[str] = Inbox(self.wake)
        self._stop = False
        self._trace: Any = None  # OMNISTAGE_STEP_TRACE's file (see `_traced`)
        self._thread = threading.Thread(target=self._run, name=f"omnistage-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self._thread.join(timeout=10)

    def abort(self, request_id: str) -> None:
        self.controls.put(request_id)

    def _stream(self) -> contextlib.AbstractContextManager:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        torch.cuda.set_device(self.device)
        return torch.cuda.stream(torch.cuda.Stream(self.device, priority=self.priority))

    @contextlib.contextmanager
    def _profiled(self) -> Iterator[None]:
        """With OMNISTAGE_PROFILE_DIR set, cProfile this worker's thread into DIR/<name>.prof at stop.
        NOTE: from Python 3.12 a profiler sees every thread and only one may run: the first worker's
        file then holds all threads, the others profile nothing."""
        out = os.environ.get("OMNISTAGE_PROFILE_DIR")
        prof = cProfile.Profile() if out else None
        try:
            if prof is not None:
                prof.enable()
        except ValueError:  # another profiler is active (Python >= 3.12)
            prof = None
        try:
            yield
        finally:
            if prof is not None:
                prof.disable()
                prof.dump_stats(os.path.join(out, f"{self.name}.prof"))

    @contextlib.contextmanager
    def _traced(self) -> Iterator[None]:
        """With OMNISTAGE_STEP_TRACE=DIR, one JSON line per step that ran rows into DIR/<name>.jsonl: its start
        (perf_counter s, one clock for every stage of the process), wall ms, rows and new input rows (`tokens`:
        prompt and decode tokens, talker prompt rows, codec frames); on CUDA also `cuda` (`allocator_totals`)."""
        out = os.environ.get("OMNISTAGE_STEP_TRACE")
        # NOTE: line-buffered: a killed server keeps every step it traced
        self._trace = open(os.path.join(out, f"{self.name}.jsonl"), "w", buffering=1) if out else None
        try:
            yield
        finally:
            if self._trace is not None:
                self._trace.close()

    def _run(self) -> None:
        try:
            with self._stream(), self._profiled(), self._traced():
                while not self._stop:
                    self.wake.clear()
                    for request_id in self.controls.drain():
                        self.stage.abort(request_id)
                    if not self._step():
                        self.wake.wait(timeout=0.1)
        except BaseException as e:  # NOTE: a failed stage fails every request in flight, loudly
            logger.exception("stage %s failed", self.name)
            self.on_error(e)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or self._stop

    def _step(self) -> bool:
        """One step; a failure is its requests' (see pipeline/faults.py), a fatal one ends the worker."""
        self.stage.step_requests = []
        start = time.perf_counter()
        try:
            busy = self.stage.step()
            self._unblamed = 0
            if busy:  # NOTE: a step that only completes earlier work (async output, ends) runs no rows
                ran = self.stage.last_batch > 0
                self.steps, self.step_rows = self.steps + ran, self.step_rows + self.stage.last_batch
                self.busy_seconds += time.perf_counter() - start
                if ran and self._trace is not None:
                    self._trace.write(json.dumps({
                        "t": round(start, 6), "ms": round(1e3 * (time.perf_counter() - start), 3),
                        "rows": self.stage.last_batch, "tokens": getattr(self.stage, "last_tokens", None),
                        **allocator_totals(self.device)}) + "\n")
        except Exception as e:
            blamed = list(self.stage.step_requests)
            self._unblamed = 0 if blamed else self._unblamed + 1
            if is_fatal(e) or self._unblamed >= MAX_UNBLAMED_FAILURES:
                raise
            logger.exception("stage %s: a step failed; failing its %d request(s)", self.name, len(blamed))
            self._fail(blamed, e)
            busy = True
        for req, e in self.stage.faults.drain():
            logger.error("stage %s: request %s failed: %r", self.name, req.request_id, e, exc_info=e)
            self._fail([req], e)
        return busy

    def _fail(self, requests: list, error: Exception) -> None:
        for req in requests:
            self.stage.abort(req.request_id)
        self.failed_requests += len(requests)
        if requests:
            self.on_error(error, requests)


def allocator_totals(device: torch.device) -> dict[str, list[int]]:
    """{"cuda": [device allocations, frees, allocations retried after the allocator freed its cache]} of the CUDA
    caching allocator on `device` so far (each a stall of the device; every stage on it shows the same); {}
    elsewhere."""
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {"cuda": [s.get("num_device_alloc", 0), s.get("num_device_free", 0), s.get("num_alloc_retries", 0)]}
