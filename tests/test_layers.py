"""Unit parity of the shared layers (norm, M-RoPE, paged attention, MoE) and of the decoder variants
(talker: MoE + shared expert, code predictor: dense) against transformers, fp32 CPU."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_reference, hf_stage_state
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_mod
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorConfig,
    Qwen3OmniMoeTextConfig,
)

from omnistage.layers.attention import Attention, allocate_kv_cache
from omnistage.layers.context import build_context, forward_context
from omnistage.layers.moe import SparseMoeBlock, fused_experts_grouped, fused_experts_reference, select_experts
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import RotaryEmbedding, apply_rotary_emb
from omnistage.models.qwen3_omni.decoder import DecoderConfig, DecoderModel
from omnistage.models.qwen3_omni.presets import preset_config


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def text_config(preset: str, stage: str = "thinker") -> dict:
    c = preset_config(preset)
    return c["thinker_config"]["text_config"] if stage == "thinker" else c["talker_config"][stage]


def test_rmsnorm_matches_transformers():
    torch.manual_seed(0)
    ours, ref = RMSNorm(48, 1e-6), hf_mod.Qwen3OmniMoeThinkerTextRMSNorm(48, 1e-6)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.2)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 3, 48) * 5
    assert torch.equal(ours(x), ref(x))


def test_interleaved_mrope_matches_transformers(preset):
    d = text_config(preset)
    cfg = Qwen3OmniMoeTextConfig(**d)
    hd = d["head_dim"]
    rope = RotaryEmbedding(hd, d["rope_parameters"]["rope_theta"], d["rope_parameters"]["mrope_section"])
    ref_rope = hf_mod.Qwen3OmniMoeThinkerTextRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    t = 11
    # distinct temporal / height / width components, as for image patches
    pos = torch.stack([torch.arange(t) + 3, torch.randint(0, 50, (t,), generator=g), torch.randint(0, 50, (t,), generator=g)])
    q, k = torch.randn(t, 4, hd, generator=g), torch.randn(t, 2, hd, generator=g)
    cos, sin = ref_rope(q, pos[:, None, :])
    ref_q, ref_k = hf_mod.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    c, s = rope(pos, q.dtype)
    assert rel(apply_rotary_emb(q, c, s), ref_q[0].transpose(0, 1)) < 1e-6
    assert rel(apply_rotary_emb(k, c, s), ref_k[0].transpose(0, 1)) < 1e-6
    # the H/W components matter: using only T positions gives a clearly different rotation
    c1, s1 = rope(pos[0], q.dtype)
    assert rel(apply_rotary_emb(q, c1, s1), ref_q[0].transpose(0, 1)) > 1e-2


def test_1d_rope_matches_transformers_code_predictor_rope(preset):
    d = text_config(preset, "code_predictor_config")
    ref_rope = hf_mod.Qwen3OmniMoeRotaryEmbedding(Qwen3OmniMoeTalkerCodePredictorConfig(**d))
    rope = RotaryEmbedding(d["head_dim"], d["rope_parameters"]["rope_theta"])
    pos = torch.arange(40) * 7
    q = torch.randn(40, 3, d["head_dim"])
    cos, sin = ref_rope(q, pos[None])
    ref_q, _ = hf_mod.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    assert rel(apply_rotary_emb(q, *rope(pos, q.dtype)), ref_q[0].transpose(0, 1)) < 1e-6


def _dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Brute force in float64: q [L, H, D], k/v [L, KV, D] of one whole sequence."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(~torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).float()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (3, 3)])
def test_paged_attention_chunked_prefill_and_decode(heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d, bs, lens = 8, 3, [10, 4]
    attn = Attention(heads, kv_heads, d, d**-0.5)
    allocate_kv_cache(attn, 12, bs, torch.float32, "cpu")
    tables = [[7, 2, 9, 0], [5, 11]]  # scattered, non-contiguous blocks
    q = [torch.randn(n, heads, d, generator=g) for n in lens]
    k = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    v = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    # three flat forwards: prefill chunk (6 + 2 tokens), second chunk (3 + 1), decode (1 + 1)
    chunks, done, outs = [(6, 2), (3, 1), (1, 1)], [0, 0], [[], []]
    for new in chunks:
        sl = [slice(done[i], done[i] + new[i]) for i in range(2)]
        with forward_context(build_context(done, new, tables, bs)):
            o = attn(torch.cat([q[i][sl[i]] for i in range(2)]), torch.cat([k[i][sl[i]] for i in range(2)]),
                     torch.cat([v[i][sl[i]] for i in range(2)]))
        outs[0].append(o[:new[0]])
        outs[1].append(o[new[0]:])
        done = [a + b for a, b in zip(done, new)]
    for i in range(2):
        assert rel(torch.cat(outs[i]), _dense_causal_attention(q[i], k[i], v[i], d**-0.5)) < 1e-5


def _moe_case(t: int = 37, h: int = 24, e: int = 6, i: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return x, w13, w2, torch.randn(e, h, generator=g)


def _dense_brute_force(x, w13, w2, router, top_k, renormalize):
    probs = (x @ router.T).softmax(-1)
    top_v, top_i = probs.topk(top_k, dim=-1)
    if renormalize:
        top_v = top_v / top_v.sum(-1, keepdim=True)
    dense_w = torch.zeros_like(probs).scatter(1, top_i, top_v)  # [T, E]
    i = w2.shape[-1]
    ys = torch.stack([(F.silu(x @ w[:i].T) * (x @ w[i:].T)) @ wd.T for w, wd in zip(w13, w2)], dim=1)
    return (dense_w[:, :, None] * ys).sum(1)


@pytest.mark.parametrize("top_k,renormalize", [(2, True), (3, False), (1, True)])
def test_moe_reference_matches_dense_brute_force(top_k, renormalize):
    x, w13, w2, router = _moe_case()
    weights, ids = select_experts(x @ router.T, top_k, renormalize)
    out = fused_experts_reference(x, w13, w2, weights, ids)
    assert rel(out, _dense_brute_force(x, w13, w2, router, top_k, renormalize)) < 1e-5


def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 8, device=device, dtype=dtype), torch.ones(1, 8, 8, device=device, dtype=dtype),
                          offs=torch.tensor([2], dtype=torch.int32, device=device))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _grouped_mm_works("cpu", torch.float32), reason="torch._grouped_mm has no CPU fp32 kernel")
def test_moe_grouped_path_matches_reference_cpu():
    x, w13, w2, router = _moe_case(t=29, e=8, i=12)  # _grouped_mm needs 16-byte aligned rows
    weights, ids = select_experts(x @ router.T, 3, True)
    ids[0] = torch.tensor([7, 6, 5])  # make sure some experts get no rows while others get many
    ref = fused_experts_reference(x, w13, w2, weights, ids)
    assert rel(fused_experts_grouped(x, w13, w2, weights, ids), ref) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_grouped_path_matches_reference_cuda_bf16():
    x, w13, w2, router = (t.cuda().bfloat16() for t in _moe_case(t=300, h=64, e=16, i=32))
    weights, ids = select_experts(x @ router.T, 4, True)
    ref = fused_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert rel(fused_experts_grouped(x, w13, w2, weights, ids).float(), ref) < 2e-2


def test_sparse_moe_block_with_shared_expert_matches_transformers(preset):
    cfg = Qwen3OmniMoeTextConfig(**text_config(preset, "text_config"))
    ref = hf_mod.Qwen3OmniMoeTalkerTextSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                          cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(1, 19, cfg.hidden_size)
    with torch.no_grad():
        assert rel(ours(x[0]), ref(x)[0]) < 1e-5


@functools.cache
def _decoder(preset: str, stage: str) -> DecoderModel:
    """Our decoder layers + norm holding the talker's (MoE + shared expert) or code predictor's (dense) weights."""
    cfg_dict = text_config(preset, "text_config" if stage == "talker" else "code_predictor_config")
    model = DecoderModel(DecoderConfig.from_dict(cfg_dict)).eval()
    prefix = "model." if stage == "talker" else "code_predictor.model."
    state = {k[len(prefix):]: v for k, v in hf_stage_state(hf_reference(preset), "talker").items()
             if k.startswith(prefix) and "codec_embedding" not in k}
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("stage", ["talker", "code_predictor"])
def test_decoder_variants_match_transformers(preset, stage):
    hf = hf_reference(preset)
    ref_model = hf.talker.model if stage == "talker" else hf.talker.code_predictor.model
    model = _decoder(preset, stage)
    t, n_layers = 13, len(model.layers)
    x = torch.randn(t, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    if stage == "talker":  # distinct T/H/W positions exercise the interleaved M-RoPE end to end
        pos = torch.stack([torch.arange(t), torch.arange(t) // 3, torch.arange(t) % 5])
        hf_pos = pos[:, None, :]
    else:
        pos = hf_pos = torch.arange(t)
        hf_pos = pos[None]
    allocate_kv_cache(model, 8, 2, torch.float32, "cpu")
    with torch.no_grad():
        ref = ref_model(inputs_embeds=x[None], position_ids=hf_pos, output_hidden_states=True)
        for layer in (0, 1, n_layers):
            with forward_context(build_context([0], [t], [list(range(8))], 2)):
                h, captured = model(x, pos, capture_layer=layer)
            assert rel(h, ref.last_hidden_state[0]) < 1e-5
            assert rel(captured, ref.hidden_states[layer][0]) < 1e-5


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (2, 2)])
def test_batched_decode_attention_matches_reference(heads, kv_heads):
    from omnistage.layers.attention import paged_attention_reference, paged_decode_attention

    g = torch.Generator().manual_seed(heads + 7 * kv_heads)
    d, bs, num_blocks = 16, 4, 20
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
    lens = [1, 4, 5, 13, 9]  # one block, exactly full, boundary + 1, several blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[4 * i:4 * i + 4] for i in range(len(lens))]
    ctx = build_context([n - 1 for n in lens], [1] * len(lens), tables, bs)
    q = torch.randn(len(lens), heads, d, generator=g)
    fast = paged_decode_attention(q, k_cache, v_cache, ctx, d**-0.5)
    assert rel(fast, paged_attention_reference(q, k_cache, v_cache, ctx, d**-0.5)) < 1e-6
