"""Deploy config: per-stage placement, batching, memory and CUDA-graph knobs (the dataclasses; loaded from
YAML and checked by `config_loader.py`, each value's rule in `config_rules.py`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from omnistage import config_rules as r

DEPLOY_DIR = Path(__file__).parent / "deploy"
STAGE_NAMES = ("thinker", "talker", "code2wav")


class ConfigError(ValueError):
    """A deploy config problem; the message starts with the offending key path."""


@dataclass(frozen=True)
class StageConfig:
    """`kv_cache_memory`: bytes (an integer > 1), or (a fraction <= 1) the stage's relative share of what its device's
    budget leaves after weights and CUDA graphs (pipeline/placement/memory.py); code2wav has no paged KV cache
    and ignores it; `max_num_batched_tokens`: the rows of one step: thinker tokens (longer prompts prefill in
    chunks), talker rows and code2wav frames (a step's first prompt / chunk goes whole); replica i runs on
    `devices[i % len(devices)]`; `stream_priority`: the CUDA stream priority of its steps (stages share a GPU);
    `sampling`: default fields of SamplingParams (thinker) / TalkerSamplingParams (talker); code2wav does not
    sample."""

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
    # prefill graphs again for rows past cached ones (thinker, talker), each reading up to ratio x the largest bucket
    cuda_graph_prefill_context_ratio: int = r.opt(0, r.non_negative_int)
    dtype: str = r.opt("bfloat16", r.dtype)
    stream_priority: int = r.opt(0, r.priority)  # CUDA stream priority of the stage's worker
    quantization: str | None = r.opt(None, r.quantization)  # "fp8" / "fp8-all": quantised at load (thinker, talker)
    encoder_stream: bool = r.opt(False, r.boolean)  # thinker: its encoders on a CUDA stream of their own (arrivals.py)
    max_num_encoder_input_tokens: int = r.opt(0, r.non_negative_int)  # thinker: media tokens encoded a step (0: all)
    kv_lookahead: int = r.opt(0, r.non_negative_int)  # talker: frames of KV each running stream keeps at admissions
    # talker: a prompt's rows but the last for their KV alone, the last with the decodes (their graph makes its frame)
    last_prompt_row_in_decode: bool = r.opt(False, r.boolean)
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
    never starves (False: every later packet `codec_chunk_frames`).
    `idle_initial_codec_chunk_frames`: the first packet's frames for a request that the talker runs alone
    (`FrameChunk.talker_alone`; 0: `initial_codec_chunk_frames`): 1 starts the audio a talker step sooner. Only
    where a frame (a talker step, then code2wav's) takes well under a 1-frame first packet's 57 ms of audio, as
    on a GPU: on the CPU's tiny checkpoint 22 of 24 such streams stalled (benchmarks/HISTORY.md, 31st section);
    the deploy files set 1 for CUDA (an H100: c = 1 TTFP -8 / -7 / -7 ms at P = 10 / 160 / 640, 32nd section).
    `idle_first_frame_alone`: while the thinker holds one request only, its second decode step waits for the
    talker's first frame (pipeline/thinker/first_frame.py; placements local and pipeline only; the deploy files
    set it for CUDA: an H100, c = 1, TTFP 46 -> 42 ms, RTF 0.071 -> 0.073, 48th section).
    `talker_prompt_at_admission`: a text prompt's talker rows but the first token's go to the talker when the
    thinker admits it, so they are prefilled beside the thinker's prefill (pipeline/thinker/early_prompt.py;
    placements local and pipeline only)."""

    initial_codec_chunk_frames: int = r.opt(4, r.positive_int)
    idle_initial_codec_chunk_frames: int = r.opt(0, r.non_negative_int)
    codec_chunk_frames: int = r.opt(25, r.positive_int)
    codec_chunk_growth: bool = r.opt(True, r.boolean)
    idle_first_frame_alone: bool = r.opt(False, r.boolean)
    talker_prompt_at_admission: bool = r.opt(False, r.boolean)


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
    `placement`: every stage replica in this process ("local"), each data-parallel pipeline in a worker process
    of its own on this host ("pipeline"), the replicas of each deploy device in one ("process"), or each in a Ray actor ("ray").
    `data_parallel_size`: N pipelines, the stages' layout repeated N times (pipeline i's replicas on the
    layout's devices + i x the GPUs one layout uses), each with its thinker; requests go to the least loaded,
    a session's to its last one's (vLLM's `--data-parallel-size`).
    `switch_interval_ms`: Python's thread switch interval in this process (stage threads share one GIL;
    Python's default is 5 ms).
    `gpu_memory_utilization`: the fraction of each GPU's memory this process may use, less what other
    processes hold (pipeline/placement/memory.py), as vLLM's flag of that name.
    `realtime_streaming_input`: a realtime spoken turn (server VAD) is encoded and prefilled while the user
    speaks (`AsyncOmni.open_request`) and where they pause (default; faster on the H200 from 7d5ec95,
    benchmarks/HISTORY.md); False: only once it is committed. `realtime_preemptive_response` (with it): where
    the user pauses, the turn's response is started on the clip that ends there, its events held back until
    server VAD ends the turn at that pause (then out at once), dropped if the user speaks on (as LiveKit's
    preemptive generation; default on: a pause that is not the end costs the compute of an answer's start).
    `enable_prefix_caching`: the thinker keeps computed prompt blocks for later prompts with the same
    prefix (vLLM's flag); `encoder_cache_mb`: MiB of encoder rows kept per thinker for media sent again
    (0: none); both count against the device's memory budget as activations do.
    `mm_processor_kwargs`: pixel limits of images and video frames ({"image" / "video": {"min_pixels",
    "max_pixels", "total_pixels"}}; requests' own knobs apply within them): by default an image is at most
    1280 x 32 x 32 pixels (<= 1280 tokens: a 4032 x 3024 photo 1 230 tokens, not 11 844).
    `mm_processor_workers`: chat requests' prompts with media (decoding, features, patches) are processed in that
    many worker processes (pipeline/processor_pool.py; the default files' CUDA entry: 8); 0 (the built-in default):
    in the engine client's threads."""

    stages: Stages = r.sub(Stages)
    connector: ConnectorConfig = r.sub(ConnectorConfig)
    async_chunk: bool = r.opt(True, r.boolean)
    async_output: bool = r.opt(True, r.boolean)
    max_waiting_requests: int = r.opt(256, r.positive_int)
    max_waiting_tokens: int = r.opt(262144, r.positive_int)
    placement: str = r.opt("local", r.placement)
    data_parallel_size: int = r.opt(1, r.positive_int)
    switch_interval_ms: float = r.opt(5.0, r.interval)
    gpu_memory_utilization: float = r.opt(0.9, r.utilization)
    realtime_streaming_input: bool = r.opt(True, r.boolean)
    realtime_preemptive_response: bool = r.opt(True, r.boolean)
    enable_prefix_caching: bool = r.opt(True, r.boolean)
    encoder_cache_mb: int = r.opt(512, r.non_negative_int)
    mm_processor_kwargs: dict = field(default_factory=lambda: {"image": {"max_pixels": 1280 * 32 * 32}},
                                      metadata={"check": r.mm_limits})
    mm_processor_workers: int = r.opt(0, r.non_negative_int)

    def stage(self, name: str) -> StageConfig:
        """The stage's config with `data_parallel_size` applied (its replicas repeated per pipeline)."""
        sc, n = getattr(self.stages, name), self.data_parallel_size
        if n == 1:
            return sc
        gpus = 1 + max(max(getattr(self.stages, s).devices) for s in STAGE_NAMES)
        devices = tuple(d + i * gpus for i in range(n) for d in sc.replica_devices)
        return replace(sc, replicas=sc.replicas * n, devices=devices)

    def to_dict(self) -> dict:
        """Plain values; `config_loader.build_deploy_config(cfg.to_dict(), platform)` gives it back."""
        return json.loads(json.dumps(asdict(self)))

    def describe(self) -> str:
        """The effective config in one line, for the start-up log."""
        return json.dumps(self.to_dict(), separators=(",", ":"))
