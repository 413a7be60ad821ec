"""The talker's scheduler (`pipeline/talker/scheduler.py`): admissions take their prompt's blocks only beyond the
room the running requests' next rows need, none while a request is swapped out, and the newest running request
goes out when blocks run out (engine/kv_growth.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.engine.kv_growth import KvGrowth
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.pipeline.talker.scheduler import TalkerScheduler
from omnistage.pipeline.talker.seq import TalkerSeq


def seq(name: str, prompt_rows: int) -> TalkerSeq:
    req = SimpleNamespace(request_id=name, talker_sampling=SimpleNamespace(max_frames=100))
    return TalkerSeq(req, torch.zeros(prompt_rows, 2), thinker_done=True)  # no text to wait for: tts_pad rows


def launched(s: TalkerSeq, rows: int) -> None:
    """As a launch leaves it: its rows computed, one more frame."""
    s.num_computed, s.prefilled, s.frames = s.num_computed + rows, True, s.frames + 1


def names(batch: list) -> list[str]:
    return [s.req.request_id for s, _ in batch]


def test_admissions_leave_the_running_room_and_wait_while_one_is_swapped_out() -> None:
    kv = KvGrowth(BlockManager(6, 1), torch.zeros(2, 1, 6, 1, 1, 1))
    sched = TalkerScheduler(kv, PenaltyTable(4, 8, "cpu", counts=False), max_batch_size=4)
    a, b, c = seq("a", 2), seq("b", 2), seq("c", 2)
    sched.add(a)
    sched.add(b)
    prefills, decodes = sched.schedule()
    assert names(prefills) == ["a", "b"] and not decodes and len(kv.blocks.free) == 2
    launched(a, 2)
    launched(b, 2)
    sched.add(c)
    prefills, decodes = sched.schedule()  # c's 2 blocks would take the 2 that a's and b's next rows need
    assert not prefills and names(decodes) == ["a", "b"] and list(sched.waiting) == [c] and not kv.blocks.free
    launched(a, 1)
    launched(b, 1)
    prefills, decodes = sched.schedule()  # none free for 2 rows: b (the newest running) out, its 3 blocks freed
    assert list(kv.swapped) == ["b"] and names(decodes) == ["a"] and list(sched.waiting) == [c]
    sched.release("a")  # a ends: b back (its 3 blocks + 1 fit in 6), then c admitted beside it
    prefills, decodes = sched.schedule()
    assert not kv.swapped and names(prefills) == ["c"] and names(decodes) == ["b"] and not sched.waiting
    for s in ("b", "c"):
        sched.release(s)
    assert len(kv.blocks.free) == 6 and sched.penalties.num_free == 4 and not sched.seqs


def test_prompts_past_the_step_budget_wait() -> None:
    kv = KvGrowth(BlockManager(64, 1), torch.zeros(2, 1, 64, 1, 1, 1))
    sched = TalkerScheduler(kv, PenaltyTable(8, 8, "cpu", counts=False), max_batch_size=8, max_num_batched_tokens=10)
    a, b, c, d = seq("a", 12), seq("b", 6), seq("c", 3), seq("d", 2)
    for s in (a, b, c, d):
        sched.add(s)
    prefills, decodes = sched.schedule()
    assert names(prefills) == ["a"] and not decodes  # a step's first prompt goes whatever its length
    launched(a, 12)
    prefills, decodes = sched.schedule()  # a's frame (1 row) + b's 6 + c's 3 = 10; d's 2 would pass it
    assert names(prefills) == ["b", "c"] and names(decodes) == ["a"]
    launched(a, 1)
    launched(b, 6)
    launched(c, 3)
    prefills, decodes = sched.schedule()
    assert names(prefills) == ["d"] and names(decodes) == ["a", "b", "c"]


def test_a_lookahead_keeps_room_for_the_running_streams_next_frames() -> None:
    """With `lookahead` 3 an admission leaves room for each running stream's next row and 3 frames after it (up to
    its last frame), so that no stream is swapped out (its audio paused) for a newcomer."""
    admitted = {}
    for lookahead, last_frame in ((0, 100), (3, 100), (3, 3)):
        kv = KvGrowth(BlockManager(8, 1), torch.zeros(2, 1, 8, 1, 1, 1))
        sched = TalkerScheduler(kv, PenaltyTable(4, 8, "cpu", counts=False), max_batch_size=4, lookahead=lookahead)
        a, b = seq("a", 2), seq("b", 3)
        a.req.talker_sampling.max_frames = last_frame
        sched.add(a)
        sched.schedule()
        launched(a, 2)  # 2 blocks held, 6 free; its next row takes 1
        sched.add(b)
        prefills, decodes = sched.schedule()
        assert names(decodes) == ["a"]
        admitted[lookahead, last_frame] = names(prefills) == ["b"]
    # b's 3 blocks + a's next 1 fit in 6; + a's 3 frames after it do not; a with 1 frame left after its next: fit
    assert admitted == {(0, 100): True, (3, 100): False, (3, 3): True}
