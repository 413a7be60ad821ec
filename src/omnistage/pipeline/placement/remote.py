"""The driver's handle of a stage replica in another process (`placement: process` or `ray`), with the
interface of a local stage (`stage_handle.py`), over a `Link` to the replica's `ReplicaHost`.

`add` queues a payload (the request's plain copy with its first payload to that replica), `abort` its
abort, both in order under one lock; a sender thread hands everything queued meanwhile to the replica in one
call. A pump thread drains the replica's events and dispatches each to the driver's request (its deltas,
usage, parts done) or to the orchestrator's router (payloads for the next stage).

A replica that dies (its process killed or crashed, its worker thread dead) fails the requests it held, and
only them; while it is started again (`respawn`, the same build) the router sends it nothing new
(`on_state`). Without `respawn`, or past `MAX_RESTARTS`, the stage is dead: the engine fails every request.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any, Protocol

from omnistage.engine.request import Request
from omnistage.outputs import Usage
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.faults import EngineDeadError
from omnistage.pipeline.placement.replica_host import Event, request_spec
from omnistage.pipeline.thinker.growth import PromptPiece

logger = logging.getLogger(__name__)

DRAIN_WAIT_S = 0.2  # an idle replica's drain returns after this long: the bound on how stale `stats` are
MAX_RESTARTS = 3  # a replica that dies more often than this is left dead (the engine fails)


class Link(Protocol):
    """The way to one replica's `ReplicaHost`."""

    def info(self) -> dict[str, Any]: ...

    def start(self) -> None: ...

    def send(self, ops: list[tuple]) -> None: ...

    def drain(self, timeout: float) -> tuple[list[Event], dict[str, int | float]]:
        """Raises when the replica is gone."""

    def kill(self) -> None:
        """After its death (or to make sure of it)."""

    def close(self) -> None:
        """Lets go of it for good (the engine stops): `closed` from then on, its end is no death."""

    @property
    def closed(self) -> bool: ...


class RemoteStage:
    """A stage replica in another process, as the orchestrator sees it."""

    def __init__(self, link: Link, name: str, stage: tuple[str, int], to_next: Callable | None,
                 on_error: Callable[..., None], lookup: Callable[[str], Request | None],
                 on_state: Callable[[str, int, bool], None] | None = None,
                 respawn: Callable[[], Link] | None = None, on_stop: Callable[[], Any] | None = None,
                 same_clock: bool = False) -> None:
        """`stage`: (stage name, replica index); `to_next`: the orchestrator's router for this stage's
        payloads; `lookup`: the driver's request in flight by id (None once finished or aborted); `on_state`:
        told when the replica goes down and is up again; `respawn`: builds the replica anew; `on_stop`:
        after the replica is gone; `same_clock`: the replica's `perf_counter` is this process's (one host),
        so its copies' phases go into the driver's requests."""
        self.link, self.name, self.stage_key, self.to_next = link, name, stage, to_next
        self.same_clock = same_clock
        self.on_error, self.lookup, self.on_state, self.respawn, self.on_stop = (
            on_error, lookup, on_state, respawn, on_stop)
        info = link.info()
        self.kv_capacity: int | None = info["kv_capacity"]
        self.talker_kv_capacity: int | None = info.get("talker_kv_capacity")  # a pipeline's (placement: pipeline)
        self._stats: dict[str, int | float] = info["stats"]
        # the requests the replica was sent a plain copy of (weak: an entry goes with its request)
        self._opened: weakref.WeakValueDictionary[str, Request] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self.state = "up"  # "restarting" while started again, "dead" for good
        self.restarts = 0
        self._stopping = False
        self._outgoing: Inbox[tuple] = Inbox(threading.Event())
        self._pump = self._pump_thread()
        self._sender = threading.Thread(target=self._send, name=f"omnistage-{name}-send", daemon=True)

    def add(self, item: Any) -> None:
        req = item if isinstance(item, Request) else item.request
        payload = None if item is req else replace(item, request=None)
        # NOTE: under the lock with `abort`: an add never overtakes the abort of its request.
        with self._lock:
            down = self.state != "up"
            if not (req.aborted or down):
                spec = None
                if (first := self._opened.get(req.request_id) is not req) or _renews(payload):
                    self._opened[req.request_id] = req
                    spec = request_spec(req, whole=first or payload.restart)
                self._outgoing.put(("add", req.request_id, spec, payload))
        if down and not req.aborted:  # NOTE: routed here as it went down: it fails rather than waits forever
            self.on_error(EngineDeadError(f"stage {self.name} is {self.state}"), [req])

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self.state == "up":
                self._outgoing.put(("abort", request_id, None, None))

    def _send(self) -> None:
        while not self._stopping:
            ops = self._outgoing.wait_drain(DRAIN_WAIT_S)
            if ops and self.state == "up":
                self.link.send(ops)

    def stats(self) -> dict[str, int | float]:
        return {**self._stats, "restarts": self.restarts}

    @property
    def num_active(self) -> int:
        return int(self._stats["active"])

    @property
    def alive(self) -> bool:
        return self.state != "dead" or self._stopping

    def start(self) -> None:
        self.link.start()
        self._pump.start()
        self._sender.start()

    def stop(self) -> None:
        self._stopping = True
        self.link.close()
        self._pump.join(timeout=10)
        self._sender.join(timeout=10)
        if self.on_stop is not None:
            self.on_stop()

    def _pump_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"omnistage-{self.name}-pump", daemon=True)

    def _run(self) -> None:
        while not self._stopping:
            try:
                events, self._stats = self.link.drain(DRAIN_WAIT_S)
            except Exception as e:  # NOTE: the replica died (killed, its node lost, its process crashed)
                if not (self._stopping or self.link.closed):  # NOTE: closed: a group member stopped first
                    self._died(f"its process died: {e!r}")
                return
            for kind, request_id, payload, usage, finish_reason, phases in events:
                if kind == "dead":
                    return self._died(payload)
                self._dispatch(kind, request_id, payload, usage, finish_reason, phases if self.same_clock else {})

    def _died(self, why: str) -> None:
        logger.error("stage %s: %s", self.name, why)
        again = self.respawn is not None and self.restarts < MAX_RESTARTS
        with self._lock:
            self.state = "restarting" if again else "dead"
            held = [r for r in self._opened.values() if self.lookup(r.request_id) is r]
            self._opened.clear()
            self._outgoing.drain()
        if self.on_state is not None:
            self.on_state(*self.stage_key, False)
        error = EngineDeadError(f"stage {self.name}: {why}")
        self.on_error(error, held)
        if not again:
            return self.on_error(error)
        try:
            self.link.kill()
        except Exception:  # NOTE: it is gone either way: the new one must still be started
            logger.exception("stage %s: killing its process", self.name)
        threading.Thread(target=self._restart, name=f"omnistage-{self.name}-restart", daemon=True).start()

    def _restart(self) -> None:
        self.restarts += 1
        try:
            link = self.respawn()
            info = link.info()
            link.start()
        except Exception as e:
            logger.exception("stage %s: could not be started again", self.name)
            with self._lock:
                self.state = "dead"
            return self.on_error(EngineDeadError(f"stage {self.name}: could not be started again: {e!r}"))
        with self._lock:
            self.link, self._stats, self.state = link, info["stats"], "up"
        self._pump = self._pump_thread()
        self._pump.start()
        logger.warning("stage %s: started again (restart %d)", self.name, self.restarts)
        if self.on_state is not None:
            self.on_state(*self.stage_key, True)

    def _dispatch(self, kind: str, request_id: str, payload: Any, usage: Usage | None,
                  finish_reason: str | None, phases: dict[str, float] | None) -> None:
        req = self.lookup(request_id)
        if req is None:
            return  # finished or aborted meanwhile
        if kind == "fail":
            return self.on_error(RuntimeError(f"stage {self.name}: {payload}"), [req])
        if kind == "part_done" or (kind == "next" and payload.finished):
            self._opened.pop(request_id, None)  # NOTE: its part here is done: this replica's death spares it
        try:
            merge(req, usage, finish_reason, phases)
            if kind == "emit":
                if payload.phases is not None:  # NOTE: a pipeline's finishing delta: its copy's and ours
                    merge(req, Usage(), None, payload.phases)
                    payload = replace(payload, phases=dict(req.phases))
                req.emit(payload)
            elif kind == "part_done":
                req.part_done()
            else:
                self.to_next(replace(payload, request=req))
        except Exception as e:  # NOTE: as a local stage's per-request faults: the request fails, not the stage
            logger.exception("stage %s: request %s failed", self.name, request_id)
            self.on_error(e, [req])


def merge(req: Request, usage: Usage, finish_reason: str | None, phases: dict[str, float] | None) -> None:
    """What a stage's copy of the request has set into the driver's request: each usage field is set by one
    stage only (counts only grow), the finish reason by the thinker, each phase by the first stage reaching it."""
    for f in fields(Usage):
        if getattr(usage, f.name) > getattr(req.usage, f.name):
            setattr(req.usage, f.name, getattr(usage, f.name))
    if finish_reason is not None:
        req.finish_reason = finish_reason
    for phase, t in (phases or {}).items():
        req.phases.setdefault(phase, t)


def _renews(payload: Any) -> bool:
    """A growing prompt's piece that closes or restarts it: the request's prompt changed (`PromptPiece`)."""
    return isinstance(payload, PromptPiece) and (payload.closed or payload.restart)


def build_remote(placement: str, *args: Any, **kwargs: Any) -> Any:
    """The `StageHandles` of a remote placement ("process", "pipeline" or "ray"; each module imported only
    when chosen: Ray is optional)."""
    if placement == "ray":
        from omnistage.pipeline.placement.ray import build_ray_stages as build
    elif placement == "pipeline":
        from omnistage.pipeline.placement.pipeline import build_pipeline_stages as build
    else:
        from omnistage.pipeline.placement.groups import build_process_stages as build
    return build(*args, **kwargs)
