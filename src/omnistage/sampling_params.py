"""Per-request sampling parameters of the thinker and of the talker (+ code predictor)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    """Thinker text sampling. `temperature == 0` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 256
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be >= 0 (0 or -1 = off)")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TalkerSamplingParams:
    """Talker codebook-0 sampling; the code predictor samples with top_k 50 / top_p 0.8, greedy when
    the talker is greedy (as transformers does). `max_frames` caps the codec frames."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    max_frames: int = 4096
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check(self.max_frames >= 1, "max_frames", "must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {why}")


def from_dict(cls: type, value: Any) -> Any:
    """Build `cls` from None, an instance, or a dict (unknown keys are an error that names them)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    known = {f.name for f in fields(cls)}
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {sorted(unknown)}")
    return cls(**value)
