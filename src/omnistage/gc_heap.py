"""Python's cyclic garbage collector in a serving process. A full collection walks every object it tracks and
holds the GIL meanwhile: in a tiny-checkpoint server ~440 000 objects (torch, transformers, the tokenizer, the
modules), 198 ms on a 2-core CPU, longer than a 2-frame first audio packet plays (~137 ms). Python runs one only
once the objects promoted since the last outnumber a quarter of the long-lived ones (none came in 400 requests
of that server). `freeze_heap` puts what start-up made out of the collector's reach (`gc.freeze`, as vLLM and
SGLang do once started); `PauseWatch` logs collections that take a threshold or longer."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

SLOW_PAUSE_S = 0.02


def freeze_heap() -> int:
    """Collects once, then freezes every object left (start-up's: they live as long as the process); the count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class PauseWatch:
    """A `gc.callbacks` entry: each collection timed, those of `threshold_s` or longer logged."""

    def __init__(self, name: str, threshold_s: float = SLOW_PAUSE_S) -> None:
        self.name, self.threshold_s = name, threshold_s
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        if took >= self.threshold_s:
            logger.warning("%s: a garbage collection of generation %d took %.0f ms (%d objects collected)",
                           self.name, info["generation"], took * 1e3, info["collected"])


def settle_heap(name: str) -> None:
    """Once a process is built: its start-up heap frozen (logged) and its slow collections watched."""
    frozen = freeze_heap()
    logger.info("%s: %d start-up objects frozen out of garbage collection", name, frozen)
    gc.callbacks.append(PauseWatch(name))
