"""Code2Wav stage: stateful streaming decode batched across requests; chunks (audio packets) as
`config.packet_frames` schedules them; every frame decoded once; one host sync per step."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from omnistage.config import StageConfig, packet_frames
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer, StreamState
from omnistage.outputs import OutputDelta
from omnistage.pipeline.code2wav_runner import Code2WavGraphRunner
from omnistage.pipeline.connector import FrameChunk, Inbox, arrive
from omnistage.pipeline.faults import StepFaults


@dataclass
class WavSeq:
    state: StreamState
    pending: list[torch.Tensor] = field(default_factory=list)  # frames [G] not decoded yet
    done: bool = False


class Code2WavStage:
    def __init__(self, code2wav: torch.nn.Module, *, max_batch_size: int = 64, initial_chunk_frames: int = 4,
                 chunk_frames: int = 25, chunk_growth: bool = True, cuda_graph: bool = False,
                 graph_batch_sizes: Sequence[int] = ()) -> None:
        """Chunks of `packet_frames(emitted, initial_chunk_frames, chunk_frames, chunk_growth)` frames.
        `cuda_graph`: chunk steps go through `Code2WavGraphRunner` (static buffers, batches padded to
        `graph_batch_sizes`, default as the deploy config's; graphs captured on CUDA only, run eagerly
        elsewhere)."""
        self.streamer = Code2WavStreamer(code2wav, max_batch_size)
        self.schedule = (initial_chunk_frames, chunk_frames, chunk_growth)
        self.runner: Code2WavGraphRunner | None = None
        if cuda_graph:
            sizes = list(graph_batch_sizes) or StageConfig(max_batch_size=max_batch_size).graph_batch_sizes()
            self.runner = Code2WavGraphRunner(self.streamer, sizes, *self.schedule)
        self.inbox: Inbox[FrameChunk] = Inbox()
        self.seqs: dict[str, tuple[FrameChunk, WavSeq]] = {}
        self.max_batch_size = max_batch_size
        self.last_batch = 0
        self.faults, self.step_requests = StepFaults(), []  # see pipeline/faults.py
        self.device = next(code2wav.parameters()).device

    def add(self, chunk: FrameChunk) -> None:
        self.inbox.put(chunk)

    def abort(self, request_id: str) -> None:
        item = self.seqs.pop(request_id, None)
        if item is not None:
            self.streamer.close(item[1].state)

    @property
    def num_active(self) -> int:
        return len(self.seqs)

    def stats(self) -> dict[str, int]:
        return dict(batch_size=self.last_batch, queue_depth=sum(len(s.pending) for _, s in list(self.seqs.values())))

    def _receive(self) -> None:
        for chunk in self.inbox.drain():
            rid = chunk.request.request_id
            if chunk.request.aborted:
                continue
            if rid not in self.seqs:
                if len(self.seqs) >= self.max_batch_size:
                    self.inbox.put(chunk)  # NOTE: no free stream slot yet; retried next step, order kept per request
                    continue
                self.seqs[rid] = (chunk, WavSeq(self.streamer.open()))
            seq = self.seqs[rid][1]
            if chunk.finished:
                seq.done = True
            else:
                seq.pending.append(arrive(chunk.frame, self.device))

    def _target(self, seq: WavSeq) -> int:
        return packet_frames(seq.state.frames, *self.schedule)

    @torch.no_grad()
    def step(self) -> bool:
        self._receive()
        ready = [(rid, seq) for rid, (_, seq) in self.seqs.items()
                 if seq.pending and (len(seq.pending) >= self._target(seq) or seq.done)]
        # NOTE: first chunks (time to first audio) do not wait behind a step of long later chunks.
        ready = [(rid, seq) for rid, seq in ready if seq.state.frames == 0] or ready
        finished = [rid for rid, (_, seq) in self.seqs.items() if seq.done and not seq.pending]
        self.last_batch = len(ready)
        self.step_requests = [self.seqs[rid][0].request for rid, _ in ready]
        if ready:
            self._decode(ready)
        for rid in finished:
            req = self.seqs[rid][0].request
            self.abort(rid)
            req.part_done()
        return bool(ready or finished)

    def _decode(self, ready: list[tuple[str, WavSeq]]) -> None:
        """The next chunk of each ready request, decoded in one batched step; its samples and codes reach
        the host in one copy each, after one sync."""
        counts = [min(len(seq.pending), self._target(seq)) for _, seq in ready]
        last = [seq.done and n == len(seq.pending) for (_, seq), n in zip(ready, counts)]
        frames = torch.stack([f for (_, seq), n in zip(ready, counts) for f in seq.pending[:n]])  # [sum n, Q]
        starts = list(itertools.accumulate(counts, initial=0))
        items = [(seq.state, frames[a:a + n].t()) for (_, seq), a, n in zip(ready, starts, counts)]
        for (rid, seq), n in zip(ready, counts):
            del seq.pending[:n]
            self.seqs[rid][0].request.mark("code2wav_start")
        wavs = self.runner.run(items, last) if self.runner is not None else self.streamer.step(items)
        wav, codes = to_host(torch.cat(wavs).float(), frames)
        for (rid, _), w, a, n in zip(ready, wav.split([w.numel() for w in wavs]), starts, counts):
            req = self.seqs[rid][0].request
            req.mark("first_audio")
            req.emit(OutputDelta(rid, audio=w.numpy().copy(), codes=codes[a:a + n].t().numpy().copy()))


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host: asynchronous copies (pinned memory), then one sync of the current stream."""
    out = [t.to("cpu", non_blocking=True) for t in tensors]
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream(tensors[0].device).synchronize()
    return out
