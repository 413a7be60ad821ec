"""The deploy config's value rules (config.py): each checks one key's value and converts it, or raises
ValueError with why; `opt` / `sub` declare a checked field / a nested config."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import field
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
PLACEMENTS = ("local", "pipeline", "process", "ray")
QUANTIZATIONS = ("fp8", "fp8-all")  # routed experts in FP8; "-all": the decoders' projections too
QUANTIZED_STAGES = ("thinker", "talker")  # the stages that may set `quantization`


def rule(ok: Callable[[Any], bool], why: str, convert: Callable[[Any], Any] = copy.deepcopy) -> Callable:
    def check(v: Any) -> Any:
        if not ok(v):
            raise ValueError(why)
        return convert(v)
    return check


def is_int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def is_memory(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return 0 < v <= 1 or (v > 1 and float(v).is_integer())


positive_int = rule(lambda v: is_int(v, 1), "must be a positive integer")
non_negative_int = rule(lambda v: is_int(v, 0), "must be an integer >= 0")
boolean = rule(lambda v: isinstance(v, bool), "must be true or false")
mm_limits = rule(lambda v: isinstance(v, dict) and set(v) <= {"image", "video"} and all(
    isinstance(d, dict) and set(d) <= {"min_pixels", "max_pixels", "total_pixels"} and all(
        is_int(x, 1) for x in d.values()) for d in v.values()),
    'must be {"image" / "video": {"min_pixels" / "max_pixels" / "total_pixels": positive integer}}')
devices = rule(lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(is_int(x, 0) for x in v),
                 "must be a non-empty list of device indices >= 0", tuple)
sizes = rule(lambda v: isinstance(v, (list, tuple)) and all(is_int(x, 1) for x in v),
               "must be a list of positive integers", tuple)
memory = rule(is_memory, "must be a fraction in (0, 1] of device memory or a whole number of bytes",
                lambda v: int(v) if v > 1 else v)
dtype = rule(lambda v: v in DTYPES, f"must be one of {', '.join(DTYPES)}")
mapping = rule(lambda v: isinstance(v, dict), "must be a mapping")
priority = rule(lambda v: isinstance(v, int) and not isinstance(v, bool) and -5 <= v <= 0,
                  "must be an integer in [-5, 0] (lower runs first)")
interval = rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 100,
                  "must be a number of milliseconds in (0, 100]", float)
utilization = rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
                     "must be a fraction in (0, 1] of each device's memory", float)
placement = rule(lambda v: v in PLACEMENTS, f"must be one of {', '.join(PLACEMENTS)}")
quantization = rule(lambda v: v is None or v in QUANTIZATIONS, f"must be null or one of {', '.join(QUANTIZATIONS)}")


def opt(default: Any, check: Callable[[Any], Any]) -> Any:
    return field(default=default, metadata={"check": check})


def sub(cls: type) -> Any:
    return field(default_factory=cls, metadata={"config": cls})
