"""The host-side layout of one prefill graph run (`prefill_graph.PrefillGraphRunner`): which sequence each of
its rows and context rows belongs to, and their KV slots.

A run of bucket T (room R: the cached rows it may read, 0 for fresh prompts) holds `max_seqs + 2` sequences:
the live prompts (their new rows, after `computed` cached ones); one padding sequence of the T - live rows,
which writes and reads the scratch block (slot i % block_size); one of keys only (no query rows: no
attention work), the R - cached context rows, read from the scratch block; then empty sequences (their
offsets repeat). Every row stays finite and no live row sees the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RunLayout:
    """Host tensors of a run's static buffers."""

    slots: torch.Tensor  # [T] the slot each new row writes
    kv_slots: torch.Tensor  # [T + R] the slot of each packed context row
    cu_q: torch.Tensor  # [max_seqs + 3] int32 query offsets
    cu_k: torch.Tensor  # [max_seqs + 3] int32 context offsets
    k_lens: torch.Tensor  # [max_seqs + 2] int32 context rows per sequence
    tables: torch.Tensor  # [max_seqs + 2, width] int32 block tables (padding sequences: the scratch block)


def run_layout(t: int, room: int, lens: Sequence[int], computed: Sequence[int], tables: Sequence[Sequence[int]],
               max_seqs: int, width: int, scratch: int, block_size: int) -> RunLayout:
    """The layout of `lens` new rows past `computed` cached ones each (through `tables`) in bucket `t` with
    `room` cached rows at most."""
    n, total, bs = len(lens), sum(lens), block_size
    empty = [0] * (max_seqs - n)
    q_lens = torch.tensor([*lens, t - total, 0, *empty], dtype=torch.int32)
    k_lens = torch.tensor([c + m for c, m in zip(computed, lens)] + [t - total, room - sum(computed), *empty],
                          dtype=torch.int32)
    rows = torch.full((max_seqs + 2, width), scratch, dtype=torch.int32)
    for i, (m, tb) in enumerate(zip(k_lens.tolist(), tables)):
        rows[i, :-(-m // bs)] = torch.tensor(tb[:-(-m // bs)], dtype=torch.int32)
    cu_q, cu_k = _offsets(q_lens), _offsets(k_lens)
    first = torch.tensor([*computed, *[0] * (len(q_lens) - n)])  # each sequence's first new position
    return RunLayout(_slots(rows, q_lens, cu_q, first, bs), _slots(rows, k_lens, cu_k, torch.zeros_like(first), bs),
                     cu_q, cu_k, k_lens, rows)


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])


def _slots(tables: torch.Tensor, lens: torch.Tensor, cu: torch.Tensor, first: torch.Tensor, bs: int
           ) -> torch.Tensor:
    """The slot of each of the sequences' `lens` rows, from position `first` on, through `tables`."""
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.arange(int(cu[-1])) - cu[seq] + first[seq]
    return tables[seq, pos // bs].long() * bs + pos % bs
