"""Bad input raises a clear error naming the problem, and leaves a running engine unharmed."""

import json
import os

import pytest

from dspark import LLM, SamplingParams
from dspark.cli import main
from tiny import save_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny(str(path), "qwen3", tied=True)
    return str(path)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"), dtype="float32")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path), dtype="float32")


def test_unsupported_architecture(tmp_path, model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(tmp_path), dtype="float32")


def test_corrupt_safetensors(tmp_path, model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    good = open(os.path.join(model_dir, "model.safetensors"), "rb").read()
    (tmp_path / "model.safetensors").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*not a valid safetensors"):
        LLM(str(tmp_path), dtype="float32")


def test_missing_weights(tmp_path, model_dir):
    from safetensors.torch import load_file, save_file
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights.*layers.1.mlp.down_proj"):
        LLM(str(tmp_path), dtype="float32")


def test_unsupported_dtype(model_dir):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model_dir, dtype="int3")


def test_prompt_longer_than_context_leaves_engine_running(model_dir):
    llm = LLM(model_dir, dtype="float32", max_model_len=32, graph="eager")
    engine = llm.engine
    rid = engine.add_request([5] * 10, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="prompt has 40 tokens.*max_model_len=32"):
        engine.add_request([5] * 40, SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 100000], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    done = []
    while engine.has_unfinished:
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [rid] and len(done[0].token_ids) == 5


def test_generate_with_one_bad_prompt_leaves_none_of_its_prompts_queued(model_dir):
    """A batch whose third prompt is refused raises, and the two prompts added before it are
    aborted rather than left to decode, unseen, inside the next call."""
    llm = LLM(model_dir, dtype="float32", max_model_len=32, graph="eager")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt has 40 tokens"):
        llm.generate([[5] * 10, [6] * 10, [5] * 40], params)
    assert not llm.engine.has_unfinished
    outs = llm.generate([[7] * 10], params)
    assert len(outs) == 1 and len(outs[0].token_ids) == 5


def test_max_model_len_ends_generation(model_dir):
    llm = LLM(model_dir, dtype="float32", max_model_len=16, graph="eager")
    out = llm.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_cli_reports_errors_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--top-p", "0"])


def test_drafter_for_another_target_is_refused(tmp_path, model_dir):
    from tiny import save_random_drafter
    other = tmp_path / "other"
    save_tiny(str(other), "qwen3", tied=True, vocab=96, num_hidden_layers=3)
    save_random_drafter(str(tmp_path / "d"), str(other), gamma=2, layer_ids=(0, 1))
    with pytest.raises(ValueError, match="vocab"):
        LLM(model_dir, dtype="float32", drafter=str(tmp_path / "d"))
    with pytest.raises(FileNotFoundError, match="drafter path"):
        LLM(model_dir, dtype="float32", drafter=str(tmp_path / "missing"))
