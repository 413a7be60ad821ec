"""Seeded random values for a checkpoint tensor, chosen by its name and shape.

One rule set serves `make-tiny` (bytes on disk) and `load_format="dummy"` (weights made on the
target device). Every tensor gets values, routers and experts included (transformers leaves the
talker routers at zero and the talker experts uninitialised). Scales keep activations O(1) so that
greedy decisions are far from ties and a planted bug changes the output.
"""

from __future__ import annotations

import math
import zlib

import torch


def _std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) for a tensor."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("alpha", "beta"):
        return 0.0, 0.1
    if leaf == "scale" or leaf == "gamma":
        return 0.1, 0.02
    if "norm" in name and len(shape) == 1:
        return 1.0, 0.1
    if leaf == "bias" or len(shape) == 1:
        return 0.0, 0.02
    if "embed" in name and len(shape) == 2:
        return 0.0, 1.0
    if "positional_embedding" in name:
        return 0.0, 0.02
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        fan_in = shape[-1]
    # NOTE: the vocoder's residual conv stack grows its signal each block; 0.7 keeps the output near
    # [-0.5, 0.5], so the final clamp does not saturate (which would hide errors) nor amplify rounding.
    gain = 0.7 if name.startswith("code2wav.decoder") and len(shape) == 3 else 1.0
    return 0.0, gain / math.sqrt(fan_in)


def tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """The same name, shape, seed and device always give the same values."""
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    mean, std = _std(name, tuple(shape))
    out = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return out.mul_(std).add_(mean).to(dtype)
