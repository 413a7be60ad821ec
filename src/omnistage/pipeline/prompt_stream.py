"""A request whose last audio arrives while the user speaks (`Orchestrator.open_request`).

The audio encoder attends within windows of `n_window_infer` mel frames, so a window's encoder rows depend
only on its own features. Each window that is complete (no frame of it reaches the clip's end) is sent to
the thinker as soon as it is, there encoded and prefilled (`PromptPiece`). Its features are those of the
audio so far, and they are a guess: Whisper's log-mel floor is the clip's global maximum - 8, so a louder
frame later changes every clamped value before it. So each time, and at `close` with the whole prompt as
the processor makes it for the ordinary path, the features already sent are compared bit for bit; the
thinker rewinds to the first window that differs and gets it again. What is kept is thus exactly what the
whole clip gives; close costs at most the last window, the tail and the chat template's end when nothing
moved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omnistage.engine.request import Request
from omnistage.media import to_conversation
from omnistage.models.qwen3_omni.prompt import PromptInputs, PromptProcessor
from omnistage.models.qwen3_omni.rope_index import audio_token_count
from omnistage.pipeline.stream_parts import Messages, chunk_width, prefix_prompt, with_audio
from omnistage.pipeline.thinker.growth import PromptPiece

CHECK_SAMPLES = 1600  # 100 ms at 16 kHz: how often new audio is looked at for a louder frame


@dataclass
class Prepared:
    """`PromptStream.prepare`'s clip, its whole prompt, and whether the thinker has all of it (nothing sent
    since rewound it)."""

    audio: np.ndarray
    prompt: PromptInputs
    sent: bool


class PromptStream:
    """Built by `Orchestrator.open_request`; `append_audio` and `close` from one thread at a time."""

    def __init__(self, processor: PromptProcessor, req: Request, messages: Messages,
                 prefix: PromptInputs | None, send: Callable[[PromptPiece], None], make: Callable[[Messages], Request],
                 submit: Callable[[Request], None]) -> None:
        """`prefix`: the prompt before the streamed audio's placeholders, already sent with `req` (None:
        nothing is sent before `close`). `send(piece)` hands a piece to the thinker; `make(messages)` is the
        ordinary path's request (with its checks); `submit(req)` adds a request that was not sent early."""
        self.processor, self.req, self.messages, self.prefix = processor, req, messages, prefix
        self.send, self.make, self.submit = send, make, submit
        self.fe = processor.feature_extractor
        self.window = processor.n_window_infer
        self.rows = audio_token_count(self.window, processor.n_window)  # encoder rows of a complete window
        self.chunk = 2 * processor.n_window  # mel frames of one conv chunk
        self.pcm: list[np.ndarray] = []
        self.samples = 0
        self.sent: list[torch.Tensor] = []  # features of each window the thinker has, in order
        self.peak = float("inf")  # the largest feature when they were last made (the floor is 8 below it)
        self.looked = 0  # samples when the audio was last looked at for a louder frame
        self.closed = False
        self.prepared: Prepared | None = None  # the last `prepare`'s
        self.closed_prepared = False  # `close` found the whole prompt sent by `prepare`

    @property
    def early_rows(self) -> int:
        """Prompt rows sent before close (prefix and complete windows, or all a prepared prompt's)."""
        if self.prefix is None:
            return 0
        if self.prepared is not None and self.prepared.sent:
            return len(self.prepared.prompt.input_ids)
        return len(self.prefix.input_ids) + self.rows * len(self.sent)

    def append_audio(self, pcm: np.ndarray) -> None:
        """16 kHz mono float samples; sends the windows this completes."""
        if self.closed:
            raise ValueError("audio appended to a closed streaming prompt")
        self.pcm.append(np.asarray(pcm, dtype=np.float32).reshape(-1))
        self.samples += self.pcm[-1].shape[0]
        windows = self._final(self.samples) // self.window
        if self.prefix is None or (windows <= len(self.sent) and not self._louder()):
            return
        feats = self.processor.audio_features([self.audio()], cache=False)[0][0]  # NOTE: a prefix, not a clip
        self.peak = float(feats.max())
        self._sync(feats, windows)

    def _final(self, samples: int) -> int:
        """Mel frames of the first `samples` that later audio leaves as they are."""
        # NOTE: frame t (of samples // hop) reads samples up to hop t + n_fft / 2: past the end, it reads the
        # clip's reflection, so it is final only once they have arrived.
        hop = self.fe.hop_length
        return min(samples // hop, max(0, (samples - self.fe.n_fft // 2) // hop + 1))

    def _louder(self) -> bool:
        """Whether the audio since the last look may hold a frame above the loudest so far (which sets the
        floor of the windows sent): then they are checked now, while the user speaks, rather than at close.
        A guess from the new audio's own features (its edges may differ from the clip's: the check is exact)."""
        new = self.samples - self.looked
        if not self.sent or new < CHECK_SAMPLES:
            return False
        self.looked = self.samples
        recent = self.audio()[-(new + self.fe.n_fft):]
        return float(self.processor.audio_features([recent], cache=False)[0].max()) > self.peak

    def audio(self) -> np.ndarray:
        if len(self.pcm) > 1:
            self.pcm = [np.concatenate(self.pcm)]
        return self.pcm[0] if self.pcm else np.zeros(0, np.float32)

    def _first_changed(self, feats: torch.Tensor) -> int:
        """Index of the first window sent whose features differ from `feats`' (len(sent) if none)."""
        w = self.window
        return next((k for k, f in enumerate(self.sent) if not torch.equal(f, feats[:, k * w:(k + 1) * w])),
                    len(self.sent))

    def _sync(self, feats: torch.Tensor, windows: int) -> None:
        """Sends windows from the first that changed up to `windows` (complete ones) of `feats`."""
        k0, w = self._first_changed(feats), self.window
        self.sent = self.sent[:k0] + [feats[:, k * w:(k + 1) * w].clone() for k in range(k0, windows)]
        if k0 < windows:
            if self.prepared is not None:
                self.prepared.sent = False  # this rewinds what it sent
            keep = len(self.prefix.input_ids) + self.rows * k0
            self.send(PromptPiece(self.req, keep, [self._pad] * (self.rows * (windows - k0)),
                                  feats[:, k0 * w:windows * w].contiguous()))

    @property
    def _pad(self) -> int:
        return self.processor.tokenizer.convert_tokens_to_ids("<|audio_pad|>")

    def prepare(self, audio: np.ndarray) -> None:
        """The clip the turn has if it ends where the user paused: its whole prompt is made now and the rows
        past the complete windows are sent to be prefilled (not closed), so that a `close` with that very
        clip only has the last row computed again to sample from. Later audio that changes a window rewinds
        them as any; a prompt the ordinary path would refuse is left to `close` to raise."""
        if self.closed or self.req.aborted:
            return
        try:
            prompt = self.make(with_audio(self.messages, audio)).prompt
        except ValueError:
            return
        piece = self._rest(prompt, closed=False) if self.prefix is not None else None
        if piece is None and self.prefix is not None:
            piece = self._rebase(prompt)
        self.prepared = Prepared(audio, prompt, piece is not None)
        if piece is not None:
            self.sent = self._windows(prompt, len(audio))  # NOTE: what the thinker has now: later audio rewinds
            self.send(piece)

    def _rebase(self, prompt: PromptInputs) -> PromptPiece | None:
        """The request started over, still open, from `prompt` (the prefix it was opened with is not that
        prompt's: e.g. an earlier audio padded otherwise, this turn being longer): its prefix is `prompt`'s."""
        prefix = prefix_prompt(self.processor, prompt)
        if prefix is None:
            return None
        self.req.prompt, self.prefix = prompt, prefix
        return PromptPiece(self.req, 0, [], restart=True)

    def _windows(self, prompt: PromptInputs, samples: int) -> list[torch.Tensor]:
        """The features of each window of `prompt`'s streamed audio (its last, `samples` long) that later audio
        leaves as they are."""
        w, feats = self.window, prompt.input_features[-1]
        return [feats[:, k * w:(k + 1) * w].clone() for k in range(self._final(samples) // w)]

    def close(self, audio: np.ndarray | None = None) -> None:
        """The audio is complete (`audio`: the whole clip, if it is not exactly what was appended, e.g. a
        resampler's last samples): the whole prompt, as the ordinary path makes it from the messages with the
        whole clip, replaces what differs of what was sent; the request then decodes as any other.
        Raises ValueError as `make_request` would (the caller then aborts the request)."""
        if self.closed:
            raise ValueError("this streaming prompt was closed already")
        self.closed = True
        if self.req.aborted:
            return
        if audio is not None:
            self.pcm = [np.asarray(audio, dtype=np.float32).reshape(-1)]
        ready, clip = self.prepared, self.audio()
        same = ready is not None and ready.audio.shape == clip.shape and np.array_equal(ready.audio, clip)
        prompt = ready.prompt if same else self.make(with_audio(self.messages, clip)).prompt
        self.req.prompt = prompt
        if self.prefix is None:
            self.submit(self.req)
            return
        if same and ready.sent:  # the thinker has the whole prompt already
            self.closed_prepared, n = True, len(prompt.input_ids)
            return self.send(PromptPiece(self.req, n - 1, prompt.input_ids[n - 1:], closed=True))
        piece = self._rest(prompt, closed=True)
        self.send(piece) if piece is not None else self._restart()

    def _rest(self, prompt: PromptInputs, closed: bool) -> PromptPiece | None:
        """The piece that makes what the thinker has `prompt` (None: it cannot be made exact, start over)."""
        lens = prompt.audio_feature_lens
        feats = prompt.input_features[-1, :, :lens[-1]]
        if not self._prefix_exact(prompt):
            return None
        k0, w, cut = self._first_changed(feats), self.window, len(self.prefix.input_ids)
        start, skip = k0 * w, 0
        tail = lens[-1] - start
        # NOTE: the tower pads every conv chunk of a call to its longest: a tail with no whole chunk is
        # encoded after the window before it, as in the whole clip, and that window's rows are dropped.
        if 0 < tail < self.chunk and k0 > 0:
            start, skip = start - w, self.rows
        if tail > 0 and chunk_width([lens[-1] - start], self.chunk) != chunk_width(lens, self.chunk):
            return None
        keep = cut + self.rows * k0
        self.sent = self.sent[:k0]
        audio = feats[:, start:].contiguous() if tail > 0 else None
        return PromptPiece(self.req, keep, prompt.input_ids[keep:], audio, skip, closed=closed)

    def _restart(self) -> None:
        self.sent = []
        self.send(PromptPiece(self.req, 0, [], closed=True, restart=True))

    def _prefix_exact(self, prompt: PromptInputs) -> bool:
        """The rows sent at open are the whole prompt's: same ids, same features of the earlier audios, each
        padded as in the whole prompt's encoder call."""
        p, cut = self.prefix, len(self.prefix.input_ids)
        if prompt.input_ids[:cut] != p.input_ids:
            return False
        lens, before = prompt.audio_feature_lens, p.audio_feature_lens
        if lens[:-1] != before:
            return False
        width = chunk_width(lens, self.chunk)
        if before and min(before) < self.chunk and chunk_width(before, self.chunk) != width:
            return False
        return all(torch.equal(prompt.input_features[i, :, :n], p.input_features[i, :, :n])
                   for i, n in enumerate(before))


def open_stream(processor: PromptProcessor, messages: Messages, make: Callable[[Messages], Request],
                send: Callable[[PromptPiece], None], submit: Callable[[Request], None]) -> PromptStream:
    """`Orchestrator.open_request`: the request made with a silent stand-in for the streamed audio (so it is
    refused now as the whole one would be), its prefix sent now (to a thinker in another process as well)."""
    audios = to_conversation(messages, processor.media_policy).audios
    # NOTE: the feature extractor pads every clip to the longest, and an earlier audio's features (even its
    # frame count) depend on whether it is padded: the stand-in is as long as the longest, so the prefix is
    # exact when the turn is no longer than that (a longer one is rebased where the user pauses, `prepare`).
    req = make(with_audio(messages, np.zeros(max(map(len, audios), default=16000), np.float32)))
    prefix = prefix_prompt(processor, req.prompt)
    stream = PromptStream(processor, req, messages, prefix, send, make, submit)
    if prefix is not None:
        req.prompt, req.growing = prefix, True
        submit(req)
    return stream
