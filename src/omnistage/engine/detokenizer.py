"""Incremental detokenization (vLLM style): each new token decodes only a short window of ids."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Feeds token ids one by one; `step` returns the new text, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: Any, prompt_tail: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_tail or [])[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix):]
        # NOTE: keep the window short so the per-token cost does not grow with the output.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 64:
            drop = self.prefix_offset - 8
            self.ids = self.ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        self.text += new
        return new
