"""Moves requests through the stages (built by `placement.build_stages`, each driven by its own worker
thread, by `placement.process.build_process_stages`, each in a worker process, or by
`placement.ray.build_ray_stages`, each in a Ray actor), routes them over replicas (the thinker's: data-parallel
pipelines; `routing.StageRouting`), fails a request that fails in a stage (only it), fails a dead replica process's
requests (only them) while it is started again, and fails every request loudly if a stage dies for good."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from omnistage.config import DeployConfig
from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.engine.request import Request
from omnistage.layers.sampling import request_seed
from omnistage.media import MediaPolicy, media_count
from omnistage.models.qwen3_omni.fp8_checkpoint import with_checkpoint_quantization
from omnistage.models.qwen3_omni.model import load_config
from omnistage.models.qwen3_omni.prompt import PromptInputs, PromptProcessor
from omnistage.outputs import NO_AUDIO_OUTPUT, OutputDelta
from omnistage.pipeline.faults import EngineDeadError, NoReplicaError
from omnistage.pipeline.input_checks import check_fits, check_int64, check_text
from omnistage.pipeline.placement.local import Placement, build_stages
from omnistage.pipeline.placement.remote import build_remote
from omnistage.pipeline.placement.stage_handle import StageHandles
from omnistage.pipeline.processor_pool import ProcessorPool
from omnistage.pipeline.prompt_stream import PromptStream, open_stream
from omnistage.pipeline.routing import StageRouting
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams, from_dict


class Orchestrator:
    def __init__(self, model_dir: str | Path, *, deploy: DeployConfig | None = None, load_format: str = "auto",
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 seed: int = 0, media_policy: MediaPolicy | None = None,
                 placement: str | None = None) -> None:
        """`device` (if given) places every stage there; otherwise replica i of a stage goes to its deploy
        `devices[i % len(devices)]`; every stage may have replicas (the thinker's: data parallel).
        `placement`: "local" (threads of this process), "process" (a worker process per replica) or "ray"
        (actors); default: the deploy config's."""
        self.config = load_config(model_dir)
        self.deploy = with_checkpoint_quantization(deploy or load_deploy_config(default_deploy_config(model_dir)),
                                                   model_dir)
        if placement is not None:  # NOTE: the stages read it (what may cross between their processes)
            self.deploy = replace(self.deploy, placement=placement)
        p = Placement(self.config, self.deploy, model_dir, load_format, device, dtype, seed)
        args = (model_dir, media_policy, self.deploy.mm_processor_kwargs, p.place("thinker")[1])  # NOTE: its dtype
        self.processor = PromptProcessor(*args)
        workers = self.deploy.mm_processor_workers
        self.process: PromptProcessor | ProcessorPool = ProcessorPool(*args, workers) if workers else self.processor
        self.requests: dict[str, Request] = {}
        self.routing = StageRouting(self.deploy)
        args = (p, self.processor.tokenizer, self.routing.to_talker, self.routing.to_code2wav, self._on_error)
        self.stages = self._build(args)
        self.routing.bind(self.stages)
        self._done = threading.Condition()
        self._error: BaseException | None = None
        for h in self.stages:
            h.start()
        # NOTE: worker threads still inside torch at interpreter exit abort the process (std::terminate).
        atexit.register(self.shutdown)

    def _build(self, args: tuple) -> StageHandles:
        if self.placement == "local":
            return build_stages(*args)
        return build_remote(self.placement, *args, lookup=self.requests.get, on_state=self.routing.set_up)

    placement = property(lambda self: self.deploy.placement)
    # NOTE: the stage objects and their workers exist in this process with the local placement only.
    thinker = property(lambda self: self.stages.thinkers[0].stage)
    thinkers = property(lambda self: [h.stage for h in self.stages.thinkers])
    talkers = property(lambda self: [h.stage for h in self.stages.talkers])
    code2wavs = property(lambda self: [h.stage for h in self.stages.code2wavs])
    workers = property(lambda self: [h.worker for h in self.stages])

    @property
    def voices(self) -> list[str]:
        """The talker's speakers; none for a thinker-only checkpoint (enable_audio_output false)."""
        return sorted(self.config.talker_config.speaker_id) if self.config.enable_audio_output else []

    def make_request(self, request_id: str, messages: list[dict] | None, prompt_token_ids: list[int] | None, *,
                     want_audio: bool, voice: str | None, sampling: Any, talker_sampling: Any,
                     emit: Callable[[OutputDelta], None], use_audio_in_video: bool = False,
                     session: str | None = None) -> Request:
        """A request from chat messages (through the processor) or prompt ids; sampling as objects or dicts.
        `use_audio_in_video`: videos bring their audio track, interleaved with their frames; `session`: its
        conversation (the thinker replica of the session's last request takes it, while up)."""
        if (messages is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of messages and prompt_token_ids")
        prompt = (PromptInputs(list(prompt_token_ids)) if messages is None
                  else self._process(check_text(messages), use_audio_in_video))
        sp = from_dict(SamplingParams, sampling)
        tp = from_dict(TalkerSamplingParams, talker_sampling)
        check_int64(sp, tp)
        voice = voice or "Ethan"
        if want_audio and not self.config.enable_audio_output:
            raise ValueError(NO_AUDIO_OUTPUT)
        if want_audio and voice.lower() not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; choose from {self.voices}")
        check_fits(len(prompt.input_ids), sp, tp, self.stages.thinkers[0].kv_capacity,
                   self.stages.talker_kv_capacity if want_audio else None)
        return Request(request_id, prompt, sp, tp, request_seed(sp.seed), emit, voice=voice, want_audio=want_audio,
                       session=session)

    def _process(self, messages: list[dict], use_audio_in_video: bool) -> PromptInputs:
        """Through the worker processes when there are any and the messages carry media; text stays here, its
        template costing less than the way there and back. 64 prompts at once on a 16-core host, 8 workers of 2
        intra-op threads against 20 threads of 1 here (`scripts/prompt_burst.py`, benchmarks/HISTORY.md 37th):
        mean completion spoken 83-92 ms against 180-183, photo 115-136 against 159-162, 4 s video 450-454
        against 893-911. (Each worker has its own feature cache: a conversation's earlier clips, sent again with each
        turn, are featurised again, ~3 ms a 2-15 s clip on the 2-core CPU, unless the worker that made them has it.)"""
        process = self.process if media_count(messages) else self.processor
        return process(messages, use_audio_in_video)

    def open_request(self, request_id: str, messages: list[dict], *, want_audio: bool, voice: str | None,
                     sampling: Any, talker_sampling: Any, emit: Callable[[OutputDelta], None],
                     session: str | None = None) -> PromptStream:
        """A request whose last user message ends with an audio still arriving (`PromptStream.append_audio`,
        then `close`): what comes before it is prefilled now, the audio's encoder windows as they complete.
        Refused as `make_request` refuses; aborted as any request."""
        def make(m: list[dict]) -> Request:
            return self.make_request(request_id, m, None, want_audio=want_audio, voice=voice,
                                     sampling=sampling, talker_sampling=talker_sampling, emit=emit,
                                     session=session)

        return open_stream(self.processor, check_text(messages), make, self.routing.to_thinker,
                           self.add_request)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per stage: last step's batch size, queue depth, KV blocks in use / total, requests held and
        requests failed, busy steps with their wall seconds and batch rows (for /metrics)."""
        return self.stages.stats()

    def health(self) -> dict[str, Any]:
        """`StageHandles.health`: "ok", "degraded" (a replica being started again), "unavailable"."""
        return self.stages.health(self.error is not None)

    @property
    def error(self) -> BaseException | None:
        """Set once a stage has died (its worker ended); the engine then refuses new requests."""
        if self._error is None and not all(h.alive for h in self.stages):
            dead = [h.name for h in self.stages if not h.alive]
            self._on_error(EngineDeadError(f"stage worker(s) {', '.join(dead)} stopped"))
        return self._error

    def add_request(self, req: Request) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine has failed: {self._error!r}")
        if req.want_audio and not self.config.enable_audio_output:
            raise ValueError(NO_AUDIO_OUTPUT)
        emit, request_id = req.emit, req.request_id

        def emit_and_forget(delta: OutputDelta) -> None:  # NOTE: not `req`: a cycle would wait for the collector
            if delta.finished:
                self._forget(request_id)
            emit(delta)

        req.emit = emit_and_forget
        with self._done:  # NOTE: under the lock `_on_error` takes: a request is failed by it or refused here
            if self._error is not None:
                raise EngineDeadError(f"the engine has failed: {self._error!r}")
            self.requests[req.request_id] = req
        try:
            self.routing.to_thinker(req)
        except NoReplicaError:
            self._forget(req.request_id)
            raise

    def _forget(self, request_id: str) -> bool:
        with self._done:
            was_in_flight = self.requests.pop(request_id, None) is not None
            self._done.notify_all()
        self.routing.release(request_id)
        return was_in_flight

    def abort(self, request_id: str) -> bool:
        """Frees what the request holds in every stage; its stream gets no further items. False when it
        was no longer in flight (finished or aborted already)."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.aborted = True  # NOTE: before forgetting it, so no stage routes it again
        if not self._forget(request_id):
            return False
        for h in self.stages:
            h.abort(request_id)
        return True

    def wait(self, request_ids: list[str]) -> None:
        """Block until these requests finished (or were aborted); raises if a stage failed."""
        with self._done:
            self._done.wait_for(lambda: self._error is not None or not any(r in self.requests for r in request_ids))
        if self._error is not None:
            raise EngineDeadError(f"the engine has failed: {self._error!r}") from self._error

    def _on_error(self, error: BaseException, requests: list[Request] | None = None) -> None:
        """`requests` failed in a stage (which has let go of them): they end with finish_reason "error"
        and leave every other stage. Without `requests` a stage died: every request in flight fails."""
        if requests is None:
            with self._done:
                self._error = error
                requests = list(self.requests.values())
                self._done.notify_all()
        for req in requests:
            if self.abort(req.request_id):
                req.emit(OutputDelta(req.request_id, finished=True, finish_reason="error"))

    def shutdown(self) -> None:
        """Stops the workers; the engine's memory can then be freed (atexit no longer holds it)."""
        for h in self.stages:
            h.stop()
        if isinstance(self.process, ProcessorPool):
            self.process.close()
        atexit.unregister(self.shutdown)

