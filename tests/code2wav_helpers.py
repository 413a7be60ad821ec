"""The code2wav stage driven as a talker would drive it, for the runner / asynchronous-output / packet tests:
a tiny Code2Wav, a plan of requests joining, finishing and aborting, and a spy on the runner's forwards."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from unittest import mock

import torch
from transformers import Qwen3OmniMoeConfig

from omnistage.models.qwen3_omni.model import build_stage
from omnistage.models.qwen3_omni.presets import preset_config
from omnistage.outputs import OutputDelta
from omnistage.pipeline.code2wav import stage as code2wav_stage
from omnistage.pipeline.code2wav.stage import Code2WavStage
from omnistage.pipeline.connector import FrameChunk

INITIAL, CHUNK, MAX_BATCH = 4, 5, 8
TICK_S = 0.02  # the stage's clock per tick (it sends a stream's later chunk along with first chunks when the stream
# is about to run dry): fixed, so runs compared with each other decide alike however fast this machine steps
SAMPLES, TAIL = 1920, 555
# per request: (tick it starts sending frames, frames, tick it is aborted or None); 1-2 frames per tick
PLAN = [(0, 23, None), (0, 9, None), (0, 12, None), (0, 30, 9), (0, 7, None), (0, 16, None), (0, 3, None),
        (0, 26, None), (1, 9, None), (2, 4, None), (3, 19, None), (4, 14, 12), (6, 21, None), (7, 5, None),
        (9, 11, None), (15, 1, None), (20, 8, None)] + [(60, 2 + i, None) for i in range(MAX_BATCH)]
# NOTE: the last MAX_BATCH join when every slot is free, so each aborted stream's slot is taken again


@functools.cache
def model() -> torch.nn.Module:
    config = Qwen3OmniMoeConfig(**preset_config("tiny"))
    return build_stage(config, "code2wav", load_format="dummy", device="cpu", dtype="float32", seed=3)


@dataclass
class Req:
    request_id: str
    aborted: bool = False
    done: bool = False
    deltas: list[OutputDelta] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # "audio" per delta, "done" at part_done, in order

    def emit(self, delta: OutputDelta) -> None:
        self.deltas.append(delta)
        self.events.append("audio")

    def mark(self, phase: str) -> None:
        self.phases.append(phase)

    def part_done(self) -> None:
        self.done = True
        self.events.append("done")


@dataclass
class Run:
    reqs: list[Req]
    slots: dict[str, tuple[int, int]]  # request -> (its cache slot, the tick it got it)
    codes: list[torch.Tensor]  # [frames, 16] per request


def drive(stage: Code2WavStage, plan: list = PLAN, alone: frozenset[int] = frozenset()) -> Run:
    """Feed the plan's frames to `stage` as a talker would (1-2 per request per tick); one step per tick. The
    requests in `alone` (indices) come as the talker's only request at their first frame."""
    gen = torch.Generator().manual_seed(0)
    run = Run([Req(f"r{i}") for i in range(len(plan))], {},
              [torch.randint(0, 2048, (frames, 16), generator=gen) for _, frames, _ in plan])
    sent, now = [0] * len(plan), [100.0]
    with mock.patch.object(code2wav_stage, "monotonic", lambda: now[0]):
        for t in range(200):
            now[0] = 100.0 + t * TICK_S
            for i, ((join, frames, abort), req) in enumerate(zip(plan, run.reqs)):
                if t == abort:
                    req.aborted = True
                    stage.abort(req.request_id)
                if t < join or req.aborted or sent[i] > frames:
                    continue
                k = min(1 + (i + t) % 2, frames - sent[i])
                for j, f in enumerate(run.codes[i][sent[i]:sent[i] + k]):
                    stage.add(FrameChunk(req, f, talker_alone=i in alone and sent[i] + j == 0))
                sent[i] += k
                if sent[i] == frames:
                    stage.add(FrameChunk(req, finished=True))
                    sent[i] += 1
            stage.step()
            for rid, seq in stage.seqs.items():
                run.slots.setdefault(rid, (seq.state.slot, t))
            if all(r.done or r.aborted for r in run.reqs) and not stage.seqs:
                return run
    raise AssertionError("the plan did not finish")


def stage(graph: bool, sizes: tuple[int, ...] = (1, 2, 4, 8), growth: bool = True, initial: int = INITIAL,
          chunk: int = CHUNK, async_output: bool = False, budget: int = 4096, idle_initial: int = 0) -> Code2WavStage:
    return Code2WavStage(model(), max_batch_size=MAX_BATCH, max_num_batched_tokens=budget,
                         initial_chunk_frames=initial, chunk_frames=chunk, idle_initial_chunk_frames=idle_initial,
                         chunk_growth=growth, cuda_graph=graph, graph_batch_sizes=sizes,
                         async_output=async_output)


@functools.cache
def eager(growth: bool = True) -> Run:
    return drive(stage(False, growth=growth))


def samples(sizes: list[int]) -> list[int]:
    return [n * SAMPLES - (TAIL if i == 0 else 0) for i, n in enumerate(sizes)]


def states(cache) -> list[torch.Tensor]:
    return [cache.pos, *cache.states.values()]


@contextlib.contextmanager
def spy(runner) -> Iterator[list]:
    """Records (live rows, batch bucket, shape (n, first), the live chunks' lengths) of every forward
    (warm-up, capture, step) and checks that it changed no cache row but its live streams' slots and the
    scratch row."""
    steps, live, cache = [], {}, runner.streamer.cache
    run_group, forward = runner._run_group, runner._forward

    def spy_run_group(shape, group):
        live["slots"], live["lens"] = {s.slot for s, _ in group}, [c.shape[-1] for _, c in group]
        return run_group(shape, group)

    def spy_forward(b, shape):
        before = [t.clone() for t in states(cache)]
        out = forward(b, shape)
        changed = set()
        for old, new in zip(before, states(cache)):
            changed |= set((old != new).reshape(len(old), -1).any(1).nonzero()[:, 0].tolist())
        assert changed <= live["slots"] | {cache.scratch}, f"wrote rows {changed - live['slots']}"
        steps.append((len(live["slots"]), b, shape, live["lens"]))
        return out

    with mock.patch.object(runner, "_run_group", spy_run_group), \
            mock.patch.object(runner, "_forward", spy_forward):
        yield steps
