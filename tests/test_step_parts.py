"""A step of several runs completes run by run: each run's tokens are copied to the host as soon as it is launched,
before the next run is, and go on first. The thinker's decode rows do not wait for the prefill beside them
(`thinker/seq.Sampled`), nor a talker prompt's first frame for the decodes after it (`talker/seq.Run`)."""

from __future__ import annotations

import pytest
import torch
from test_prefill_graph import omni_cuda
from test_talker_graph import omni as omni_talker_graph  # NOTE: by name: conftest empties the caches this file uses
from test_thinker_graph import PROMPTS
from test_thinker_graph import omni as omni_thinker_graph

from omnistage.pipeline.talker.frame_step import TalkerFrameStep
from omnistage.pipeline.talker.seq import Run
from omnistage.pipeline.thinker.seq import Sampled

SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU clock before a step's later run: far longer than the host's launches


def ids(seqs) -> tuple[str, ...]:
    return tuple(s.req.request_id for s in seqs)


def spy_runs(o, monkeypatch) -> tuple[dict[str, list[tuple]], list[bool]]:
    """Logs each stage's run launches and copies, its completions and what they hand on (a log a stage: each runs
    in a thread of its own); on CUDA a sleep before the thinker's prefill and the talker's decodes, and at each
    completion of several runs: whether the last run's copy was ready once the first's was waited on."""
    thinker, talker, ready = o.engine.thinker, o.engine.talkers[0], []
    logs = {"thinker": [], "talker": []}

    def logged(cls, name: str, stage: str, entry):
        original = getattr(cls, name)

        def wrapper(self, *a):
            if (e := entry(self, *a)) is not None:
                logs[stage].append(e)
            return original(self, *a)
        monkeypatch.setattr(cls, name, wrapper)

    def delayed(later: bool) -> None:
        if later and torch.cuda.is_available():
            torch.cuda._sleep(SLEEP_CYCLES)

    def completes(name: str, stage, parts) -> None:
        complete = stage._complete

        def wrapper(launched) -> None:
            runs = parts(launched)
            logs[name].append(("complete", [rid for r in runs for rid in r[0]]))
            if len(runs) > 1 and runs[0][1].ready is not None:
                runs[0][1].wait()
                ready.append(runs[-1][1].ready.query())
            complete(launched)
        monkeypatch.setattr(stage, "_complete", wrapper)

    logged(Sampled, "__post_init__", "thinker", lambda s: ("copy", ids(s.seqs)))
    logged(Run, "__post_init__", "talker", lambda r: ("copy", ids(s for s, _ in r.group)))
    if thinker.runner is not None:
        logged(type(thinker.runner), "run", "thinker", lambda r, *a: ("launch", "graph"))
    logged(type(thinker.eager), "__call__", "thinker", lambda e, b: (delayed(True), ("launch", "prefill"))[1]
           if b else None)
    logged(TalkerFrameStep, "__call__", "talker", lambda f, fb: (delayed(max(fb.lens) == 1), ("launch", "decode"
           if max(fb.lens) == 1 else "prompt"))[1])
    logged(type(thinker), "_append", "thinker", lambda st, seq, *a: ("on", seq.req.request_id))
    logged(type(talker), "_advance", "talker", lambda st, seq, *a: ("on", seq.req.request_id))
    completes("thinker", thinker, lambda ln: [(ids(p.seqs), p.host) for p in ln.parts])
    completes("talker", talker, lambda ln: [(ids(s for s, _ in r.group), r.c0) for r in ln.runs])
    return logs, ready


def run_mixed_steps(o, monkeypatch, rounds: int = 1) -> tuple[dict[str, list[tuple]], list[bool]]:
    """A short and a long prompt at once with 8 prompt tokens a thinker step: the long one prefills beside the
    short one's decodes, and its talker prompt runs in a step with the short one's frames (the last of `rounds`
    such chats logged)."""
    monkeypatch.setattr(o.engine.thinker.scheduler, "token_budget", 8)
    for stage in (o.engine.thinker, o.engine.talkers[0]):  # NOTE: prompts prefilled in full, each round
        monkeypatch.setattr(stage, "prefix_caching", False)
    logs, ready = spy_runs(o, monkeypatch)
    for _ in range(rounds):
        for log in (*logs.values(), ready):
            log.clear()
        results = o.chat([[{"role": "user", "content": PROMPTS[i]}] for i in (2, 1)], modalities=("text", "audio"),
                         sampling={"temperature": 0, "max_tokens": 8, "ignore_eos": True},
                         talker_sampling={"temperature": 0, "max_frames": 6, "ignore_eos": True})
        assert [len(r.token_ids) for r in results] == [8, 8] and [r.codes.shape[1] for r in results] == [6, 6]
    return logs, ready


def check_order(log: list[tuple], first: str) -> int:
    """Every completion hands its rows on in launch order (a row ended since its launch is dropped) -> the steps
    whose `first` run's copy came before their next run's launch."""
    early = 0
    for i, (what, value) in enumerate(log):
        if what == "launch" and i > 1 and log[i - 1][0] == "copy" and log[i - 2] == ("launch", first):
            early += value != first
        if what == "complete":
            handed = []
            for w, rid in log[i + 1:]:
                if w != "on":
                    break
                handed.append(rid)
            assert handed == [rid for rid in value if rid in handed]
    return early


def test_a_steps_first_run_is_copied_before_its_next_run_is_launched(monkeypatch) -> None:
    # on the CPU each stage runs apart its prompts and one-row inputs only with its (graph) runner
    logs, _ = run_mixed_steps(omni_thinker_graph(True), monkeypatch)
    assert check_order(logs["thinker"], "graph") >= 2  # the short prompt's decodes beside the long one's chunks
    logs, _ = run_mixed_steps(omni_talker_graph(True), monkeypatch)
    assert check_order(logs["talker"], "prompt") >= 1  # the long prompt's first frame, then the short one's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies' timing is a CUDA matter")
def test_a_steps_first_run_is_on_the_host_while_its_next_run_runs(monkeypatch) -> None:
    # NOTE: the first round captures the graphs its shapes need (each capture syncs: this engine captures no KV
    # widths at start), so the second finds them
    logs, ready = run_mixed_steps(omni_cuda(), monkeypatch, rounds=2)
    assert check_order(logs["thinker"], "graph") >= 2 and check_order(logs["talker"], "prompt") >= 1
    assert len(ready) >= 3 and not all(ready)  # one copy a step: every step's rows would wait for its last run
