"""Log-mel features of clips seen before (`FeatureCache`): equal bit for bit to the feature extractor's batch
(a clip's row depends on the batch's padded length, which is in the key), held within its bytes."""

from __future__ import annotations

import numpy as np
import torch

from omnistage.models.qwen3_omni.feature_cache import FeatureCache
from omnistage.models.qwen3_omni.make_tiny import tiny_checkpoint
from omnistage.models.qwen3_omni.prompt import PromptProcessor


def test_cached_features_equal_the_batch() -> None:
    p = PromptProcessor(tiny_checkpoint("tiny"))
    rng = np.random.default_rng(0)
    a, b, c = (0.1 * rng.standard_normal(n).astype(np.float32) for n in (38_400, 25_001, 61_111))
    calls = []
    make = p._clip_features
    p._clip_features = lambda clip, n: calls.append(n) or make(clip, n)  # type: ignore[method-assign]
    for batch in ([a, b], [b, a], [a, b, c], [c], [b, a, c]):
        ours, ref = p.audio_features(batch), p.audio_features(batch, cache=False)
        assert all(torch.equal(x, y) for x, y in zip(ours, ref)), [len(x) for x in batch]
    # made once per (clip, padded length): a, b at a's length; a, b, c at c's; then only hits
    assert calls == [38_400, 38_400, 61_111, 61_111, 61_111]


def test_held_within_its_bytes() -> None:
    cache = FeatureCache(capacity_bytes=3 * 1000)
    feats = lambda clip, n: (torch.zeros(10, 20), torch.ones(20, dtype=torch.int32))  # noqa: E731 - 880 bytes
    for i in range(6):
        cache.features([np.full(10 + i, i, np.float32)], feats)
        assert cache.bytes <= 3000
    assert len(cache._entries) == 3 and cache.bytes == 3 * 880
