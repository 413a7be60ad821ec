"""Thinker stage: continuous batching over a paged KV cache; chunked prefill within a token budget;
asynchronous output (the host handles step N's tokens while step N+1 runs on the device)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from omnistage.config import StageConfig
from omnistage.engine.block_manager import BlockManager
from omnistage.engine.kv_growth import KvGrowth
from omnistage.engine.penalty_table import PenaltyTable
from omnistage.engine.request import Request
from omnistage.layers import triton_ops
from omnistage.layers.attention import allocate_kv_cache
from omnistage.models.qwen3_omni.rope_index import RopeSpec
from omnistage.outputs import OutputDelta
from omnistage.pipeline.async_output import AsyncOutputStep
from omnistage.pipeline.connector import Inbox, TalkerPrompt, TextChunk
from omnistage.pipeline.faults import StepFaults
from omnistage.pipeline.prefill_graph import PrefillGraphRunner, prefill_runner
from omnistage.pipeline.thinker.admission import ThinkerAdmission
from omnistage.pipeline.thinker.arrivals import Arrivals
from omnistage.pipeline.thinker.audio_graph import AUDIO_CHUNKS, AudioGraphRunner
from omnistage.pipeline.thinker.eager import ThinkerEagerStep
from omnistage.pipeline.thinker.encoder_cache import EncoderCache
from omnistage.pipeline.thinker.first_frame import alone_before_first_frame, wait_first_frame
from omnistage.pipeline.thinker.growth import PromptPiece
from omnistage.pipeline.thinker.prefix import register_prefix
from omnistage.pipeline.thinker.runner import ThinkerGraphRunner
from omnistage.pipeline.thinker.scheduler import ThinkerScheduler
from omnistage.pipeline.thinker.seq import Launched, Sampled, ThinkerSeq
from omnistage.pipeline.thinker.vision_graph import VISION_FRAMES, VISION_ROWS, VisionGraphRunner


class ThinkerStage(AsyncOutputStep, ThinkerAdmission):
    """`step` (see `AsyncOutputStep`): with asynchronous output a request's next decode row takes its last
    token on the device, and a request that ends on a token has one more token computed and dropped."""

    def __init__(self, thinker: torch.nn.Module, config: Any, tokenizer: Any, to_talker: Callable[[TextChunk], None],
                 *, max_batch_size: int = 64, max_num_batched_tokens: int = 8192, num_blocks: int = 1024,
                 block_size: int = 16, cuda_graph: bool = False, graph_batch_sizes: Sequence[int] = (),
                 prefill_tokens: Sequence[int] = (), async_output: bool = False, prefix_caching: bool = False,
                 encoder_cache_bytes: int = 0, prefill_context_ratio: int = 0, encoder_stream: bool = False,
                 max_encoder_tokens: int = 0, hold_first_frame: bool = False,
                 early_talker_prompt: bool = False) -> None:
        """`cuda_graph`: decode rows go through `ThinkerGraphRunner` (as the talker stage's runner), prefill
        chunks of the same step beside them: fresh prompts (media included) through `PrefillGraphRunner` when
        `prefill_tokens` (its token buckets) are given, rows past cached ones there too with
        `prefill_context_ratio`, others eagerly; one KV block is then reserved for padding rows; images and
        videos through `VisionGraphRunner`, audio through `AudioGraphRunner`.
        `async_output`: see `step`. `prefix_caching`: prompts share computed prefixes (thinker/prefix.py);
        `encoder_cache_bytes`: encoder rows kept for media sent again (thinker/encoder_cache.py), and as much
        again for the accept-layer rows kept beside cached prefix blocks. `encoder_stream`, `max_encoder_tokens`
        (media tokens a step encodes; 0: all that arrived): see `arrivals`. `hold_first_frame`: see
        `first_frame`; `early_talker_prompt`: see `early_prompt`."""
        self.thinker, self.tokenizer, self.to_talker = thinker, tokenizer, to_talker
        p = thinker.model.norm.weight  # NOTE: not the first parameter: FP8 weights (`quantization`)
        self.device, self.dtype = p.device, p.dtype
        self.blocks = BlockManager(num_blocks, block_size, encoder_cache_bytes)  # NOTE: the prefix's mm rows
        cache = allocate_kv_cache(thinker.model, num_blocks, block_size, p.dtype, p.device)
        self.penalties = PenaltyTable(max_batch_size, thinker.lm_head.out_features, p.device)
        self.runner: ThinkerGraphRunner | None = None
        self.prefill: PrefillGraphRunner | None = None
        self.vision: VisionGraphRunner | None = None
        self.audio: AudioGraphRunner | None = None
        if cuda_graph:
            # NOTE: the encoders' reference attention syncs (per-sequence lengths): no graphs without the fast path
            if triton_ops.ENABLED:
                self.vision = VisionGraphRunner(thinker.visual, VISION_ROWS, VISION_FRAMES, self.device)
                self.audio = AudioGraphRunner(thinker.audio_tower, AUDIO_CHUNKS, self.device)
            scratch = self.blocks.reserve()
            sizes = list(graph_batch_sizes) or StageConfig(max_batch_size=max_batch_size).graph_batch_sizes()
            self.runner = ThinkerGraphRunner(thinker, sizes, self.blocks.num_blocks, block_size, scratch,
                                             self.penalties)
            self.prefill = prefill_runner(thinker.model, prefill_tokens, max_batch_size, block_size, scratch,
                                          config.talker_config.accept_hidden_layer,
                                          len(config.thinker_config.vision_config.deepstack_visual_indexes),
                                          prefill_context_ratio)
        self.eager = ThinkerEagerStep(thinker, self.blocks, self.penalties, self.prefill,
                                      config.talker_config.accept_hidden_layer)
        self.prefix_caching = prefix_caching
        self.graph_tokens = self.prefill.buckets[-1] if self.prefill is not None else 0
        self.encoder_cache = EncoderCache(encoder_cache_bytes) if encoder_cache_bytes > 0 else None
        self.eos_ids = {config.im_end_token_id}
        self.rope = RopeSpec.from_config(config)
        self.inbox: Inbox[Request | PromptPiece] = Inbox()
        self.queued: deque[tuple[Request | PromptPiece, int]] = deque()  # drained, not yet taken (`take_within`)
        self.max_encoder_tokens = max_encoder_tokens
        self.mm_ids = frozenset((thinker.audio_token_id, thinker.image_token_id, thinker.video_token_id))
        self.arrivals = Arrivals(self.device, encoder_stream)
        self.scheduler = ThinkerScheduler(KvGrowth(self.blocks, cache, "thinker"), self.penalties, max_batch_size,
                                          max_num_batched_tokens, self.graph_tokens,
                                          self.prefill.max_context if self.prefill else 0)
        self.waiting, self.running = self.scheduler.waiting, self.scheduler.running  # the same queues
        self.async_output = async_output  # `step`'s `last_batch` / `pending` start as `AsyncOutputStep`'s
        self.faults, self.step_requests = StepFaults(), []  # see pipeline/faults.py
        self.hold_first_frame, self.early_talker_prompt = hold_first_frame, early_talker_prompt

    def stats(self) -> dict[str, int]:
        kv = self.scheduler.kv
        counters = dict(kv_block_waits=kv.waits, kv_swaps=kv.swaps, prefix_cache_queries=self.blocks.queries,
                        prefix_cache_hits=self.blocks.hits,
                        **(self.encoder_cache.stats() if self.encoder_cache is not None else {}))
        return dict(batch_size=self.last_batch, queue_depth=len(self.waiting), **self.blocks.stats(), **counters)

    def add(self, item: Request | PromptPiece) -> None:
        """A request, or more prompt for a growing one (applied in arrival order, after the requests
        that arrived with it)."""
        self.inbox.put(item)

    def abort(self, request_id: str) -> None:
        for seq in [*self.waiting, *self.running]:
            if seq.req.request_id == request_id:
                self._release(seq)

    @property
    def num_active(self) -> int:
        queued = sum(isinstance(item, Request) for item, _ in self.queued)
        return len(self.waiting) + len(self.running) + len(self.arrivals) + queued

    def step(self) -> bool:
        return super().step() or bool(self.queued)  # NOTE: media left for the next step: no idle wait

    def _schedule(self) -> list[tuple[ThinkerSeq, int]]:
        """What arrived admitted (`ThinkerAdmission`), then the scheduler's (seq, new tokens) for this step."""
        self._take_arrivals()
        if self.hold_first_frame and alone_before_first_frame(self) is not None:
            self._drain()  # its first token to the talker (with async output still in flight)
            if (req := alone_before_first_frame(self)) is not None:
                wait_first_frame(req, self.inbox)
        return self.scheduler.schedule()

    def _tokens(self, batch: list[tuple[ThinkerSeq, int]]) -> int:
        return sum(n for _, n in batch)

    def _launch(self, batch: list[tuple[ThinkerSeq, int]]) -> Launched | None:
        self.step_requests = [s.req for s, _ in batch]
        seqs = [s for s, _ in batch if not s.in_prefill]
        prefills = [(s, n) for s, n in batch if s.in_prefill]
        tables = [self.blocks.tables[s.req.request_id] for s in seqs]
        out = self.runner.run(seqs, tables, self.pending) if self.runner is not None and seqs else None
        if out is None:  # NOTE: eager decode rows read their last token on the host: finish the step in flight
            self._drain()  # (a request it ended, or whose token failed to complete, leaves this step)
            return Launched.of(self.eager([(s, n) for s, n in batch
                                              if not s.released and len(s.output_ids) == s.num_sampled]))
        # NOTE: the decode rows replayed their graph; prefill chunks of the same step run eagerly after them.
        for seq in seqs:
            seq.num_computed += 1
            seq.num_sampled += 1
        decoded = Sampled(seqs, *out)  # NOTE: before the prefill's launch: its tokens go on when the graph is done
        return Launched.of([decoded, *self.eager(prefills)])

    def _complete(self, launched: Launched) -> None:
        # NOTE: the step's host syncs, one a run; each also makes its embeddings ready for the talker's stream.
        for part in launched.parts:
            for seq, token, embed in zip(part.seqs, part.host.tolist(), part.embeds):
                if not seq.released:  # not ended (or aborted) since its launch
                    self.faults.run(seq.req, self._append, seq, token, embed)

    def _append(self, seq: ThinkerSeq, token: int, embed: torch.Tensor) -> None:
        text, stopped, done = seq.append(token, self.eos_ids)
        req = seq.req
        first = len(seq.output_ids) == 1
        if first:
            req.mark("first_token")
            register_prefix(self.blocks, seq)
        if req.want_audio:
            prompt = None
            if first:
                mm = torch.cat(seq.mm_hidden) if seq.mm_hidden else None
                prompt = TalkerPrompt(seq.prompt_ids, seq.embeds, mm)
            self.to_talker(TextChunk(req, embed, prompt))
        req.emit(OutputDelta(req.request_id, text=text, token_ids=[token]))
        if done:
            req.finish_reason = "stop" if stopped else "length"
            self._finish(seq)

    def _finish(self, seq: ThinkerSeq) -> None:
        req = seq.req
        req.usage.prompt_tokens = seq.prompt_len
        req.usage.completion_tokens = len(seq.output_ids)
        self._release(seq)
        if req.want_audio:
            self.to_talker(TextChunk(req, finished=True))
        req.part_done()

    def _release(self, seq: ThinkerSeq) -> None:
        self.scheduler.release(seq)
