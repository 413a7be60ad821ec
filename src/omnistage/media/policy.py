"""Where media in a request may come from and how much of it a request may carry."""

from __future__ import annotations

from dataclasses import dataclass


class MediaError(ValueError):
    """Bad media in a request (a client error: the server answers 400). Messages never carry a path or URL;
    `param` names the item ("messages[0].content[2]") where one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # NOTE: `param` survives pickling (from a prompt-processing worker)
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class MediaPolicy:
    """The default refuses local files and private addresses and fetches public http(s) URLs within limits.

    `allowed_local_dir`: `file://` URLs and plain paths only resolve (symlinks and `..` followed) inside it;
    relative paths are taken from it. `allowed_domains`: http(s) hosts allowed (exact names; None: any).
    `allow_private_urls`: fetch from private, loopback, link-local and other non-global addresses too.
    """

    allowed_local_dir: str | None = None
    allowed_domains: tuple[str, ...] | None = None
    allow_private_urls: bool = False
    fetch_timeout_s: float = 15.0
    max_redirects: int = 3
    max_bytes: int = 64 << 20  # one item's encoded size
    max_items: int = 16  # media items in one request
    max_audio_seconds: float = 1200.0
    max_video_seconds: float = 600.0
    max_image_pixels: int = 32_000_000
    max_video_frames: int = 768
    # NOTE: qwen-omni-utils' default total budget (0.9 x 128k tokens of 28x28): frames are scaled down by
    # ffmpeg to at most min(max_frame_pixels, max_video_pixels / frames) each, so memory stays bounded.
    max_video_pixels: int = 90_316_800
    max_frame_pixels: int = 1280 * 720
