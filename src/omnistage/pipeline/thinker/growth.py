"""A thinker request whose prompt grows at its end (`Request.growing`): `PromptPiece`s drop rows past a point
(the rows whose inputs changed) and append new ones, encoded here as admission encodes a whole prompt. The
stage prefills whatever rows are there and samples only once a closing piece has made the prompt whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omnistage.engine.detokenizer import IncrementalDetokenizer
from omnistage.engine.request import Request
from omnistage.pipeline.thinker.audio_graph import AudioGraphRunner
from omnistage.pipeline.thinker.inputs import audio_rows
from omnistage.pipeline.thinker.seq import ThinkerSeq


@dataclass
class PromptPiece:
    """More prompt for a growing request: keep its first `keep` rows, append `input_ids`; their
    `<|audio_pad|>` rows are the encoder rows of `audio` (`[mels, frames]` log-mel features of one stretch of
    audio that starts at an encoder-window boundary) past its first `skip` rows (context, dropped).
    `closed`: the prompt is now whole (`request.prompt` is the whole prompt's `PromptInputs`).
    `restart`: the rows kept would not be exact; the stage starts the request over from `request.prompt`
    (still growing unless `closed`)."""

    request: Request
    keep: int
    input_ids: list[int]
    audio: torch.Tensor | None = None
    skip: int = 0
    closed: bool = False
    restart: bool = False


def rewind(seq: ThinkerSeq, keep: int) -> None:
    """Drop the prompt rows from `keep` on (their KV entries are overwritten when prefilled again)."""
    if keep >= seq.prompt_len:
        return
    seq.num_computed = min(seq.num_computed, keep)
    if seq.mm_hidden:
        seq.mm_hidden = [torch.cat(seq.mm_hidden)[:int(seq.mm_mask[:seq.num_computed].sum())]]
    seq.prompt_ids, seq.embeds, seq.mm_mask = seq.prompt_ids[:keep], seq.embeds[:keep], seq.mm_mask[:keep]


def piece_rows(thinker: torch.nn.Module, pieces: list[PromptPiece], device: torch.device, dtype: torch.dtype,
               audio: AudioGraphRunner | None) -> list[torch.Tensor | None]:
    """The pieces' encoder rows (None: none, or to be encoded alone by `extend`): with the audio graphs, all
    pieces' audio in runs of them, as admission encodes the audios that arrive together. Without them each
    piece is encoded alone, as before (on the CPU that is the whole clip's encoder call bit for bit)."""
    feats = [p.audio for p in pieces if p.audio is not None]
    if audio is None or not feats:
        return [None] * len(pieces)
    rows = iter(audio_rows(thinker.audio_tower, feats, [f.shape[1] for f in feats], device, dtype, audio))
    return [next(rows) if p.audio is not None else None for p in pieces]


def extend(thinker: torch.nn.Module, seq: ThinkerSeq, piece: PromptPiece, tokenizer: Any,
           rows: torch.Tensor | None = None) -> None:
    """Rewind to `piece.keep`, then append its rows (embedded with its encoder rows scattered in: `rows`, the
    piece's audio encoded with others', or encoded here)."""
    rewind(seq, piece.keep)
    device, dtype = seq.embeds.device, seq.embeds.dtype
    ids = torch.tensor(piece.input_ids, dtype=seq.prompt_ids.dtype)
    if rows is None and piece.audio is not None:
        feats = piece.audio[None].to(device, dtype, non_blocking=True)
        rows = thinker.encode_audio(feats, torch.ones(feats.shape[::2], dtype=torch.long))
    if rows is not None:
        rows = rows[piece.skip:]
    embeds, _ = thinker.embed(ids.to(device, non_blocking=True), rows, host_ids=ids)
    mm = ids == thinker.audio_token_id
    seq.prompt_ids = torch.cat([seq.prompt_ids, ids])
    seq.embeds = torch.cat([seq.embeds, embeds])
    seq.mm_mask = torch.cat([seq.mm_mask, mm])
    seq.has_mm = seq.has_mm or bool(mm.any())
    if piece.closed:
        seq.open = False
        seq.detok = IncrementalDetokenizer(tokenizer, seq.prompt_ids.tolist())
