"""Where each request and chunk goes between the stages: a `Router` per stage over its replicas (the thinker's
sticky per session, the talker's and code2wav's preferring the replicas on the device of the request's replica in
the stage before), and the thinker's text held back until it finishes when `async_chunk` is off (the ablation)."""

from __future__ import annotations

from omnistage.config import DeployConfig
from omnistage.engine.request import Request
from omnistage.pipeline.connector import FrameChunk, TextChunk
from omnistage.pipeline.placement.router import Router, near_replicas
from omnistage.pipeline.placement.stage_handle import StageHandles
from omnistage.pipeline.thinker.growth import PromptPiece


class StageRouting:
    def __init__(self, deploy: DeployConfig) -> None:
        self.async_chunk = deploy.async_chunk
        self._near = {"talker": near_replicas(deploy, "thinker", "talker"),
                      "code2wav": near_replicas(deploy, "talker", "code2wav")}
        self._held: dict[str, list[TextChunk]] = {}  # thinker output held back when async_chunk is off
        self.stages: StageHandles | None = None

    def bind(self, stages: StageHandles) -> None:
        """The stages built (with this object's `to_talker` / `to_code2wav` as their outputs): a router each."""
        self.stages = stages
        self.thinker = Router(len(stages.thinkers))
        self.talker = Router(len(stages.talkers))
        self.code2wav = Router(len(stages.code2wavs))

    def set_up(self, stage: str, replica: int, up: bool) -> None:
        """A remote replica went down (its requests failed) or is up again (started anew)."""
        {"thinker": self.thinker, "talker": self.talker, "code2wav": self.code2wav}[stage].set_up(replica, up)

    def to_thinker(self, item: Request | PromptPiece) -> None:
        """A request to the thinker replica of its session (else the least loaded), its prompt's later pieces
        after it. Raises NoReplicaError (an EngineDeadError: 503) when every replica is restarting."""
        req = item if isinstance(item, Request) else item.request
        self.stages.thinkers[self._pick(self.thinker, req, req.session)].add(item)

    def to_talker(self, chunk: TextChunk) -> None:
        if chunk.request.aborted:
            return
        if not self.async_chunk:  # ablation: the talker starts once the thinker has finished
            held = self._held.setdefault(chunk.request.request_id, [])
            held.append(chunk)
            if not chunk.finished:
                return
            del self._held[chunk.request.request_id]
        else:
            held = [chunk]
        req = chunk.request
        near_thinker = self._near["talker"].get(self.thinker.replica_of(req.request_id), ())
        talker = self.stages.talkers[self._pick(self.talker, req, prefer=near_thinker)]
        for c in held:
            talker.add(c)

    def to_code2wav(self, chunk: FrameChunk) -> None:
        req = chunk.request
        if not req.aborted:
            near_talker = self._near["code2wav"].get(self.talker.replica_of(req.request_id), ())
            self.stages.code2wavs[self._pick(self.code2wav, req, prefer=near_talker)].add(chunk)

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, failed or aborted): no replica holds a place for it."""
        for router in (self.thinker, self.talker, self.code2wav):
            router.release(request_id)
        self._held.pop(request_id, None)

    @staticmethod
    def _pick(router: Router, req: Request, session: str | None = None, prefer: tuple[int, ...] = ()) -> int:
        i = router.pick(req.request_id, session, prefer)
        if req.aborted:  # NOTE: an abort between the caller's check and `pick` would leak the load
            router.release(req.request_id)
        return i
