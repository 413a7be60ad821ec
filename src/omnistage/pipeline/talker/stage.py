"""Talker stage: one codec frame per request per step (talker forward, codebook 0, 15 code-predictor
passes, next input), batched across requests. A request joins after the thinker's first token (a text prompt
with `talker_prompt_at_admission` at the thinker's admission, its rows but the last prefilled for their KV) and
then needs one text row per frame; it waits only when the thinker lags."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.engine.block_manager import BlockManager
from omnistage.engine.kv_growth import KvGrowth
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.layers.attention import allocate_kv_cache
from omnistage.models.qwen3_omni.talker_prompt import TalkerTokens, text_rows
from omnistage.pipeline.async_output import AsyncOutputStep
from omnistage.pipeline.connector import FrameChunk, Inbox, TextChunk
from omnistage.pipeline.faults import StepFaults
from omnistage.pipeline.prefill_graph import PrefillGraphRunner, prefill_runner
from omnistage.pipeline.talker.admission import TalkerAdmission
from omnistage.pipeline.talker.frame_step import TalkerFrameStep
from omnistage.pipeline.talker.prefix import register_prefix
from omnistage.pipeline.talker.runner import TalkerGraphRunner
from omnistage.pipeline.talker.scheduler import TalkerScheduler
from omnistage.pipeline.talker.seq import Launched, Run, TalkerSeq, frame_batch


class TalkerStage(TalkerAdmission, AsyncOutputStep):
    """`step` (see `AsyncOutputStep`): with asynchronous output a step's frames reach code2wav and end
    requests one step later, and a request ended by codec_eos has one extra frame computed and dropped."""

    def __init__(self, talker: torch.nn.Module, config: Any, to_code2wav: Callable[[FrameChunk], None],
                 thinker_tts_embeds: torch.Tensor, *, max_batch_size: int = 64, max_num_batched_tokens: int = 8192,
                 num_blocks: int = 1024, block_size: int = 16, cuda_graph: bool = False,
                 graph_batch_sizes: Sequence[int] = (), prefill_tokens: Sequence[int] = (),
                 async_output: bool = False, prefix_caching: bool = False, prefill_context_ratio: int = 0,
                 kv_lookahead: int = 0, last_prompt_row_in_decode: bool = False) -> None:
        """`cuda_graph`: decodes go through `TalkerGraphRunner` (static buffers, batches padded to
        `graph_batch_sizes`, default as the deploy config's; graphs captured on CUDA only, run eagerly
        elsewhere), prefills as a forward (through `PrefillGraphRunner` at its `prefill_tokens` buckets when
        given and the prompts fit, rows past cached ones there too with `prefill_context_ratio`, else
        eagerly) plus its head graph; one KV block is then reserved for padding rows. `prefix_caching`: the
        prompts' user-turn rows are cached (talker/prefix.py). `max_num_batched_tokens`: rows a step,
        `kv_lookahead`: frames of room each running request keeps at an admission (`TalkerScheduler`).
        `last_prompt_row_in_decode`: a prompt's rows but the last are prefilled for their KV alone and the last
        goes with the step's decodes, so one decode graph replay makes every frame of the step (no head graph)."""
        self.talker, self.to_code2wav = talker, to_code2wav
        p = talker.model.norm.weight  # NOTE: not the first parameter: FP8 weights (`quantization`)
        self.device, self.dtype = p.device, p.dtype
        talker.set_tts_embeds(thinker_tts_embeds.to(self.device))
        self.tokens = TalkerTokens.from_config(config)
        self.blocks = BlockManager(num_blocks, block_size)
        cache = allocate_kv_cache(talker.model, num_blocks, block_size, p.dtype, p.device)
        # NOTE: requests hold a row from admission to their end; more than this many wait, as for KV blocks
        self.penalties = PenaltyTable(4 * max_batch_size, talker.codec_head.out_features, p.device, counts=False)
        self.scheduler = TalkerScheduler(KvGrowth(self.blocks, cache, "talker"), self.penalties, max_batch_size,
                                         max_num_batched_tokens, kv_lookahead)
        self.seqs, self.waiting = self.scheduler.seqs, self.scheduler.waiting  # the same queues
        self.runner: TalkerGraphRunner | None = None
        self.prefill: PrefillGraphRunner | None = None
        if cuda_graph:
            scratch = self.blocks.reserve()
            sizes = list(graph_batch_sizes) or StageConfig(max_batch_size=max_batch_size).graph_batch_sizes()
            self.runner = TalkerGraphRunner(talker, sizes, max_batch_size, self.blocks.num_blocks, block_size,
                                            scratch, self.penalties)
            self.prefill = prefill_runner(talker.model, prefill_tokens, max_batch_size, block_size, scratch,
                                          context_ratio=prefill_context_ratio)
        self.prefix_caching = prefix_caching
        self.last_row_in_decode = last_prompt_row_in_decode
        self.frame_step = TalkerFrameStep(talker, self.blocks, self.penalties, self.runner, self.prefill)
        self.inbox: Inbox[TextChunk] = Inbox()
        self.async_output = async_output  # `step`'s `last_batch` / `pending` start as `AsyncOutputStep`'s
        self.faults, self.step_requests = StepFaults(), []  # see pipeline/faults.py

    def stats(self) -> dict[str, int]:
        return dict(batch_size=self.last_batch, queue_depth=len(self.waiting), **self.blocks.stats(),
                    kv_block_waits=self.scheduler.kv.waits, kv_swaps=self.scheduler.kv.swaps,
                    prefix_cache_queries=self.blocks.queries,
                    prefix_cache_hits=self.blocks.hits)

    def add(self, chunk: TextChunk) -> None:
        self.inbox.put(chunk)

    def abort(self, request_id: str) -> None:
        self.scheduler.release(request_id)

    @property
    def num_active(self) -> int:
        return len(self.seqs)

    def _schedule(self) -> list[tuple[TalkerSeq, torch.Tensor]]:
        """The scheduler's prefills, then its decodes with their input rows (last frame's codec embedding + text)."""
        self._receive()
        batch, decodes = self.scheduler.schedule()
        self.step_requests = [s.req for s, _ in batch] + [s.req for s, _ in decodes]
        if decodes:
            embeds, finals = zip(*(t for _, t in decodes))
            rows = torch.stack([s.codec_embed for s, _ in decodes]) + text_rows(self.talker, embeds, finals)
            batch += [(s, rows[i:i + 1]) for i, (s, _) in enumerate(decodes)]
        return batch

    def _tokens(self, batch: list[tuple[TalkerSeq, torch.Tensor]]) -> int:
        return sum(rows.shape[0] for _, rows in batch)

    def _launch(self, batch: list[tuple[TalkerSeq, torch.Tensor]]) -> Launched | None:
        # prompt rows for their KV alone: an early prompt's before its first token, with `last_row_in_decode` a
        # prompt's rows but the last (which joins the one-row inputs)
        split = [(s, r, self.last_row_in_decode and r.shape[0] > 1) for s, r in batch]
        if kv := [(s, r if s.awaiting else r[:-1]) for s, r, cut in split if s.awaiting or cut]:
            self.frame_step.prefill_kv(frame_batch(kv, self.blocks.tables))
            for seq, rows in kv:
                seq.num_computed += rows.shape[0]
        batch = [(s, r[-1:] if cut else r) for s, r, cut in split if not s.awaiting]
        # NOTE: with the runner, prompts and one-row inputs (decodes, a prompt's last row) run apart so the
        # one-row inputs always replay their graph.
        groups = ([[e for e in batch if e[1].shape[0] > 1], [e for e in batch if e[1].shape[0] == 1]]
                  if self.runner else [batch])
        runs = []
        for group in filter(None, groups):
            fb = frame_batch(group, self.blocks.tables)
            frames, codec_embeds = self.frame_step(fb)
            for i, (seq, _) in enumerate(group):
                seq.num_computed += fb.lens[i]
                seq.frames += 1
                seq.codec_embed = codec_embeds[i]
                if not seq.prefilled:
                    seq.prefilled = True
                    register_prefix(self.blocks, seq)
            runs.append(Run(group, frames))  # NOTE: its copy before the next run's launch: its frames go on first
        return Launched(runs) if runs else None

    def _complete(self, launched: Launched) -> None:
        for run in launched.runs:  # NOTE: a host sync a run; a prompt's first frame needs not wait for the decodes
            for (seq, _), frame, code in zip(run.group, run.frames, run.c0.tolist()):
                if self.seqs.get(seq.req.request_id) is seq:  # not ended (or aborted) since its launch
                    self.faults.run(seq.req, self._advance, seq, frame, code)

    def _advance(self, seq: TalkerSeq, frame: torch.Tensor, c0: int) -> None:
        if c0 == self.talker.codec_eos:
            return self._finish(seq)
        seq.emitted += 1
        alone = False
        if seq.emitted == 1:
            seq.req.mark("first_frame")
            alone = len(self.seqs) == 1 and not self.waiting
        self.to_code2wav(FrameChunk(seq.req, frame, talker_alone=alone))
        if seq.emitted >= seq.req.talker_sampling.max_frames:
            self._finish(seq)

    def _finish(self, seq: TalkerSeq) -> None:
        seq.req.usage.audio_frames = seq.emitted
        self.abort(seq.req.request_id)
        self.to_code2wav(FrameChunk(seq.req, finished=True))
