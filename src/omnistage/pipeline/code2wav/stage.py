"""Code2Wav stage: stateful streaming decode batched across requests; chunks (audio packets) as
`connector.packet_frames` schedules them; every frame decoded once; one host sync per step, with
asynchronous output while the next step runs (`AsyncOutputStep`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from time import monotonic

import torch

from omnistage.config import StageConfig
from omnistage.layers.context import HostCopy
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer
from omnistage.outputs import SAMPLE_RATE, OutputDelta
from omnistage.pipeline.async_output import AsyncOutputStep
from omnistage.pipeline.code2wav.runner import Code2WavGraphRunner
from omnistage.pipeline.code2wav.seq import Launched, WavSeq
from omnistage.pipeline.connector import FrameChunk, Inbox, PacketSchedule, arrive
from omnistage.pipeline.faults import StepFaults

DRY_SOON_S = 0.15  # a later chunk goes with first chunks if its stream runs dry sooner (a few steps under load)


class Code2WavStage(AsyncOutputStep):
    """`step` (see `AsyncOutputStep`): with asynchronous output a step's chunks are emitted one step later,
    and a request ends (`part_done`) once its last chunk's samples are emitted."""

    def __init__(self, code2wav: torch.nn.Module, *, max_batch_size: int = 64, max_num_batched_tokens: int = 4096,
                 initial_chunk_frames: int = 4, chunk_frames: int = 25, chunk_growth: bool = True,
                 idle_initial_chunk_frames: int = 0, cuda_graph: bool = False, graph_batch_sizes: Sequence[int] = (),
                 async_output: bool = False) -> None:
        """Chunks of `packet_frames(emitted, initial, chunk_frames, chunk_growth)` frames, `initial` a stream's
        `idle_initial_chunk_frames` where the talker ran it alone at its first frame (and that is not 0), else
        `initial_chunk_frames`; at most `max_num_batched_tokens` frames a step (a step's first chunk goes
        whatever its length).
        `cuda_graph`: chunk steps go through `Code2WavGraphRunner` (static buffers, batches padded to
        `graph_batch_sizes`, default as the deploy config's; graphs captured on CUDA only, run eagerly
        elsewhere). `async_output`: see `step`."""
        self.streamer = Code2WavStreamer(code2wav, max_batch_size)
        self.initials = (initial_chunk_frames, idle_initial_chunk_frames or initial_chunk_frames)  # (shared, alone)
        self.packets = PacketSchedule.of(self.initials, chunk_frames, chunk_growth)
        self.runner: Code2WavGraphRunner | None = None
        if cuda_graph:
            sizes = list(graph_batch_sizes) or StageConfig(max_batch_size=max_batch_size).graph_batch_sizes()
            self.runner = Code2WavGraphRunner(self.streamer, sizes, sorted(set(self.initials)), self.packets)
        self.inbox: Inbox[FrameChunk] = Inbox()
        self.seqs: dict[str, WavSeq] = {}
        self.waiting: dict[str, list[FrameChunk]] = {}  # requests without a stream slot yet, in arrival order
        self.max_batch_size, self.max_num_batched_tokens = max_batch_size, max_num_batched_tokens
        self.async_output = async_output  # `step`'s `last_batch` / `pending` start as `AsyncOutputStep`'s
        self.faults, self.step_requests = StepFaults(), []  # see pipeline/faults.py
        self.device = next(code2wav.parameters()).device

    def add(self, chunk: FrameChunk) -> None:
        self.inbox.put(chunk)

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            # NOTE: a chunk of it may still run; the slot's next stream zeroes the slot's state
            # (`Code2WavStreamCache.allocate`) on this stage's stream, so after that chunk wrote it.
            self.streamer.close(seq.state)

    @property
    def num_active(self) -> int:
        return len(self.seqs) + len(self.waiting)

    def stats(self) -> dict[str, int]:
        queued = sum(len(s.pending) for s in list(self.seqs.values()))
        waiting = sum(len(chunks) for chunks in list(self.waiting.values()))
        return dict(batch_size=self.last_batch, queue_depth=queued + waiting)

    def _receive(self) -> None:
        """New chunks to their requests' streams, or to `waiting` for a request that has no slot yet."""
        for chunk in self.inbox.drain():
            rid = chunk.request.request_id
            if chunk.request.aborted:
                continue
            if rid in self.seqs:
                self._take(self.seqs[rid], chunk)
            else:
                self.waiting.setdefault(rid, []).append(chunk)

    def _admit(self) -> None:
        """Waiting requests into the free stream slots, the longest waiting first."""
        while self.waiting and len(self.seqs) < self.max_batch_size:
            rid = next(iter(self.waiting))
            chunks = self.waiting.pop(rid)
            seq = WavSeq(chunks[0].request, self.streamer.open(), self.initials[chunks[0].talker_alone])
            self.seqs[rid] = seq
            for chunk in chunks:
                self._take(seq, chunk)

    def _take(self, seq: WavSeq, chunk: FrameChunk) -> None:
        if chunk.finished:
            seq.done = True
        else:
            seq.pending.append(arrive(chunk.frame, self.device))

    def _schedule(self) -> list[WavSeq]:
        self._receive()
        for seq in [s for s in self.seqs.values() if s.ended]:  # its last chunk emitted in an earlier step
            self.faults.run(seq.req, self._finish, seq)
        self._admit()
        for s in self.seqs.values():
            s.chunk = self.packets.next_chunk(s.state.frames, s.initial, len(s.pending), s.done)
        ready = [s for s in self.seqs.values() if s.chunk[0]]
        # NOTE: first chunks (time to first audio) do not wait behind a step of long later chunks; those of
        # streams about to run dry go along (in a burst of first chunks they waited, and their playback stalled)
        if firsts := [s for s in ready if s.state.frames == 0]:
            soon = monotonic() + DRY_SOON_S
            ready = firsts + [s for s in ready if s.dry_at is not None and s.dry_at < soon]
        ready = self._within_budget(ready)
        self.step_requests = [s.req for s in ready]
        return ready

    def _within_budget(self, ready: list[WavSeq]) -> list[WavSeq]:
        kept, frames = [], 0
        for seq in ready:
            n = seq.chunk[0]
            if not kept or frames + n <= self.max_num_batched_tokens:
                kept.append(seq)
                frames += n
        return kept

    def _tokens(self, ready: list[WavSeq]) -> int:
        return sum(seq.chunk[0] for seq in ready)

    def _launch(self, ready: list[WavSeq]) -> Launched:
        """The next chunk of each ready request, decoded in one batched step; its samples and codes start
        on their way to the host."""
        counts, targets = [seq.chunk[0] for seq in ready], [seq.chunk[1] for seq in ready]
        last = [seq.done and n == len(seq.pending) for seq, n in zip(ready, counts)]
        frames = torch.stack([f for seq, n in zip(ready, counts) for f in seq.pending[:n]])  # [sum n, Q]
        starts = list(itertools.accumulate(counts, initial=0))
        items = [(seq.state, frames[a:a + n].t()) for seq, a, n in zip(ready, starts, counts)]
        for seq, n in zip(ready, counts):
            del seq.pending[:n]
            seq.in_flight += 1
            seq.req.mark("code2wav_start")
        wavs = self.runner.run(items, last, targets) if self.runner is not None else self.streamer.step(items)
        # NOTE: queued before the samples' copy, so the one event `HostCopy` records covers the codes too.
        codes = frames.to("cpu", non_blocking=True)
        return Launched(ready, [w.numel() for w in wavs], counts, codes, HostCopy(torch.cat(wavs).float()))

    def _complete(self, launched: Launched) -> None:
        for seq, wav, codes in zip(launched.seqs, *launched.wait()):
            if self.seqs.get(seq.req.request_id) is seq:  # not aborted since its launch
                self.faults.run(seq.req, self._emit, seq, wav, codes)

    def _emit(self, seq: WavSeq, wav: torch.Tensor, codes: torch.Tensor) -> None:
        seq.in_flight -= 1
        seq.dry_at = max(seq.dry_at or 0.0, monotonic()) + wav.numel() / SAMPLE_RATE
        seq.req.mark("first_audio")
        seq.req.emit(OutputDelta(seq.req.request_id, audio=wav.numpy().copy(),
                                 codes=codes.t().numpy().copy()))
        if seq.ended:
            self._finish(seq)

    def _finish(self, seq: WavSeq) -> None:
        self.abort(seq.req.request_id)
        seq.req.part_done()
