"""Media in chat messages: content parts -> the processor's conversation and decoded items (`to_conversation`),
under a `MediaPolicy` (where media may come from, how much of it)."""

from omnistage.media.decode import AUDIO_INPUT_RATE, decode_audio_bytes, decode_image_bytes, resample
from omnistage.media.parts import MediaItems, decode_media, media_count, to_conversation
from omnistage.media.policy import MediaError, MediaPolicy
from omnistage.media.video import VideoItem

__all__ = ["AUDIO_INPUT_RATE", "MediaError", "MediaItems", "MediaPolicy", "VideoItem", "decode_audio_bytes",
           "decode_image_bytes", "decode_media", "media_count", "resample", "to_conversation"]
