"""`placement: ray`: every stage replica (thinker i, talker i, code2wav i) in its own Ray actor
(`StageActor`: a `ReplicaHost`), so stages and replicas may sit on any GPU of any host of the cluster. The
orchestrator holds a `remote.RemoteStage` per actor over a `RayLink`; a dead actor is made again with the same
options (its requests fail, only them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omnistage.engine.request import Request
from omnistage.pipeline.placement.local import Placement, replica_names
from omnistage.pipeline.placement.remote import RemoteStage
from omnistage.pipeline.placement.replica_host import Event, ReplicaHost, build_order
from omnistage.pipeline.placement.stage_handle import StageHandles
from omnistage.platform import current_platform

GPU_WAIT_S = 300  # how long to wait for the cluster to free the GPUs the deploy config asks for


@ray.remote(concurrency_groups={"outbox": 1})
class StageActor(ReplicaHost):
    """`handle` runs in the actor's default group (one thread: in submission order); `drain` in its own
    group, so a waiting drain never holds it up."""

    @ray.method(concurrency_group="outbox")
    def drain(self, timeout: float) -> tuple[list[Event], dict[str, int | float]]:
        return ReplicaHost.drain(self, timeout)


class RayLink:
    """A `remote.Link` to one actor."""

    def __init__(self, actor: Any) -> None:
        self.actor, self.closed = actor, False

    def info(self) -> dict[str, Any]:
        return ray.get(self.actor.info.remote())

    def start(self) -> None:
        self.actor.start.remote()

    def send(self, ops: list[tuple]) -> None:
        self.actor.handle.remote(ops)

    def drain(self, timeout: float) -> tuple[list[Event], dict[str, int | float]]:
        return ray.get(self.actor.drain.remote(timeout))

    def kill(self) -> None:
        ray.kill(self.actor)

    def close(self) -> None:
        self.closed = True
        self.kill()


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
                     on_error: Callable[..., None], *, lookup: Callable[[str], Request | None],
                     on_state: Callable[[str, int, bool], None] | None = None) -> StageHandles:
    """Every stage replica in a Ray actor (built and ready; pumps not started). Joins the cluster at
    RAY_ADDRESS when it is set and Ray is not initialised yet, else starts a local one."""
    if not ray.is_initialized():
        ray.init()
    replicas = replica_names(p)
    actor_p, options, free_gpus = actor_options(p, replicas)

    def start(k: int, rebuilt: bool = False, **kwargs: Any) -> RayLink:
        name, i, wname = replicas[k]
        link = RayLink(StageActor.options(**options[k]).remote(actor_p, name, i, wname, rebuilt=rebuilt, **kwargs))
        link.info()  # NOTE: built: the next one sizes its KV cache from what this one left
        return link

    # NOTE: one actor at a time, in `build_order`: each sizes its KV cache from what its GPU has left when it
    # starts (pipeline/placement/sizing.py); the talkers need a thinker's tts embeddings.
    links, args, tts = {}, {}, None
    for name, i, wname in build_order(replicas):
        k = replicas.index((name, i, wname))
        args[k] = {"tokenizer": tokenizer} if name == "thinker" else {"tts": tts} if name == "talker" else {}
        links[k] = start(k, **args[k])
        if name == "thinker" and tts is None and p.config.enable_audio_output:
            tts = ray.get(links[k].actor.tts_embeds.remote())
    to_next = {"thinker": to_talker, "talker": to_code2wav}
    # NOTE: the orchestrator stops its stages in order: the GPUs are freed after the last actor is gone.
    return StageHandles.of([(name, RemoteStage(
        links[k], wname, (name, i), to_next.get(name), on_error, lookup, on_state,
        respawn=lambda k=k: start(k, rebuilt=True, **args[k]),
        on_stop=free_gpus if k == len(replicas) - 1 else None)) for k, (name, i, wname) in enumerate(replicas)])
