"""Shapes of the tiny random checkpoints that `omnistage make-tiny` writes.

Every preset keeps each structural feature of Qwen3-Omni-30B-A3B (thinker MoE with q/k-norm and
interleaved M-RoPE, audio and vision encoders, talker MoE with a sigmoid-gated shared expert,
a 16-group code predictor, code2wav with the real upsample rates) and the real token and codec ids.
"""

from __future__ import annotations

import copy
from typing import Any

SPECIAL_IDS = dict(
    im_start_token_id=151644, im_end_token_id=151645, system_token_id=8948, user_token_id=872,
    assistant_token_id=77091, tts_pad_token_id=151671, tts_bos_token_id=151672, tts_eos_token_id=151673,
)
MM_IDS = dict(
    audio_token_id=151675, image_token_id=151655, video_token_id=151656, audio_start_token_id=151669,
    audio_end_token_id=151670, vision_start_token_id=151652, vision_end_token_id=151653,
)
CODEC_IDS = dict(
    codec_bos_id=2149, codec_eos_token_id=2150, codec_pad_id=2148, codec_nothink_id=2155,
    codec_think_bos_id=2156, codec_think_eos_id=2157,
    speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303},
)
THINKER_VOCAB = 152064


def _mrope(head_dim: int) -> list[int]:
    half = head_dim // 2
    h = w = (half * 5 // 16) // 1
    return [half - h - w, h, w]


def _preset(h: int, layers: int, heads: int, kv: int, hd: int, experts: int, topk: int, moe_i: int,
            th: int, t_layers: int, t_heads: int, t_kv: int, t_experts: int, t_topk: int, t_moe_i: int,
            shared_i: int, cp_layers: int, cp_kv: int, c_h: int, c_layers: int, c_heads: int,
            decoder_dim: int, accept: int, audio_d: int = 32, vision_h: int = 32) -> dict[str, Any]:
    rope = dict(rope_type="default", rope_theta=1_000_000.0, mrope_section=_mrope(hd), interleaved=True,
                mrope_interleaved=True)
    text = dict(
        vocab_size=THINKER_VOCAB, hidden_size=h, intermediate_size=h, moe_intermediate_size=moe_i,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        num_experts=experts, num_experts_per_tok=topk, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], shared_expert_intermediate_size=0, use_qk_norm=True, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6, attention_bias=False, sliding_window=None,
        rope_parameters=rope, tie_word_embeddings=False,
    )
    audio = dict(
        num_mel_bins=128, d_model=audio_d, encoder_layers=2, encoder_attention_heads=4,
        encoder_ffn_dim=2 * audio_d, downsample_hidden_size=16, output_dim=h, n_window=50,
        n_window_infer=800, conv_chunksize=500, max_source_positions=1500, activation_function="gelu",
        scale_embedding=False,
    )
    vision = dict(
        depth=2, hidden_size=vision_h, intermediate_size=2 * vision_h, num_heads=4, out_hidden_size=h,
        hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0],
        apply_vit_abs_pos_embed=True, image_size=128, tokens_per_second=2,
    )
    talker_text = dict(
        vocab_size=3072, hidden_size=th, intermediate_size=2 * h, moe_intermediate_size=t_moe_i,
        shared_expert_intermediate_size=shared_i, num_hidden_layers=t_layers, num_attention_heads=t_heads,
        num_key_value_heads=t_kv, head_dim=hd, num_experts=t_experts, num_experts_per_tok=t_topk,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=None, tie_word_embeddings=False,
        rope_parameters={k: v for k, v in rope.items() if k != "mrope_interleaved"},
    )
    code_predictor = dict(
        vocab_size=2048, hidden_size=th, intermediate_size=2 * th, num_hidden_layers=cp_layers,
        num_attention_heads=t_heads, num_key_value_heads=cp_kv, head_dim=hd, hidden_act="silu",
        max_position_embeddings=64, rms_norm_eps=1e-6, num_code_groups=16, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
    )
    code2wav = dict(
        codebook_size=2048, hidden_size=c_h, intermediate_size=2 * c_h, num_hidden_layers=c_layers,
        num_attention_heads=c_heads, num_key_value_heads=c_heads, hidden_act="silu", rms_norm_eps=1e-5,
        layer_scale_initial_scale=0.01, max_position_embeddings=8000, sliding_window=72, num_quantizers=16,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=decoder_dim, attention_bias=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )
    return dict(
        architectures=["Qwen3OmniMoeForConditionalGeneration"], model_type="qwen3_omni_moe",
        enable_audio_output=True, **SPECIAL_IDS,
        thinker_config=dict(
            text_config=text, audio_config=audio, vision_config=vision, **MM_IDS, user_token_id=872,
            position_id_per_seconds=13, seconds_per_chunk=2, tie_word_embeddings=False,
        ),
        talker_config=dict(
            text_config=talker_text, code_predictor_config=code_predictor, num_code_groups=16,
            thinker_hidden_size=h, accept_hidden_layer=accept, **CODEC_IDS, **MM_IDS,
            position_id_per_seconds=13, seconds_per_chunk=2, spatial_merge_size=2, tie_word_embeddings=False,
        ),
        code2wav_config=code2wav,
    )


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _preset(h=64, layers=4, heads=4, kv=2, hd=16, experts=8, topk=2, moe_i=32,
                    th=32, t_layers=2, t_heads=4, t_kv=2, t_experts=8, t_topk=2, t_moe_i=16, shared_i=48,
                    cp_layers=2, cp_kv=2, c_h=32, c_layers=2, c_heads=4, decoder_dim=64, accept=2),
    "tiny-wide": _preset(h=96, layers=3, heads=6, kv=3, hd=32, experts=12, topk=3, moe_i=40,
                         th=48, t_layers=3, t_heads=3, t_kv=1, t_experts=10, t_topk=3, t_moe_i=24, shared_i=40,
                         cp_layers=3, cp_kv=3, c_h=48, c_layers=3, c_heads=6, decoder_dim=96, accept=1,
                         audio_d=48, vision_h=48),
}


def preset_config(name: str = "tiny") -> dict[str, Any]:
    """A fresh copy of the `config.json` dict of a preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
