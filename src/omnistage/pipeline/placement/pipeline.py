"""`placement: pipeline`: each data-parallel pipeline (its thinker, talkers and code2wavs: the deploy layout once,
on its own GPUs) in a worker process of its own, running the local placement inside (an `Orchestrator` with
`placement: local`, threads and CUDA streams as on one GPU). Against `placement: process` (a process per device,
`groups.py`), only a request (in) and its output deltas (out) cross processes, never a token's or a frame's
payload; and as there, each GPU keeps one process (separate processes' CUDA contexts are time-sliced: on one
H200, three stage processes gave 22.0 req/s at c = 64 against 27.9 in threads, benchmarks/HISTORY.md).

The serving process holds a `remote.RemoteStage` per pipeline, as it would a thinker replica: its router picks
the pipeline (least loaded, a session's last one); a pipeline whose process dies fails its requests and is
started again. `stats()` nests the pipeline's stages (`pipeline<i>.thinker`, ...; one pipeline's as `thinker`,
...).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from omnistage.config import STAGE_NAMES
from omnistage.engine.request import Request
from omnistage.outputs import OutputDelta, Usage
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.orchestrator import Orchestrator
from omnistage.pipeline.placement.local import Placement
from omnistage.pipeline.placement.process import ProcessLink, run_host
from omnistage.pipeline.placement.remote import RemoteStage
from omnistage.pipeline.placement.replica_host import Event, renew, request_copy
from omnistage.pipeline.placement.stage_handle import StageHandles


def pipeline_placement(p: Placement, i: int) -> Placement:
    """Pipeline i's placement: the deploy layout on its devices (`DeployConfig.stage`'s replicas of pipeline i)."""
    stages = {}
    for name in STAGE_NAMES:
        sc, per = p.deploy.stage(name), getattr(p.deploy.stages, name).replicas
        stages[name] = replace(getattr(p.deploy.stages, name), devices=sc.replica_devices[i * per:(i + 1) * per])
    deploy = replace(p.deploy, data_parallel_size=1, placement="local", mm_processor_workers=0,
                     stages=replace(p.deploy.stages, **stages))
    return replace(p, deploy=deploy)


class PipelineHost:
    """The far side of a pipeline: its `Orchestrator` (local placement), with `ReplicaHost`'s interface
    (`info`, `start`, `handle`, `drain`), so `process.py`'s worker process and `ProcessLink` carry it."""

    def __init__(self, p: Placement) -> None:
        self.engine = Orchestrator(p.model_dir, deploy=p.deploy, load_format=p.load_format, device=p.device,
                                   dtype=p.dtype, seed=p.seed, placement="local")
        self.outbox: Inbox[Event] = Inbox(threading.Event())

    def info(self) -> dict[str, Any]:
        talkers = self.engine.stages.talkers
        return {"kv_capacity": self.engine.stages.thinkers[0].kv_capacity, "stats": self._stats(),
                "talker_kv_capacity": talkers[0].kv_capacity if talkers else None}

    def tts_embeds(self) -> None:
        return None

    def start(self) -> None:
        pass  # NOTE: the engine's workers started with it

    def handle(self, ops: list[tuple[str, str, dict[str, Any] | None, Any]]) -> None:
        """Requests (a spec), a growing prompt's pieces (a payload; a spec too when the prompt changed, see
        `RemoteStage.add`) and aborts, in the driver's order."""
        for op, request_id, spec, piece in ops:
            if op == "abort":
                self.engine.abort(request_id)
                continue
            req = self.engine.requests.get(request_id)
            if req is None and spec is not None and piece is None:
                self._add(request_id, spec)
            elif req is not None:  # NOTE: else finished or aborted here meanwhile
                if spec is not None:
                    renew(req, spec)
                self._try(request_id, self.engine.routing.to_thinker, replace(piece, request=req))

    def _add(self, request_id: str, spec: dict[str, Any]) -> None:
        req = request_copy(spec, lambda d: self._emit(request_id, d))
        self._try(request_id, self.engine.add_request, req)

    def _try(self, request_id: str, add: Callable[[Any], None], item: Any) -> None:
        try:
            add(item)
        except Exception as e:  # NOTE: refused here (a dead stage): the request fails, as in a stage
            self.outbox.put(("fail", request_id, repr(e), None, None, None))

    def _emit(self, request_id: str, delta: OutputDelta) -> None:
        self.outbox.put(("emit", request_id, delta, Usage(), None, None))

    def drain(self, timeout: float) -> tuple[list[Event], dict[str, Any]]:
        events = self.outbox.wait_drain(timeout)
        if self.engine.error is not None:
            events.append(("dead", None, repr(self.engine.error), None, None, None))
        return events, self._stats()

    def _stats(self) -> dict[str, Any]:
        stages = self.engine.stats()
        return {"active": len(self.engine.requests), "stages": stages}


def serve_pipeline(p: Placement, threads: int, inbox: Any, outbox: Any) -> None:
    """A pipeline's process (`process.run_host`'s protocol)."""
    torch.set_num_threads(threads)
    run_host(lambda: PipelineHost(p), inbox, outbox)


def build_pipeline_stages(p: Placement, tokenizer: Any, to_talker: Callable, to_code2wav: Callable,
                          on_error: Callable[..., None], *, lookup: Callable[[str], Request | None],
                          on_state: Callable[[str, int, bool], None] | None = None) -> StageHandles:
    """A `RemoteStage` per pipeline in the thinkers' place (no talker or code2wav handles: each pipeline has
    its own), every pipeline built one after another."""
    del tokenizer, to_talker, to_code2wav  # NOTE: each pipeline's engine has its own

    def start(i: int) -> ProcessLink:
        return ProcessLink(serve_pipeline, (pipeline_placement(p, i), torch.get_num_threads()), f"pipeline{i}")

    handles = []
    for i in range(p.deploy.data_parallel_size):
        handles.append(("thinker", RemoteStage(start(i), f"pipeline{i}", ("thinker", i), None, on_error, lookup,
                                               on_state, respawn=lambda i=i: start(i))))
    return StageHandles.of(handles)
