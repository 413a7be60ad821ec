"""`placement: process`: the stage replicas in worker processes on this host, one process per deploy device index
(`replica_host.GroupHost`: the device's replicas, their worker threads, one CUDA context), so replicas on several
GPUs no longer share the serving process's GIL, and replicas of one GPU still overlap their kernels (separate
processes' CUDA contexts are time-sliced: on one H200 three stage processes served 22.0 req/s at c = 64 against
27.9 in threads, benchmarks/HISTORY.md).

The orchestrator holds a `remote.RemoteStage` per replica, each over a `MemberLink`: its share of its group's
pipes (`GroupLink`, read by one thread into each member's inbox). Payloads go producer -> serving process ->
consumer, routed by the orchestrator as in the other placements. A group's process that dies takes its members'
requests with it; the first member to notice builds the group again (`Groups.respawn`), the others join it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from omnistage.engine.request import Request
from omnistage.pipeline.connector import Inbox
from omnistage.pipeline.placement.local import Placement, replica_names
from omnistage.pipeline.placement.process import ProcessLink, serve_group
from omnistage.pipeline.placement.remote import DRAIN_WAIT_S, RemoteStage
from omnistage.pipeline.placement.replica_host import Event, build_order
from omnistage.pipeline.placement.stage_handle import StageHandles

Member = tuple[str, int, str]  # (stage, replica, worker name)


class GroupLink:
    """One group process's pipes: a reader thread splits each drain into the members' inboxes."""

    def __init__(self, link: ProcessLink) -> None:
        self.link, self.dead = link, False
        self.infos: list[dict[str, Any]] = link.info()
        self.stats = [i["stats"] for i in self.infos]
        self.inboxes: list[Inbox[Event]] = [Inbox(threading.Event()) for _ in self.infos]
        self._started = False
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"{link.process.name}-out", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                events, stats = self.link.drain(DRAIN_WAIT_S)
            except Exception:  # NOTE: the process died: each member's drain says so
                self.dead = True
                for inbox in self.inboxes:
                    inbox.wake.set()
                return
            for i, (member_events, member_stats) in enumerate(zip(events, stats or [])):
                self.stats[i] = member_stats
                for e in member_events:
                    self.inboxes[i].put(e)

    def start(self) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self.link.start()

    def kill(self) -> None:
        self.dead = True
        self.link.kill()

    def close(self) -> None:
        self.link.closed = True
        self.kill()


class MemberLink:
    """A `remote.Link` to member `i` of a group."""

    def __init__(self, group: GroupLink, i: int) -> None:
        self.group, self.i = group, i

    def info(self) -> dict[str, Any]:
        return self.group.infos[self.i]

    def start(self) -> None:
        self.group.start()

    def send(self, ops: list[tuple]) -> None:
        self.group.link.send((self.i, ops))

    def drain(self, timeout: float) -> tuple[list[Event], dict[str, int | float]]:
        events = self.group.inboxes[self.i].wait_drain(timeout)
        if not events and self.group.dead:
            raise EOFError(f"exit code {self.group.link.process.exitcode}")
        return events, self.group.stats[self.i]

    def kill(self) -> None:
        self.group.kill()

    def close(self) -> None:
        self.group.close()

    @property
    def closed(self) -> bool:
        return self.group.link.closed


class Groups:
    """The group processes, by deploy device index, built one after another (the thinkers' first: the talkers
    need their tts embeddings)."""

    def __init__(self, p: Placement, tokenizer: Any) -> None:
        self.p, self.tokenizer, self.tts = p, tokenizer, None
        by_device: dict[int, list[Member]] = {}
        for name, i, wname in build_order(replica_names(p)):
            by_device.setdefault(p.deploy.stage(name).replica_devices[i], []).append((name, i, wname))
        self.members = sorted(by_device.values(), key=lambda ms: (all(n != "thinker" for n, _, _ in ms), ms))
        self.links = [self._spawn(ms) for ms in self.members]
        self._lock = threading.Lock()

    def _spawn(self, members: list[Member]) -> GroupLink:
        args = (self.p, members, self.tokenizer, self.tts, torch.get_num_threads())
        link = GroupLink(ProcessLink(serve_group, args, "+".join(w for _, _, w in members)))
        self.tts = link.link.tts if self.tts is None else self.tts
        return link

    def member(self, g: int, i: int) -> MemberLink:
        return MemberLink(self.links[g], i)

    def respawn(self, g: int, i: int) -> MemberLink:
        """Member i of group g on a live group: the group built again if its process died."""
        with self._lock:
            if self.links[g].dead:
                self.links[g].kill()
                self.links[g] = self._spawn(self.members[g])
            return MemberLink(self.links[g], i)


def build_process_stages(p: Placement, tokenizer: Any, to_talker: Callable, to_code2wav: Callable,
                         on_error: Callable[..., None], *, lookup: Callable[[str], Request | None],
                         on_state: Callable[[str, int, bool], None] | None = None) -> StageHandles:
    """Every stage replica in its device's process (built and ready; pumps not started)."""
    groups = Groups(p, tokenizer)
    to_next = {"thinker": to_talker, "talker": to_code2wav}
    handles = []
    for name, i, wname in replica_names(p):
        g, k = next((g, k) for g, ms in enumerate(groups.members) for k, m in enumerate(ms) if m[:2] == (name, i))
        handles.append((name, RemoteStage(
            groups.member(g, k), wname, (name, i), to_next.get(name), on_error, lookup, on_state,
            respawn=lambda g=g, k=k: groups.respawn(g, k), same_clock=True)))
    return StageHandles.of(handles)
