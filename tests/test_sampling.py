from __future__ import annotations

from types import SimpleNamespace as P

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omnistage.layers.sampling import SamplingTensors, exponential_noise, process_logits, record_tokens, sample

V = 64


def _history(batch: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, n), generator=g)


def _seen(history: torch.Tensor) -> torch.Tensor:
    seen = torch.zeros(history.shape[0], V, dtype=torch.bool)
    return seen.scatter_(1, history, True)


def _hf_row(logits: torch.Tensor, hist: torch.Tensor, p, suppress: list[int], sampled: bool) -> torch.Tensor:
    procs = [RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty)), SuppressTokensLogitsProcessor(suppress)]
    if sampled:
        procs += [TemperatureLogitsWarper(float(p.temperature))]
        procs += [TopKLogitsWarper(p.top_k)] if p.top_k > 0 else []
        procs += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
        procs += [MinPLogitsWarper(p.min_p)] if p.min_p > 0 else []
    x = logits[None].clone()
    for proc in procs:
        x = proc(hist[None], x)
    return x[0]


def test_greedy_equals_hf_argmax_with_penalty_and_suppress():
    torch.manual_seed(0)
    logits = torch.randn(32, V) * 3
    hist = _history(32, 6, 1)
    pens = [1.0 + 0.25 * (i % 5) for i in range(32)]
    params = [P(temperature=0.0, repetition_penalty=pens[i]) for i in range(32)]
    suppress = list(range(48, 64))
    suppress_mask = torch.zeros(V, dtype=torch.bool)
    suppress_mask[suppress] = True
    st = SamplingTensors.build(params, seeds=range(32))
    ours = sample(logits, st, torch.zeros(32, dtype=torch.int64), seen=_seen(hist), suppress=suppress_mask)
    hf = torch.stack([_hf_row(logits[i], hist[i], params[i], suppress, False).argmax() for i in range(32)])
    assert torch.equal(ours, hf)
    # the processors change the decision in a good share of rows, so the comparison has teeth
    assert (logits.argmax(-1) != hf).sum() >= 8


def test_sampling_view_equals_hf_warpers():
    torch.manual_seed(1)
    logits = torch.randn(12, V) * 2
    hist = _history(12, 5, 2)
    params = [P(temperature=[0.7, 1.0, 1.3][i % 3], top_k=[0, 5, 20, 50][i % 4], top_p=[1.0, 0.8, 0.5][i % 3],
                min_p=[0.0, 0.05][i % 2], repetition_penalty=1.1) for i in range(12)]
    st = SamplingTensors.build(params, seeds=range(12))
    suppress = [3, 7, 60]
    mask = torch.zeros(V, dtype=torch.bool)
    mask[suppress] = True
    _, view = process_logits(logits, st, seen=_seen(hist), suppress=mask)
    for i in range(12):
        hf = _hf_row(logits[i], hist[i], params[i], suppress, True)
        assert torch.equal(torch.isinf(view[i]), torch.isinf(hf)), i
        keep = ~torch.isinf(hf)
        torch.testing.assert_close(view[i][keep], hf[keep], rtol=1e-6, atol=1e-6)
    kept = (~torch.isinf(view)).sum(-1)
    assert kept[0] == V - 3 and kept[1:].max() < V - 3  # row 0 truncates nothing, the others do


def _draws(logits_row: torch.Tensor, p, n: int, seed: int = 7, suppress: torch.Tensor | None = None):
    st = SamplingTensors.build([p] * n, seeds=[seed] * n)
    return sample(logits_row.expand(n, -1), st, torch.arange(n), suppress=suppress)


def test_top_k_distribution_and_never_masked():
    torch.manual_seed(2)
    logits = torch.randn(V)
    suppress = torch.zeros(V, dtype=torch.bool)
    top = logits.topk(6).indices
    suppress[top[0]] = True  # the most likely id is suppressed: top-5 are top[1:6]
    n = 20000
    toks = _draws(logits, P(temperature=0.8, top_k=5), n, suppress=suppress)
    allowed = top[1:6]
    assert torch.isin(toks, allowed).all()
    expect = (logits[allowed] / 0.8).softmax(-1) * n
    got = torch.stack([(toks == a).sum() for a in allowed]).float()
    chi2 = ((got - expect) ** 2 / expect).sum()
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def test_top_p_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)))
    n = 20000
    toks = _draws(logits, P(temperature=1.0, top_p=0.9), n)
    assert torch.isin(toks, torch.tensor([0, 1, 2])).all()  # 0.5 + 0.3 + 0.15 covers 0.9
    got = torch.bincount(toks, minlength=3)[:3].float()
    expect = torch.tensor([0.5, 0.3, 0.15]) / 0.95 * n
    assert ((got - expect) ** 2 / expect).sum() < 13.82  # 2 degrees of freedom, p = 0.001


def test_noise_is_exponential():
    e = exponential_noise(torch.tensor([3, 2**40 + 5]), torch.tensor([0, 9]), 50000)
    assert torch.allclose(e.mean(-1), torch.ones(2), atol=0.02)
    assert torch.allclose(e.var(-1), torch.ones(2), atol=0.05)
    assert (e > 0).all()
    assert (e[0] != e[1]).float().mean() > 0.99


def test_mixed_batch_and_seed_independent_of_batch():
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    params = [P(temperature=0.0), P(temperature=1.0, top_k=20), P(temperature=0.0), P(temperature=0.9, top_p=0.9)]
    seeds = [11, 12, 13, 14]
    steps = torch.tensor([5, 6, 7, 8])
    batch = sample(logits, SamplingTensors.build(params, seeds), steps)
    assert batch[0] == logits[0].argmax() and batch[2] == logits[2].argmax()
    for i in range(4):
        alone = sample(logits[i:i + 1], SamplingTensors.build(params[i:i + 1], seeds[i:i + 1]), steps[i:i + 1])
        assert alone[0] == batch[i]
    # the same seeded row in another batch, at another index, next to other rows
    other = torch.cat([torch.randn(2, V), logits[1:2]])
    p2 = [P(temperature=1.0), P(temperature=0.5, min_p=0.1), params[1]]
    again = sample(other, SamplingTensors.build(p2, [99, 98, 12]), torch.tensor([0, 1, 6]))
    assert again[2] == batch[1]


def test_seeded_sequences_repeat_and_differ_by_seed():
    logits = torch.zeros(64, V)  # uniform: every draw depends on the noise only
    p = [P(temperature=1.0)] * 64

    def run(seed):
        return sample(logits, SamplingTensors.build(p, [seed] * 64), torch.arange(64))

    assert torch.equal(run(5), run(5))
    assert (run(5) != run(6)).sum() > 50
    assert run(5).unique().numel() > 30


def test_presence_frequency_penalties_and_record():
    logits = torch.zeros(2, V)
    counts = torch.zeros(2, V, dtype=torch.int32)
    seen = torch.zeros(2, V, dtype=torch.bool)
    record_tokens(torch.tensor([3, 4]), seen, counts)
    record_tokens(torch.tensor([3, 5]), seen, counts)
    assert counts[0, 3] == 2 and counts[1, 4] == 1 and counts[1, 5] == 1 and seen.sum() == 3
    st = SamplingTensors.build([P(presence_penalty=0.5, frequency_penalty=0.25)] * 2, [0, 0])
    view, _ = process_logits(logits, st, counts=counts)
    assert view[0, 3] == pytest.approx(-1.0) and view[1, 4] == pytest.approx(-0.75) and view[0, 4] == 0


def test_build_fills_missing_fields_with_neutral_values() -> None:
    st = SamplingTensors.build([P(temperature=0.5, top_k=3), P()], [7, 2**62 - 1])
    assert st.temperature.tolist() == [0.5, 0.0] and st.top_k.tolist() == [3, 0] and st.top_p.tolist() == [1, 1]
    assert st.repetition_penalty.tolist() == [1, 1] and st.seeds.tolist() == [7, 2**62 - 1]
    assert not st.all_greedy and st.need_truncation


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_build_on_cuda_does_not_wait_for_the_device() -> None:
    # a blocking host-to-device copy would wait for the step in flight (the eager thinker step's sampling)
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        busy @ busy
        st = SamplingTensors.build([P(temperature=0.5, top_k=3)] * 2, [1, 2], "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert st.top_k.is_cuda and st.top_k.tolist() == [3, 3] and st.seeds.tolist() == [1, 2]
