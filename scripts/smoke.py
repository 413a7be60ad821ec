"""One text + audio request against a running server: exit 0 when it answers 200 with 30 frames of audio.

usage: python scripts/smoke.py URL
"""

from __future__ import annotations

import base64
import sys

import httpx

FRAMES = 30


def main() -> int:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "modalities": ["text", "audio"],
            "audio": {"voice": "Ethan", "format": "pcm16"}, "max_tokens": 8, "ignore_eos": True,
            "talker": {"max_frames": FRAMES, "ignore_eos": True}}
    try:
        r = httpx.post(f"{sys.argv[1]}/v1/chat/completions", json=body, timeout=120)
    except httpx.HTTPError as e:
        print(f"smoke: {e!r}")
        return 1
    audio = (r.json()["choices"][0]["message"].get("audio") or {}).get("data", "") if r.status_code == 200 else ""
    samples = len(base64.b64decode(audio)) // 2
    ok = samples == FRAMES * 1920 - 555
    print(f"smoke: HTTP {r.status_code}, {samples} samples ({'ok' if ok else 'FAILED: ' + r.text[:300]})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
