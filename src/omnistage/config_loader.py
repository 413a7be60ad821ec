"""Deploy configs from YAML: the packaged one for a checkpoint (`default_deploy_config`), a file or layout name
(`resolve_deploy_config`), merged and checked (`load_deploy_config`).

Precedence: CLI overrides > `platforms:` entry of the platform > file > its `base:` file (if any) > built-in
defaults.
Errors name the key path: "stages.talker.max_batch_size: must be a positive integer, got -1".
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from omnistage.config import DEPLOY_DIR, STAGE_NAMES, ConfigError, DeployConfig, StageConfig
from omnistage.config_rules import QUANTIZED_STAGES
from omnistage.platform import PLATFORMS, detect_platform, platform_from_name
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams, from_dict
from omnistage.utils import deep_merge


def build_deploy_config(data: dict, platform: str) -> DeployConfig:
    """Validate `data` merged over the built-in defaults, for `platform` (one of PLATFORMS)."""
    config = _build(DeployConfig, deep_merge(DeployConfig().to_dict(), data), "")
    for name in STAGE_NAMES:
        _check_stage(name, config.stage(name), platform)
    return config


def load_deploy_config(
    path: str | Path,
    platform: str | None = None,
    stage_overrides: str | dict | None = None,
    overrides: dict | None = None,
) -> DeployConfig:
    """`platform` defaults to the detected one; `stage_overrides` (JSON text or dict keyed by stage name) and
    `overrides` (top-level keys, e.g. {"async_chunk": False}) come from the CLI."""
    platform = platform or detect_platform()
    platform_from_name(platform)
    raw = _read_yaml(Path(path))
    entries = raw.pop("platforms", None) or {}
    _check_entries(raw, entries, platform)
    data = deep_merge(raw, entries.get(platform) or {})
    data = deep_merge(data, overrides or {})
    stages = _parse_stage_overrides(stage_overrides)
    return build_deploy_config(deep_merge(data, {"stages": stages}) if stages else data, platform)


def default_deploy_config(model_dir: str | Path, layout: str | None = None) -> Path:
    """The packaged deploy YAML for the checkpoint's config.json `model_type`: `<model_type>.yaml`, or with a
    `layout` (e.g. "80gb", "2x80gb") `<model_type>_<layout>.yaml`."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file}: not found; cannot choose a deploy config")
    model_type = json.loads(config_file.read_text()).get("model_type")
    path = DEPLOY_DIR / (f"{model_type}_{layout}.yaml" if layout else f"{model_type}.yaml")
    if not path.is_file():
        have = sorted(p.stem for p in DEPLOY_DIR.glob("*.yaml"))
        which = f"model_type {model_type!r}" + (f" and layout {layout!r}" if layout else "")
        raise ConfigError(f"no deploy config for {which} (have: {', '.join(have)}); pass a deploy YAML or a "
                          "packaged layout name with --deploy-config")
    return path


def resolve_deploy_config(model_dir: str | Path, name: str | None) -> Path:
    """`--deploy-config`: a YAML path, a packaged layout name ("80gb", "2x80gb"), or None (the default)."""
    if name is None:
        return default_deploy_config(model_dir)
    path = Path(name)
    return path if path.exists() or path.suffix or "/" in name else default_deploy_config(model_dir, name)


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or '<root>'}: must be a mapping, got {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = [_join(path, k) for k in data if k not in known]
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: unknown key (known: {', '.join(known)})")
    kwargs = {}
    for name, f in known.items():
        key, value = _join(path, name), data[name]
        if "config" in f.metadata:
            kwargs[name] = _build(f.metadata["config"], value, key)
            continue
        try:
            kwargs[name] = f.metadata["check"](value)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}, got {value!r}") from None
    return cls(**kwargs)


def _check_stage(name: str, stage: StageConfig, platform: str) -> None:
    n, big = stage.max_batch_size, [s for s in stage.cuda_graph_batch_sizes if s > stage.max_batch_size]
    problems = [
        (len(stage.devices) > stage.replicas, "devices",
         f"{len(stage.devices)} devices for {stage.replicas} replica(s); list at most one per replica"),
        (stage.max_num_batched_tokens < n, "max_num_batched_tokens",
         f"must be >= max_batch_size ({n}), got {stage.max_num_batched_tokens}"),
        (bool(big), "cuda_graph_batch_sizes", f"must be <= max_batch_size ({n}), got {big}"),
        (stage.cuda_graph and not platform_from_name(platform).supports_cuda_graph, "cuda_graph",
         f"CUDA graphs are not available on platform {platform!r}"),
        (name not in QUANTIZED_STAGES and stage.quantization is not None, "quantization",
         f"only the thinker and the talker may be quantised, got {stage.quantization!r}"),
    ]
    for bad, key, why in problems:
        if bad:
            raise ConfigError(f"stages.{name}.{key}: {why}")
    _check_sampling(name, stage.sampling)


def _check_sampling(name: str, sampling: dict) -> None:
    cls = {"thinker": SamplingParams, "talker": TalkerSamplingParams}.get(name)
    if cls is None:
        if sampling:
            raise ConfigError(f"stages.{name}.sampling: {name} does not sample, got {sampling!r}")
        return
    try:
        from_dict(cls, sampling)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"stages.{name}.sampling: {e}") from None


def _check_entries(raw: dict, entries: Any, platform: str) -> None:
    """Every entry must name a platform and give a valid config, not only the detected one."""
    if not isinstance(entries, dict):
        raise ConfigError(f"platforms: must be a mapping, got {entries!r}")
    for name, entry in entries.items():
        if name not in PLATFORMS:
            raise ConfigError(f"platforms.{name}: unknown platform (known: {', '.join(PLATFORMS)})")
        if not isinstance(entry or {}, dict):
            raise ConfigError(f"platforms.{name}: must be a mapping, got {entry!r}")
        if name == platform:
            continue
        try:
            build_deploy_config(deep_merge(raw, entry or {}), name)
        except ConfigError as e:
            raise ConfigError(f"platforms.{name}: {e}") from None


def _read_yaml(path: Path, within: tuple[Path, ...] = ()) -> dict:
    """The file's mapping; with a `base:` key (a file beside it), merged over that file's, recursively."""
    if not path.is_file():
        raise ConfigError(f"{path}: deploy config not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a mapping at the top level")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base: must be a file name, got {base!r}")
    within = (*within, path.resolve())
    if (path.parent / base).resolve() in within:
        raise ConfigError(f"{path}: base: {base} is the file itself or one it is the base of")
    return deep_merge(_read_yaml(path.parent / base, within), raw)


def _parse_stage_overrides(value: str | dict | None) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--stage-overrides: invalid JSON ({e})") from None
    if not isinstance(value or {}, dict):
        raise ConfigError(f"--stage-overrides: must be a JSON object keyed by stage name, got {value!r}")
    return value or {}


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
