"""Deploy config: per-stage placement, batching, memory and CUDA-graph knobs, loaded from YAML.

Precedence: CLI overrides > `platforms:` entry of the platform > file > built-in defaults.
Errors name the key path: "stages.talker.max_batch_size: must be a positive integer, got -1".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from omnistage import config_rules as r
from omnistage.platform import PLATFORMS, detect_platform, platform_from_name
from omnistage.sampling_params import SamplingParams, TalkerSamplingParams, from_dict
from omnistage.utils import deep_merge

DEPLOY_DIR = Path(__file__).parent / "deploy"
STAGE_NAMES = ("thinker", "talker", "code2wav")


class ConfigError(ValueError):
    """A deploy config problem; the message starts with the offending key path."""


@dataclass(frozen=True)
class StageConfig:
    """`kv_cache_memory`: bytes (an integer > 1), or (a fraction <= 1) the stage's relative share of what its
    device's budget leaves after weights and CUDA graphs (pipeline/placement/memory.py); code2wav has no
    paged KV cache and ignores it; `max_num_batched_tokens`:
    token budget of one step; replica i runs on `devices[i % len(devices)]`; `stream_priority`: the CUDA
    stream priority of its steps (stages share a GPU); `sampling`: default fields of SamplingParams
    (thinker) / TalkerSamplingParams (talker); code2wav does not sample."""

    devices: tuple[int, ...] = r.opt((0,), r.devices)
    replicas: int = r.opt(1, r.positive_int)
    max_batch_size: int = r.opt(64, r.positive_int)
    max_num_batched_tokens: int = r.opt(8192, r.positive_int)
    kv_cache_memory: float | int = r.opt(0.1, r.memory)
    block_size: int = r.opt(16, r.positive_int)
    cuda_graph: bool = r.opt(False, r.boolean)
    cuda_graph_batch_sizes: tuple[int, ...] = r.opt((), r.sizes)
    cuda_graph_capture_widths: tuple[int, ...] = r.opt((), r.sizes)  # KV blocks per row captured at start
    cuda_graph_prefill_tokens: tuple[int, ...] = r.opt((), r.sizes)  # token buckets of fresh-prompt prefill graphs
    dtype: str = r.opt("bfloat16", r.dtype)
    stream_priority: int = r.opt(0, r.priority)  # CUDA stream priority of the stage's worker
    sampling: dict = field(default_factory=dict, metadata={"check": r.mapping})

    @property
    def replica_devices(self) -> tuple[int, ...]:
        return tuple(self.devices[i % len(self.devices)] for i in range(self.replicas))

    def graph_batch_sizes(self) -> list[int]:
        """Ascending: the configured sizes, else 1, 2, 4, 8, 16, 32, ... and max_batch_size."""
        n = self.max_batch_size
        default = [*(s for s in (1, 2, 4, 8) if s < n), *range(16, n, 16), n]
        return sorted(set(self.cuda_graph_batch_sizes or default))


@dataclass(frozen=True)
class ConnectorConfig:
    """Talker -> code2wav: the first audio packet after `initial_codec_chunk_frames` frames, then packets
    of `connector.packet_frames(...)` frames (at most `codec_chunk_frames`).
    `codec_chunk_growth`: each later packet as long as all the audio before it, up to the cap, so playback
    never starves (False: every later packet `codec_chunk_frames`)."""

    initial_codec_chunk_frames: int = r.opt(4, r.positive_int)
    codec_chunk_frames: int = r.opt(25, r.positive_int)
    codec_chunk_growth: bool = r.opt(True, r.boolean)


@dataclass(frozen=True)
class Stages:
    thinker: StageConfig = r.sub(StageConfig)
    talker: StageConfig = r.sub(StageConfig)
    code2wav: StageConfig = r.sub(StageConfig)


@dataclass(frozen=True)
class DeployConfig:
    """`async_chunk`: the talker consumes thinker rows as they are produced (False: it starts after the
    thinker finished). `async_output`: the thinker, the talker and code2wav handle step N's outputs on the
    host while step N+1 runs.
    `max_waiting_requests` / `max_waiting_tokens`: the server's admission bound on requests (and their
    prompt tokens) that have not yet produced every output they asked for; past it a 429.
    `placement`: every stage replica in this process ("local") or each in a Ray actor ("ray").
    `switch_interval_ms`: Python's thread switch interval in this process (stage threads share one GIL;
    Python's default is 5 ms).
    `gpu_memory_utilization`: the fraction of each GPU's memory this process may use, less what other
    processes hold (pipeline/placement/memory.py), as vLLM's flag of that name.
    `realtime_streaming_input`: a realtime spoken turn (server VAD) is encoded and prefilled while the user
    speaks (`AsyncOmni.open_request`); False (default: slower on the H200 so far, benchmarks/HISTORY.md): only
    once it is committed.
    `enable_prefix_caching`: the thinker keeps computed prompt blocks for later prompts with the same
    prefix (vLLM's flag); `encoder_cache_mb`: MiB of encoder rows kept per thinker for media sent again
    (0: none); both count against the device's memory budget as activations do.
    `mm_processor_kwargs`: pixel limits of images and video frames ({"image" / "video": {"min_pixels",
    "max_pixels", "total_pixels"}}; requests' own knobs apply within them): by default an image is at most
    1280 x 32 x 32 pixels (<= 1280 tokens: a 4032 x 3024 photo 1 230 tokens, not 11 844)."""

    stages: Stages = r.sub(Stages)
    connector: ConnectorConfig = r.sub(ConnectorConfig)
    async_chunk: bool = r.opt(True, r.boolean)
    async_output: bool = r.opt(True, r.boolean)
    max_waiting_requests: int = r.opt(256, r.positive_int)
    max_waiting_tokens: int = r.opt(262144, r.positive_int)
    placement: str = r.opt("local", r.placement)
    switch_interval_ms: float = r.opt(5.0, r.interval)
    gpu_memory_utilization: float = r.opt(0.9, r.utilization)
    realtime_streaming_input: bool = r.opt(False, r.boolean)
    enable_prefix_caching: bool = r.opt(True, r.boolean)
    encoder_cache_mb: int = r.opt(512, r.non_negative_int)
    mm_processor_kwargs: dict = field(default_factory=lambda: {"image": {"max_pixels": 1280 * 32 * 32}},
                                      metadata={"check": r.mm_limits})

    def stage(self, name: str) -> StageConfig:
        return getattr(self.stages, name)

    def to_dict(self) -> dict:
        """Plain values; `build_deploy_config(cfg.to_dict(), platform)` gives it back."""
        return json.loads(json.dumps(asdict(self)))

    def describe(self) -> str:
        """The effective config in one line, for the start-up log."""
        return json.dumps(self.to_dict(), separators=(",", ":"))


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
        (name == "thinker" and stage.replicas != 1, "replicas",
         f"must be 1 for the thinker, got {stage.replicas}"),
        (len(stage.devices) > stage.replicas, "devices",
         f"{len(stage.devices)} devices for {stage.replicas} replica(s); list at most one per replica"),
        (stage.max_num_batched_tokens < n, "max_num_batched_tokens",
         f"must be >= max_batch_size ({n}), got {stage.max_num_batched_tokens}"),
        (bool(big), "cuda_graph_batch_sizes", f"must be <= max_batch_size ({n}), got {big}"),
        (stage.cuda_graph and not platform_from_name(platform).supports_cuda_graph, "cuda_graph",
         f"CUDA graphs are not available on platform {platform!r}"),
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


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: deploy config not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a mapping at the top level")
    return raw


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
