"""`placement: ray`: every stage replica (thinker, talker i, code2wav i) in its own Ray actor
(`ray_actor.StageActor`), so stages and replicas may sit on any GPU of any host of the cluster.

The orchestrator holds a `RayStage` per actor, with the interface of a local stage (`stage_handle.py`):
`add` sends a payload (its tensors on the CPU; the request's plain copy with its first payload to that
actor), `abort` reaches the actor's stage (both in order, batched into one Ray call by a sender thread), and a pump thread per actor drains the actor's outbox and
dispatches each event to the driver's request (its deltas, usage, parts done) or to the orchestrator's
router (payloads for the next stage). A dead actor or a dead stage worker ends as a dead local stage does:
every request in flight fails and the engine reports the error.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omnistage.engine.request import Request
from omnistage.outputs import Usage
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.faults import EngineDeadError
from omnistage.pipeline.placement.local import Placement, replica_names
from omnistage.pipeline.placement.ray_actor import StageActor, build_order, request_spec
from omnistage.pipeline.placement.stage_handle import StageHandles
from omnistage.platform import current_platform

logger = logging.getLogger(__name__)

DRAIN_WAIT_S = 0.2  # an idle actor's drain returns after this long: the bound on how stale `stats` are
GPU_WAIT_S = 300  # how long to wait for the cluster to free the GPUs the deploy config asks for


class RayStage:
    """A stage replica in a Ray actor, as the orchestrator sees it."""

    def __init__(self, actor: Any, name: str, to_next: Callable | None, on_error: Callable[..., None],
                 lookup: Callable[[str], Request | None], on_stop: Callable[[], Any] | None = None) -> None:
        """`to_next`: the orchestrator's router for this stage's payloads; `lookup`: the driver's request
        in flight by id (None once it has finished or was aborted); `on_stop`: after the actor is gone."""
        self.actor, self.name, self.to_next, self.on_stop = actor, name, to_next, on_stop
        self.on_error, self.lookup = on_error, lookup
        info = ray.get(actor.info.remote())
        self.kv_capacity: int | None = info["kv_capacity"]
        self._stats: dict[str, int | float] = info["stats"]
        # the requests the actor was sent a plain copy of (weak: an entry goes with its request)
        self._opened: weakref.WeakValueDictionary[str, Request] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._dead = self._stopping = False
        self._pump = threading.Thread(target=self._run, name=f"omnistage-ray-{name}", daemon=True)
        # adds and aborts, sent in order, as one Ray call per batch that queued meanwhile (not one per payload)
        self._outgoing: Inbox[tuple] = Inbox(threading.Event())
        self._sender = threading.Thread(target=self._send, name=f"omnistage-ray-{name}-send", daemon=True)

    def add(self, item: Any) -> None:
        req = item if isinstance(item, Request) else item.request
        payload = None if item is req else replace(item, request=None)
        # NOTE: under the lock with `abort`: an add never overtakes the abort of its request.
        with self._lock:
            if req.aborted or self._dead:
                return
            spec = None
            if self._opened.get(req.request_id) is not req:
                self._opened[req.request_id] = req
                spec = request_spec(req)
            self._outgoing.put(("add", req.request_id, spec, payload))

    def abort(self, request_id: str) -> None:
        with self._lock:
            if not self._dead:
                self._outgoing.put(("abort", request_id, None, None))

    def _send(self) -> None:
        while not self._stopping:
            ops = self._outgoing.wait_drain(DRAIN_WAIT_S)
            if ops and not self._dead:
                self.actor.handle.remote(ops)

    def stats(self) -> dict[str, int | float]:
        return dict(self._stats)

    @property
    def num_active(self) -> int:
        return int(self._stats["active"])

    @property
    def alive(self) -> bool:
        return (self._pump.is_alive() and not self._dead) or self._stopping

    def start(self) -> None:
        self.actor.start.remote()
        self._pump.start()
        self._sender.start()

    def stop(self) -> None:
        self._stopping = True
        ray.kill(self.actor)
        self._pump.join(timeout=10)
        self._sender.join(timeout=10)
        if self.on_stop is not None:
            self.on_stop()

    def _run(self) -> None:
        while not self._stopping:
            try:
                events, self._stats = ray.get(self.actor.drain.remote(DRAIN_WAIT_S))
            except Exception as e:  # NOTE: the actor died (killed, its node lost, its process crashed)
                if not self._stopping:
                    self._died(f"actor died: {e!r}")
                return
            for kind, request_id, payload, usage, finish_reason in events:
                if kind == "dead":
                    return self._died(payload)
                self._dispatch(kind, request_id, payload, usage, finish_reason)

    def _died(self, why: str) -> None:
        logger.error("stage %s: %s", self.name, why)
        with self._lock:
            self._dead = True
        self.on_error(EngineDeadError(f"stage {self.name}: {why}"))

    def _dispatch(self, kind: str, request_id: str, payload: Any, usage: Usage | None,
                  finish_reason: str | None) -> None:
        req = self.lookup(request_id)
        if req is None:
            return  # finished or aborted meanwhile
        if kind == "fail":
            return self.on_error(RuntimeError(f"stage {self.name}: {payload}"), [req])
        try:
            merge(req, usage, finish_reason)
            if kind == "emit":
                req.emit(payload)
            elif kind == "part_done":
                req.part_done()
            else:
                self.to_next(replace(payload, request=req))
        except Exception as e:  # NOTE: as a local stage's per-request faults: the request fails, not the stage
            logger.exception("stage %s: request %s failed", self.name, request_id)
            self.on_error(e, [req])


def merge(req: Request, usage: Usage, finish_reason: str | None) -> None:
    """What a stage's copy of the request has set into the driver's request: each usage field is set by one
    stage only (counts only grow), the finish reason by the thinker."""
    for f in fields(Usage):
        if getattr(usage, f.name) > getattr(req.usage, f.name):
            setattr(req.usage, f.name, getattr(usage, f.name))
    if finish_reason is not None:
        req.finish_reason = finish_reason


def gpu_shares(p: Placement, replicas: list[tuple[str, int, str]]) -> list[tuple[int, float]]:
    """(GPU bundle, share of that GPU) per replica: one bundle per deploy device index; the replicas on
    one index split its GPU evenly."""
    devices = [p.deploy.stage(name).replica_devices[i] for name, i, _ in replicas]
    slots = sorted(set(devices))
    # NOTE: Ray keeps 4 decimals of a fractional GPU: round down so the shares of one GPU fit in it.
    return [(slots.index(d), int(10000 / devices.count(d)) / 10000) for d in devices]


def actor_options(p: Placement, replicas: list[tuple[str, int, str]]
                  ) -> tuple[Placement, list[dict[str, Any]], Callable[[], Any] | None]:
    """The placement the actors build with, each replica's actor options, and what frees their GPUs."""
    device = torch.device(p.device) if p.device is not None else current_platform().device()
    if device.type != "cuda":
        return p, [{"num_cpus": 0}] * len(replicas), None
    shares = gpu_shares(p, replicas)
    gpus = max(b for b, _ in shares) + 1
    pg = placement_group([{"GPU": 1}] * gpus, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=GPU_WAIT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"the Ray cluster did not free {gpus} GPU(s) (one per deploy device index) in "
                           f"{GPU_WAIT_S} s") from None
    options = [{"num_cpus": 0, "num_gpus": share, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=bundle)} for bundle, share in shares]
    # NOTE: Ray shows each actor only its GPU (CUDA_VISIBLE_DEVICES), as device 0.
    return replace(p, device="cuda:0"), options, lambda: remove_placement_group(pg)


def build_ray_stages(p: Placement, tokenizer: Any, to_talker: Callable, to_code2wav: Callable,
                     on_error: Callable[..., None], *, lookup: Callable[[str], Request | None]
                     ) -> StageHandles:
    """Every stage replica in a Ray actor (built and ready; pumps not started). Joins the cluster at
    RAY_ADDRESS when it is set and Ray is not initialised yet, else starts a local one."""
    if not ray.is_initialized():
        ray.init()
    replicas = replica_names(p)
    actor_p, options, free_gpus = actor_options(p, replicas)

    def start(k: int, **kwargs: Any) -> Any:
        name, i, wname = replicas[k]
        return StageActor.options(**options[k]).remote(actor_p, name, i, wname, **kwargs)

    # NOTE: one actor at a time, in `build_order`: each sizes its KV cache from what its GPU has left when it
    # starts (pipeline/placement/sizing.py); the talkers need the thinker's tts embeddings.
    actors, tts = {}, None
    for name, i, wname in build_order(replicas):
        k = replicas.index((name, i, wname))
        kwargs = {"tokenizer": tokenizer} if name == "thinker" else {"tts": tts} if name == "talker" else {}
        actors[k] = start(k, **kwargs)
        ray.get(actors[k].info.remote())
        if name == "thinker" and p.config.enable_audio_output:
            tts = ray.get(actors[k].tts_embeds.remote())
    to_next = {"thinker": to_talker, "talker": to_code2wav}
    # NOTE: the orchestrator stops its stages in order: the GPUs are freed after the last actor is gone.
    return StageHandles.of([(name, RayStage(actors[k], wname, to_next.get(name), on_error, lookup,
                                            free_gpus if k == len(replicas) - 1 else None))
                            for k, (name, _, wname) in enumerate(replicas)])
