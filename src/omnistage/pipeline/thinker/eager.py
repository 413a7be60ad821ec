"""The thinker's eager step: any mix of decode rows and prefill chunks in one forward (through the prefill
graphs where one run takes them), then sampling of the rows that need a token. The stage runs it for
prefill chunks beside its decode graph, and for whole steps without one."""

from __future__ import annotations

import torch

from omnistage.engine.block_manager import BlockManager
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.layers.context import build_context, forward_context, to_device
from omnistage.layers.sampling import SamplingTensors
from omnistage.models.qwen3_omni.decoder import Deepstack
from omnistage.models.qwen3_omni.rope_index import flat_positions
from omnistage.pipeline.prefill_graph import PrefillGraphRunner
from omnistage.pipeline.thinker.inputs import step_deepstack
from omnistage.pipeline.thinker.runner import sample_tokens
from omnistage.pipeline.thinker.seq import Sampled, ThinkerSeq


class ThinkerEagerStep:
    def __init__(self, thinker: torch.nn.Module, blocks: BlockManager, penalties: PenaltyTable,
                 prefill: PrefillGraphRunner | None, accept_layer: int) -> None:
        """`accept_layer`: the layer whose hidden rows the talker takes at multimodal positions."""
        self.thinker, self.blocks, self.penalties, self.prefill = thinker, blocks, penalties, prefill
        self.accept_layer, self.device = accept_layer, next(thinker.parameters()).device

    def __call__(self, batch: list[tuple[ThinkerSeq, int]]) -> list[Sampled]:
        """An eager step over any mix of decodes and prefill chunks; samples the rows that need a token."""
        if not batch:
            return []
        # NOTE: `_schedule` puts decodes first: their rows are one embedding lookup, then prefill slices.
        decode_ids = [s.output_ids[-1] for s, _ in batch if not s.in_prefill]
        rows = [self.thinker.model.embed_tokens(to_device(decode_ids, torch.long, self.device))] if decode_ids else []
        rows += [s.embeds[s.num_computed:s.num_computed + n] for s, n in batch if s.in_prefill]
        spans = [(s.num_computed, n) for s, n in batch]
        positions = flat_positions(spans, [s.mrope for s, _ in batch], self.device)
        capture = self.accept_layer if any(s.in_prefill and s.has_mm for s, _ in batch) else None
        hidden, accept = self._model(batch, torch.cat(rows), positions, capture, step_deepstack(batch))
        offset, samplers = 0, []
        for seq, n in batch:
            if capture is not None and seq.in_prefill:
                seq.mm_hidden.append(accept[offset:offset + n][seq.mm_mask[seq.num_computed:seq.num_computed + n]])
            seq.num_computed += n
            offset += n
            if not seq.in_prefill:
                seq.deepstack = None  # NOTE: the prompt is done: its DeepStack rows are not needed again
                samplers.append((seq, offset - 1))
        return [self._sample(samplers, hidden)] if samplers else []

    def _model(self, batch: list[tuple[ThinkerSeq, int]], rows: torch.Tensor, positions: torch.Tensor,
               capture: int | None, deepstack: Deepstack | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Path choice: the rows through the prefill graphs where one run takes them (with the accept layer's
        rows where the talker needs them, and their DeepStack rows), else eagerly."""
        lens, tables = [n for _, n in batch], [self.blocks.tables[s.req.request_id] for s, _ in batch]
        computed = [s.num_computed for s, _ in batch]
        if self.prefill is not None and self.prefill.fits_deepstack(deepstack) and self.prefill.fits(lens, computed):
            return self.prefill.run(rows, positions, lens, tables, capture is not None, deepstack, computed)
        ctx = build_context(computed, lens, tables, self.blocks.block_size, self.device)
        with forward_context(ctx):
            return self.thinker.model(rows, positions, capture, deepstack)

    def _sample(self, samplers: list[tuple[ThinkerSeq, int]], hidden: torch.Tensor) -> Sampled:
        seqs = [s for s, _ in samplers]
        logits = self.thinker.compute_logits(hidden[to_device([i for _, i in samplers], torch.long, self.device)])
        st = SamplingTensors.build([s.req.sampling for s in seqs], [s.req.seed for s in seqs], self.device)
        tokens, embeds = sample_tokens(self.thinker, self.penalties, logits, st,
                                       to_device([s.num_sampled for s in seqs], torch.long, self.device),
                                       to_device([s.slot for s in seqs], torch.long, self.device))
        for seq in seqs:
            seq.num_sampled += 1
        return Sampled(seqs, tokens, embeds)

