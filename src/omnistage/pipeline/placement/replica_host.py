"""The far side of a remote stage replica (`placement: process`: a worker process; `placement: ray`: a Ray
actor): the replica built by `placement.build_sized_replicas`, driven by its own `StageWorker` thread as in the
local placement, its KV cache sized by `sizing.py` with a per-host budget (see `ReplicaHost.__init__`).

A request reaches the replica once as a plain copy (`request_spec`), then its payloads by id. What the stage
does to a request (output deltas, a part done, payloads for the next stage, failures) queues as an `Event` in
the outbox, which the driver's `RemoteStage` pump drains and dispatches to the driver's request and router.
Payload tensors are copied to the CPU before they leave the replica.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch

from omnistage.engine.request import Request
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.placement.local import (
    Placement, build_sized_replicas, replica_names, replica_worker, tts_embeds)
from omnistage.pipeline.placement.sizing import kv_shares
from omnistage.pipeline.placement.stage_handle import kv_capacity, worker_stats

# The Request fields the stages read: a request's plain copy in a replica is built from these.
SPEC_FIELDS = ("request_id", "prompt", "sampling", "talker_sampling", "seed", "voice", "want_audio",
               "growing")

# (kind, request id, payload, the copy's usage, its finish_reason, its phases or None: unchanged); kinds: "emit"
# (an OutputDelta), "part_done", "next" (a payload for the next stage, its request stripped), "fail" and "dead"
# (payload: the error's repr; "dead" has no request).
Event = tuple[str, str | None, Any, Any, str | None, dict[str, float] | None]


def build_order(replicas: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The order replicas are built in: code2wav (no KV cache) first, then the thinkers, the talkers last."""
    rank = {"code2wav": 0, "thinker": 1, "talker": 2}
    return sorted(replicas, key=lambda r: rank[r[0]])


def request_spec(req: Request, whole: bool = True) -> dict[str, Any]:
    """The fields, and the driver's `arrival` (the copy's phases count from it); not `whole`: only what a
    closing piece changes in a copy that has the request (`renew`)."""
    if not whole:
        return {"growing": req.growing, "media_keys": req.prompt.media_keys}
    return {**{f: getattr(req, f) for f in SPEC_FIELDS}, "arrival": req.arrival}


def request_copy(spec: dict[str, Any], emit: Callable[[Any], None]) -> Request:
    """The replica's plain copy of a request from its `request_spec`."""
    req = Request(**{f: spec[f] for f in SPEC_FIELDS}, emit=emit)
    req.arrival = spec["arrival"]
    return req


def renew(req: Request, spec: dict[str, Any]) -> None:
    """A copy's prompt from a later spec: a growing request's, sent again with the piece that closes or
    restarts it (`RemoteStage.add`), which the thinker reads from the request (`PromptPiece`). A closing
    piece's spec brings only the whole prompt's media keys (its prefix hashes'): the copy keeps the prompt its
    thinker admitted, or will admit before the pieces that bring the rest; never the features again (MBs)."""
    req.prompt = spec["prompt"] if "prompt" in spec else replace(req.prompt, media_keys=spec["media_keys"])
    req.growing = spec["growing"]


def to_cpu(payload: Any) -> Any:
    """A payload dataclass with its tensors (nested dataclasses' too) copied to the CPU, compact (a view
    would pickle its whole storage)."""
    changes = {}
    for f in fields(payload):
        v = getattr(payload, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = v.to("cpu", copy=True)
        elif is_dataclass(v):
            changes[f.name] = to_cpu(v)
    return replace(payload, **changes)


class ReplicaHost:
    """`handle` takes batches of adds and aborts in the driver's order; `drain` (another thread may wait in
    it meanwhile) hands the events queued since the last drain."""

    def __init__(self, p: Placement, name: str, replica: int, worker_name: str, tokenizer: Any = None,
                 tts: torch.Tensor | None = None, rebuilt: bool = False) -> None:
        """`rebuilt`: started again after it died, the others running: it takes all its device has left."""
        # NOTE: a per-replica budget: of what its GPU has left when it starts, its share among the replicas on
        # its deploy device index still to be built (in `build_order`, one after another): the last takes all.
        order = [(n, i) for n, i, _ in build_order(replica_names(p))]
        key = (name, replica)
        later = [key] if rebuilt else order[order.index(key):]
        groups = {(n, i): p.deploy.stage(n).replica_devices[i] for n, i in later}
        stage = build_sized_replicas(p, [key], kv_shares(p, groups), {name: lambda chunk: self._to_next(chunk)},
                                     tokenizer=tokenizer, tts=tts)[key]
        self._attach(p, name, replica, worker_name, stage, threading.Event())

    def _attach(self, p: Placement, name: str, replica: int, worker_name: str, stage: Any,
                wake: threading.Event) -> None:
        """`wake`: set by every event queued (shared by the replicas of one process: `GroupHost`)."""
        self.p, self.stage = p, stage
        self.outbox: Inbox[Event] = Inbox(wake)
        self.requests: dict[str, Request] = {}  # the plain copies of the requests this replica serves
        self.phases_sent: dict[str, int] = {}  # per request: how many of its copy's phases went out
        self.worker = replica_worker(p, name, worker_name, stage, p.place(name, replica)[0], self._on_error)

    def info(self) -> dict[str, Any]:
        return {"kv_capacity": kv_capacity(self.stage), "stats": worker_stats(self.worker)}

    def tts_embeds(self) -> torch.Tensor | None:
        """A thinker replica's tts embeddings, for the talker replicas (None: not a thinker, or no audio)."""
        if not hasattr(self.stage, "thinker") or not self.p.config.enable_audio_output:
            return None
        return tts_embeds(self.p, self.stage.thinker).to("cpu", copy=True)

    def start(self) -> None:
        self.worker.start()

    def handle(self, ops: list[tuple[str, str, dict[str, Any] | None, Any]]) -> None:
        """(`"add"`, request_id, spec, payload) and (`"abort"`, request_id, ...) in the driver's order."""
        for op, request_id, spec, payload in ops:
            if op == "abort":
                self.abort(request_id)
            else:
                self.add(request_id, spec, payload)

    def add(self, request_id: str, spec: dict[str, Any] | None, payload: Any) -> None:
        """`spec` comes with a request's first payload to this replica (and again when its prompt changed);
        `payload` None: the request itself."""
        req = self.requests.get(request_id)
        if req is None:
            if spec is None or "prompt" not in spec:
                return  # NOTE: this replica is done with it (a talker that ended before the thinker did)
            req = self._open(spec)
        elif spec is not None:
            renew(req, spec)
        self.stage.add(req if payload is None else replace(payload, request=req))

    def abort(self, request_id: str) -> None:
        self.phases_sent.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.aborted = True
        self.worker.abort(request_id)

    def drain(self, timeout: float) -> tuple[list[Event], dict[str, int | float]]:
        """The events queued so far (waits up to `timeout` s for one), and the stage's stats now."""
        return self.outbox.wait_drain(timeout), worker_stats(self.worker)

    def _open(self, spec: dict[str, Any]) -> Request:
        req = request_copy(spec, lambda delta: self._event("emit", req, delta))
        # NOTE: the driver's request counts the parts done (the thinker's and code2wav's are in two replicas).
        req.part_done = lambda: self._event("part_done", req, forget=True)
        self.requests[req.request_id] = req
        return req

    def _event(self, kind: str, req: Request, payload: Any = None, forget: bool = False) -> None:
        """The copy's phases go along only when it reached a new one (a few times a request, not per token)."""
        phases = dict(req.phases) if len(req.phases) > self.phases_sent.get(req.request_id, 0) else None
        if phases is not None:
            self.phases_sent[req.request_id] = len(phases)
        if forget:
            self.requests.pop(req.request_id, None)
            self.phases_sent.pop(req.request_id, None)
        self.outbox.put((kind, req.request_id, payload, replace(req.usage), req.finish_reason, phases))

    def _to_next(self, chunk: Any) -> None:
        self._event("next", chunk.request, to_cpu(replace(chunk, request=None)), forget=chunk.finished)

    def _on_error(self, error: BaseException, requests: list[Request] | None = None) -> None:
        """As the orchestrator's: those requests failed here, or (no `requests`) the stage is dead."""
        if requests is None:
            self.outbox.put(("dead", None, repr(error), None, None, None))
        for req in requests or []:
            self.requests.pop(req.request_id, None)
            self.phases_sent.pop(req.request_id, None)
            self.outbox.put(("fail", req.request_id, repr(error), None, None, None))


class GroupHost:
    """Several replicas in one process (`placement: process`: those of one deploy device, one CUDA context), their
    KV caches sized together as the local placement sizes a device's; `ReplicaHost`'s interface over all of them,
    ops and events tagged by the member's index (`handle((i, ops))`; `drain`: per member, in order)."""

    def __init__(self, p: Placement, members: list[tuple[str, int, str]], tokenizer: Any = None,
                 tts: torch.Tensor | None = None) -> None:
        self.wake = threading.Event()
        hosts: dict[tuple[str, int], ReplicaHost] = {}
        keys = [(n, i) for n, i, _ in members]
        after = {k: (lambda chunk, k=k: hosts[k]._to_next(chunk)) for k in keys}
        stages = build_sized_replicas(p, keys, kv_shares(p, {k: p.place(*k)[0] for k in keys}), after,
                                      tokenizer=tokenizer, tts=tts)
        for n, i, w in members:
            hosts[n, i] = ReplicaHost.__new__(ReplicaHost)
            hosts[n, i]._attach(p, n, i, w, stages[n, i], self.wake)
        self.hosts = [hosts[k] for k in keys]

    def info(self) -> list[dict[str, Any]]:
        return [h.info() for h in self.hosts]

    def tts_embeds(self) -> torch.Tensor | None:
        return next((t for h in self.hosts if (t := h.tts_embeds()) is not None), None)

    def start(self) -> None:
        for h in self.hosts:
            h.start()

    def handle(self, tagged: tuple[int, list[tuple]]) -> None:
        self.hosts[tagged[0]].handle(tagged[1])

    def drain(self, timeout: float) -> tuple[list[list[Event]], list[dict[str, int | float]]]:
        self.wake.wait(timeout)
        self.wake.clear()  # NOTE: before draining: an event queued meanwhile sets it again
        return [h.outbox.drain() for h in self.hosts], [worker_stats(h.worker) for h in self.hosts]
