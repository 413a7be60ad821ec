"""Compiles every Triton kernel of `omnistage.layers.triton_*` for a CUDA target without a GPU (PTX, then cubin through
Triton's bundled ptxas): the modules' wrappers run on CPU tensors at the real model's shapes under a stand-in driver,
and each launch compiles instead of running, so the specialisations checked (dtypes, strides such as the code
predictor's stride-0 RoPE rows, constexprs) are the ones the wrappers launch. Exits 1 when a `*_kernel` of those
modules is launched by no example below or fails to compile.

usage: python scripts/triton_compile_check.py [--arch 90]
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable
from types import SimpleNamespace
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # NOTE: before Triton loads: real kernels, not the interpreter

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

import omnistage.layers
from omnistage.layers.sampling import SamplingTensors

BF16 = torch.bfloat16


class StandInDriver:
    """What `JITFunction.run` asks the driver for before it compiles: a device, a stream, the target."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def experts(h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised gate/up and down weights of 128 experts (nothing runs, the launch only compiles)."""
    return torch.empty(128, 2 * i, h, dtype=BF16), torch.empty(128, h, i, dtype=BF16)


def decode_attention(attn, heads: int, kv: int, rows: int = 16, width: int = 64) -> object:
    """One decode step's fused KV write + paged attention, q/k/v as views of one qkv GEMM output as in the model."""
    q, k, v = torch.empty(rows, heads + 2 * kv, 128, dtype=BF16).split([heads, kv, kv], 1)
    cache = torch.empty(2, 1024, 16, kv, 128, dtype=BF16)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    lens = torch.ones(rows, dtype=torch.int32)
    return attn.decode_attention_with_kvcache(q, k, v, cache[0], cache[1], lens.long(), tables, lens, 0.088)


def static_attention(attn, pos: int, n: int, rows: int = 16) -> object:
    """The code predictor's pass at `pos` of `n` positions (16 q, 8 kv heads)."""
    q, k, v = torch.empty(rows * n, 32, 128, dtype=BF16).split([16, 8, 8], 1)
    cache = torch.empty(2, rows, 16, 8, 128, dtype=BF16)
    return attn.static_attention_with_kvcache(q, k, v, cache[0], cache[1], pos, rows, 0.088)


def skinny(lin, rows: int, n: int, k: int, gated: bool = False, split_k: int = 1) -> object:
    """A decode GEMM of `triton_linear` (`rows` x `k` by a `[n, k]` weight); `split_k` > 1 forces that split."""
    x, w = torch.empty(rows, k, dtype=BF16), torch.empty(n, k, dtype=BF16)
    tiles = {(n, k, lin.m_bucket(rows), gated): (16, 16, 256, 4, 4, split_k)} if split_k > 1 else {}
    with mock.patch.dict(lin.CONFIGS, tiles):
        return lin.linear_silu_mul(x, w) if gated else lin.linear(x, w)


def examples(m: dict) -> list[tuple[str, Callable[[], object]]]:
    """One call per launch shape worth checking (m: the triton_* modules by short name)."""
    norm, ops, act, moe, smp, fmoe, conv = (m[k] for k in ("norm", "ops", "activation", "moe", "sampling", "fused_moe",
                                                            "conv"))
    x, w = torch.randn(16, 1024, dtype=BF16), torch.ones(1024, dtype=BF16)
    qkv = torch.randn(16, 32, 128, dtype=BF16)  # code predictor: 16 q + 8 k + 8 v heads of one GEMM
    qw, table = torch.ones(128, dtype=BF16), torch.randn(16, 64, dtype=BF16)
    logits = torch.randn(8, 3072)
    sampled = SamplingTensors.build([SimpleNamespace(temperature=0.9, top_k=50, top_p=0.8)] * 8, range(8))
    greedy = SamplingTensors.build([SimpleNamespace(temperature=0.0)] * 8, range(8))
    steps, seen = torch.zeros(8, dtype=torch.long), torch.zeros(8, 3072, dtype=torch.bool)
    ids = torch.randint(0, 128, (16, 8))
    c2w = torch.empty(16, 96, 48006, dtype=BF16)  # code2wav's last level: a later 25-frame chunk's conv input
    dense = torch.empty(16, 96, 48000, dtype=BF16)
    return [
        ("rms_norm", lambda: norm.rms_norm(x, w, 1e-6)),
        ("rms_norm_qk, strided cos", lambda: norm.rms_norm_qk(qkv[:, :24], qw, qw, 16, 1e-6, table[:16], table[:16])),
        ("rms_norm_qk, stride-0 cos", lambda: norm.rms_norm_qk(qkv[:, :24], qw, qw, 16, 1e-6, table[3].expand(16, -1),
                                                              table[4].expand(16, -1))),
        ("add_rms_norm 1024", lambda: norm.add_rms_norm(x, x, w, 1e-6)),
        ("add_rms_norm 2048", lambda: norm.add_rms_norm(x.view(8, 2048), x.view(8, 2048), w.repeat(2), 1e-6)),
        ("silu_mul", lambda: act.silu_mul(torch.randn(16, 2 * 3072, dtype=BF16))),
        ("snake_beta", lambda: ops.snake_beta(torch.randn(1, 1024, 2000, dtype=BF16), w, w)),
        ("snake_beta, trimmed input + bias into a conv buffer",
         lambda: ops.snake_beta(c2w[..., 3:48003], w[:96], w[:96], w[:96], out=c2w[..., 6:])),
        ("bias_residual, trimmed input + bias", lambda: conv.bias_residual(c2w[..., 3:48003], dense, w[:96], w[:96])),
        ("bias_residual", lambda: conv.bias_residual(dense, dense, w[:96])),
        ("conv1d_out1 96 -> 1, k 7", lambda: conv.conv1d_out1(c2w, torch.empty(1, 96, 7, dtype=BF16), w[:1])),
        ("race_argmax", lambda: ops.race_argmax(logits, sampled.seeds, steps)),
        ("moe route", lambda: moe.route(torch.randn(16, 128, dtype=BF16), 8, True)),
        ("moe align", lambda: moe.moe_align(ids, 128)),
        ("moe unpermute", lambda: moe.moe_unpermute(torch.randn(128, 2048, dtype=BF16),
                                                    torch.rand(16, 8, dtype=BF16), torch.arange(128))),
        ("fused_moe thinker", lambda: fmoe.fused_moe(x.repeat(1, 2), *experts(2048, 768), torch.rand(16, 8, dtype=BF16),
                                                      ids)),
        ("fused_moe talker", lambda: fmoe.fused_moe(x, *experts(1024, 384), torch.rand(16, 6, dtype=BF16), ids[:, :6],
                                                     (torch.randn(16, 129, dtype=BF16)[:, 128:], x))),
        ("decode attention thinker", lambda: decode_attention(m["attention"], 32, 4)),
        ("decode attention talker", lambda: decode_attention(m["attention"], 16, 2)),
        ("static attention, first pass", lambda: static_attention(m["attention"], 0, 2)),
        ("static attention, pass 5", lambda: static_attention(m["attention"], 5, 1)),
        ("skinny linear, code predictor qkv", lambda: skinny(m["linear"], 1, 4096, 1024)),
        ("skinny linear, thinker o_proj 64 rows", lambda: skinny(m["linear"], 64, 2048, 4096)),
        ("skinny linear_silu_mul, code predictor", lambda: skinny(m["linear"], 16, 6144, 1024, gated=True)),
        ("skinny linear, split-K down", lambda: skinny(m["linear"], 1, 1024, 3072, split_k=4)),
        ("skinny linear_silu_mul, split-K talker", lambda: skinny(m["linear"], 1, 1536, 1024, True, split_k=2)),
        ("sample, greedy", lambda: smp.fused_sample(logits, greedy, steps)),
        ("sample, penalties", lambda: smp.fused_sample(logits, sampled, steps, seen, seen.int(), seen[0])),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    arch = parser.parse_args().arch
    driver.set_active(StandInDriver(arch))
    compiled: list[tuple[str, object]] = []
    launched: set[str] = set()
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        launched.add(self.fn.__name__)
        compiled.append((self.fn.__name__, run(self, *args, grid=grid, warmup=True, **kwargs)))

    JITFunction.run = compile_only
    mods = {name[len("triton_"):]: importlib.import_module(f"omnistage.layers.{name}")
            for _, name, _ in pkgutil.iter_modules(omnistage.layers.__path__) if name.startswith("triton_")}
    kernels = {k for mod in mods.values() for k, v in vars(mod).items() if isinstance(v, JITFunction)
               and k.endswith("_kernel")}
    failed = False
    for label, call in examples(mods):
        before = len(compiled)
        try:
            call()
        except Exception as e:  # NOTE: report every failing kernel, not only the first
            print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            failed = True
        for name, k in compiled[before:]:
            print(f"ok   {label}: {name} sm_{arch} ptx {len(k.asm['ptx'])} chars, cubin {len(k.asm['cubin'])} "
                  f"bytes, {k.metadata.num_warps} warps, {k.metadata.shared} B shared")
    missing = kernels - launched
    if missing:
        print(f"FAIL no example launches {sorted(missing)}")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
