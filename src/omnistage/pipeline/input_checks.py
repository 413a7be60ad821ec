"""Checks on values a client sends that the engine would otherwise trip over (a 400, not a failed step)."""

from __future__ import annotations

from typing import Any

INT64 = range(-(1 << 63), 1 << 63)


def check_int64(*params: Any) -> None:
    """Sampling integers that become int64 tensors must fit (JSON numbers have no bound)."""
    for p in params:
        for name in ("seed", "top_k"):
            value = getattr(p, name)
            if value is not None and value not in INT64:
                raise ValueError(f"{name} must fit in 64 bits, got {value}")


def check_text(value: Any) -> Any:
    """`value` (messages) when every string in it is encodable text: JSON may carry lone surrogates."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("messages: text must be valid Unicode (a lone surrogate was sent)") from None
    elif isinstance(value, dict | list):
        for v in value.values() if isinstance(value, dict) else value:
            check_text(v)
    return value


def check_fits(prompt_tokens: int, sampling: Any, talker_sampling: Any, thinker_rows: int,
               talker_rows: int | None) -> None:
    """The prompt and what it asks for fit one request's KV cache: the thinker's (prompt + max_tokens) and, when
    the talker runs for it (`talker_rows`), the talker's (prompt + its 9 assistant rows + max_frames)."""
    need = prompt_tokens + sampling.max_tokens
    if need > thinker_rows:
        raise ValueError(f"prompt ({prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) = {need} "
                         f"exceeds the thinker's KV cache ({thinker_rows} tokens)")
    if talker_rows is not None and prompt_tokens + 9 + talker_sampling.max_frames > talker_rows:
        raise ValueError(f"max_frames ({talker_sampling.max_frames}) with this prompt exceeds the talker's KV cache "
                         f"({talker_rows} rows)")
