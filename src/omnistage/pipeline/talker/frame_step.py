"""The talker's frame step on a flat batch: decodes replay the runner's graph; prefills run a forward
(through the prefill graphs, in as many runs as they need) plus the runner's head graph;
everything eagerly without a runner (or past its largest bucket)."""

from __future__ import annotations

import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.layers.context import build_context, forward_context, to_device
from omnistage.layers.sampling import SamplingTensors
from omnistage.models.qwen3_omni.rope_index import flat_positions
from omnistage.pipeline.prefill_graph import PrefillGraphRunner
from omnistage.pipeline.talker.runner import FrameBatch, TalkerGraphRunner


class TalkerFrameStep:
    def __init__(self, talker: torch.nn.Module, blocks: BlockManager, penalties: PenaltyTable,
                 runner: TalkerGraphRunner | None, prefill: PrefillGraphRunner | None) -> None:
        self.talker, self.blocks, self.penalties, self.runner, self.prefill = talker, blocks, penalties, runner, prefill
        self.device = next(talker.parameters()).device

    def __call__(self, fb: FrameBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(frames [B, G], codec_embeds [B, H]): a decode batch through the runner's graph, a prefill batch
        as an eager talker forward plus the runner's head graph; eagerly without a runner (or past its
        largest bucket)."""
        decode = max(fb.lens) == 1
        if self.runner is not None and decode and (out := self.runner.run(fb)) is not None:
            return out
        hidden = self._hidden(fb)
        if self.runner is not None and not decode and (out := self.runner.run_head(hidden, fb)) is not None:
            return out
        st = SamplingTensors.build(fb.params, fb.seeds, self.device)
        frame_index = to_device(fb.frame_index, torch.long, self.device)
        ignore_eos = to_device([p.ignore_eos for p in fb.params], torch.bool, self.device)
        return self.penalties.update_seen(to_device(fb.slots, torch.long, self.device),
                                          lambda seen: self.talker.head(hidden, st, frame_index, seen, ignore_eos))

    def prefill_kv(self, fb: FrameBatch) -> None:
        """The talker forward over prompt rows for their KV alone: no frame (an early prompt's rows)."""
        self._hidden(fb)

    def _hidden(self, fb: FrameBatch) -> torch.Tensor:
        """The talker forward over a flat batch (any mix of prefills and decodes): each request's last hidden;
        through the prefill graphs where they take it (in as many runs as it needs)."""
        positions = flat_positions(list(zip(fb.num_computed, fb.lens)), fb.mropes, self.device)
        if self.prefill is not None and (
                out := self.prefill.run_last(fb.inputs, positions, fb.lens, fb.tables, fb.num_computed)) is not None:
            return out
        last = to_device(fb.lens, torch.long, self.device).cumsum(0) - 1
        ctx = build_context(fb.num_computed, fb.lens, fb.tables, self.blocks.block_size, self.device)
        with forward_context(ctx):
            return self.talker(fb.inputs, positions).index_select(0, last)
