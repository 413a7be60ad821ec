"""CUDA graphs for decode steps: batch and KV-width buckets, static attention metadata, capture/replay.

A decode step of B rows (one new token each) whose longest context spans `need` KV blocks runs as the
graph of (the smallest batch bucket >= B, `width_bucket(need)`). Rows past B are padding rows.

Width buckets are powers of two, capped at the widest block table. On CUDA the decode attention
(`layers.triton_attention`) reads only each row's own blocks, so a wider bucket costs only its block-table
rows; the reference path (`layers.attention.paged_decode_attention`) gathers `width` blocks for every row,
at most 2x the gather + SDPA work (and transient memory) of the batch's longest context. Pairs at the
deploy config's `cuda_graph_capture_widths` are captured at start; any other pair on the first step that
needs it, so only the pairs a workload reaches exist: at most
ceil(log2(max width)) + 1 per batch bucket (P prompt rows + F frames need widths up to
ceil((P + F) / block_size)). A lazy capture pays one eager warm-up step plus the capture (0.2-0.4 s for
the talker's frame step at full size on the H200, benchmarks/HISTORY.md), and `torch.cuda.graph` synchronizes
the device and empties the allocator's cache, stalling the other stages once. Every capture is logged with
its time and the growth of the reserved memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

from omnistage.layers.context import ForwardContext

logger = logging.getLogger(__name__)
# NOTE: one capture at a time in a process: entering `torch.cuda.graph` syncs the device and empties the
# allocator's cache, which invalidates a capture another stage's thread has in flight (seen on the H200
# when the talker and code2wav captured at once: cudaErrorStreamCaptureInvalidated).
_CAPTURE_LOCK = threading.Lock()
T = TypeVar("T")


def batch_bucket(rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds `rows`; None when none does."""
    return next((s for s in sizes if s >= rows), None)


def fit_runs(items: Sequence[T], fits: Callable[[list[T]], bool]) -> list[list[int]]:
    """Consecutive items in runs (their indices), each run within `fits`; an item that does not fit alone is a
    run of its own."""
    out: list[list[int]] = []
    for i, item in enumerate(items):
        if out and fits([items[j] for j in out[-1]] + [item]):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` without the host waiting: a host `src` through page-locked memory. From pageable memory CUDA
    stages the copy and "may synchronize with the stream": small copies are staged at once (layers/context.to_device),
    one of megabytes (a run's patches) is suspected of waiting for the work queued before it (benchmarks/HISTORY.md,
    thirty-eighth section: the encoders' stream)."""
    if dst.is_cuda and src.device.type == "cpu" and not src.is_pinned():
        src = src.pin_memory()  # NOTE: torch keeps the block until the copy ran (an event on the stream)
    dst.copy_(src, non_blocking=True)


def width_bucket(need: int, max_width: int, minimum: int = 1) -> int:
    """KV blocks a decode graph gathers per row: the next power of two >= `need` and >= `minimum` (the
    narrowest width captured at start, so short contexts replay it rather than capture their own), at
    most `max_width`."""
    return min(max(1 << max(need - 1, 0).bit_length(), minimum), max_width)


class StaticDecodeContext:
    """`ForwardContext` tensors of decode steps at fixed addresses, for up to `max_rows` rows and block
    tables of up to `max_width` blocks. Padding rows write their KV to slot 0 of `scratch_block` (a block
    no sequence owns) and attend to that slot only (context length 1)."""

    def __init__(self, max_rows: int, max_width: int, block_size: int, scratch_block: int,
                 device: torch.device | str) -> None:
        self.block_size, self.scratch = block_size, scratch_block
        self.slot_mapping = torch.full((max_rows,), scratch_block * block_size, dtype=torch.long,
                                       device=device)
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.full((max_rows, max_width), scratch_block, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)

    def fill(self, num_computed: Sequence[int], tables: Sequence[Sequence[int]], rows: int,
             width: int) -> None:
        """Live row i appends one token after its `num_computed[i]` cached ones, through `tables[i]`;
        rows len(tables)..rows-1 are padding. Tables are cut or padded (scratch) to `width` blocks."""
        bs, pad, n = self.block_size, self.scratch, len(tables)
        slots = [t[c // bs] * bs + c % bs for c, t in zip(num_computed, tables)]
        slots += [pad * bs] * (rows - n)
        lens = [c + 1 for c in num_computed] + [1] * (rows - n)
        table_rows = [list(t[:width]) + [pad] * (width - len(t)) for t in tables]
        table_rows += [[pad] * width] * (rows - n)
        # NOTE: non_blocking from pageable memory is safe (staged before return) and skips a stream sync.
        self.slot_mapping[:rows].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        self.context_lens[:rows].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:rows, :width].copy_(torch.tensor(table_rows, dtype=torch.int32), non_blocking=True)

    def context(self, rows: int, width: int) -> ForwardContext:
        """The context of a `rows`-row step gathering `width` blocks per row (views of the static tensors)."""
        return ForwardContext(
            is_prefill=False, cu_seqlens_q=self.cu_seqlens_q[:rows + 1], max_seqlen_q=1,
            max_seqlen_k=width * self.block_size, context_lens=self.context_lens[:rows],
            slot_mapping=self.slot_mapping[:rows], block_tables=self.block_tables[:rows, :width],
            block_size=self.block_size)


class ReplayTimer:
    """GPU time of graph replays: CUDA events around each replay, read without a sync (a replay counts once
    its end event has completed). It includes waiting for SMs the other stages' kernels hold, not the host's
    time: against a stage's step wall time it tells the GPU's share from the host's."""

    def __init__(self) -> None:
        self.gpu_seconds, self.replays = 0.0, 0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # read pairs, reused

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        start, end = self._free.pop() if self._free else (torch.cuda.Event(enable_timing=True),
                                                          torch.cuda.Event(enable_timing=True))
        start.record()
        graph.replay()
        end.record()
        self._pending.append((start, end))
        self.harvest()

    def harvest(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self.gpu_seconds += start.elapsed_time(end) / 1e3
            self.replays += 1
            self._free.append((start, end))


class CUDAGraphs:
    """One CUDA graph per key, captured from a function of static buffers; all share one memory pool.
    Sharing is safe because the graphs replay one at a time on one stream and their outputs stay
    allocated (a later capture reuses only memory that earlier ones freed, i.e. their intermediates)."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None
        self.timer = ReplayTimer()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def capture(self, key: Hashable, fn: Callable[[], Any]) -> None:
        """Run `fn` once eagerly (warm-up), then capture it. `fn` must not sync with the host."""
        with _CAPTURE_LOCK:
            self._capture(key, fn)

    def _capture(self, key: Hashable, fn: Callable[[], Any]) -> None:
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        if self.pool is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        # NOTE: warm up outside the capture (lazy cuBLAS / kernel initialisation must not be captured).
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread_local: the other stages keep running (and syncing) in their threads during a capture.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        self.graphs[key] = (graph, out)
        logger.info("captured CUDA graph %s in %.3f s; reserved memory +%.1f MiB", key,
                    time.perf_counter() - start, (torch.cuda.memory_reserved() - reserved) / 2**20)

    def replay(self, key: Hashable) -> Any:
        """Replay the graph of `key` on the current stream; returns its (static) outputs."""
        graph, out = self.graphs[key]
        self.timer.replay(graph)
        return out
