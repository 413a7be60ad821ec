"""Code2Wav's chunk-step runner (static buffers, batch buckets x chunk shapes; CUDA graphs on CUDA) against
the eager stage, on the CPU: same samples and exact chunk sizes (the growing packet schedule) for requests
joining, finishing and aborting at different times; shorter last chunks padded into larger shapes; padding
rows touch only the scratch row of the stream cache."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omnistage.config import default_deploy_config, later_packet_frames, load_deploy_config, packet_frames
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.code2wav_stream import StreamState
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.model import build_stage
from omnistage.models.qwen3_omni.presets import preset_config
from omnistage.outputs import OutputDelta
from omnistage.pipeline.code2wav_stage import Code2WavStage
from omnistage.pipeline.connector import FrameChunk

from graph_helpers import EmulatedGraphs, packet_sizes

INITIAL, CHUNK, MAX_BATCH = 4, 5, 8
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


def drive(stage: Code2WavStage, plan: list = PLAN) -> Run:
    """Feed the plan's frames to `stage` as a talker would (1-2 per request per tick); one step per tick."""
    gen = torch.Generator().manual_seed(0)
    run = Run([Req(f"r{i}") for i in range(len(plan))], {},
              [torch.randint(0, 2048, (frames, 16), generator=gen) for _, frames, _ in plan])
    sent = [0] * len(plan)
    for t in range(200):
        for i, ((join, frames, abort), req) in enumerate(zip(plan, run.reqs)):
            if t == abort:
                req.aborted = True
                stage.abort(req.request_id)
            if t < join or req.aborted or sent[i] > frames:
                continue
            k = min(1 + (i + t) % 2, frames - sent[i])
            for f in run.codes[i][sent[i]:sent[i] + k]:
                stage.add(FrameChunk(req, f))
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
          chunk: int = CHUNK, async_output: bool = False) -> Code2WavStage:
    return Code2WavStage(model(), max_batch_size=MAX_BATCH, initial_chunk_frames=initial, chunk_frames=chunk,
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

    runner._run_group, runner._forward = spy_run_group, spy_forward
    try:
        yield steps
    finally:
        del runner._run_group, runner._forward


@pytest.mark.parametrize("graphs,sizes,growth", [
    (None, (1, 2, 4, 8), True), (EmulatedGraphs, (1, 2, 4, 8), True), (EmulatedGraphs, (1, 3), True),
    (EmulatedGraphs, (1, 3), False)])
def test_runner_equals_the_eager_stage(graphs, sizes, growth) -> None:
    st = stage(True, sizes, growth)
    st.runner.graphs = graphs and graphs()
    cache = st.streamer.cache
    for t in states(cache)[1:]:  # live rows never read the scratch row: NaN there would reach their samples
        t[cache.scratch] = float("nan")
    with spy(st.runner) as steps:
        ran = drive(st)
    ref = eager(growth)
    for (_, frames, abort), a, b, codes in zip(PLAN, ran.reqs, ref.reqs, ref.codes):
        assert len(a.deltas) == len(b.deltas) and a.done == (abort is None)
        for x, y in zip(a.deltas, b.deltas):
            assert np.array_equal(x.codes, y.codes)
            np.testing.assert_allclose(x.audio, y.audio, rtol=0, atol=1e-6)  # measured: 2.4e-7
        got = np.concatenate([d.codes for d in a.deltas], 1)
        assert np.array_equal(got, codes[:got.shape[1]].T.numpy())
        if abort is None:
            packets = packet_sizes(frames, INITIAL, CHUNK, growth)
            assert [d.audio.size for d in a.deltas] == samples(packets) and got.shape[1] == frames
    assert not st.seqs and len(cache.free_slots) == MAX_BATCH
    first_kv = next(iter(cache.states.values()))
    assert not torch.isnan(first_kv[cache.scratch]).all()  # padding rows wrote the scratch row
    top = max(sizes)
    assert len(steps) >= 20 and all(b == top for n, b, _, _ in steps if n > top)  # groups past the top split
    assert any(b > n for n, b, _, _ in steps)  # padded batches
    assert len({b for _, b, _, _ in steps}) == len(sizes)
    assert {s for _, _, s, _ in steps} == set(st.runner.codes)  # every shape ran
    assert any(min(lens) < n for _, _, (n, _), lens in steps if lens)  # shorter last chunks padded


def test_an_aborted_stream_frees_its_slot_for_the_next() -> None:
    ran = drive(stage(True))
    for i, (_, _, abort) in enumerate(PLAN):
        if abort is None:
            continue
        req, (slot, _) = ran.reqs[i], ran.slots[f"r{i}"]
        assert req.deltas and not req.done  # aborted mid-stream
        later = sorted((t, int(r[1:])) for r, (s, t) in ran.slots.items() if s == slot and t >= abort)
        assert later, "no stream took the slot after the abort"
        j = later[0][1]  # the next stream in the slot starts from a clean state: it decodes as if alone
        alone = model()(ran.codes[j].T[None])[0, 0].numpy()
        got = np.concatenate([d.audio for d in ran.reqs[j].deltas])
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)  # measured: 1.4e-7


def test_chunks_must_fit_their_shape() -> None:
    runner = stage(True).runner
    state, codes = StreamState(slot=0), torch.zeros(16, CHUNK, dtype=torch.long)
    with pytest.raises(ValueError, match="first chunk of 5 frames does not fit 4"):
        runner.run([(state, codes)], [True])
    with pytest.raises(ValueError, match="later chunk of 3 frames"):
        runner.run([(StreamState(slot=0, frames=4), codes[:, :3])], [False])
    with pytest.raises(ValueError, match="later chunk of 5 frames does not fit 4"):  # growth: 4 after 4
        runner.run([(StreamState(slot=0, frames=4), codes)], [False])


def test_deploy_config_switches_the_runner_on() -> None:
    d = tiny_checkpoint("tiny")
    chunks = {"connector": {"initial_codec_chunk_frames": 2, "codec_chunk_frames": 3}}
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu", overrides=chunks)
    # NOTE: the deploy config refuses cuda_graph on the cpu platform; set past validation, it means
    # "runner on, graphs captured only on CUDA": the static-buffer path runs eagerly here.
    c2w = replace(cfg.stages.code2wav, cuda_graph=True, cuda_graph_batch_sizes=(1, 2))
    o = Omni(d, deploy=replace(cfg, stages=replace(cfg.stages, code2wav=c2w)), device="cpu")
    st = o.engine.code2wavs[0]
    runner = st.runner
    assert runner is not None and runner.batch_sizes == [1, 2] and runner.shapes == {True: [2], False: [2, 3]}
    out = {}
    try:
        for on in (True, False):
            st.runner = runner if on else None
            out[on] = o.chat([[{"role": "user", "content": "Say hello."}]] * 3, sampling={"temperature": 0, "max_tokens": 2},
                             talker_sampling=[{"temperature": 0, "max_frames": f, "ignore_eos": True}
                                              for f in (9, 13, 4)])
    finally:
        o.engine.shutdown()
    for a, b, f in zip(out[True], out[False], (9, 13, 4)):
        assert a.audio.size == f * SAMPLES - TAIL and np.array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-6)


@pytest.mark.parametrize("graph", [False, True])
def test_first_chunks_go_before_later_chunks(graph: bool) -> None:
    st, gen = stage(graph), torch.Generator().manual_seed(1)
    a, b = Req("a"), Req("b")
    for f in torch.randint(0, 2048, (INITIAL + CHUNK, 16), generator=gen):
        st.add(FrameChunk(a, f))
    st.step()  # a's first chunk
    for f in torch.randint(0, 2048, (INITIAL, 16), generator=gen):
        st.add(FrameChunk(b, f))
    st.step()  # b's first chunk only, though a's next chunk is ready too
    assert [len(a.deltas), len(b.deltas), st.last_batch] == [1, 1, 1]
    assert len(b.deltas[0].audio) == INITIAL * SAMPLES - TAIL
    st.step()
    # growth: a's second chunk is as long as its first (the audio before it), not CHUNK
    assert [len(a.deltas), len(b.deltas)] == [2, 1] and len(a.deltas[1].audio) == INITIAL * SAMPLES


def test_capture_at_start_then_replay() -> None:
    st = stage(True)
    st.runner.graphs = EmulatedGraphs()
    st.runner.capture()  # every (batch bucket, chunk shape) graph, on padding rows only
    assert set(st.runner.graphs.fns) == {(b, n, first) for b in (1, 2, 4, 8)
                                         for n, first in ((INITIAL, True), (INITIAL, False), (CHUNK, False))}
    ran, ref = drive(st), eager()
    for a, b in zip(ran.reqs, ref.reqs):
        assert len(a.deltas) == len(b.deltas)
        for x, y in zip(a.deltas, b.deltas):
            np.testing.assert_allclose(x.audio, y.audio, rtol=0, atol=1e-6)


def test_packet_schedule() -> None:
    assert [packet_frames(e, 2, 25, True) for e in (0, 2, 4, 8, 16, 32, 57)] == [2, 2, 4, 8, 16, 25, 25]
    assert packet_sizes(132, 2, 25, True) == [2, 2, 4, 8, 16, 25, 25, 25, 25]
    assert packet_sizes(79, 4, 25, False) == [4, 25, 25, 25] and packet_sizes(40, 2, 25, True)[-1] == 8
    assert later_packet_frames(2, 25, True) == [2, 4, 8, 16, 25] and later_packet_frames(4, 25, False) == [25]
    assert later_packet_frames(4, 3, True) == [3]


GROWING = {43: [2, 2, 4, 8, 16, 11], 40: [2, 2, 4, 8, 16, 8], 3: [2, 1], 1: [1]}  # frames -> packets


def test_growing_packets_are_exact() -> None:
    """Initial 2, cap 25, growth: packets of exactly the schedule's frames and samples, eager and through the
    runner; shorter last chunks (11, 1 later, 1 first) run padded in the next larger shape."""
    plan = [(0, n, None) for n in GROWING]
    ran = {}
    for graph in (False, True):
        st = stage(graph, (1, 2, 4), initial=2, chunk=25)
        if graph:
            st.runner.graphs = EmulatedGraphs()
            assert st.runner.shapes == {True: [2], False: [2, 4, 8, 16, 25]}
            with spy(st.runner) as steps:
                ran[graph] = drive(st, plan)
        else:
            ran[graph] = drive(st, plan)
    padded = {(shape, n) for _, _, shape, lens in steps for n in lens if n < shape[0]}
    assert padded == {((16, False), 11), ((2, False), 1), ((2, True), 1)}
    for (frames, packets), a, b, codes in zip(GROWING.items(), ran[True].reqs, ran[False].reqs, ran[True].codes):
        for req in (a, b):
            assert [d.codes.shape[1] for d in req.deltas] == packets == packet_sizes(frames, 2, 25, True)
            assert [d.audio.size for d in req.deltas] == samples(packets) and req.done
        for x, y in zip(a.deltas, b.deltas):
            np.testing.assert_allclose(x.audio, y.audio, rtol=0, atol=1e-6)  # measured: 3.3e-7
        alone = model()(codes.T[None])[0, 0].numpy()
        np.testing.assert_allclose(np.concatenate([d.audio for d in a.deltas]), alone, rtol=0, atol=1e-6)
