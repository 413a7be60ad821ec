"""The actor side of `placement: ray`: one stage replica in a Ray actor, built by `placement.build_replica`
and driven by its own `StageWorker` thread, as in the local placement.

Its KV cache is sized by `sizing.py` as in the local placement, with a per-actor budget (see `__init__`).

A request reaches the actor once as a plain copy (`request_spec`), then its payloads by id. What the
stage does to a request (output deltas, a part done, payloads for the next stage, failures) queues as an
`Event` in the actor's outbox, which the driver's `RayStage` pump drains and dispatches to the driver's
request and router. Payload tensors are copied to the CPU before they leave the actor.
"""

from __future__ import annotations

import threading
from dataclasses import fields, is_dataclass, replace
from typing import Any

import ray
import torch

from omnistage.engine.request import Request
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.placement.local import (
    Placement, build_sized_replicas, replica_names, replica_worker, tts_embeds)
from omnistage.pipeline.placement.sizing import kv_shares
from omnistage.pipeline.placement.stage_handle import kv_capacity, worker_stats

# The Request fields the stages read: a request's plain copy in an actor is built from these.
SPEC_FIELDS = ("request_id", "prompt", "sampling", "talker_sampling", "seed", "voice", "want_audio")

# (kind, request id, payload, the copy's usage, the copy's finish_reason); kinds: "emit" (an OutputDelta),
# "part_done", "next" (a payload for the next stage, its request stripped), "fail" and "dead" (payload: the
# error's repr; "dead" has no request).
Event = tuple[str, str | None, Any, Any, str | None]


def build_order(replicas: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The order actors are built in: code2wav (no KV cache) first, then the thinker, the talkers last."""
    rank = {"code2wav": 0, "thinker": 1, "talker": 2}
    return sorted(replicas, key=lambda r: rank[r[0]])


def request_spec(req: Request) -> dict[str, Any]:
    return {f: getattr(req, f) for f in SPEC_FIELDS}


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


@ray.remote(concurrency_groups={"outbox": 1})
class StageActor:
    """`handle` (batches of adds and aborts) runs in the actor's default group (one thread: in submission
    order); `drain` in its own group, so a waiting drain never holds it up."""

    def __init__(self, p: Placement, name: str, replica: int, worker_name: str, tokenizer: Any = None,
                 tts: torch.Tensor | None = None) -> None:
        self.p = p
        self.outbox: Inbox[Event] = Inbox(threading.Event())
        self.requests: dict[str, Request] = {}  # the plain copies of the requests this replica serves
        # NOTE: a per-actor budget: of what its GPU has left when it starts, its share among the replicas on
        # its deploy device index still to be built (in `build_order`, one after another): the last takes all.
        order = [(n, i) for n, i, _ in build_order(replica_names(p))]
        key = (name, replica)
        groups = {(n, i): p.deploy.stage(n).replica_devices[i] for n, i in order[order.index(key):]}
        self.stage = build_sized_replicas(p, [key], kv_shares(p, groups), {name: self._to_next},
                                          tokenizer=tokenizer, tts=tts)[key]
        device = p.place(name, replica)[0]
        self.worker = replica_worker(p, name, worker_name, self.stage, device, self._on_error)

    def info(self) -> dict[str, Any]:
        return {"kv_capacity": kv_capacity(self.stage), "stats": worker_stats(self.worker)}

    def tts_embeds(self) -> torch.Tensor:
        """The thinker actor's tts embeddings, for the talker actors."""
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
        """`spec` comes with a request's first payload to this actor; `payload` None: the request itself."""
        req = self.requests.get(request_id)
        if req is None:
            if spec is None:
                return  # NOTE: this replica is done with it (a talker that ended before the thinker did)
            req = self._open(spec)
        self.stage.add(req if payload is None else replace(payload, request=req))

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.aborted = True
        self.worker.abort(request_id)

    @ray.method(concurrency_group="outbox")
    def drain(self, timeout: float) -> tuple[list[Event], dict[str, int | float]]:
        """The events queued so far (waits up to `timeout` s for one), and the stage's stats now."""
        return self.outbox.wait_drain(timeout), worker_stats(self.worker)

    def _open(self, spec: dict[str, Any]) -> Request:
        req = Request(**spec, emit=lambda delta: self._event("emit", req, delta))
        # NOTE: the driver's request counts the parts done (the thinker's and code2wav's are in two actors).
        req.part_done = lambda: self._event("part_done", req, forget=True)
        self.requests[req.request_id] = req
        return req

    def _event(self, kind: str, req: Request, payload: Any = None, forget: bool = False) -> None:
        if forget:
            self.requests.pop(req.request_id, None)
        self.outbox.put((kind, req.request_id, payload, replace(req.usage), req.finish_reason))

    def _to_next(self, chunk: Any) -> None:
        self._event("next", chunk.request, to_cpu(replace(chunk, request=None)), forget=chunk.finished)

    def _on_error(self, error: BaseException, requests: list[Request] | None = None) -> None:
        """As the orchestrator's: those requests failed here, or (no `requests`) the stage is dead."""
        if requests is None:
            self.outbox.put(("dead", None, repr(error), None, None))
        for req in requests or []:
            self.requests.pop(req.request_id, None)
            self.outbox.put(("fail", req.request_id, repr(error), None, None))
