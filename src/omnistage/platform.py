"""Which accelerator this process runs on, and the device strings that follow from it.

The one place that knows platform names; deploy config `platforms:` entries are keyed by them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

PLATFORMS = ("cuda", "rocm", "xpu", "npu", "cpu")


@dataclass(frozen=True)
class Platform:
    """`name` is one of PLATFORMS; `device_type` is torch's device type (rocm runs as "cuda")."""

    name: str
    device_type: str

    @property
    def supports_cuda_graph(self) -> bool:
        return self.name in ("cuda", "rocm")

    def device(self, index: int = 0) -> torch.device:
        """The torch device of accelerator `index` (the index is ignored on cpu)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, index)


def platform_from_name(name: str) -> Platform:
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {name!r}; known: {', '.join(PLATFORMS)}")
    return Platform(name, {"rocm": "cuda"}.get(name, name))


def detect_platform() -> str:
    """The platform name of this process (rocm when torch is a HIP build)."""
    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    # NOTE: torch.npu only exists once torch_npu is imported (Ascend); it registers itself.
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


@functools.cache
def current_platform() -> Platform:
    return platform_from_name(detect_platform())
