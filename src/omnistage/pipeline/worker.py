"""Drives one stage in its own thread, on its own CUDA stream when on a GPU.

A stage's state is touched only by its worker's thread: inputs arrive through the stage's inbox and
aborts through `controls`, both thread-safe; a stage never waits on another.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from omnistage.pipeline.connector import Inbox

logger = logging.getLogger(__name__)


class StageWorker:
    def __init__(self, name: str, stage: Any, device: torch.device,
                 on_error: Callable[[BaseException], None]) -> None:
        self.name, self.stage, self.device, self.on_error = name, stage, device, on_error
        self.wake = threading.Event()
        self.stage.inbox.wake = self.wake
        self.controls: Inbox[str] = Inbox(self.wake)
        self._stop = False
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
        return torch.cuda.stream(torch.cuda.Stream(self.device))

    def _run(self) -> None:
        try:
            with self._stream():
                while not self._stop:
                    self.wake.clear()
                    for request_id in self.controls.drain():
                        self.stage.abort(request_id)
                    if not self.stage.step():
                        self.wake.wait(timeout=0.1)
        except BaseException as e:  # NOTE: a failed stage fails every request in flight, loudly
            logger.exception("stage %s failed", self.name)
            self.on_error(e)
