from __future__ import annotations

import json

import pytest
import yaml

from omnistage.config import DEPLOY_DIR, ConfigError, DeployConfig, StageConfig
from omnistage.config_loader import build_deploy_config, default_deploy_config, load_deploy_config
from omnistage.platform import current_platform, platform_from_name

DEFAULT_YAML = DEPLOY_DIR / "qwen3_omni_moe.yaml"


def write(tmp_path, data: dict):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_packaged_config_loads_for_every_platform():
    cuda = load_deploy_config(DEFAULT_YAML, "cuda")
    assert cuda.stages.thinker.cuda_graph and cuda.stages.talker.cuda_graph
    assert cuda.stages.thinker.sampling["temperature"] == 0.4
    assert cuda.stages.talker.sampling == {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.05,
                                           "max_frames": 4096}
    assert cuda.connector.initial_codec_chunk_frames == 2 and cuda.connector.codec_chunk_frames == 25
    assert cuda.connector.codec_chunk_growth is True
    cpu = load_deploy_config(DEFAULT_YAML, "cpu")
    assert (cuda.connector.idle_initial_codec_chunk_frames, cpu.connector.idle_initial_codec_chunk_frames) == (1, 0)
    assert (cuda.connector.idle_first_frame_alone, cpu.connector.idle_first_frame_alone) == (True, False)
    assert (cuda.connector.talker_prompt_at_admission, cpu.connector.talker_prompt_at_admission) == (True, False)
    assert [cpu.stage(s).cuda_graph for s in ("thinker", "talker", "code2wav")] == [False] * 3
    assert cpu.stages.thinker.dtype == "float32" and cpu.stages.thinker.kv_cache_memory == 67108864
    assert cpu.stages.thinker.max_batch_size == cuda.stages.thinker.max_batch_size == 64
    rocm = load_deploy_config(DEFAULT_YAML, "rocm")
    assert not rocm.stages.thinker.cuda_graph and rocm.stages.talker.cuda_graph
    # detected platform by default (cpu here)
    assert load_deploy_config(DEFAULT_YAML) == load_deploy_config(DEFAULT_YAML, current_platform().name)


def test_precedence_cli_over_platform_over_file_over_defaults(tmp_path):
    path = write(tmp_path, {
        "async_output": False, "async_chunk": True,
        "stages": {"talker": {"max_batch_size": 16, "block_size": 32,
                              "sampling": {"top_k": 20, "temperature": 0.7}}},
        "platforms": {"cpu": {"async_chunk": True,
                              "stages": {"talker": {"max_batch_size": 8, "sampling": {"top_k": 10}}}}},
    })
    cfg = load_deploy_config(path, "cpu", stage_overrides='{"talker": {"max_batch_size": 4}}',
                             overrides={"async_chunk": False})
    talker = cfg.stages.talker
    assert talker.max_batch_size == 4            # CLI
    assert talker.sampling == {"top_k": 10, "temperature": 0.7}  # platform entry merged key by key into file
    assert talker.block_size == 32               # file
    assert talker.max_num_batched_tokens == StageConfig().max_num_batched_tokens == 8192  # built-in default
    assert cfg.async_chunk is False and cfg.async_output is False
    assert load_deploy_config(path, "cuda").stages.talker.max_batch_size == 16  # the cpu entry is unused
    assert load_deploy_config(path, "cpu").stages.talker.max_batch_size == 8


@pytest.mark.parametrize("stage_overrides, message", [
    ({"talker": {"max_batch_size": -1}}, "stages.talker.max_batch_size: must be a positive integer, got -1"),
    ({"talker": {"max_batch_size": True}},
     "stages.talker.max_batch_size: must be a positive integer, got True"),
    ({"talker": {"max_batch_sise": 8}}, "stages.talker.max_batch_sise: unknown key"),
    ({"vocoder": {}}, "stages.vocoder: unknown key"),
    ({"thinker": {"replicas": 2, "devices": [0, 1, 2]}}, "stages.thinker.devices: 3 devices for 2 replica(s)"),
    ({"talker": {"devices": [0, 1]}}, "stages.talker.devices: 2 devices for 1 replica(s)"),
    ({"talker": {"devices": []}}, "stages.talker.devices: must be a non-empty list"),
    ({"code2wav": {"kv_cache_memory": 1.5}}, "stages.code2wav.kv_cache_memory: must be a fraction in (0, 1]"),
    ({"code2wav": {"kv_cache_memory": 0}}, "stages.code2wav.kv_cache_memory: must be a fraction"),
    ({"thinker": {"dtype": "fp8"}},
     "stages.thinker.dtype: must be one of bfloat16, float16, float32, got 'fp8'"),
    ({"thinker": {"max_num_batched_tokens": 32}},
     "stages.thinker.max_num_batched_tokens: must be >= max_batch_size (64)"),
    ({"talker": {"cuda_graph_batch_sizes": [8, 128]}},
     "stages.talker.cuda_graph_batch_sizes: must be <= max_batch_size (64), got [128]"),
    ({"talker": {"sampling": {"topk": 3}}},
     "stages.talker.sampling: unknown TalkerSamplingParams field(s): ['topk']"),
    ({"thinker": {"sampling": {"top_p": 0}}}, "stages.thinker.sampling: top_p must be in (0, 1]"),
    ({"code2wav": {"sampling": {"temperature": 0.5}}}, "stages.code2wav.sampling: code2wav does not sample"),
    ({"talker": {"stream_priority": 1}}, "stages.talker.stream_priority: must be an integer in [-5, 0]"),
    ({"thinker": {"cuda_graph": True}},
     "stages.thinker.cuda_graph: CUDA graphs are not available on platform 'cpu'"),
    ('{"talker": ', "--stage-overrides: invalid JSON"),
    ("[1]", "--stage-overrides: must be a JSON object keyed by stage name"),
])
def test_errors_name_the_key_path(stage_overrides, message):
    with pytest.raises(ConfigError) as err:
        load_deploy_config(DEFAULT_YAML, "cpu", stage_overrides=stage_overrides)
    assert str(err.value).startswith(message), str(err.value)


def test_file_errors(tmp_path):
    bad = r"^connector.codec_chunk_frames: must be a positive integer, got 'x'"
    with pytest.raises(ConfigError, match=bad):
        load_deploy_config(write(tmp_path, {"connector": {"codec_chunk_frames": "x"}}), "cpu")
    with pytest.raises(ConfigError, match=r"^connector.codec_chunk_growth: must be true or false, got 1"):
        load_deploy_config(write(tmp_path, {"connector": {"codec_chunk_growth": 1}}), "cpu")
    with pytest.raises(ConfigError, match=r"^async_chunks: unknown key \(known: stages, connector, async_"):
        load_deploy_config(write(tmp_path, {"async_chunks": True}), "cpu")
    with pytest.raises(ConfigError, match=r"^platforms.tpu: unknown platform \(known: cuda, rocm, xpu, npu"):
        load_deploy_config(write(tmp_path, {"platforms": {"tpu": {}}}), "cpu")
    # an entry for another platform is validated too, and named
    bad_xpu = {"stages": {"talker": {"cuda_graph": True}},
               "platforms": {"xpu": {"stages": {"talker": {"block": 1}}}}}
    with pytest.raises(ConfigError, match=r"^platforms.xpu: stages.talker.block: unknown key"):
        load_deploy_config(write(tmp_path, bad_xpu), "cuda")
    with pytest.raises(ConfigError, match=r"^stages: must be a mapping, got \[\{'stage_id': 0\}\]"):
        load_deploy_config(write(tmp_path, {"stages": [{"stage_id": 0}]}), "cpu")
    with pytest.raises(ConfigError, match="deploy config not found"):
        load_deploy_config(tmp_path / "missing.yaml", "cpu")


def test_default_deploy_config_from_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    assert default_deploy_config(tmp_path) == DEFAULT_YAML
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"no deploy config for model_type 'llama' \(have: qwen3_omni_moe"):
        default_deploy_config(tmp_path)
    with pytest.raises(ConfigError, match="config.json: not found; cannot choose a deploy config"):
        default_deploy_config(tmp_path / "nowhere")


def test_to_dict_round_trip_and_describe():
    two = {"code2wav": {"replicas": 2, "devices": [0, 1]}}
    cfg = load_deploy_config(DEFAULT_YAML, "cuda", stage_overrides=two)
    assert build_deploy_config(cfg.to_dict(), "cuda") == cfg
    logged = json.loads(cfg.describe())
    assert logged["stages"]["code2wav"]["devices"] == [0, 1]
    assert logged["stages"]["thinker"]["kv_cache_memory"] == 0.8 and logged["gpu_memory_utilization"] == 0.9
    assert "\n" not in cfg.describe()
    assert build_deploy_config({}, "cpu") == DeployConfig()


def test_stage_helpers():
    talker = StageConfig(devices=(1, 2), replicas=3, max_batch_size=40)
    assert talker.replica_devices == (1, 2, 1)
    assert talker.graph_batch_sizes() == [1, 2, 4, 8, 16, 32, 40]
    assert StageConfig(max_batch_size=3).graph_batch_sizes() == [1, 2, 3]
    assert StageConfig(cuda_graph_batch_sizes=(8, 1, 8)).graph_batch_sizes() == [1, 8]


def test_platform_devices():
    assert platform_from_name("rocm").device(1) == platform_from_name("cuda").device(1)
    assert str(platform_from_name("cuda").device(1)) == "cuda:1"
    assert str(platform_from_name("cpu").device(3)) == "cpu"
    assert platform_from_name("xpu").supports_cuda_graph is False
    with pytest.raises(ValueError, match="unknown platform 'tpu'"):
        platform_from_name("tpu")


def test_data_parallel_repeats_the_layout_on_the_next_gpus(tiny_dir) -> None:
    """Pipeline i's replicas on the layout's devices + i x the GPUs one layout uses."""
    two_gpu = {"thinker": {"devices": [0]}, "talker": {"replicas": 2, "devices": [1]},
               "code2wav": {"devices": [1]}}
    cfg = load_deploy_config(default_deploy_config(tiny_dir), "cuda", two_gpu,
                             overrides={"data_parallel_size": 3})
    assert cfg.data_parallel_size == 3 and cfg.stages.talker.replicas == 2  # as written
    assert (cfg.stage("thinker").replicas, cfg.stage("thinker").replica_devices) == (3, (0, 2, 4))
    assert cfg.stage("talker").replica_devices == (1, 1, 3, 3, 5, 5)
    assert cfg.stage("code2wav").replica_devices == (1, 3, 5)
    assert load_deploy_config(default_deploy_config(tiny_dir), "cuda").stage("thinker").replica_devices == (0,)
    with pytest.raises(ConfigError, match="data_parallel_size: must be a positive integer, got 0"):
        load_deploy_config(default_deploy_config(tiny_dir), "cuda", overrides={"data_parallel_size": 0})


@pytest.mark.parametrize("layout, placement, devices", [
    ("2gpu", "pipeline", {"thinker": (0, 1), "talker": (0, 1), "code2wav": (0, 1)}),
    ("4gpu", "pipeline", {"thinker": (0, 1, 2, 3), "talker": (0, 1, 2, 3), "code2wav": (0, 1, 2, 3)}),
    ("3gpu", "process", {"thinker": (0,), "talker": (1, 2), "code2wav": (1, 2)}),
    ("4x80gb", "pipeline", {"thinker": (0, 2), "talker": (1, 3), "code2wav": (1, 3)}),
])
def test_the_multi_gpu_layouts(tiny_dir, layout, placement, devices) -> None:
    cfg = load_deploy_config(default_deploy_config(tiny_dir, layout), "cuda")
    default = load_deploy_config(default_deploy_config(tiny_dir), "cuda")
    assert cfg.placement == placement
    assert {s: cfg.stage(s).replica_devices for s in devices} == devices
    assert cfg.stage("thinker").cuda_graph_prefill_tokens == default.stage("thinker").cuda_graph_prefill_tokens
    cpu = load_deploy_config(default_deploy_config(tiny_dir, layout), "cpu")  # the base's platforms: entry too
    assert cpu.stage("thinker").dtype == "float32" and not cpu.stage("talker").cuda_graph


@pytest.mark.parametrize("layout", [None, "80gb"])
def test_the_stages_run_in_a_worker_process_on_gpus_and_in_this_one_on_the_cpu(tiny_dir, layout) -> None:
    path = default_deploy_config(tiny_dir, layout)
    assert [load_deploy_config(path, p).placement for p in ("cuda", "rocm", "cpu")] == ["pipeline"] * 2 + ["local"]
    assert load_deploy_config(path, "cpu", overrides={"placement": "process"}).placement == "process"  # the flag


def test_a_base_that_includes_itself_is_refused(tmp_path) -> None:
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nasync_chunk: false\n")
    with pytest.raises(ConfigError, match="base: a.yaml is the file itself or one it is the base of"):
        load_deploy_config(tmp_path / "a.yaml", "cpu")
    (tmp_path / "c.yaml").write_text("base: 3\n")
    with pytest.raises(ConfigError, match="base: must be a file name, got 3"):
        load_deploy_config(tmp_path / "c.yaml", "cpu")


@pytest.mark.parametrize("layout", [None, "80gb", "2x80gb", "2gpu", "3gpu", "4gpu", "4x80gb"])
def test_the_talker_captures_at_start_whatever_prompt_the_thinker_does(tiny_dir, layout) -> None:
    # a talker row holds the thinker's prompt: past its widths a graph was captured in the middle of serving
    cfg = load_deploy_config(default_deploy_config(tiny_dir, layout), "cuda")
    widths = {s: cfg.stage(s).cuda_graph_capture_widths for s in ("thinker", "talker")}
    assert max(widths["talker"]) >= max(widths["thinker"]) >= 256
