"""`omnistage serve` flags for the media policy (where request media may come from, how much of it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from omnistage.media import MediaPolicy


def add_media_args(p: argparse.ArgumentParser) -> None:
    d = MediaPolicy()
    g = p.add_argument_group("media in requests")
    g.add_argument("--allowed-local-media-path", default=None,
                   help="folder that file:// URLs and paths in requests may read from (default: none)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="the only hosts http(s) media may come from (default: any public host)")
    g.add_argument("--allow-private-media-urls", action="store_true",
                   help="let media URLs reach private, loopback and link-local addresses")
    g.add_argument("--media-fetch-timeout", type=float, default=d.fetch_timeout_s, metavar="S")
    g.add_argument("--media-max-redirects", type=int, default=d.max_redirects)
    g.add_argument("--max-media-bytes", type=int, default=d.max_bytes, help="per item, encoded")
    g.add_argument("--max-media-items", type=int, default=d.max_items, help="per request")
    g.add_argument("--max-audio-seconds", type=float, default=d.max_audio_seconds)
    g.add_argument("--max-video-seconds", type=float, default=d.max_video_seconds)


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """The policy the flags describe; SystemExit for a local media folder that is not one."""
    local = args.allowed_local_media_path
    if local is not None and not Path(local).is_dir():
        raise SystemExit(f"omnistage serve: --allowed-local-media-path {local}: not a directory")
    domains = args.allowed_media_domains
    return MediaPolicy(
        allowed_local_dir=local, allowed_domains=tuple(h.lower() for h in domains) if domains else None,
        allow_private_urls=args.allow_private_media_urls, fetch_timeout_s=args.media_fetch_timeout,
        max_redirects=args.media_max_redirects, max_bytes=args.max_media_bytes, max_items=args.max_media_items,
        max_audio_seconds=args.max_audio_seconds, max_video_seconds=args.max_video_seconds)
