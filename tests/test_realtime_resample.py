"""The VAD worker's batched resampling (server/realtime/resample.py): many streams in one call, cut into
windows, give the same 16 kHz samples bit for bit as each stream resampled alone and whole."""

from __future__ import annotations

import numpy as np
from scipy.signal import resample_poly

from omnistage.server.realtime.resample import (
    Audio24k,
    StreamResampler,
    WindowedStream,
    push_many,
    ready,
    windows_many,
)


def test_push_many_equals_each_stream_alone():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(int(rng.integers(2000, 9000))).astype(np.float32) for _ in range(6)]
    resamplers, outs, fed = [StreamResampler() for _ in xs], [[] for _ in xs], [0] * len(xs)
    while any(f < x.size for f, x in zip(fed, xs)):
        some = [i for i, x in enumerate(xs) if fed[i] < x.size and rng.random() < 0.7]
        if not some:
            continue
        pieces = []
        for i in some:
            n = int(rng.integers(1, 1500))
            pieces.append(xs[i][fed[i]:fed[i] + n])
            fed[i] += n
        for i, out in zip(some, push_many([resamplers[i] for i in some], pieces)):
            outs[i].append(out)
    for x, out in zip(xs, outs):
        got = np.concatenate(out)
        assert got.size == ready(x.size)
        assert np.array_equal(got, resample_poly(x, 2, 3)[:got.size])  # float32 in, float32 out: exact


def test_windows_many_cuts_whole_windows_and_skips():
    rng = np.random.default_rng(1)
    pcm = [rng.integers(-20000, 20000, 24000, dtype=np.int16) for _ in range(3)]
    whole = [StreamResampler().push(p.astype(np.float32) / 32768.0) for p in pcm]
    streams, fed, starts, cut = [WindowedStream() for _ in pcm], [0, 0, 0], [0, 0, 0], 0
    for _ in range(30):
        pieces = []
        for i, p in enumerate(pcm):
            n = int(rng.integers(300, 1500))
            piece, fed[i] = p[fed[i]:fed[i] + n], fed[i] + n
            if rng.random() < 0.1:  # a reset: what was resampled but not windowed is skipped
                starts[i] = ready(fed[i] - n)
            pieces.append((streams[i], Audio24k(piece, starts[i], (ready(fed[i]) - starts[i]) // 512)))
            starts[i] += pieces[-1][1].count * 512
        for i, ((_, audio), windows) in enumerate(zip(pieces, windows_many(pieces, 512))):
            assert len(windows) == audio.count
            for k, w in enumerate(windows):
                at = audio.start + k * 512
                assert np.array_equal(w, whole[i][at:at + 512])
            cut += len(windows)
    assert cut > 60
