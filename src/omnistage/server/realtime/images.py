"""A user item's `input_image` part (GA: `image_url`, base64 image bytes as a data: URL; `detail` is taken
and, as on the chat path, not used). It is decoded when the item arrives, exactly as /v1/chat/completions
decodes an `image_url` part (media.decode_media, under the server's media policy: size and pixel limits), so
a bad image is an `error` event for that client event and the item is not added. The decoded image is the
chat message's image part, as the chat path's decoder makes it."""

from __future__ import annotations

from PIL import Image

from omnistage.media import MediaError, MediaPolicy, decode_media
from omnistage.server.realtime.events import RealtimeError


def decode_image(url: str | None, policy: MediaPolicy, param: str) -> Image.Image:
    """`url` (a data: URL) -> the RGB image; a RealtimeError naming `param` for anything wrong with it."""
    if not url or not url.startswith("data:"):
        # NOTE: no http(s) or file URLs here: a fetch would hold up the session's event loop
        raise RealtimeError(f"{param}: a data: URL of base64 image bytes is required "
                            "(data:image/png;base64,...)", param)
    try:
        return decode_media("image", url, policy)
    except MediaError as e:
        raise RealtimeError(f"{param}: {e}", param) from None
