"""Sticky least-loaded routing of requests over a stage's replicas, skipping replicas that are down."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection

from omnistage.config import DeployConfig
from omnistage.pipeline.faults import NoReplicaError

MAX_SESSIONS = 4096  # sessions whose replica is remembered (least recently routed forgotten first)


class Router:
    """A request goes to the replica with the fewest requests at its first payload and stays there; a request
    of a `session` (a realtime session, a chat `prompt_cache_key`) goes where the session's last one went while
    that replica is up, so the session's history stays in one prefix cache. `prefer`: replicas to choose among
    first (those on the device of the request's replica in the stage before: no copy between GPUs, and with
    `placement: process` one process fewer that the request depends on)."""

    def __init__(self, num_replicas: int) -> None:
        self.load = [0] * num_replicas
        self.down: set[int] = set()
        self._of: dict[str, int] = {}
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def pick(self, request_id: str, session: str | None = None, prefer: Collection[int] = ()) -> int:
        with self._lock:
            i = self._of.get(request_id)
            if i is None:
                i = self._sessions.get(session) if session is not None else None
                if i is None or i in self.down:
                    i = self._least_loaded(prefer)
                if session is not None:
                    self._remember(session, i)
                self._of[request_id] = i
                self.load[i] += 1
            return i

    def _least_loaded(self, prefer: Collection[int]) -> int:
        up = [i for i in range(len(self.load)) if i not in self.down]
        if not up:
            raise NoReplicaError("every replica of the stage is restarting")
        return min([i for i in up if i in prefer] or up, key=self.load.__getitem__)

    def replica_of(self, request_id: str) -> int | None:
        """Where the request went (None: not routed, or released)."""
        return self._of.get(request_id)

    def _remember(self, session: str, i: int) -> None:
        self._sessions[session] = i
        self._sessions.move_to_end(session)
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def release(self, request_id: str) -> None:
        with self._lock:
            i = self._of.pop(request_id, None)
            if i is not None:
                self.load[i] -= 1

    def set_up(self, replica: int, up: bool) -> None:
        """A replica that is down takes no new request (its sessions move to another)."""
        with self._lock:
            (self.down.discard if up else self.down.add)(replica)


def near_replicas(deploy: DeployConfig, before: str, stage: str) -> dict[int, tuple[int, ...]]:
    """Per replica of `before`: the replicas of `stage` on its deploy device (the router's first choice)."""
    devices = deploy.stage(stage).replica_devices
    return {i: tuple(j for j, d in enumerate(devices) if d == dev)
            for i, dev in enumerate(deploy.stage(before).replica_devices)}
