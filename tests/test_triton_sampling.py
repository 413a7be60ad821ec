"""The one-kernel sampler (`triton_sampling.fused_sample`) against the eager `sampling.sample` path: the same
token ids, on the GPU or in Triton's interpreter on the CPU (conftest); skipped without Triton."""

from __future__ import annotations

from types import SimpleNamespace as P

import pytest
import torch

from omnistage.layers import triton_ops, triton_sampling
from omnistage.layers.sampling import SamplingTensors, process_logits, sample

from conftest import KERNEL_DEVICE as DEV

pytestmark = pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")

CONFIGS = [
    P(temperature=0.0, repetition_penalty=1.3),
    P(temperature=0.9, top_k=50, repetition_penalty=1.05),  # the talker's codebook 0
    P(temperature=1.0, top_k=50, top_p=0.8),  # the code predictor
    P(temperature=1.3, top_k=10 ** 6, top_p=1.0, min_p=0.05),
    P(temperature=0.7, top_p=0.5, presence_penalty=0.5, frequency_penalty=0.25),
    P(temperature=2.0, top_k=5, top_p=0.95, min_p=0.1, repetition_penalty=0.8),
    P(temperature=1.0),
    P(temperature=0.0, presence_penalty=1.0),
]


def _eager(logits: torch.Tensor, st: SamplingTensors, steps: torch.Tensor, **masks) -> torch.Tensor:
    triton_ops.ENABLED = False
    try:
        return sample(logits, st, steps, **masks)
    finally:
        triton_ops.ENABLED = True


def _both(logits: torch.Tensor, params: list, steps: torch.Tensor | None = None, seeds=None, **masks):
    """(fused, eager) token ids for rows of `logits` with per-row `params`."""
    b = logits.shape[0]
    st = SamplingTensors.build(params, seeds if seeds is not None else range(100, 100 + b), DEV)
    steps = torch.arange(b, device=DEV) if steps is None else steps
    return triton_sampling.fused_sample(logits, st, steps, **masks), _eager(logits, st, steps, **masks)


def _random_case(b: int, vocab: int, seed: int, masks: str):
    g = torch.Generator(DEV).manual_seed(seed)
    dtype = torch.bfloat16 if vocab == 3072 else torch.float32  # bf16: the talker's logits, read as fp32
    wide = torch.full((b, vocab + 64), 100.0, device=DEV, dtype=dtype)  # NOTE: rows read through a stride
    logits = wide[:, :vocab].copy_((torch.randn(b, vocab, device=DEV, generator=g) * 3).bfloat16())
    kw = {}
    if masks != "none":
        kw["seen"] = torch.rand(b, vocab, device=DEV, generator=g) < 0.05
        kw["counts"] = (kw["seen"] * torch.randint(1, 4, (b, vocab), device=DEV, generator=g)).int()
        sup = torch.zeros(vocab, dtype=torch.bool, device=DEV)
        sup[vocab - 1024:] = True
        sup[vocab - 1000] = False  # the talker suppresses its control ids but codec_eos
        if vocab == 3072:  # per row: codec_eos suppressed too in even rows
            sup = sup.expand(b, -1).clone()
            sup[::2, vocab - 1000] = True
        kw["suppress"] = sup
    steps = torch.randint(0, 10 ** 9, (b,), device=DEV, generator=g)
    seeds = torch.randint(0, 2 ** 62, (b,), generator=torch.Generator().manual_seed(seed)).tolist()
    return logits, [CONFIGS[(i + b) % len(CONFIGS)] for i in range(b)], steps, seeds, kw


@pytest.mark.parametrize("b", [1, 5, 64])
@pytest.mark.parametrize("vocab", [2048, 3072])
@pytest.mark.parametrize("masks", ["none", "seen+counts+suppress"])  # suppress [V] at 2048, [B, V] at 3072
def test_fused_equals_eager_on_talker_shapes(b: int, vocab: int, masks: str) -> None:
    logits, params, steps, seeds, kw = _random_case(b, vocab, b * vocab, masks)
    fused, eager = _both(logits, params, steps, seeds, **kw)
    assert torch.equal(fused, eager)
    if b == 64:
        sampled = torch.tensor([p.temperature > 0 for p in params], device=DEV)
        assert (fused != logits.argmax(-1))[sampled].sum() > 20  # draws, not argmaxes
        if masks != "none":
            assert (kw["seen"].gather(1, fused[:, None])[:, 0]).sum() < 10  # penalties push seen ids down


def _probe(logits_row: torch.Tensor, p, n: int = 32, **masks) -> set[int]:
    """Draw `n` times from one row (steps 0..n-1): the fused draws must be the eager draws, and they may only
    take ids that `truncate` keeps. Returns the ids drawn."""
    logits = logits_row.expand(n, -1)
    fused, eager = _both(logits, [p] * n, seeds=[7] * n, **masks)
    assert torch.equal(fused, eager)
    st = SamplingTensors.build([p], [7], DEV)
    kept = torch.isfinite(process_logits(logits_row[None], st, **masks)[1][0])  # masks: [V] ones only
    drawn = set(fused.tolist())
    assert kept[list(drawn)].all()
    return drawn


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    x = torch.randn(2048, device=DEV) * 0.5 - 5
    x[[7, 300, 1500]] = 3.0
    x[[11, 900, 1200, 2047]] = 2.5
    assert _probe(x, P(temperature=1.0, top_k=3)) == {7, 300, 1500}
    assert _probe(x, P(temperature=1.0, top_k=2)) == {7, 300, 1500}  # ties at the k-th value all stay
    assert _probe(x, P(temperature=1.0, top_k=5), 64) == {7, 300, 1500, 11, 900, 1200, 2047}


def test_top_p_cuts_a_tie_in_index_order() -> None:
    x = torch.full((3072,), -30.0, device=DEV)
    tied = [3000, 40, 2500, 9, 1777, 600, 61, 2048, 1234, 5]
    x[tied] = torch.tensor(0.05).log()
    x[100] = torch.tensor(0.5).log()
    # ascending cumsum over the tie: 0.05 r; 0.05 r <= 1 - 0.72 cuts ranks 1..5 (the 5 lowest ids)
    assert _probe(x, P(temperature=1.0, top_p=0.72), 64) == {100, 1234, 1777, 2048, 2500, 3000}


def test_top_p_edge_is_inclusive_and_the_max_stays() -> None:
    x = torch.zeros(2048, device=DEV)
    sup = torch.ones(2048, dtype=torch.bool, device=DEV)
    sup[[900, 30, 1500, 4]] = False  # four ids of p = 0.25 exactly: every sum is exact
    assert _probe(x, P(temperature=1.0, top_p=0.5), suppress=sup) == {900, 1500}  # cumsum 0.5 <= 0.5 is cut
    # 1 - 1e-9 is 1.0 in fp32: every cumsum is <= 1, all is cut but the last of the sort (the highest tied id)
    assert _probe(x, P(temperature=1.0, top_p=1e-9), suppress=sup) == {1500}


def test_k_past_vocab_and_top_p_one_keep_everything() -> None:
    drawn = _probe(torch.zeros(2048, device=DEV), P(temperature=1.0, top_k=5000, top_p=1.0, min_p=0.0), 64)
    assert len(drawn) > 55  # uniform over 2048 ids


def test_greedy_takes_the_first_max_and_flags_skip_work() -> None:
    x = torch.randn(4, 3072, device=DEV)
    x[:, [20, 10]] = 9.0
    seen = torch.zeros(4, 3072, dtype=torch.bool, device=DEV)
    seen[1, 10] = True
    counts = seen.int() * 2
    greedy = [P(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.1)] * 4
    fused, eager = _both(x, greedy, seen=seen, counts=counts)  # all greedy: no sampling compiled in
    assert torch.equal(fused, eager) and fused.tolist() == [10, 20, 10, 10]
    plain = [P(temperature=t, repetition_penalty=1.5) for t in (0.5, 0.0, 1.0, 3.0)]  # no truncation anywhere
    fused, eager = _both(x, plain, seen=seen, counts=counts)
    assert torch.equal(fused, eager) and fused[1] == 20


def test_supports_only_cuda_and_small_vocab() -> None:
    assert not triton_sampling.supports(torch.zeros(2, 3072))
    if DEV == "cuda":
        assert triton_sampling.supports(torch.zeros(2, 8192, device=DEV, dtype=torch.bfloat16))
        assert not triton_sampling.supports(torch.zeros(2, 8193, device=DEV))
