"""Per-forward attention metadata (nano-vllm style), read by every `Attention` layer of a forward.

Decoders run on flat token batches: the new tokens of all sequences concatenated, `[T]`. The engine
(or `build_context` for tests and simple offline runs) sets a `ForwardContext` around each forward.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """Metadata of one flat forward over `num_seqs` sequences and `T` new tokens.

    is_prefill: some sequence has more than one new token (False: exactly one new token per sequence).
    cu_seqlens_q: [num_seqs + 1] int32, offsets of each sequence's new tokens in the flat batch.
    cu_seqlens_k: [num_seqs + 1] int32, offsets of each sequence's whole context (cached + new).
    context_lens: [num_seqs] int32, tokens per sequence incl. the new ones (= KV length to attend to).
    slot_mapping: [T] int64, slot (block * block_size + offset) of each new token in the paged KV cache.
    block_tables: [num_seqs, max_blocks] int32, the KV blocks of each sequence (padding entries unused).
    kv_slots: [sum(context_lens)] int64, slot of every context token of every sequence in sequence order
        (`k_cache.view(-1, KV, D)[kv_slots]` is the batch's packed K, offsets `cu_seqlens_k`); prefill only.
    """

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    block_size: int = 0
    kv_slots: torch.Tensor | None = None


# NOTE: thread-local, because stages (thinker, talker) run forwards concurrently in their own threads.
_local = threading.local()


def get_context() -> ForwardContext:
    ctx = getattr(_local, "context", None)
    if ctx is None:
        raise RuntimeError("no ForwardContext set: wrap the forward in `with forward_context(ctx):`")
    return ctx


def set_context(ctx: ForwardContext | None) -> None:
    _local.context = ctx


def reset_context() -> None:
    set_context(None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Set `ctx` for the enclosed forward; the previous context (if any) is restored on exit."""
    prev = getattr(_local, "context", None)
    set_context(ctx)
    try:
        yield ctx
    finally:
        set_context(prev)


def token_slots(block_tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, total: int,
                block_size: int) -> torch.Tensor:
    """Flat cache slots of positions `starts[i] .. starts[i] + lens[i] - 1` of every sequence i, in sequence
    order: `[total]` int64 with `total = sum(lens)` given by the caller, so no host sync on the device."""
    seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens, output_size=total)
    first_row = lens.cumsum(0) - lens
    pos = starts[seq] + torch.arange(total, device=lens.device) - first_row[seq]
    return block_tables[seq, pos // block_size].long() * block_size + pos % block_size


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host values as a tensor on `device`, without waiting for the device's stream.
    NOTE: a blocking host-to-device copy waits for everything queued on the stream (a step in flight); a
    non_blocking one from pageable memory is staged at once (0.13 ms with the stream busy on the H200; from
    page-locked memory 0.20 ms with the pinning: `scripts/gpu_profile.py --parts h2d`)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostCopy:
    """A device tensor on its way to the host: a pinned non-blocking copy and an event, so the host waits
    only when it reads the values (asynchronous output's one sync per step)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.ready: torch.cuda.Event | None = None
        if t.is_cuda:
            t = t.to("cpu", non_blocking=True)  # NOTE: lands in pinned memory, so the copy is truly async
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.host = t

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy (and all work queued before it on the stream) is done."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host

    def tolist(self) -> list:
        return self.wait().tolist()


def build_context(num_computed: Sequence[int], num_new: Sequence[int], block_tables: Sequence[Sequence[int]],
                  block_size: int, device: torch.device | str = "cpu") -> ForwardContext:
    """Context for sequences that already hold `num_computed[i]` tokens in the cache and append `num_new[i]`."""
    kv_lens = [c + n for c, n in zip(num_computed, num_new)]
    for table, end in zip(block_tables, kv_lens):
        if math.ceil(end / block_size) > len(table):
            raise ValueError(f"sequence of {end} tokens needs more than {len(table)} blocks of {block_size}")
    width = max(len(t) for t in block_tables)
    tables = to_device([list(t) + [0] * (width - len(t)) for t in block_tables], torch.int32, device)
    context_lens = to_device(kv_lens, torch.int32, device)
    new_lens = to_device(num_new, torch.int32, device)
    is_prefill = any(n != 1 for n in num_new)

    def cumsum(xs: Sequence[int]) -> torch.Tensor:
        return to_device([0, *xs], torch.int32, device).cumsum(0, dtype=torch.int32)

    return ForwardContext(
        is_prefill=is_prefill,
        cu_seqlens_q=cumsum(num_new),
        cu_seqlens_k=cumsum(kv_lens),
        max_seqlen_q=max(num_new),
        max_seqlen_k=max(kv_lens),
        context_lens=context_lens,
        slot_mapping=token_slots(tables, context_lens - new_lens, new_lens, sum(num_new), block_size),
        block_tables=tables,
        block_size=block_size,
        kv_slots=token_slots(tables, torch.zeros_like(context_lens), context_lens, sum(kv_lens), block_size)
        if is_prefill else None,
    )


def contiguous_block_tables(num_seqs: int, max_len: int, block_size: int) -> list[list[int]]:
    """Trivial allocation: sequence i owns blocks [i * n, (i + 1) * n) with n = ceil(max_len / block_size)."""
    n = math.ceil(max_len / block_size)
    return [list(range(i * n, (i + 1) * n)) for i in range(num_seqs)]


class StaticBlockAllocator:
    """Fixed blocks per sequence (`contiguous_block_tables`) and a running token count: enough to run
    prefill + decode of a few sequences without the engine's scheduler (tests, simple offline runs)."""

    def __init__(self, num_seqs: int, max_len: int, block_size: int, device: torch.device | str = "cpu") -> None:
        self.block_tables = contiguous_block_tables(num_seqs, max_len, block_size)
        self.num_blocks = num_seqs * len(self.block_tables[0])
        self.block_size, self.device = block_size, device
        self.num_computed = [0] * num_seqs

    def context(self, num_new: Sequence[int], seq_ids: Sequence[int] | None = None) -> ForwardContext:
        """Context for appending `num_new[j]` tokens to sequence `seq_ids[j]` (default: all, in order)."""
        seq_ids = list(range(len(self.num_computed))) if seq_ids is None else list(seq_ids)
        ctx = build_context([self.num_computed[i] for i in seq_ids], num_new,
                            [self.block_tables[i] for i in seq_ids], self.block_size, self.device)
        for i, n in zip(seq_ids, num_new):
            self.num_computed[i] += n
        return ctx
