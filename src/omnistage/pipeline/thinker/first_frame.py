"""The talker's prefill and first frame alone on the device (deploy `connector.idle_first_frame_alone`): while the
thinker holds one request only, its second decode step waits until the talker has made that request's first
frame (at most `HOLD_S`). The talker needs the second token only for its second frame, and the thinker's decode
steps beside its prefill and first frame slow them (an H100, c = 1: a talker frame 4.3 ms alone, 6.4 beside a
thinker decode step; benchmarks/HISTORY.md, 47th section). Only where the thinker's request is the talker's
(one process: the talker's "first_frame" mark is seen here)."""

from __future__ import annotations

import time
from typing import Any

from omnistage.engine.request import Request

HOLD_S = 0.03  # at most this long: a talker that never makes the frame (failed, aborted) holds nothing up
POLL_S = 0.0002


def alone_before_first_frame(stage: Any) -> Request | None:
    """The thinker's one request, when its first token is launched, it wants audio, the talker has not made
    its first frame, and nothing else waits for the thinker; else None."""
    if len(stage.running) != 1 or stage.waiting or stage.queued or len(stage.arrivals) or len(stage.inbox):
        return None
    seq = stage.running[0]
    req = seq.req
    if seq.in_prefill or seq.num_sampled != 1 or not req.want_audio or "first_frame" in req.phases:
        return None
    return req


def wait_first_frame(req: Request, inbox: Any) -> None:
    """Until the talker marked `req`'s first frame, `req` was aborted, something arrived in `inbox`, or
    `HOLD_S` passed."""
    deadline = time.perf_counter() + HOLD_S
    while ("first_frame" not in req.phases and not req.aborted and not len(inbox)
           and time.perf_counter() < deadline):
        time.sleep(POLL_S)
