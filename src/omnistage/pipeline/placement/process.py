"""`placement: process`: every stage replica (thinker i, talker i, code2wav i) in a worker process of its own
on this host, so replicas on several GPUs no longer share the serving process's GIL: each adds a Python
interpreter's worth of host work, not a thread.

A replica's process is spawned (the serving process has threads and maybe CUDA: no fork) and builds a
`ReplicaHost` on its deploy device (every GPU visible; `cuda:<device>`), one after another in `build_order` so
each sizes its KV cache from what its GPU has left. Two pipes join it to the serving process: adds and aborts in
(a reader thread hands them to the host in order), events and stats out (its main thread drains the host every
`DRAIN_WAIT_S` at most). Payloads cross as `wire` pickles, their tensors' bytes inline, already on the CPU
(`replica_host.to_cpu`), each O(its chunk): one token's rows, one packet's frames, never the history.
A process that dies is spawned again (`remote.RemoteStage`); one whose serving process is gone exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from omnistage.engine.request import Request
from omnistage.pipeline.placement.local import Placement, replica_names
from omnistage.pipeline.placement.remote import DRAIN_WAIT_S, RemoteStage
from omnistage.pipeline.placement.replica_host import Event, ReplicaHost, build_order
from omnistage.pipeline.placement.stage_handle import StageHandles
from omnistage.pipeline.placement.wire import dumps, loads

START_TIMEOUT_S = 1800  # a full-size replica's load, profiling build and captures


def serve_replica(p: Placement, name: str, replica: int, wname: str, tokenizer: Any, tts: torch.Tensor | None,
                  rebuilt: bool, threads: int, inbox: Any, outbox: Any) -> None:
    """A replica's process."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {wname} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    run_host(lambda: ReplicaHost(p, name, replica, wname, tokenizer, tts, rebuilt), inbox, outbox)


def run_host(make: Callable[[], Any], inbox: Any, outbox: Any) -> None:
    """A host's process (a `ReplicaHost` or a pipeline's): ("info", info, tts embeds) or ("error", why) once
    `make()` built it, then (events, stats) at each drain."""
    try:
        host = make()
        embeds = host.tts_embeds()
    except BaseException as e:
        outbox.send_bytes(dumps(("error", repr(e))))
        raise
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


class ProcessLink:
    """A `remote.Link` to a host's process: `target(*args, inbox, outbox)` spawned, built by the constructor."""

    def __init__(self, target: Callable[..., None], args: tuple, name: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        inbox, self._writer = ctx.Pipe(duplex=False)
        self._reader, outbox = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=target, args=(*args, inbox, outbox), name=f"omnistage-{name}")
        self.process.start()
        inbox.close()
        outbox.close()
        self._lock = threading.Lock()
        kind, *rest = self._first()
        if kind == "error":
            self.kill()
            raise RuntimeError(f"{name}: its process failed to build it: {rest[0]}")
        self._info, self.tts = rest
        self._stats = self._info["stats"]

    def _first(self) -> tuple:
        try:
            if self._reader.poll(START_TIMEOUT_S):
                return loads(self._reader.recv_bytes())
        except EOFError:
            pass
        self.kill()
        raise RuntimeError(f"{self.process.name}: its process ended before its replica was built "
                           f"(exit code {self.process.exitcode})")

    def info(self) -> dict[str, Any]:
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

    def drain(self, timeout: float) -> tuple[list[Event], dict[str, int | float]]:
        if not self._reader.poll(timeout):
            if not self.process.is_alive():
                raise EOFError(f"exit code {self.process.exitcode}")
            return [], self._stats
        events, self._stats = loads(self._reader.recv_bytes())
        return events, self._stats

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=30)
        self._writer.close()


def build_process_stages(p: Placement, tokenizer: Any, to_talker: Callable, to_code2wav: Callable,
                         on_error: Callable[..., None], *, lookup: Callable[[str], Request | None],
                         on_state: Callable[[str, int, bool], None] | None = None) -> StageHandles:
    """Every stage replica in its own process (built and ready; pumps not started)."""
    replicas = replica_names(p)
    links, args, tts = {}, {}, None
    threads = torch.get_num_threads()

    def start(k: int, rebuilt: bool = False) -> ProcessLink:
        return ProcessLink(serve_replica, (*args[k], rebuilt, threads), replicas[k][2])

    for name, i, wname in build_order(replicas):
        k = replicas.index((name, i, wname))
        args[k] = (p, name, i, wname, tokenizer if name == "thinker" else None, tts if name == "talker" else None)
        links[k] = start(k)
        tts = links[k].tts if tts is None else tts
    to_next = {"thinker": to_talker, "talker": to_code2wav}
    return StageHandles.of([(name, RemoteStage(
        links[k], wname, (name, i), to_next.get(name), on_error, lookup, on_state,
        respawn=lambda k=k: start(k, rebuilt=True), same_clock=True))
        for k, (name, i, wname) in enumerate(replicas)])
