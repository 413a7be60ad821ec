"""The cost of one payload's hop between processes (`placement: process`): each payload is sent to a spawned
echo process and back over the pipes and `wire` pickles the placement uses; a hop is half the round trip.
Payloads at the full-size model's shapes (thinker hidden 2048, bfloat16 on the GPU): one token's text row,
the first text chunk with P prompt rows, a codec frame, a 2 s audio packet; the token row also taken late in a
long request (a view of a 4096-row history) to show a payload costs its own bytes only.

    python scripts/handoff_bench.py [--repeat 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

import torch

from omnistage.pipeline.connector import FrameChunk, TalkerPrompt, TextChunk
from omnistage.pipeline.placement.wire import dumps, loads

HIDDEN = 2048


def echo(inbox, outbox) -> None:
    while True:
        try:
            data = inbox.recv_bytes()
        except EOFError:
            return
        outbox.send_bytes(dumps(loads(data)))


def payloads() -> dict[str, object]:
    history = torch.randn(4096, HIDDEN).to(torch.bfloat16)
    out = {"text row (token 1)": TextChunk(None, history[0]), "text row (token 4000)": TextChunk(None, history[4000]),
           "codec frame [16]": FrameChunk(None, torch.arange(16)),
           "audio packet 2 s (48000 float32)": torch.randn(48000)}
    for p in (160, 640):
        prompt = TalkerPrompt(torch.arange(p), torch.randn(p, HIDDEN).to(torch.bfloat16), None)
        out[f"first text chunk, P = {p}"] = TextChunk(None, history[0], prompt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    child_in, to_child = ctx.Pipe(duplex=False)
    from_child, child_out = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=echo, args=(child_in, child_out))
    proc.start()
    rows = []
    for name, payload in payloads().items():
        data = dumps(payload)
        for k in range(args.repeat + 10):  # the first 10: warm-up
            if k == 10:
                t = time.perf_counter()
            to_child.send_bytes(dumps(payload))
            loads(from_child.recv_bytes())
        hop = (time.perf_counter() - t) / args.repeat / 2
        rows.append({"payload": name, "bytes": len(data), "hop_us": round(hop * 1e6, 1)})
        print(f"{name:36s} {len(data):>9d} B  {hop * 1e6:8.1f} us a hop")
    to_child.close()
    proc.join()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "repeat": args.repeat, "threads": torch.get_num_threads()}, f, indent=1)


if __name__ == "__main__":
    main()
