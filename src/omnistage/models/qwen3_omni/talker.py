"""Talker: MoE decoder over codec frames (+ the code predictor), and a reference single-request loop.

One `step` takes a flat batch of input rows (a request's prompt rows at prefill, or one row per
request at decode), runs the talker, samples codebook 0 from the last row of each request
(repetition penalty over the request's generated codes, ids [vocab-1024, vocab) suppressed except
codec_eos) and completes the frame with the code predictor. It returns the frame [B, G] and the codec
part of each request's next input row; the engine adds the next text row (`talker_prompt.next_text_row`).
Positions are 0..L-1 over the talker's own sequence (1-D: the interleaved M-RoPE reduces to RoPE).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers.attention import allocate_kv_cache
from omnistage.layers.context import build_context, contiguous_block_tables, forward_context
from omnistage.layers.sampling import SamplingTensors, record_tokens, request_seed, sample
from omnistage.models.qwen3_omni.code_predictor import CodePredictor, predictor_sampling
from omnistage.models.qwen3_omni.decoder import DecoderConfig, DecoderModel
from omnistage.sampling_params import TalkerSamplingParams


class ResizeMLP(nn.Module):
    """Thinker width -> talker width: Linear(bias) -> SiLU -> Linear(bias)."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(DecoderModel):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class Talker(nn.Module):
    def __init__(self, config) -> None:
        """`config`: transformers' `talker_config`."""
        super().__init__()
        text = config.text_config.to_dict()
        # NOTE: transformers' talker config serialises `num_experts` under its alias `num_local_experts`.
        text.setdefault("num_experts", text.get("num_local_experts", 0))
        cfg = DecoderConfig.from_dict(text)
        self.model = TalkerModel(cfg)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, text["intermediate_size"], cfg.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, text["intermediate_size"], cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config.code_predictor_config)
        self.num_code_groups = config.num_code_groups
        self.codec_eos = config.codec_eos_token_id
        suppress = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        suppress[max(0, cfg.vocab_size - 1024):] = True
        suppress[self.codec_eos] = False
        self.register_buffer("suppress", suppress, persistent=False)
        self.register_buffer("eos_mask", torch.arange(cfg.vocab_size) == self.codec_eos, persistent=False)
        # talker rows of tts_bos, tts_eos, tts_pad: set from the thinker's embeddings by `set_tts_embeds`
        self.register_buffer("tts_embeds", torch.zeros(3, cfg.hidden_size), persistent=False)

    @torch.no_grad()
    def set_tts_embeds(self, thinker_embeds: torch.Tensor) -> None:
        """`thinker_embeds` [3, Ht]: the thinker's input embeddings of tts_bos, tts_eos, tts_pad."""
        self.tts_embeds.copy_(self.text_projection(thinker_embeds.to(self.tts_embeds.dtype)))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat rows [T, H] at `positions` [T] -> final normed hidden [T, H] (needs a ForwardContext)."""
        return self.model(inputs_embeds, positions)[0]

    def step(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, last_index: torch.Tensor,
             st: SamplingTensors, frame_index: torch.Tensor, seen: torch.Tensor | None,
             ignore_eos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for each of B requests: `last_index` [B] is each request's last flat row,
        `frame_index` [B] its frame number (the draw counter), `seen` [B, vocab] its generated codes
        (updated in place), `ignore_eos` [B] bool: codec_eos suppressed too, so every frame is valid.
        Returns (frames [B, G]: codebook 0 then 1..G-1, codec_embeds [B, H])."""
        return self.head(self(inputs_embeds, positions).index_select(0, last_index), st, frame_index, seen,
                         ignore_eos)

    def head(self, hidden: torch.Tensor, st: SamplingTensors, frame_index: torch.Tensor, seen: torch.Tensor | None,
             ignore_eos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame from each request's last talker hidden [B, H]: codebook 0, then the code predictor
        (arguments and result as `step`)."""
        counters = frame_index * self.num_code_groups
        suppress = self.suppress if ignore_eos is None else self.suppress | (self.eos_mask & ignore_eos[:, None])
        c0 = sample(self.codec_head(hidden), st, counters, seen=seen, suppress=suppress)
        record_tokens(c0, seen)
        codes, codec_embeds = self.code_predictor.predict(
            hidden, self.model.codec_embedding(c0), predictor_sampling(st), counters)
        return torch.cat([c0[:, None], codes], 1), codec_embeds


@torch.no_grad()
def generate_codes(talker: Talker, prompt_embeds: torch.Tensor, text_rows: torch.Tensor,
                   params: TalkerSamplingParams | None = None, max_frames: int | None = None,
                   block_size: int = 16) -> torch.Tensor:
    """Reference single-request loop: prefill `prompt_embeds` [L, H], then one frame per step, adding
    `text_rows[t]` ([K, H], talker rows after the first text token) to step t's input, then tts_pad.
    Stops at codec_eos or after `max_frames` (default `params.max_frames`); with `params.ignore_eos`
    codec_eos is suppressed and there are exactly `max_frames` frames.
    Returns codes [G, frames]. NOTE: attaches a fresh paged KV cache to `talker`."""
    params = params or TalkerSamplingParams()
    max_frames = max_frames or params.max_frames
    length = prompt_embeds.shape[0]
    tables = contiguous_block_tables(1, length + max_frames, block_size)
    allocate_kv_cache(talker, len(tables[0]), block_size, prompt_embeds.dtype, prompt_embeds.device)
    st = SamplingTensors.build([params], [request_seed(params.seed)], prompt_embeds.device)
    seen = torch.zeros(1, talker.codec_head.out_features, dtype=torch.bool, device=prompt_embeds.device)
    ignore_eos = torch.tensor([params.ignore_eos], device=prompt_embeds.device)
    inputs, done, frames = prompt_embeds, 0, []
    for t in range(max_frames):
        n = inputs.shape[0]
        positions = torch.arange(done, done + n, device=inputs.device)
        with forward_context(build_context([done], [n], tables, block_size, inputs.device)):
            frame, codec_embed = talker.step(inputs, positions, torch.tensor([n - 1], device=inputs.device), st,
                                             torch.tensor([t], device=inputs.device), seen, ignore_eos)
        if int(frame[0, 0]) == talker.codec_eos:
            break
        frames.append(frame[0])
        done += n
        text = text_rows[t] if t < text_rows.shape[0] else talker.tts_embeds[2]
        inputs = codec_embed + text[None]
    return torch.stack(frames, 1) if frames else prompt_embeds.new_zeros(talker.num_code_groups, 0).long()
