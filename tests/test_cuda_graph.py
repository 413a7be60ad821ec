"""CUDA-graph capture bookkeeping that holds on any device."""

from __future__ import annotations

import threading
import time

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
