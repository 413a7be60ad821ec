"""3-D M-RoPE positions (temporal, height, width) of a Qwen3-Omni prompt, as transformers computes them.

Text (and audio) tokens advance all three axes together. An image or video of `t x h x w` merged tokens
starts at the next free position s: token (i, y, x) sits at (s + T_i, s + y, s + x), with T_i = i x 13
for images (`position_id_per_seconds`) and i x `second_per_grid` x 13 for videos. The position after a
segment is one past the maximum of its last piece, so tokens after an image continue from
s + max(T, h, w) + 1. A video with its audio track (`use_audio_in_video`) is laid out as
`<|vision_start|><|audio_start|>` + video and audio tokens interleaved by time + `<|audio_end|><|vision_end|>`.
Positions are float32 (fractional for videos whose second_per_grid x 13 is fractional), as in transformers.

Decoding goes on from the prompt: the token at sequence index i >= L sits at i + delta on every axis.
Prompts without image or video grids are plain 1-D RoPE (`mrope_positions` returns None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch


class MRope(NamedTuple):
    positions: torch.Tensor  # [3, L] float32, the prompt's positions
    delta: float  # the token at sequence index i >= L sits at i + delta on every axis


@dataclass(frozen=True)
class RopeSpec:
    """The ids and constants the position rule reads (from the thinker's or the talker's config)."""

    image_token: int
    video_token: int
    audio_token: int
    vision_start: int
    audio_start: int
    spatial_merge_size: int
    position_id_per_seconds: int | float
    audio_n_window: int

    @classmethod
    def from_config(cls, config: Any, stage: str = "thinker") -> RopeSpec:
        """From a top-level `Qwen3OmniMoeConfig`. NOTE: the talker's rule uses the talker config's ids;
        its config has no `audio_config`, so the audio window comes from the thinker's (transformers
        raises there: `talker_config.audio_config` does not exist)."""
        th = config.thinker_config
        c = th if stage == "thinker" else config.talker_config
        merge = th.vision_config.spatial_merge_size if stage == "thinker" else c.spatial_merge_size
        return cls(c.image_token_id, c.video_token_id, c.audio_token_id, c.vision_start_token_id,
                   c.audio_start_token_id, merge, c.position_id_per_seconds, th.audio_config.n_window)


def audio_token_count(feature_len: int, n_window: int) -> int:
    """Audio encoder output tokens for `feature_len` mel frames."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(int(feature_len), n_window))


class _Layout:
    """Position pieces in prompt order and the next free position: one past the maximum of the last
    piece appended (for interleaved video + audio: of the tail left once one side ran out)."""

    def __init__(self) -> None:
        self.pieces: list[torch.Tensor] = []
        self.next: torch.Tensor | int = 0

    def add(self, piece: torch.Tensor, last: torch.Tensor | None = None) -> None:
        self.pieces.append(piece)
        self.next = (piece if last is None else last).max() + 1

    def line(self, n: int) -> None:
        if n:
            self.add(_line(n, self.next))


def _line(n: int, start: torch.Tensor | int) -> torch.Tensor:
    return torch.arange(n).view(1, -1).expand(3, -1) + start


def _grid(start: torch.Tensor | int, thw: Sequence[int], t_index: torch.Tensor, merge: int) -> torch.Tensor:
    """[3, t * h * w] positions of a visual block (t outer, then rows, then columns)."""
    t, h, w = len(t_index), int(thw[1]) // merge, int(thw[2]) // merge
    tt = t_index.float().view(-1, 1).expand(-1, h * w).flatten()
    hh = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten().float()
    ww = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten().float()
    return torch.stack([tt, hh, ww]) + start


def merge_ranks(video_times: torch.Tensor, audio_times: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of video and audio tokens (each sorted by time) merged by time, video first on ties."""
    v, a = video_times.contiguous(), audio_times.contiguous()
    return (torch.arange(v.numel()) + torch.searchsorted(a, v, side="left"),
            torch.arange(a.numel()) + torch.searchsorted(v, a, side="right"))


def _interleave(video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Video and audio columns merged by temporal position, and the tail that is left once one side
    runs out (its maximum decides the next free position)."""
    video, audio = video.float(), audio.float()
    v0, a0 = video[0], audio[0]
    rank_v, rank_a = merge_ranks(v0, a0)
    merged = torch.empty(3, v0.numel() + a0.numel())
    merged[:, rank_v], merged[:, rank_a] = video, audio
    tail = audio[:, a0 >= v0[-1]] if a0[-1] >= v0[-1] else video[:, v0 > a0[-1]]
    return merged, tail


def mrope_positions(ids: Sequence[int], spec: RopeSpec, image_grid_thw: torch.Tensor | None = None,
                    video_grid_thw: torch.Tensor | None = None, second_per_grid: torch.Tensor | None = None,
                    audio_feature_lens: Sequence[int] = (), use_audio_in_video: bool = False) -> MRope | None:
    """Positions of the prompt `ids` (grids `[n, 3]` of its images / videos in order, `second_per_grid`
    `[num_videos]`, mel frames of its audios in order). None without image and video grids (1-D)."""
    if image_grid_thw is None and video_grid_thw is None:
        return None
    ids, n = list(ids), len(ids)
    after_vs = [ids[i + 1] for i, t in enumerate(ids[:-1]) if t == spec.vision_start]
    left = {"image": after_vs.count(spec.image_token), "audio": ids.count(spec.audio_start),
            "video": after_vs.count(spec.audio_start if use_audio_in_video else spec.video_token)}
    segments = left["image"] + left["audio"] + (0 if use_audio_in_video else left["video"])
    visual_tokens = spec.image_token in ids or spec.video_token in ids
    media = _Media(spec, image_grid_thw, video_grid_thw, second_per_grid, audio_feature_lens, left)
    layout, st = _Layout(), 0
    for _ in range(segments):
        # NOTE: counts may go negative (a video with audio in a prompt read without use_audio_in_video)
        vision_left = visual_tokens and max(left["image"], left["video"]) > 0
        v_at = ids.index(spec.vision_start, st) if vision_left else n + 1
        a_at = ids.index(spec.audio_start, st) if spec.audio_token in ids and left["audio"] > 0 else n + 1
        at = min(v_at, a_at)
        layout.line(at - st)
        edge = 2 if at == v_at and v_at + 1 == a_at else 1  # <|vision_start|><|audio_start|>: both
        layout.line(edge)
        kind = "audio" if at == a_at else {spec.image_token: "image", spec.video_token: "video"}.get(
            ids[at + 1], "audio_in_video")
        st = at + 2 * edge + media.add(kind, layout)
        layout.line(edge)
    layout.line(n - st)
    positions = torch.cat([p.float() for p in layout.pieces], dim=1)
    return MRope(positions, float(positions.max() + 1 - n))


class _Media:
    """The prompt's images, videos and audios, taken in order as their segments come up."""

    def __init__(self, spec: RopeSpec, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
                 second_per_grid: torch.Tensor | None, audio_feature_lens: Sequence[int],
                 left: dict[str, int]) -> None:
        self.spec, self.left, self.used = spec, left, {"image": 0, "video": 0, "audio": 0}
        self.image_grid_thw, self.video_grid_thw = image_grid_thw, video_grid_thw
        self.second_per_grid, self.audio_feature_lens = second_per_grid, audio_feature_lens

    def _take(self, kind: str) -> int:
        i = self.used[kind]
        self.used[kind] += 1
        self.left[kind] -= 1
        return i

    def _audio(self, start: torch.Tensor | int) -> torch.Tensor:
        frames = int(self.audio_feature_lens[self._take("audio")])
        return _line(audio_token_count(frames, self.spec.audio_n_window), start)

    def _visual(self, kind: str, start: torch.Tensor | int) -> torch.Tensor:
        i = self._take(kind)
        thw = (self.image_grid_thw if kind == "image" else self.video_grid_thw)[i]
        steps = torch.arange(int(thw[0]))
        if kind == "image":
            t_index = steps * 1 * self.spec.position_id_per_seconds
        else:
            t_index = steps * self.second_per_grid[i].cpu().float() * self.spec.position_id_per_seconds
        return _grid(start, thw, t_index, self.spec.spatial_merge_size)

    def add(self, kind: str, layout: _Layout) -> int:
        """Append the body of one segment (`audio`, `image`, `video` or `audio_in_video`); its token count."""
        if kind in ("audio", "image", "video"):
            layout.add(self._audio(layout.next) if kind == "audio" else self._visual(kind, layout.next))
            return layout.pieces[-1].shape[1]
        audio = self._audio(layout.next)
        merged, tail = _interleave(self._visual("video", layout.next), audio)
        layout.add(merged, last=tail)
        return merged.shape[1]


def flat_positions(spans: Sequence[tuple[int, int]], mropes: Sequence[MRope | None],
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Positions of a flat batch whose request j brings the rows c_j .. c_j + n_j - 1 of its sequence
    (`spans` (c_j, n_j)): `[T]` int64 when no request has 3-D positions, else `[3, T]` float32 (prompt
    rows from `positions`, later rows at i + delta on every axis, computed as transformers does)."""
    if all(m is None for m in mropes):
        return torch.tensor([p for c, n in spans for p in range(c, c + n)]).to(device, non_blocking=True)
    cols = []
    for (c, n), m in zip(spans, mropes):
        length, delta = (0, 0.0) if m is None else (m.positions.shape[1], m.delta)
        later = torch.arange(min(max(c, length), c + n), c + n) + torch.tensor(delta, dtype=torch.float32)
        if c < length:
            cols.append(m.positions[:, c:c + n])
        cols.append(later.expand(3, -1))
    return torch.cat(cols, dim=1).to(device, non_blocking=True)
