"""The thinker's scheduler (`pipeline.thinker.scheduler`) over stand-in sequences: prompts past cached rows
share a step only while one prefill graph run reads all their cached rows (`max_context`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.engine.kv_growth import KvGrowth
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.pipeline.thinker.scheduler import ThinkerScheduler


@dataclass(eq=False)
class _Seq:
    """What the scheduler reads of a `ThinkerSeq`; its cached prefix already taken (`num_computed`)."""

    name: str
    prompt_len: int
    num_computed: int
    req: Any = None
    open: bool = False
    slot: int = -1
    num_sampled: int = 0
    block_hashes: None = None
    cached_blocks: int = 0
    prompt_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))

    def __post_init__(self) -> None:
        self.req = SimpleNamespace(request_id=self.name, sampling=SimpleNamespace(max_tokens=4),
                                   mark=lambda phase: None)

    @property
    def in_prefill(self) -> bool:
        return self.open or self.num_computed < self.prompt_len

    @property
    def rows_ready(self) -> int:
        return self.prompt_len - self.num_computed


def _kv() -> KvGrowth:
    return KvGrowth(BlockManager(128, 4), torch.zeros(2, 1, 128, 4, 1, 1))


def _steps(max_context: int, seqs: list[_Seq], n: int) -> list[list[tuple[str, int]]]:
    sched = ThinkerScheduler(_kv(), PenaltyTable(4, 8, "cpu"), max_batch_size=4,
                             token_budget=64, graph_tokens=64, max_context=max_context)
    sched.waiting.extend(seqs)
    out = []
    for _ in range(n):
        batch = sched.schedule()
        out.append([(s.name, k) for s, k in batch])
        for s, k in batch:  # as the step computes them
            s.num_computed += k
            s.num_sampled += not s.in_prefill
    return out


@pytest.mark.parametrize("max_context, steps", [
    (100, [[("a", 10)], [("a", 1), ("b", 10), ("c", 5)]]),  # 60 + 50 cached rows: past one run's 100
    (0, [[("a", 10), ("b", 10), ("c", 5)], [("a", 1), ("b", 1), ("c", 1)]]),  # no limit (graphs take none)
    (110, [[("a", 10), ("b", 10), ("c", 5)], [("a", 1), ("b", 1), ("c", 1)]]),
])
def test_prompts_past_cached_rows_share_a_step_within_one_runs_context(max_context: int,
                                                                     steps: list[list[tuple[str, int]]]) -> None:
    seqs = [_Seq("a", 70, 60), _Seq("b", 60, 50), _Seq("c", 5, 0)]
    assert _steps(max_context, seqs, 2) == steps


def test_a_prompt_past_more_cached_rows_than_a_run_reads_still_runs_alone() -> None:
    # its step goes eagerly, but it goes: the first prefill chunk of a step is never held back
    assert _steps(100, [_Seq("a", 300, 280), _Seq("b", 5, 0)], 2) == [[("a", 20)], [("a", 1), ("b", 5)]]


def test_an_open_prompt_with_no_rows_ready_holds_back_no_other_prefill() -> None:
    """A streamed prompt waiting for more audio (open, its rows all computed, many of them) takes no part in
    the step: the prefills after it still share it."""
    sched = ThinkerScheduler(_kv(), PenaltyTable(4, 8, "cpu"), max_batch_size=4, token_budget=64,
                             graph_tokens=64, max_context=64)
    sched.running.extend([_Seq("a", 40, 8), _Seq("open", 60, 60, open=True), _Seq("b", 40, 8)])
    assert [(s.name, k) for s, k in sched.schedule()] == [("a", 32), ("b", 32)]
