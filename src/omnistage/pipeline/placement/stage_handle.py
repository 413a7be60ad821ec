"""What the orchestrator holds of each stage replica: a handle with one small interface, whether the
replica runs in this process (`LocalStage`: the stage and its worker thread) or in another (`remote.RemoteStage`:
a worker process or a Ray actor). The request lifecycle in `Orchestrator` is the same for all."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from omnistage.pipeline.worker import StageWorker


class StageHandle(Protocol):
    name: str  # the worker's name: "thinker", "talker" (or "talker0", "talker1", ... with replicas), ...
    kv_capacity: int | None  # tokens the stage's KV cache holds (None for code2wav)

    def add(self, item: Any) -> None:
        """A Request (thinker), TextChunk (talker) or FrameChunk (code2wav); never blocks."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, int | float]: ...

    @property
    def num_active(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def state(self) -> str:
        """"up", "restarting" (a replica process started again: it takes no request meanwhile) or "dead"."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def worker_name(stage: str, replica: int, replicas: int) -> str:
    return stage if replicas == 1 else f"{stage}{replica}"


def worker_stats(w: StageWorker) -> dict[str, int | float]:
    """A stage's stats with its worker's counters (and its CUDA graphs' GPU time, where it has graphs):
    what `Orchestrator.stats` reports per stage."""
    out = {**w.stage.stats(), "active": w.stage.num_active, "failed": w.failed_requests, "steps": w.steps,
           "busy_seconds": w.busy_seconds, "step_rows": w.step_rows}
    graphs = getattr(getattr(w.stage, "runner", None), "graphs", None)
    if graphs is not None:
        out.update(graph_gpu_seconds=graphs.timer.gpu_seconds, graph_replays=graphs.timer.replays,
                   graph_captures=len(graphs))
    return out


def kv_capacity(stage: Any) -> int | None:
    blocks = getattr(stage, "blocks", None)
    return None if blocks is None else blocks.capacity


class LocalStage:
    """A stage replica in this process, driven by its worker thread."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker, self.stage, self.name = worker, worker.stage, worker.name
        self.kv_capacity = kv_capacity(worker.stage)

    def add(self, item: Any) -> None:
        self.stage.add(item)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def stats(self) -> dict[str, int | float]:
        return worker_stats(self.worker)

    @property
    def num_active(self) -> int:
        return self.stage.num_active

    @property
    def alive(self) -> bool:
        return self.worker.alive

    @property
    def state(self) -> str:
        return "up" if self.worker.alive else "dead"

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()


@dataclass
class StageHandles:
    """The thinker replicas (data-parallel pipelines), the talker replicas and the code2wav replicas (none
    without audio output)."""

    thinkers: list[StageHandle]
    talkers: list[StageHandle]
    code2wavs: list[StageHandle]

    @classmethod
    def of(cls, handles: list[tuple[str, StageHandle]]) -> StageHandles:
        """From (stage name, handle) pairs."""
        by = {name: [h for n, h in handles if n == name] for name in ("thinker", "talker", "code2wav")}
        return cls(by["thinker"], by["talker"], by["code2wav"])

    @property
    def talker_kv_capacity(self) -> int | None:
        """A talker's KV tokens (a pipeline's, with `placement: pipeline`); None without audio output."""
        if self.talkers:
            return self.talkers[0].kv_capacity
        return getattr(self.thinkers[0], "talker_kv_capacity", None) if self.thinkers else None

    def stats(self) -> dict[str, dict[str, int | float]]:
        """By replica name; a pipeline's handle (`placement: pipeline`) nests its stages'
        (`pipeline<i>.<stage>`; with one pipeline, `<stage>` as in the local placement)."""
        out, nested = {}, len(self.thinkers) > 1
        for h in self:
            s, nest = h.stats(), f"{h.name}." if nested else ""
            inner = {nest + k: {**v, "restarts": s["restarts"]} for k, v in s.get("stages", {}).items()}
            out.update(inner or {h.name: s})
        return out

    def health(self, failed: bool) -> dict[str, Any]:
        """"ok"; "degraded" while a replica is started again and its stage has another up; "unavailable" while
        none of a stage's is up, or once the engine has `failed`. `replicas`: those not up."""
        down = {h.name: h.state for h in self if h.state != "up"}
        serving = not failed and all(any(h.state == "up" for h in g) for g in (self.thinkers, self.talkers,
                                                                                 self.code2wavs) if g)
        return {"status": "unavailable" if not serving else "degraded" if down else "ok", "replicas": down}

    def __iter__(self) -> Iterator[StageHandle]:
        yield from self.thinkers
        yield from self.talkers
        yield from self.code2wavs
