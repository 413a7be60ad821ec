"""Prefill graphs past cached rows (`pipeline.prefill_graph`, `context_ratio`): a run whose prompts have rows in
the cache already (a prefix-cache hit, a later chunk) against the eager forward over the same cache, on the CPU
through the same static buffers and, on CUDA, captured."""

from __future__ import annotations

import pytest
import torch
from graph_helpers import kv
from test_prefill_graph import BLOCK, BUCKETS, omni, omni_cuda

from omnistage.layers.context import build_context, forward_context


def _past_cached(model, runner, computed: list[int], lens: list[int], device: str = "cpu"):
    """Block tables for `computed` + `lens` rows each, the cached rows written by an eager forward first,
    then (the new rows' embeds, positions, tables)."""
    width = [-(-(c + n) // BLOCK) for c, n in zip(computed, lens)]
    tables = [list(range(1 + sum(width[:i]), 1 + sum(width[:i + 1]))) for i in range(len(lens))]
    g = torch.Generator(device).manual_seed(sum(computed) + sum(lens))
    dtype, hidden = runner.embeds.dtype, runner.embeds.shape[1]
    cached = [i for i, c in enumerate(computed) if c]
    with forward_context(build_context([0] * len(cached), [computed[i] for i in cached],
                                       [tables[i] for i in cached], BLOCK, device)):
        model(torch.randn(sum(computed), hidden, device=device, generator=g).to(dtype),
              torch.cat([torch.arange(computed[i], device=device) for i in cached]))
    embeds = torch.randn(sum(lens), hidden, device=device, generator=g).to(dtype)
    positions = torch.cat([torch.arange(c, c + n, device=device) for c, n in zip(computed, lens)])
    return embeds, positions, tables


@pytest.mark.parametrize("computed, lens", [([8, 0, 20], [5, 11, 3]), ([60], [1]), ([200], [16]),
                                            ([600, 400], [1, 1])])
def test_rows_past_cached_ones_match_the_eager_forward(computed: list[int], lens: list[int]) -> None:
    """A run past cached rows (every bucket reads up to 4 x the largest's of them, so the new rows alone
    choose it: 1 000 cached take the 16-row bucket for two one-row closes) equals the eager forward and writes
    only its new rows' slots and the scratch."""
    stage = omni(True).engine.thinker
    runner, model = stage.prefill, stage.thinker.model
    assert runner.max_context == 4 * BUCKETS[-1] and runner.fits(lens, computed)
    assert not runner.fits([1], [4 * BUCKETS[-1] + 1]) and runner._bucket(16, 200) == 16
    assert runner._bucket(2, 4 * BUCKETS[-1]) == 16 and runner._bucket(17, 1) == 32
    embeds, positions, tables = _past_cached(model, runner, computed, lens)
    before = kv(model).clone()
    hidden = runner.run(embeds, positions, lens, tables, computed=computed)[0].clone()
    after = kv(model).clone()
    with forward_context(build_context(computed, lens, tables, BLOCK)):
        ref = model(embeds, positions)[0]
    torch.testing.assert_close(hidden, ref, rtol=1e-5, atol=1e-5)
    slots = (after != before).flatten(4).any(-1).flatten(0, 1).any(0).flatten()
    live = {t[p // BLOCK] * BLOCK + p % BLOCK for c, n, t in zip(computed, lens, tables) for p in range(c, c + n)}
    scratch = set(range(runner.scratch * BLOCK, (runner.scratch + 1) * BLOCK))
    assert live <= set(slots.nonzero()[:, 0].tolist()) <= live | scratch


def test_last_rows_past_cached_ones_over_several_runs() -> None:
    # the talker's prompts past their cached user rows: runs split by rows (256) and by cached rows (1 024)
    stage = omni(True).engine.talkers[0]
    runner, model = stage.prefill, stage.talker.model
    computed, lens = [40, 0, 900, 200], [30, 100, 200, 9]
    assert runner.groups(lens, computed) == [(0, 2), (2, 3), (3, 4)] and runner.groups([1], [1025]) is None
    embeds, positions, tables = _past_cached(model, runner, computed, lens)
    last = runner.run_last(embeds, positions, lens, tables, computed)
    with forward_context(build_context(computed, lens, tables, BLOCK)):
        ref = model(embeds, positions)[0][torch.tensor(lens).cumsum(0) - 1]
    torch.testing.assert_close(last, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and flash attention need a GPU")
@pytest.mark.parametrize("computed, lens", [([8, 0, 20], [5, 11, 3]), ([60], [1]), ([200, 700], [16, 90])])
def test_captured_graph_past_cached_rows_matches_the_eager_forward_on_cuda(computed: list[int],
                                                                         lens: list[int]) -> None:
    stage = omni_cuda().engine.thinker
    runner, model = stage.prefill, stage.thinker.model
    embeds, positions, tables = _past_cached(model, runner, computed, lens, "cuda")
    hidden = runner.run(embeds, positions, lens, tables, computed=computed)[0].clone()
    with forward_context(build_context(computed, lens, tables, BLOCK, "cuda")):
        ref = model(embeds, positions)[0]
    assert torch.isfinite(hidden).all()
    torch.testing.assert_close(hidden.float(), ref.float(), rtol=3e-2, atol=3e-2)
