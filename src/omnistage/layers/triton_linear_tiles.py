"""The skinny GEMMs' tiles (`layers.triton_linear`), measured on the H200 by scripts/linear_bench.py."""

Config = tuple[int, int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k
# (weight rows N, K, M bucket, gated) -> Config, or None: F.linear (+ silu_mul) is faster there
# H200, scripts/linear_bench.py (call `c106fcc`)
CONFIGS: dict[tuple[int, int, int, bool], Config | None] = {
    (4096, 1024, 16, False): (16, 32, 128, 4, 6, 1),  # cp_qkv 4.5 vs 5.0 us
    (4096, 1024, 32, False): None,  # cp_qkv 5.5 vs 5.2 us
    (4096, 1024, 64, False): (64, 32, 128, 4, 4, 1),  # cp_qkv 5.2 vs 5.3 us
    (1024, 2048, 16, False): (16, 16, 256, 4, 4, 1),  # o_proj 5.5 vs 10.4 us
    (1024, 2048, 32, False): (16, 16, 256, 4, 4, 1),  # o_proj 5.6 vs 5.8 us
    (1024, 2048, 64, False): None,  # o_proj 6.6 vs 5.8 us
    (6144, 1024, 16, True): (16, 32, 256, 4, 4, 1),  # cp_gate_up 6.7 vs 7.5 us
    (6144, 1024, 32, True): None,  # cp_gate_up 7.7 vs 7.6 us
    (6144, 1024, 64, True): (64, 32, 128, 4, 4, 1),  # cp_gate_up 7.4 vs 7.8 us
    (1024, 3072, 16, False): (16, 16, 256, 4, 4, 4),  # cp_down 6.4 vs 6.7 us
    (1024, 3072, 32, False): None,  # cp_down 6.9 vs 6.8 us
    (1024, 3072, 64, False): None,  # cp_down 8.7 vs 7.1 us
    (2048, 1024, 16, False): (16, 32, 128, 4, 6, 1),  # cp_lm_head 4.1 vs 4.7 us
    (2048, 1024, 32, False): (16, 32, 128, 4, 6, 1),  # cp_lm_head 4.1 vs 4.8 us
    (2048, 1024, 64, False): (64, 32, 128, 4, 4, 1),  # cp_lm_head 4.7 vs 4.8 us
    (2560, 1024, 16, False): (16, 32, 128, 4, 6, 1),  # talker_qkv 4.2 vs 4.9 us
    (2560, 1024, 32, False): None,  # talker_qkv 5.2 vs 4.9 us
    (2560, 1024, 64, False): (64, 32, 128, 4, 4, 1),  # talker_qkv 4.9 vs 5.1 us
    (1536, 1024, 16, True): (16, 32, 256, 4, 4, 1),  # talker_gate_up 5.6 vs 7.1 us
    (1536, 1024, 32, True): (16, 32, 256, 4, 4, 1),  # talker_gate_up 5.2 vs 7.0 us
    (1536, 1024, 64, True): (16, 32, 256, 4, 4, 1),  # talker_gate_up 5.2 vs 7.0 us
    (1024, 768, 16, False): (16, 16, 512, 4, 3, 1),  # talker_down 3.3 vs 5.5 us
    (1024, 768, 32, False): (16, 32, 128, 4, 6, 1),  # talker_down 3.3 vs 4.1 us
    (1024, 768, 64, False): (16, 32, 128, 4, 6, 1),  # talker_down 3.4 vs 4.2 us
    (5120, 2048, 16, False): None,  # thinker_qkv 8.8 vs 7.9 us
    (5120, 2048, 32, False): None,  # thinker_qkv 10.7 vs 8.0 us
    (5120, 2048, 64, False): None,  # thinker_qkv 9.9 vs 7.9 us
    (2048, 4096, 16, False): None,  # thinker_o_proj 8.8 vs 8.4 us
    (2048, 4096, 32, False): None,  # thinker_o_proj 10.9 vs 8.6 us
    (2048, 4096, 64, False): None,  # thinker_o_proj 12.1 vs 8.8 us
}
# FP8 weights' tiles by the same key (an FP8 tile carries half the bytes of a bf16 one): `linear_bench.py --fp8`
# (call `b655ffb`, rows 1 / 16 / 64); a shape not here takes CONFIGS' tiles. Only `quantization: fp8-all` uses them.
FP8_CONFIGS: dict[tuple[int, int, int, bool], Config] = {
    (4096, 1024, 16, False): (16, 32, 128, 4, 6, 1),  # cp_qkv 5.1 vs bf16 cuBLAS 5.0 us
    (4096, 1024, 64, False): (64, 32, 128, 4, 4, 1),  # cp_qkv 7.7 vs bf16 cuBLAS 5.3 us
    (1024, 2048, 16, False): (16, 16, 256, 4, 4, 4),  # o_proj 5.8 vs bf16 cuBLAS 9.2 us
    (1024, 2048, 64, False): (16, 32, 512, 4, 3, 1),  # o_proj 6.7 vs bf16 cuBLAS 5.8 us
    (6144, 1024, 16, True): (16, 32, 512, 4, 3, 1),  # cp_gate_up 7.7 vs bf16 cuBLAS 7.5 us
    (6144, 1024, 64, True): (16, 32, 128, 4, 6, 1),  # cp_gate_up 11.9 vs bf16 cuBLAS 7.8 us
    (1024, 3072, 16, False): (16, 16, 256, 4, 4, 4),  # cp_down 7.0 vs bf16 cuBLAS 6.7 us
    (1024, 3072, 64, False): (16, 32, 512, 4, 3, 1),  # cp_down 9.1 vs bf16 cuBLAS 7.1 us
    (2048, 1024, 16, False): (16, 32, 512, 4, 3, 1),  # cp_lm_head 4.6 vs bf16 cuBLAS 4.7 us
    (2048, 1024, 64, False): (16, 32, 256, 4, 4, 1),  # cp_lm_head 5.7 vs bf16 cuBLAS 4.8 us
    (2560, 1024, 16, False): (16, 32, 512, 4, 3, 1),  # talker_qkv 5.0 vs bf16 cuBLAS 4.9 us
    (2560, 1024, 64, False): (16, 32, 128, 4, 6, 1),  # talker_qkv 7.3 vs bf16 cuBLAS 5.1 us
    (1536, 1024, 16, True): (16, 32, 512, 4, 3, 1),  # talker_gate_up 6.9 vs bf16 cuBLAS 7.1 us
    (1536, 1024, 64, True): (16, 32, 512, 4, 3, 1),  # talker_gate_up 6.7 vs bf16 cuBLAS 7.1 us
    (1024, 768, 16, False): (16, 32, 256, 4, 4, 1),  # talker_down 3.9 vs bf16 cuBLAS 5.2 us
    (1024, 768, 64, False): (16, 32, 256, 4, 4, 1),  # talker_down 4.1 vs bf16 cuBLAS 4.2 us
    (5120, 2048, 16, False): (16, 32, 512, 4, 3, 1),  # thinker_qkv 9.5 vs bf16 cuBLAS 7.9 us
    (5120, 2048, 64, False): (64, 32, 128, 4, 4, 1),  # thinker_qkv 15.2 vs bf16 cuBLAS 7.9 us
    (2048, 4096, 16, False): (16, 16, 256, 4, 4, 2),  # thinker_o_proj 10.6 vs bf16 cuBLAS 8.4 us
    (2048, 4096, 64, False): (16, 32, 512, 4, 3, 1),  # thinker_o_proj 14.9 vs bf16 cuBLAS 8.8 us
}
