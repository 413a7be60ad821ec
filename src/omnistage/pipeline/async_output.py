"""The step of a stage that launches work on the device and completes it later (deploy `async_output`).

`step` launches this step (`_launch`: schedule, load, graph replay; nothing waits for the device), then
completes it at once or, with asynchronous output, completes the previous step while this one runs on the
device (`_complete`: the one host sync, then the outputs go on). Shared by the thinker, talker and code2wav
stages.
"""

from __future__ import annotations

from typing import Any

import torch


class AsyncOutputStep:
    async_output: bool = False
    pending: Any = None  # the launched step not completed yet
    last_batch: int = 0
    last_tokens: int = 0  # new input rows of the step just launched (`_tokens`)

    def _schedule(self) -> list: ...

    def _tokens(self, batch: list) -> int:
        return len(batch)

    def _launch(self, batch: list) -> Any: ...

    def _complete(self, launched: Any) -> None: ...

    @torch.no_grad()
    def step(self) -> bool:
        batch = self._schedule()
        self.last_batch, self.last_tokens = len(batch), self._tokens(batch)
        launched = self._launch(batch) if batch else None
        if self.async_output:
            launched, self.pending = self.pending, launched
        if launched is not None:
            self._complete(launched)
        return bool(batch) or launched is not None

    def _drain(self) -> None:
        """Complete the step in flight now (a step that needs its outputs on the host first)."""
        launched, self.pending = self.pending, None
        if launched is not None:
            self._complete(launched)
