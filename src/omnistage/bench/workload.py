"""The "read-aloud" workload: LibriSpeech-PC sentences as TTS-style chat requests of a set prompt length.

A request is a system prompt plus the user's text: further pool sentences as context, then the sentence
to read. `prompt_tokens` counts the tokens of the message texts (system + user), not the chat template's
~13 framing tokens; the server's own count comes back in `usage`. Longer prompts get more context; when
the sentence alone is longer than the target it is truncated, and the system prompt goes in only when it
fits whole. With random weights the outputs are forced to realistic lengths: text = the sentence's
tokens, audio = round(12.5 x the human reading time) codec frames. Unless `repeat`, the user's text opens with a
tag unique to the run (`TAGS`), so no request shares a prefix with another past the system prompt (a repeated
request of an earlier row would find its prompt in the server's prefix cache, as distinct users' prompts do not);
prompts under twice the tag's tokens (P = 10) carry none.
"""

from __future__ import annotations

import csv
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

POOL = Path(__file__).parents[1] / "data" / "librispeech_pc_test_clean.tsv"
FRAMES_PER_SECOND = 12.5
SYSTEM_PROMPT = ("You are a text-to-speech voice. Read the last sentence of the user's message aloud, "
                 "exactly as written, in a clear and natural voice, and say nothing else.")
TAGS = itertools.count(time.time_ns() // 1000)  # NOTE: from the clock: runs against one server never repeat


@dataclass(frozen=True)
class Sentence:
    utt_id: str
    duration_s: float
    text: str


def load_sentences(path: str | Path = POOL) -> list[Sentence]:
    with open(path, encoding="utf-8", newline="") as f:
        return [Sentence(r["utt_id"], float(r["duration_s"]), r["text"]) for r in csv.DictReader(f, delimiter="\t")]


class TokenCounter(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def truncate(self, text: str, n: int) -> str: ...


class ApproxTokens:
    """One token per pre-token of Qwen's split regex (a word with its leading space, one digit, a run of
    punctuation). On this pool it is 6% under the real tokenizer, mean |error| 1.4 tokens a sentence."""

    name = "approx"

    def __init__(self) -> None:
        import regex

        from omnistage.models.qwen3_omni.tokenizer import PRETOKENIZE_REGEX

        self._split = regex.compile(PRETOKENIZE_REGEX).findall

    def count(self, text: str) -> int:
        return len(self._split(text))

    def truncate(self, text: str, n: int) -> str:
        return "".join(self._split(text)[:n])


class HFTokens:
    """The checkpoint's tokenizer (transformers.AutoTokenizer)."""

    def __init__(self, tokenizer_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.name = str(tokenizer_dir)
        self._tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def truncate(self, text: str, n: int) -> str:
        return self._tok.decode(self._tok.encode(text, add_special_tokens=False)[:n])


def token_counter(tokenizer_dir: str | Path | None = None) -> TokenCounter:
    return HFTokens(tokenizer_dir) if tokenizer_dir else ApproxTokens()


@dataclass(frozen=True)
class BenchRequest:
    index: int
    sentence: Sentence
    messages: list[dict]
    prompt_tokens: int  # tokens of the message texts, by the counter
    text_tokens: int  # tokens of the whole sentence: the forced text length
    seed: int
    extra: dict = field(default_factory=dict)  # further body fields (use_audio_in_video)

    @property
    def audio_frames(self) -> int:
        """The forced audio length: the human reading time in codec frames (12.5 per second)."""
        return round(FRAMES_PER_SECOND * self.sentence.duration_s)


def forced_lengths(req: BenchRequest, max_tokens: int | None = None, max_frames: int | None = None,
                   scale: float = 1.0) -> tuple[int, int]:
    """(text tokens, audio frames) a random-weight run forces: the sentence's times `scale`, each capped when a cap
    is given."""
    text, frames = round(req.text_tokens * scale), round(req.audio_frames * scale)
    return min(text, max_tokens or text), min(frames, max_frames or frames)


def _context(pool: list[Sentence], start: int, n: int, counter: TokenCounter) -> str:
    """The first `n` tokens of the pool's sentences from `start` on, joined by spaces."""
    if n <= 0:
        return ""
    parts, have, i = [], 0, start
    while have < n + 2:  # NOTE: a little spare for tokens that merge where sentences are joined
        parts.append(pool[i % len(pool)].text)
        have += counter.count(parts[-1])
        i += 1
    return counter.truncate(" ".join(parts), n).rstrip()


def _prompt(pool: list[Sentence], pos: int, target: int, counter: TokenCounter, tag: str = ""
            ) -> tuple[list[dict], int]:
    tag = tag if 2 * counter.count(tag) <= target else ""
    sentence = counter.truncate(pool[pos].text, target - counter.count(tag))
    room = target - counter.count(sentence) - counter.count(tag)
    system = SYSTEM_PROMPT if room >= counter.count(SYSTEM_PROMPT) else None
    room -= counter.count(system) if system else 0
    user, size = sentence, target
    for _ in range(3):  # NOTE: joining texts can merge or split a token at the seam; correct by the error
        context = _context(pool, pos + 1, room, counter)
        user = " ".join(t for t in (tag, context, sentence) if t)
        size = counter.count(user) + (counter.count(system) if system else 0)
        if size == target or not context:
            break
        room += target - size
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return messages, size


def build_requests(prompt_tokens: int, num: int, seed: int, counter: TokenCounter,
                   sentences: list[Sentence] | None = None, repeat: bool = False) -> list[BenchRequest]:
    """`num` requests over a seeded shuffle of the pool; the same seed gives the same sentences at every
    prompt length and concurrency (`repeat`: the same texts too, untagged)."""
    pool = shuffled_pool(seed, sentences)
    tags: Iterator[int] | None = None if repeat else TAGS
    out = []
    for i in range(num):
        pos = i % len(pool)
        tag = "" if tags is None else f"[{next(tags) % 10**6:06d}]"  # NOTE: six digits, a token each
        messages, size = _prompt(pool, pos, prompt_tokens, counter, tag)
        out.append(BenchRequest(i, pool[pos], messages, size, counter.count(pool[pos].text), seed * 100_003 + i))
    return out


def shuffled_pool(seed: int, sentences: list[Sentence] | None = None) -> list[Sentence]:
    """The pool in the seed's order: request i of every workload forces the lengths of sentence i."""
    pool = list(sentences or load_sentences())
    random.Random(seed).shuffle(pool)
    return pool


class Budget:
    """A wall-clock budget for a sweep, shared out evenly over the rows still to run (0 = unlimited)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds if seconds > 0 else float("inf")

    def left(self) -> float:
        return self.end - time.perf_counter()

    def row_deadline(self, rows_left: int) -> float:
        """perf_counter() time after which the next row sends nothing new."""
        return time.perf_counter() + self.left() / max(1, rows_left)
