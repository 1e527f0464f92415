"""`--generation-config`: with `auto` a request that leaves temperature unset samples as the
model's generation_config.json says (here: greedy); with `vllm` it gets the built-in 1.0."""

from __future__ import annotations

import json
import logging
import os
import shutil
import urllib.request

import pytest

from tiny_server import serve

BODY = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 24, "ignore_eos": True, "seed": 7}


@pytest.fixture(scope="module")
def greedy_model(target_dir, tmp_path_factory) -> str:
    """The shared tiny target, whose generation_config.json recommends temperature 0."""
    path = str(tmp_path_factory.mktemp("greedy_target") / "model")
    shutil.copytree(target_dir, path)
    config_path = os.path.join(path, "generation_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "temperature": 0.0}, f)
    return path


def text(url: str, **overrides) -> str:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**BODY, **overrides}).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())["choices"][0]["text"]


def test_unset_temperature_takes_the_models_default(greedy_model, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.server.api_server"), serve(greedy_model) as served:
        assert "sampling defaults: the model's temperature=0.0" in caplog.text      # said at start-up
        greedy = text(served.url, temperature=0)
        assert text(served.url) == greedy
        assert text(served.url, temperature=1.0) != greedy          # an explicit value still wins


def test_vllm_mode_ignores_the_models_default(greedy_model, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.server.api_server"), \
            serve(greedy_model, generation_config="vllm") as served:
        assert "sampling defaults: built-in" in caplog.text
        greedy = text(served.url, temperature=0)
        assert text(served.url) != greedy
        assert text(served.url) == text(served.url, temperature=1.0)
