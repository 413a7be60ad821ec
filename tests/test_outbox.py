"""entrypoints/outbox.py: deltas from engine threads reach their queues all, in order, with one wakeup of the
event loop for everything that came while it was busy."""

from __future__ import annotations

import asyncio
import threading

import pytest

from omnistage.entrypoints.outbox import Outbox
from omnistage.outputs import OutputDelta


def test_a_step_of_deltas_wakes_the_loop_once():
    async def go():
        loop = asyncio.get_running_loop()
        wakeups = []
        threadsafe = loop.call_soon_threadsafe
        box = Outbox(loop)
        loop.call_soon_threadsafe = lambda f, *a: (f == box._deliver and wakeups.append(f)) or threadsafe(f, *a)
        queues = [asyncio.Queue() for _ in range(64)]
        emits = [box.emitter(q) for q in queues]
        # NOTE: the loop is busy meanwhile (joining here), as under load: nothing is taken mid-step
        step = threading.Thread(target=lambda: [emit(OutputDelta(f"r{i}", token_ids=[i])) for i, emit in enumerate(emits)])
        step.start()
        step.join()
        await asyncio.sleep(0)
        got = [q.get_nowait().token_ids for q in queues]
        await asyncio.to_thread(emits[0], OutputDelta("r0", finished=True))  # the next step: a wakeup of its own
        await asyncio.sleep(0)
        return len(wakeups), got, queues[0].get_nowait().finished

    wakeups, got, finished = asyncio.run(go())
    assert wakeups == 2 and got == [[i] for i in range(64)] and finished


def test_threads_racing_the_loop_lose_nothing():
    """Two producer threads (as the thinker's text and code2wav's audio) while the loop takes deltas: each queue
    gets all of its own, in order."""
    n = 5000

    async def go():
        box = Outbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(4)]
        emits = [box.emitter(q) for q in queues]

        def produce(first: int) -> None:
            for k in range(n):
                for i in (first, first + 2):
                    emits[i](OutputDelta(f"r{i}", token_ids=[k]))

        producers = [threading.Thread(target=produce, args=(first,)) for first in (0, 1)]
        for t in producers:
            t.start()
        got = await asyncio.gather(*[take(q, n) for q in queues])
        for t in producers:
            t.join()
        return got

    async def take(queue: asyncio.Queue, count: int) -> list[int]:
        return [(await asyncio.wait_for(queue.get(), 30)).token_ids[0] for _ in range(count)]

    assert asyncio.run(go()) == [list(range(n))] * 4


def test_a_closed_loop_raises_and_keeps_nothing():
    loop = asyncio.new_event_loop()
    box = Outbox(loop)
    queue: asyncio.Queue = asyncio.Queue()
    loop.close()
    for _ in range(2):  # NOTE: not silently queued behind the first
        with pytest.raises(RuntimeError):
            box.emitter(queue)(OutputDelta("r"))
