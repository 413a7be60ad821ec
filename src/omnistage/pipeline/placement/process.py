"""Worker processes on this host (`placement: process`, `placement: pipeline`): a host (`replica_host.GroupHost`,
`pipeline.PipelineHost`) built in a spawned process (the serving process has threads and maybe CUDA: no fork;
every GPU visible, a replica on `cuda:<device>`), and `ProcessLink`, the serving process's end of its two pipes:
adds and aborts in (a reader thread hands them to the host in order), events and stats out (the process's main
thread drains the host every `DRAIN_WAIT_S` at most). Payloads cross as `wire` pickles, their tensors' bytes
inline, already on the CPU (`replica_host.to_cpu`), each O(its chunk): one token's rows, one packet's frames,
never the history. A process whose serving process is gone exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from omnistage.gc_heap import settle_heap
from omnistage.pipeline.placement.local import Placement
from omnistage.pipeline.placement.remote import DRAIN_WAIT_S
from omnistage.pipeline.placement.replica_host import Event, GroupHost
from omnistage.pipeline.placement.wire import dumps, loads

START_TIMEOUT_S = 1800  # a full-size replica's load, profiling build and captures


def serve_group(p: Placement, members: list[tuple[str, int, str]], tokenizer: Any, tts: torch.Tensor | None,
                threads: int, inbox: Any, outbox: Any) -> None:
    """The process of the replicas `members` (those of one deploy device)."""
    torch.set_num_threads(threads)
    run_host(lambda: GroupHost(p, members, tokenizer, tts), inbox, outbox)


def run_host(make: Callable[[], Any], inbox: Any, outbox: Any) -> None:
    """A host's process (a `GroupHost` or a `PipelineHost`): ("info", info, tts embeds) or ("error", why) once
    `make()` built it, then (events, stats) at each drain."""
    try:
        host = make()
        embeds = host.tts_embeds()
    except BaseException as e:
        outbox.send_bytes(dumps(("error", repr(e))))
        raise
    settle_heap(multiprocessing.current_process().name)
    outbox.send_bytes(dumps(("info", host.info(), embeds)))
    threading.Thread(target=_read, args=(host, inbox), name="omnistage-host-in", daemon=True).start()
    while True:
        try:
            outbox.send_bytes(dumps(host.drain(DRAIN_WAIT_S)))
        except OSError:  # NOTE: the serving process is gone
            os._exit(0)


def _read(host: Any, inbox: Any) -> None:
    while True:
        try:
            kind, *rest = loads(inbox.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # NOTE: the serving process is gone (or let go of this replica)
        if kind == "start":
            host.start()
        else:
            host.handle(rest[0])


def process_main(target: Callable[..., None], name: str, level: int, *args: Any) -> None:
    """A spawned process: its log lines at the serving process's `level` (a server's start-up lines: KV sizes,
    graph captures), labelled `name`; then `target(*args)`."""
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    target(*args)


class ProcessLink:
    """A `remote.Link` to a host's process: `target(*args, inbox, outbox)` spawned (`process_main`), built by the
    constructor."""

    def __init__(self, target: Callable[..., None], args: tuple, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        inbox, self._writer = ctx.Pipe(duplex=False)
        self._reader, outbox = ctx.Pipe(duplex=False)
        level = logging.getLogger().getEffectiveLevel()
        self.process = ctx.Process(target=process_main, args=(target, name, level, *args, inbox, outbox),
                                   name=f"omnistage-{name}")
        self.process.start()
        inbox.close()
        outbox.close()
        self._lock, self._kill_lock, self.closed = threading.Lock(), threading.Lock(), False
        kind, *rest = self._first()
        if kind == "error":
            self.kill()
            raise RuntimeError(f"{name}: its process failed to build it: {rest[0]}")
        self._info, self.tts = rest
        self._stats = self._info["stats"] if isinstance(self._info, dict) else None

    def _first(self) -> tuple:
        try:
            if self._reader.poll(START_TIMEOUT_S):
                return loads(self._reader.recv_bytes())
        except EOFError:
            pass
        self.kill()
        raise RuntimeError(f"{self.process.name}: its process ended before its replica was built "
                           f"(exit code {self.process.exitcode})")

    def info(self) -> Any:
        return self._info

    def start(self) -> None:
        self._put(("start",))

    def send(self, ops: list[tuple]) -> None:
        self._put(("ops", ops))

    def _put(self, message: tuple) -> None:
        try:
            with self._lock:
                self._writer.send_bytes(dumps(message))
        except OSError:
            pass  # NOTE: the process died: the pump's drain says so

    def drain(self, timeout: float) -> tuple[list[Event], Any]:
        if not self._reader.poll(timeout):
            if not self.process.is_alive():
                raise EOFError(f"exit code {self.process.exitcode}")
            return [], self._stats
        events, self._stats = loads(self._reader.recv_bytes())
        return events, self._stats

    def kill(self) -> None:
        """Idempotent; safe from several threads (a group's members notice its death together)."""
        with self._kill_lock:  # NOTE: not `_lock`: a send blocked on a stuck process holds that one
            self.process.kill()
            self.process.join(timeout=30)
            if not self._writer.closed:
                self._writer.close()

    def close(self) -> None:
        self.closed = True
        self.kill()
