"""KV blocks taken as requests grow (engine/kv_growth.py): only the rows computed hold blocks, a growth that could
end with every request waiting for blocks is refused, and on a KV cache too small to hold two answers whole the
stages run several at once and answer exactly as with room to spare."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from omnistage.config_loader import default_deploy_config, load_deploy_config
from omnistage.engine.block_manager import BlockManager
from omnistage.engine.kv_growth import KvGrowth
from omnistage.entrypoints.omni import Omni
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint


def test_a_grant_takes_the_rows_computed_not_the_limit() -> None:
    kv = KvGrowth(BlockManager(100, 16))
    assert kv.grant("a", 20, 2000) and len(kv.blocks.tables["a"]) == 2 and len(kv.blocks.free) == 98
    assert kv.grant("a", 32, 2000) and len(kv.blocks.tables["a"]) == 2  # still within its second block
    assert kv.grant("a", 33, 2000) and len(kv.blocks.tables["a"]) == 3
    kv.release("a")
    assert len(kv.blocks.free) == 100 and kv.limits == {}


def lockstep(kv: KvGrowth, limits: dict[str, int]) -> tuple[list[tuple[str, int]], list[str]]:
    """Every request asks for one more row per step, in turn, until all reach their limits (then end):
    (refused (request, rows held) in order, the order they ended in)."""
    rows = dict.fromkeys(limits, 0)
    refused, ended = [], []
    for _ in range(1000):
        for sid in [s for s in rows if s not in ended]:
            if rows[sid] == limits[sid]:
                kv.release(sid)
                ended.append(sid)
            elif kv.grant(sid, rows[sid] + 1, limits[sid]):
                rows[sid] += 1
            else:
                refused.append((sid, rows[sid]))
        if len(ended) == len(rows):
            return refused, ended
    raise AssertionError(f"deadlock: {rows}")


def test_requests_that_cannot_all_reach_their_limits_take_turns_instead_of_deadlocking() -> None:
    # 10 blocks of 1 row, two requests of up to 8: both at 5 rows would leave none free and both 3 short
    kv = KvGrowth(BlockManager(10, 1))
    refused, ended = lockstep(kv, {"a": 8, "b": 8})
    # from 2 rows each (6 free, 6 short each) a's third row leaves exactly what a still needs: b waits until a ends
    assert refused[0] == ("b", 2) and {r for _, r in refused} == {2} and {s for s, _ in refused} == {"b"}
    assert ended == ["a", "b"] and len(kv.blocks.free) == 10


def test_many_requests_end_whatever_their_limits() -> None:
    kv = KvGrowth(BlockManager(40, 4))
    limits = {f"r{i}": n for i, n in enumerate([150, 37, 90, 5, 160, 64, 120, 12])}
    refused, ended = lockstep(kv, limits)
    assert refused and sorted(ended) == sorted(limits) and len(kv.blocks.free) == 40


def test_a_refused_grant_changes_nothing() -> None:
    kv = KvGrowth(BlockManager(10, 1))
    assert kv.grant("a", 2, 8) and kv.grant("b", 2, 8) and kv.grant("a", 3, 8)
    free, tables, limits = len(kv.blocks.free), {k: list(v) for k, v in kv.blocks.tables.items()}, dict(kv.limits)
    assert not kv.grant("b", 3, 8)  # growth
    assert not kv.grant("c", 1, 8)  # admission: c's limit would be out of reach
    assert not kv.grant("a", 3, 9)  # a larger limit (a growing prompt) with no new block
    assert (len(kv.blocks.free), kv.blocks.tables, kv.limits) == (free, tables, limits)


def test_blocks_shared_through_the_prefix_cache_are_not_counted_as_freed() -> None:
    blocks = BlockManager(10, 1)
    kv = KvGrowth(blocks)
    assert kv.grant("a", 4, 4)
    blocks.register("a", [b"0", b"1", b"2", b"3"])
    assert blocks.match("b", [b"0", b"1", b"2", b"3"], 4) and kv.grant("b", 5, 10)
    # 5 free, b 5 short. c at 1 row of 6 would leave 4 free: a ends first but frees nothing (b holds its blocks),
    # then b and c are both 5 short of their limits; counting a's 4 blocks as freed would have let it in
    assert not kv.grant("c", 1, 6) and kv.grant("c", 1, 5)


def test_a_prompt_still_growing_holds_its_blocks_and_no_one_waits_on_it_to_end() -> None:
    kv = KvGrowth(BlockManager(8, 1))
    assert kv.grant("o", 4, None) and kv.grant("p", 1, None)  # turns being spoken: no limits yet, they end only
    # once their users stop
    assert not kv.grant("a", 1, 6)  # 6 rows cannot be promised beside their 5 (counting on o to end first could
    assert kv.grant("b", 1, 3) and kv.grant("b", 3, 3)  # deadlock: o waiting for blocks, a for o); 3 can
    assert not kv.grant("o", 5, None)  # none free
    kv.release("b")
    assert kv.grant("o", 5, None)
    assert not kv.grant("o", 6, 8) and "o" not in kv.limits  # whole at 6 rows, 8 to reach, 1 left: it waits
    assert kv.grant("o", 6, 7) and kv.limits == {"o": 7}


def engine(kv_blocks: dict[str, int] | None) -> Omni:
    """The tiny checkpoint's engine; `kv_blocks`: KV blocks per stage (thinker 16 KiB, talker 8 KiB a block)."""
    d = tiny_checkpoint("tiny")
    per_block = {"thinker": 1 << 14, "talker": 1 << 13}
    stages = {s: {"kv_cache_memory": n * per_block[s]} for s, n in (kv_blocks or {}).items()}
    cfg = load_deploy_config(default_deploy_config(d), platform="cpu", overrides={"stages": stages})
    return Omni(d, deploy=replace(cfg, enable_prefix_caching=False), device="cpu")


TOKENS, FRAMES = 64, 56  # each stage's KV cache at least 8 blocks (placement/sizing.fixed_blocks)
PROMPTS = [[{"role": "user", "content": t}] for t in ("Say hello.", "Count to three.", "Name a colour.", "Hi")]


def answers(o: Omni) -> list:
    return o.chat(PROMPTS, sampling={"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True},
                  talker_sampling={"temperature": 0, "max_frames": FRAMES, "ignore_eos": True})


def spy(kv: KvGrowth) -> dict[str, int]:
    """Counts refusals and the most requests holding blocks at once."""
    seen = {"refused": 0, "together": 0}
    grant = kv.grant

    def counted(seq_id: str, tokens: int, limit: int) -> bool:
        ok = grant(seq_id, tokens, limit)
        seen["refused"] += not ok
        seen["together"] = max(seen["together"], len(kv.limits))
        return ok

    kv.grant = counted
    return seen


def test_a_small_kv_cache_runs_answers_together_and_exactly() -> None:
    ref = engine(None)
    want = answers(ref)
    ref.engine.shutdown()
    limits = [(r.usage.prompt_tokens + TOKENS, r.usage.prompt_tokens + 9 + FRAMES) for r in want]
    # one block short of two of the longest answers whole, in each stage: one at a time with their limits taken
    # at admission; growing, several at once (some wait a step for a block)
    thinker, talker = (2 * -(-max(lim[i] for lim in limits) // 16) - 1 for i in (0, 1))
    o = engine({"thinker": thinker, "talker": talker})
    assert o.engine.thinkers[0].blocks.num_blocks == thinker and o.engine.talkers[0].blocks.num_blocks == talker
    seen = {"thinker": spy(o.engine.thinkers[0].scheduler.kv), "talker": spy(o.engine.talkers[0].kv)}
    try:
        got, stats = answers(o), o.engine.stats()
    finally:
        o.engine.shutdown()
    for stage in ("thinker", "talker"):
        assert seen[stage]["together"] >= 2 and seen[stage]["refused"] == stats[stage]["kv_block_waits"] > 0, seen
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.usage.completion_tokens == TOKENS
        assert np.array_equal(a.codes, b.codes) and a.codes.shape[1] == FRAMES
        np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-6)
    assert all(stats[s]["kv_blocks_used"] == 0 for s in ("thinker", "talker")), stats
