from __future__ import annotations

import argparse

import pytest

from omnistage.server.launch import TINY_MODEL_NAME, LaunchError, add_serve_args, deploy_config, resolve_model


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
