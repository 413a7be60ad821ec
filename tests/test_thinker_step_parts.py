"""A thinker step with decode rows and a prefill chunk beside them: the decode rows' tokens are copied to the host
as soon as their graph is launched, before the prefill is, and reach the talker first, so on CUDA they do not
wait for the prefill (pipeline/thinker/seq.py, `Sampled`)."""

from __future__ import annotations

import pytest
import torch
from test_prefill_graph import omni_cuda
from test_thinker_graph import PROMPTS, omni

from omnistage.pipeline.thinker.seq import Sampled

SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU clock before each prefill: far longer than the host's launches


def run_mixed_steps(o, monkeypatch) -> tuple[list[tuple], list[tuple[bool, bool]]]:
    """A short and a long prompt at once with 8 prompt tokens a step, so the long one prefills beside the short
    one's decodes -> (what happened, in order), and at each mixed step's completion (on CUDA): whether the
    decode rows' copy was ready and the prefill's not once the first was waited on."""
    stage, log, ready = o.engine.thinker, [], []
    monkeypatch.setattr(stage.scheduler, "token_budget", 8)
    post, eager, complete, append = Sampled.__post_init__, stage.eager, stage._complete, stage._append

    def sampled(self) -> None:
        log.append(("copy", tuple(s.req.request_id for s in self.seqs)))
        post(self)

    def prefill(batch):
        if torch.cuda.is_available():
            torch.cuda._sleep(SLEEP_CYCLES)
        log.append(("prefill", tuple(s.req.request_id for s, _ in batch)))
        return eager(batch)

    def completed(launched) -> None:
        log.append(("complete", [s.req.request_id for s in launched.seqs]))
        if len(launched.parts) > 1 and launched.parts[0].host.ready is not None:
            launched.parts[0].host.wait()
            ready.append((launched.parts[0].host.ready.query(), launched.parts[-1].host.ready.query()))
        complete(launched)

    monkeypatch.setattr(Sampled, "__post_init__", sampled)
    monkeypatch.setattr(stage, "eager", prefill)
    monkeypatch.setattr(stage, "_complete", completed)
    monkeypatch.setattr(stage, "_append", lambda seq, *a: (log.append(("append", seq.req.request_id)), append(seq, *a)))
    results = o.chat([[{"role": "user", "content": PROMPTS[i]}] for i in (2, 1)], modalities=("text", "audio"),
                     sampling={"temperature": 0, "max_tokens": 6, "ignore_eos": True},
                     talker_sampling={"temperature": 0, "max_frames": 4, "ignore_eos": True})
    assert [len(r.token_ids) for r in results] == [6, 6] and all(r.codes.shape[1] == 4 for r in results)
    return log, ready


def check_order(log: list[tuple]) -> int:
    """Each mixed step: the decode rows' copy before the prefill's launch; every completion appends its rows in
    launch order, the decode rows' first -> the number of mixed steps."""
    mixed = 0
    for i, (what, ids) in enumerate(log):
        before = [w for w, _ in log[max(i - 2, 0):i]]
        if what == "prefill" and before[-1:] == ["copy"] and before[:1] != ["prefill"]:
            mixed += set(log[i - 1][1]).isdisjoint(ids)  # the copy was the decode graph's, not a prefill's
        if what == "complete":
            appends = []
            for w, rid in log[i + 1:]:
                if w != "append":
                    break
                appends.append(rid)
            assert appends == [rid for rid in ids if rid in appends]  # a row ended since its launch is dropped
    return mixed


def test_decode_rows_are_copied_before_the_prefill_beside_them_is_launched(monkeypatch) -> None:
    log, _ = run_mixed_steps(omni(True), monkeypatch)
    assert check_order(log) >= 2  # the long prompt's chunks beside the short one's decodes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy's timing is a CUDA matter")
def test_decode_tokens_are_on_the_host_while_the_prefill_beside_them_runs(monkeypatch) -> None:
    log, ready = run_mixed_steps(omni_cuda(), monkeypatch)
    assert check_order(log) >= 2 and len(ready) >= 2
    assert all(first and not last for first, last in ready)
