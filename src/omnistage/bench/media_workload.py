"""The media workloads: a voice assistant's turns with speech, a photo or a short video in them.

spoken-question: the user turn is a spoken clip (`input_audio`, its FLAC or WAV bytes) and a short text
instruction; visual-question: a photo (`image_url` data URL) and a question about it; video / video-audio: a
320x240 video (`video_url` data URL) whose audio track asks the question, sent without and with
`use_audio_in_video`. Request i carries media item i (cycling over the chosen ones); with random weights it
forces the output lengths of the read-aloud workload's request i at the same seed (that sentence's tokens and
reading time), so every workload's rows answer at the same lengths. `prompt_tokens` counts the message texts
only; the server's count (usage) has the media's tokens too. Each request's media differ a little from every
other's (bench/media.py `varied`) unless `repeat_media`, so no request repeats another's media.
"""

from __future__ import annotations

import argparse
import base64
from dataclasses import dataclass

from omnistage.bench import media
from omnistage.bench.media import Media, varied
from omnistage.bench.workload import TAGS, BenchRequest, TokenCounter, build_requests, shuffled_pool

MEDIA_WORKLOADS = ("spoken-question", "visual-question", "video", "video-audio")
SYSTEM_PROMPT = "You are a helpful voice assistant. Answer briefly, in a clear and natural voice."
QUESTIONS = {"spoken-question": ("Answer the question you hear.",),
             "visual-question": ("What is in this picture?", "Describe this photo in one sentence.",
                                 "What stands out in this image?"),
             "video": ("What happens in this video?",),
             "video-audio": ("Answer the question asked in the video.",)}
VIDEO_CLIPS = ("q03", "q04", "q02", "q05")  # the videos' audio tracks (3-6 s spoken questions)


@dataclass(frozen=True)
class MediaOptions:
    names: tuple[str, ...] = ()  # the clips (spoken-question) or photos (the others); (): the default set
    video_seconds: float = 4.0
    repeat_media: bool = False  # the same bytes for every use of an item (to measure a media cache)


def media_items(workload: str, options: MediaOptions) -> list[Media]:
    """The media the workload's requests take in turn."""
    if workload == "spoken-question":
        return [media.spoken_clip(n) for n in options.names or media.SPOKEN]
    if workload == "visual-question":
        return [media.photo(n) for n in options.names or media.DEFAULT_PHOTOS]
    return [media.video(p, VIDEO_CLIPS[i % len(VIDEO_CLIPS)], options.video_seconds)
            for i, p in enumerate(options.names or media.SHIPPED_PHOTOS)]


def media_part(item: Media, data: bytes) -> dict:
    """The OpenAI content part that carries `data` (the item's bytes, maybe varied)."""
    b64 = base64.b64encode(data).decode()
    if item.mime.startswith("audio/"):
        return {"type": "input_audio", "input_audio": {"data": b64, "format": item.format}}
    kind = "image_url" if item.mime.startswith("image/") else "video_url"
    return {"type": kind, kind: {"url": f"data:{item.mime};base64,{b64}"}}


def build_media_requests(workload: str, num: int, seed: int, counter: TokenCounter,
                         options: MediaOptions = MediaOptions()) -> list[BenchRequest]:
    pool, items, questions = shuffled_pool(seed), media_items(workload, options), QUESTIONS[workload]
    extra = {"use_audio_in_video": True} if workload == "video-audio" else {}
    out = []
    for i in range(num):
        item, question, sentence = items[i % len(items)], questions[i % len(questions)], pool[i % len(pool)]
        data = varied(item, None if options.repeat_media else next(TAGS))
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": [media_part(item, data), {"type": "text", "text": question}]}]
        out.append(BenchRequest(i, sentence, messages, counter.count(SYSTEM_PROMPT) + counter.count(question),
                                counter.count(sentence.text), seed * 100_003 + i, extra))
    return out


def add_media_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--media", type=lambda t: tuple(t.split(",")), default=(),
                   help="media workloads: the clips (spoken-question: q01..q12, question_5s, ...) or photos "
                        "(visual-question, video: astronaut, coffee, chelsea, rocket, hd = 1280x720, "
                        "phone = 4032x3024) requests take in turn (default: the clips q01..q12; the photos "
                        "but phone; video: the four shipped photos)")
    p.add_argument("--video-seconds", type=float, default=4.0, help="video workloads: the videos' length")
    p.add_argument("--repeat-media", action="store_true",
                   help="media workloads and realtime turns: send an item's bytes unchanged each time (default: "
                        "each request's or turn's media carry a fresh tag: the server's caches never find another's)")


def workload_requests(args: argparse.Namespace, counter: TokenCounter, prompt_tokens: int | None, num: int,
                      seed: int) -> list[BenchRequest]:
    """`num` requests of `args.workload` (read-aloud at `prompt_tokens`)."""
    if args.workload == "read-aloud":
        return build_requests(prompt_tokens, num, seed, counter, repeat=args.repeat_prompts)
    options = MediaOptions(args.media, args.video_seconds, args.repeat_media)
    return build_media_requests(args.workload, num, seed, counter, options)


def media_fields(args: argparse.Namespace) -> dict:
    """What a media row records of its media beside its workload (read-aloud: whether its prompts repeat)."""
    if args.workload == "read-aloud":
        return {"repeat_prompts": True} if args.repeat_prompts else {}
    fields = {"media": ",".join(args.media) if args.media else None, "repeat_media": args.repeat_media}
    return fields | ({"video_seconds": args.video_seconds} if args.workload.startswith("video") else {})
