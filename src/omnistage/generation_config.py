"""`--generation-config`: the checkpoint's generation_config.json as the default sampling, as in vLLM.

`auto` (the default) reads MODEL/generation_config.json, a folder reads FOLDER/generation_config.json, and
`vllm` (vLLM's spelling) reads none: the built-in defaults. Precedence, highest first: the request's fields >
the keys the deploy config sets in `stages.<stage>.sampling` > generation_config.json > SamplingParams'
defaults. Thinker: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens` (our
`max_tokens`), each also as `thinker_<key>` (which wins); `do_sample: false` is greedy. Talker: the same keys
with `talker_` (`talker_max_new_tokens` is our `max_frames`). Qwen3-Omni's own file holds talker keys only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from omnistage.config import ConfigError, DeployConfig
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams, from_dict

GENERATION_CONFIG_FILE = "generation_config.json"
IGNORE = "vllm"
_THINKER_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_TALKER_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_frames"}
_STAGES = (("thinker", ("", "thinker_"), _THINKER_KEYS, SamplingParams),
           ("talker", ("talker_",), _TALKER_KEYS, TalkerSamplingParams))


def read_generation_config(model_dir: str | Path, source: str = "auto") -> dict[str, Any]:
    """The generation_config.json that `source` names ({} for `vllm`, or `auto` without the file)."""
    if source == IGNORE:
        return {}
    path = Path(model_dir if source == "auto" else source) / GENERATION_CONFIG_FILE
    if not path.is_file():
        if source == "auto":
            return {}
        raise ConfigError(f"--generation-config: {path} not found")
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    if not isinstance(generation, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return generation


def sampling_defaults(generation: dict[str, Any], prefixes: tuple[str, ...], keys: dict[str, str]
                      ) -> dict[str, Any]:
    """Our sampling fields from a generation config's keys (later prefixes win; null is unset)."""
    out: dict[str, Any] = {}
    for prefix in prefixes:
        out.update((ours, generation[prefix + key]) for key, ours in keys.items()
                   if generation.get(prefix + key) is not None)
        if generation.get(prefix + "do_sample") is False:
            out["temperature"] = 0.0
    return out


def with_generation_defaults(deploy: DeployConfig, generation: dict[str, Any]) -> DeployConfig:
    """`deploy` with each sampling stage's defaults = generation config under the deploy config's own keys."""
    stages = deploy.stages
    for name, prefixes, keys, cls in _STAGES:
        stage = deploy.stage(name)
        sampling = {**sampling_defaults(generation, prefixes, keys), **stage.sampling}
        try:
            from_dict(cls, sampling)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{GENERATION_CONFIG_FILE} with stages.{name}.sampling: {e}") from None
        stages = replace(stages, **{name: replace(stage, sampling=sampling)})
    return replace(deploy, stages=stages)


def describe_defaults(deploy: DeployConfig, generation: dict[str, Any]) -> list[str]:
    """One start-up log line per sampling stage: every effective default of `deploy` (before
    `with_generation_defaults`) with `generation`, and where the set ones come from."""
    merged = with_generation_defaults(deploy, generation)
    lines = []
    for name, _, _, cls in _STAGES:
        values = asdict(from_dict(cls, merged.stage(name).sampling))
        shown = " ".join(f"{k}={v}" for k, v in values.items() if v is not None and v != [])
        own = deploy.stage(name).sampling
        sources = ", ".join(f"{k} from {'the deploy config' if k in own else GENERATION_CONFIG_FILE}"
                            for k in merged.stage(name).sampling) or "all built-in"
        lines.append(f"{name} sampling defaults (request fields override): {shown} ({sources})")
    return lines
