"""Shared by the decode-runner tests: KV snapshots, a spy that checks every runner forward writes only
the live rows' slots and the scratch slot, CUDA-graph capture emulated on the CPU, and the audio packet
sizes a stream gets (engine, server and code2wav tests)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from omnistage.pipeline.connector import packet_frames


def kv(model: torch.nn.Module) -> torch.Tensor:
    """Every layer's paged K and V of a decoder `model` (its `.layers`) [L, 2, blocks, block, KV, D]."""
    attn = [layer.self_attn.attn for layer in model.layers]
    return torch.stack([torch.stack([a.k_cache, a.v_cache]) for a in attn])


@contextlib.contextmanager
def spy(runner, model: torch.nn.Module, block: int, live_slots: Callable[..., set[int]]) -> Iterator[list]:
    """Records (live rows, batch bucket, width bucket) of every `runner.run(*args)`, and checks that each
    forward (warm-up, capture, step) changed no KV slot but `live_slots(*args)` and the scratch slot."""
    steps, live = [], {}
    run, forward = runner.run, runner._forward
    scratch = runner.context.scratch * block

    def spy_run(*args):
        live["slots"] = live_slots(*args)
        out = run(*args)
        steps.append((len(live["slots"]), *live["bucket"]))  # one new slot per live row
        return out

    def spy_forward(b, w):
        before = kv(model).clone()
        out = forward(b, w)
        slots = (kv(model) != before).flatten(4).any(-1).flatten(0, 1).any(0).flatten()  # [blocks * block]
        changed = set(slots.nonzero()[:, 0].tolist())
        assert changed <= live["slots"] | {scratch}, f"wrote slots {changed - live['slots']}"
        live["bucket"] = (b, w)
        return out

    with mock.patch.object(runner, "run", spy_run), mock.patch.object(runner, "_forward", spy_forward):
        yield steps


class EmulatedGraphs:
    """`CUDAGraphs` on the CPU (`capture` warms up and keeps `fn`, `replay` runs it): tests the runner's
    capture protocol, i.e. what the static buffers hold at warm-up, capture and replay."""

    def __init__(self) -> None:
        self.fns: dict = {}

    def __contains__(self, key) -> bool:
        return key in self.fns

    def capture(self, key, fn) -> None:
        fn()
        self.fns[key] = fn

    def replay(self, key):
        return self.fns[key]()


def settle(check: Callable[[], None], timeout: float = 30.0) -> None:
    """Retry `check` (assertions) until it passes, for at most `timeout` s: workers drain aborts at their own
    pace (a step in flight finishes first, which takes long on a loaded machine)."""
    deadline = time.time() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def add_and_abort(engine, n: int, make: Callable[[int], object], rng: random.Random, within: float) -> None:
    """Add requests `make(0..n-1)` to `engine`, each aborted from a timer at a random moment in [0, within) s."""
    for i in range(n):
        req = make(i)
        engine.add_request(req)
        threading.Timer(rng.uniform(0, within), engine.abort, args=(req.request_id,)).start()


def packet_sizes(frames: int, initial: int, cap: int, growth: bool) -> list[int]:
    """Frames per audio packet of a stream of `frames` frames, as `packet_frames` schedules them (the last
    one may be shorter)."""
    sizes: list[int] = []
    while (done := sum(sizes)) < frames:
        sizes.append(min(packet_frames(done, initial, cap, growth), frames - done))
    return sizes
