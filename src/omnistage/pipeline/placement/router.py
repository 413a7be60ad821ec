"""Sticky least-loaded routing of requests over a stage's replicas."""

from __future__ import annotations

import threading


class Router:
    """A request goes to the replica with the fewest requests at its first payload and stays there."""

    def __init__(self, num_replicas: int) -> None:
        self.load = [0] * num_replicas
        self._of: dict[str, int] = {}
        self._lock = threading.Lock()

    def pick(self, request_id: str) -> int:
        with self._lock:
            i = self._of.get(request_id)
            if i is None:
                i = min(range(len(self.load)), key=self.load.__getitem__)
                self._of[request_id] = i
                self.load[i] += 1
            return i

    def release(self, request_id: str) -> None:
        with self._lock:
            i = self._of.pop(request_id, None)
            if i is not None:
                self.load[i] -= 1
