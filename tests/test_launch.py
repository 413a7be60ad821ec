from __future__ import annotations

import argparse
import json

import pytest

from omnistage.config_loader import build_deploy_config

from omnistage.server.launch import (TINY_MODEL_NAME, LaunchError, deploy_config, deploy_overrides,
                                     resolve_model)
from omnistage.server.serve_args import add_serve_args


def test_defaults_and_tiny(tiny_dir):
    args = add_serve_args(argparse.ArgumentParser()).parse_args([])
    assert (args.model, args.port, args.load_format, args.api_key) == (None, 8091, "auto", None)
    src = resolve_model(None)
    assert (src.path, src.name, src.random_weights) == (tiny_dir, TINY_MODEL_NAME, True)
    real = resolve_model(str(tiny_dir), "served")
    assert (real.path, real.name, real.random_weights) == (tiny_dir, "served", False)
    assert resolve_model(str(tiny_dir), load_format="dummy").random_weights


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LaunchError, match="'acme/no-such' is not a local directory and the Hugging Face Hub"):
        resolve_model("acme/no-such")


@pytest.mark.parametrize("model", ["./missing", "/no/such/dir", "a/b/c"])
def test_missing_directory(model):
    with pytest.raises(LaunchError, match=f"{model}: not a checkpoint directory"):
        resolve_model(model)


def test_deploy_config_platform_and_overrides(tiny_dir):
    cfg = deploy_config(tiny_dir, None, '{"talker": {"max_batch_size": 3}}', "cpu")
    assert cfg.stages.talker.max_batch_size == 3 and cfg.stages.thinker.dtype == "float32"
    with pytest.raises(LaunchError, match="stages.thinker.block_size: must be a positive integer"):
        deploy_config(tiny_dir, None, '{"thinker": {"block_size": 0}}', "cpu")


def test_deploy_overrides_flag(tiny_dir):
    from omnistage.server.launch import json_object

    cfg = deploy_config(tiny_dir, None, None, "cpu", json_object('{"async_chunk": false}', "--deploy-overrides"))
    assert cfg.async_chunk is False and deploy_config(tiny_dir, None, None, "cpu").async_chunk is True
    for bad, why in (("{async_chunk}", "not JSON"), ("[1]", "expected a JSON object")):
        with pytest.raises(LaunchError, match=f"--deploy-overrides: {why}"):
            json_object(bad, "--deploy-overrides")


def test_start_up_log_says_when_the_tiny_checkpoint_is_written(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path))
    caplog.set_level("INFO", "omnistage.serve")
    first, again = resolve_model(None).path, resolve_model(None).path
    assert first == again and first.is_relative_to(tmp_path)
    said = [r.getMessage() for r in caplog.records if r.name == "omnistage.serve"]
    assert said[0].endswith("written now (first start only); OMNISTAGE_CACHE_DIR moves the cache")
    assert "written at an earlier start" in said[1] and str(first) in said[1]


def test_bench_without_its_extra_names_the_extra(monkeypatch, capsys):
    import importlib.util

    from omnistage.cli import main

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "httpx" else find(m, *a))
    with pytest.raises(SystemExit, match=r"omnistage bench needs httpx: pip install 'omnistage\[bench\]'"):
        main(["bench", "--base-url", "http://127.0.0.1:1"])


def test_generate_help_has_defaults_and_warns_of_random_weights(capsys, monkeypatch):
    from omnistage import cli

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "codec frames at most, 12.5 per second (default: 200)" in out and "speaker_id; default: Ethan)" in out
    monkeypatch.setattr("omnistage.entrypoints.omni.Omni", lambda *a, **k: (_ for _ in ()).throw(RuntimeError))
    with pytest.raises(RuntimeError):
        cli.main(["generate", "--prompt", "hi"])
    assert "omnistage generate: the weights are RANDOM" in capsys.readouterr().err


GENERATION = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 99,
              "thinker_top_k": 30, "talker_temperature": 0.5, "talker_max_new_tokens": 300}


def test_generation_config_defaults_applied_and_overridden(tmp_path):
    from omnistage.generation_config import (
        describe_defaults,
        read_generation_config,
        with_generation_defaults,
    )
    from omnistage.server.protocol import (
        ChatCompletionRequest,
        talker_sampling_params,
        thinker_sampling_params,
    )

    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION))
    deploy = build_deploy_config({"stages": {"thinker": {"sampling": {"temperature": 0.2}}}}, "cpu")
    generation = read_generation_config(tmp_path)
    merged = with_generation_defaults(deploy, generation)
    # the deploy config's key > generation_config.json (thinker_ keys over plain ones) > built-in
    assert merged.stages.thinker.sampling == {"temperature": 0.2, "top_p": 0.8, "top_k": 30,
                                              "repetition_penalty": 1.1, "max_tokens": 99}
    assert merged.stages.talker.sampling == {"temperature": 0.5, "max_frames": 300}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], top_p=0.5, max_tokens=7)
    sp = thinker_sampling_params(req, merged.stages.thinker.sampling)  # the request's fields > all
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (
        0.2, 0.5, 30, 1.1, 7)
    tp = talker_sampling_params(req, merged.stages.talker.sampling)
    assert (tp.temperature, tp.top_k, tp.top_p, tp.max_frames) == (0.5, 50, 1.0, 300)
    assert describe_defaults(deploy, generation)[1] == (
        "talker sampling defaults (request fields override): temperature=0.5 top_k=50 top_p=1.0 "
        "repetition_penalty=1.05 max_frames=300 ignore_eos=False (temperature from generation_config.json, "
        "max_frames from generation_config.json)")
    assert with_generation_defaults(deploy, read_generation_config(tmp_path, "vllm")) == deploy
    greedy = with_generation_defaults(deploy, {"do_sample": False, "talker_do_sample": False, "top_p": None})
    assert greedy.stages.thinker.sampling["temperature"] == 0.2 and greedy.stages.talker.sampling == {
        "temperature": 0.0}


def test_generation_config_flag(tiny_dir, tmp_path, caplog):
    from omnistage.server.launch import generation_defaults

    args = add_serve_args(argparse.ArgumentParser()).parse_args([])
    assert args.generation_config == "auto"
    shipped = deploy_config(tiny_dir, None, None, "cpu")
    with caplog.at_level("INFO", "omnistage.serve"):
        merged = generation_defaults(shipped, tiny_dir, "auto")  # the real file: talker keys only
    assert merged.stages.thinker.sampling == shipped.stages.thinker.sampling
    assert merged.stages.talker.sampling == {**shipped.stages.talker.sampling, "top_p": 1.0}
    thinker = "thinker sampling defaults (request fields override): temperature=0.4 top_p=0.9 top_k=1"
    assert thinker in caplog.text
    assert "top_p from generation_config.json" in caplog.text
    missing = f"--generation-config: {tmp_path}/generation_config.json not found"
    with pytest.raises(LaunchError, match=missing):
        generation_defaults(shipped, tiny_dir, str(tmp_path))
    (tmp_path / "generation_config.json").write_text('{"top_p": 2}')
    bad = "generation_config.json with stages.thinker.sampling: top_p must be"
    with pytest.raises(LaunchError, match=bad):
        generation_defaults(build_deploy_config({}, "cpu"), tiny_dir, str(tmp_path))


def test_data_parallel_size_flag(tiny_dir) -> None:
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["--data-parallel-size", "2", "--placement",
                                                                 "process"])
    cfg = deploy_config(tiny_dir, None, None, "cpu", deploy_overrides(args))
    assert (cfg.data_parallel_size, cfg.placement, cfg.stage("thinker").replicas) == (2, "process", 2)
    assert deploy_config(tiny_dir, None, None, "cpu").data_parallel_size == 1
