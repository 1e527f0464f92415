"""The model's recommended sampling: read from generation_config.json or GGUF metadata, filtered
as vLLM filters it, validated, and offered offline by `LLM.get_default_sampling_params()`."""

from __future__ import annotations

import json
import os

import pytest

from dspark import LLM, SamplingParams
from dspark.config import EngineConfig
from dspark.generation_config import describe, read_gguf_sampling, sampling_defaults
from tiny import save_tiny


def folder(tmp_path, **generation) -> str:
    path = str(tmp_path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, **generation}, f)
    return path


def test_folder_values_that_differ_from_transformers_defaults(tmp_path):
    path = folder(tmp_path, temperature=0.6, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                  do_sample=True)
    got = sampling_defaults(path)
    assert got == {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05,        # top_k 50 is transformers'
                   "repetition_penalty": 1.1}
    assert sampling_defaults(path, "vllm") == {}


def test_no_file_or_no_sampling_fields_means_builtin(tmp_path):
    assert sampling_defaults(str(tmp_path)) == {}
    restated = tmp_path / "restated"
    restated.mkdir()
    assert sampling_defaults(folder(restated, temperature=1.0, top_p=1.0)) == {}


@pytest.mark.parametrize("bad, match", [({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "non-numeric"),
                                        ({"top_k": 2.5}, "fractional"), ({"temperature": -1}, "temperature")])
def test_unusable_values_are_errors_naming_the_source(tmp_path, bad, match):
    path = folder(tmp_path, **bad)
    with pytest.raises(ValueError, match=match) as info:
        sampling_defaults(path)
    assert str(tmp_path) in str(info.value)


def test_broken_file_is_an_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("{temperature")
    with pytest.raises(ValueError, match="not valid JSON"):
        sampling_defaults(str(tmp_path))


def test_gguf_general_sampling_metadata(tmp_path):
    import gguf
    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.penalty_repeat", 1.2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_sampling(path) == pytest.approx({"temperature": 0.25, "top_k": 20, "repetition_penalty": 1.2})
    got = sampling_defaults(path)
    assert got == pytest.approx({"temperature": 0.25, "top_k": 20, "repetition_penalty": 1.2})
    assert isinstance(got["top_k"], int)


@pytest.mark.slow
def test_the_embedded_model_recommends_nothing():
    """SmolLM2's GGUF carries no general.sampling.* keys: the built-in defaults apply."""
    assert sampling_defaults(None) == {}


def test_describe_names_the_source():
    assert "built-in" in describe({}, "auto") and "recommends none" in describe({}, "auto")
    assert "--generation-config vllm" in describe({}, "vllm")
    line = describe({"temperature": 0.6}, "auto")
    assert "the model's temperature=0.6" in line and "top_p=1.0" in line


def test_engine_config_checks_the_mode():
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="model")


def test_llm_default_sampling_params(tmp_path):
    save_tiny(str(tmp_path), "llama")
    folder(tmp_path, temperature=0.0, top_p=0.8)
    kwargs = dict(drafter=None, dtype="float32", graph="eager", max_model_len=64, kv_cache_bytes=1 << 20)
    llm = LLM(str(tmp_path), **kwargs)
    params = llm.get_default_sampling_params()
    assert params.greedy and params.top_p == 0.8
    assert SamplingParams().temperature == 1.0                  # the offline default is untouched
    neutral = LLM(str(tmp_path), generation_config="vllm", **kwargs).get_default_sampling_params()
    assert neutral == SamplingParams()
