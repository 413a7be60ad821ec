"""`omnistage` command line: make-tiny | generate | serve | bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from omnistage.bench.cli import add_bench_args
from omnistage.config_rules import PLACEMENTS
from omnistage.models.qwen3_omni.make_tiny import add_make_tiny_args, run_make_tiny
from omnistage.server.launch import RANDOM_WEIGHTS_NOTE, serve
from omnistage.server.serve_args import add_serve_args


def _generate(args: argparse.Namespace) -> None:
    import soundfile as sf

    from omnistage.entrypoints.omni import Omni

    if args.model is None or args.load_format == "dummy":
        print(f"omnistage generate: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
    omni = Omni(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                placement=args.placement)
    modalities = ["text"] if args.text_only else ["text", "audio"]
    out = omni.chat([{"role": "user", "content": args.prompt}], modalities=modalities, voice=args.voice,
                    sampling={"temperature": args.temperature, "max_tokens": args.max_tokens},
                    talker_sampling={"max_frames": args.max_frames})
    print(out.text)
    if out.audio is not None and args.output:
        sf.write(args.output, out.audio, out.sample_rate, subtype="PCM_16")
        print(f"wrote {len(out.audio)} samples ({len(out.audio) / out.sample_rate:.2f} s) to {args.output}",
              file=sys.stderr)


def _bench(args: argparse.Namespace) -> None:
    import importlib.util

    missing = [m for m in ("httpx", "tqdm", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"omnistage bench needs {', '.join(missing)}: pip install 'omnistage[bench]'")
    from omnistage.bench.cli import run_bench

    sys.exit(run_bench(args))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = add_make_tiny_args(sub.add_parser("make-tiny", help="write a tiny random-weight HF-format Qwen3-Omni "
                                                           "directory (the real repo's file set)"))
    t.set_defaults(func=run_make_tiny)

    g = sub.add_parser("generate", help="one chat turn offline: print the text, write the speech")
    g.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (default: the built-in tiny random-weight one)")
    g.add_argument("--prompt", required=True, help="the user's message")
    g.add_argument("--voice", default="Ethan",
                   help="a voice of the checkpoint (talker_config.speaker_id; default: %(default)s)")
    g.add_argument("--output", default="out.wav",
                   help="where the speech goes, 16-bit WAV at 24 kHz (default: %(default)s)")
    g.add_argument("--text-only", action="store_true", help="text only: no talker, no speech")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="the thinker's; 0 is greedy (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=64, help="text tokens at most (default: %(default)s)")
    g.add_argument("--max-frames", type=int, default=200,
                   help="codec frames at most, 12.5 per second (default: %(default)s)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: seeded random weights for the architecture; default: %(default)s")
    g.add_argument("--device", default=None,
                   help="one torch device for every stage (default: the deploy config's)")
    g.add_argument("--dtype", default=None,
                   help="bfloat16 | float16 | float32 (default: the deploy config's)")
    g.add_argument("--placement", choices=PLACEMENTS, default=None, help="as for serve")
    g.set_defaults(func=_generate)
    s = add_serve_args(sub.add_parser("serve", help="the OpenAI-compatible HTTP server (chat, speech)"))
    s.set_defaults(func=serve)
    b = add_bench_args(sub.add_parser("bench", help="load-test a server (or transformers) on read-aloud requests"))
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    func: Callable[[argparse.Namespace], None] = args.func
    func(args)


if __name__ == "__main__":
    main()
