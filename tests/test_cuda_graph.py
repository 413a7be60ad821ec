"""CUDA-graph capture bookkeeping that holds on any device."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omnistage.engine.cuda_graph import CUDAGraphs


def test_captures_of_different_stages_never_overlap(monkeypatch) -> None:
    # each stage captures from its own worker thread; two captures at once invalidate each other on CUDA
    inside, seen = [0], []

    def fake_capture(self, key, fn) -> None:
        inside[0] += 1
        seen.append(inside[0])
        time.sleep(0.02)
        inside[0] -= 1

    monkeypatch.setattr(CUDAGraphs, "_capture", fake_capture)
    threads = [threading.Thread(target=CUDAGraphs().capture, args=(i, None)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [1] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_are_timed_on_the_gpu() -> None:
    graphs = CUDAGraphs()
    x = torch.randn(2048, 2048, device="cuda")
    graphs.capture("mm", lambda: x @ x @ x)
    for _ in range(5):
        graphs.replay("mm")
    torch.cuda.synchronize()
    graphs.timer.harvest()
    assert graphs.timer.replays == 5 and 0 < graphs.timer.gpu_seconds < 1
