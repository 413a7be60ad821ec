"""A session's input audio on its way to server VAD. An append is taken at once; a task of the feed's own
hands the detector everything appended since its last call, in one piece, and then the session the turns it
found.

Were each append awaited in turn, a session could score at most one append per VAD tick: when the worker's
ticks run long (under load it waits for the GIL behind the stage threads), every append adds its wait to the
next, and the turn's end is heard later the longer the user speaks (on the H200 at bfdff15, 32 sessions' 20 s
turns were heard ending 1.17 s after the speech, their 2 s turns 0.62 s). In one piece, a session that fell
behind catches up in its next tick. Other client events drain the feed first (the session's `handle`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import numpy as np

from omnistage.server.realtime.vad import TurnDetector, TurnEvent

logger = logging.getLogger(__name__)
OnFed = Callable[[list[TurnEvent], int], Awaitable[None]]


class TurnFeed:
    def __init__(self, detector: TurnDetector, on_fed: OnFed) -> None:
        """`on_fed(turns, fed)`: the detector has scored the first `fed` samples pushed and found `turns`
        in them (called in order, one at a time)."""
        self.detector, self.on_fed = detector, on_fed
        self.fed = 0  # 24 kHz samples scored and handed on
        self._pending: list[np.ndarray] = []
        self._task: asyncio.Task | None = None

    def push(self, pcm: np.ndarray) -> None:
        """int16 mono 24 kHz (kept, not copied)."""
        self._pending.append(pcm)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def drain(self) -> None:
        """Once everything pushed so far has been scored and its turns handled."""
        while self._task is not None and not self._task.done():
            await asyncio.wait([self._task])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while self._pending:
            pcm = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
            self._pending = []
            try:
                turns = await self.detector.feed(pcm)
            except Exception:  # NOTE: the VAD worker failed this call; later audio is scored anew
                logger.exception("server VAD failed on a session's audio")
                turns = []
            self.fed += pcm.size
            try:
                await self.on_fed(turns, self.fed)
            except Exception:  # NOTE: the session lives on (its handlers make error events of what they can)
                logger.exception("handling a session's turns failed")
