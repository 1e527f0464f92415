"""The runner: chosen once at start-up and logged with its reason, the models left plain modules,
and what it ran counted in one stats object that the engine's load (so /metrics and the bench
JSON) carries."""

import logging

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.models.drafter import Drafter
from dspark.models.llama import CausalLM
from tiny import save_random_drafter, save_tiny, speculating


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("runner")
    save_tiny(str(path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=1)
    save_random_drafter(str(path / "d"), str(path / "t"), gamma=3, copy_prev=6.0)
    return str(path / "t"), str(path / "d")


def make(target, drafter=None, **kw):
    return speculating(LLM(target, dtype="float32", drafter=drafter, block_size=4, max_model_len=64,
                           graph="eager", **kw))


def test_the_choice_is_logged_once_with_its_reason(pair, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.runner.setup"):
        make(pair[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark.runner.setup"]
    assert len(lines) == 1
    assert lines[0].startswith("runner: eager at ") and "no fused layer kernel (it runs bf16 weights)" in lines[0]


def test_models_stay_plain_modules(pair):
    llm = make(*pair)
    model, drafter = llm.engine.worker.model, llm.engine.drafter
    for obj, cls in ((model, CausalLM), (drafter, Drafter)):
        added = {k for k, v in vars(obj).items() if callable(v) and not isinstance(v, torch.nn.Module)}
        assert added == set(), added                      # nothing installed on the instances
    assert not hasattr(CausalLM, "fused_stack") and not hasattr(Drafter, "fused_blocks")


def test_what_ran_is_counted_in_the_engine_load(pair):
    llm = make(*pair)
    before = llm.engine.load().runner
    assert set(before) == {"target_graph_steps", "target_eager_steps", "target_fused_steps",
                           "capture_fallbacks", "draft_graph_steps", "draft_eager_steps",
                           "dummy_steps", "varlen_attention_calls",
                           "attention_fallbacks"}
    out = llm.generate([[3, 9, 4, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    after = llm.engine.load().runner
    rounds = llm.engine.spec_stats.draft_rounds
    assert rounds > 0 and len(out.token_ids) == 12
    assert after["draft_graph_steps"] - before["draft_graph_steps"] == rounds   # one per drafting step
    steps = after["target_graph_steps"] - before["target_graph_steps"]
    assert rounds <= steps <= 12                          # a prefill, then one per round or token
    assert after["target_fused_steps"] == after["dummy_steps"] == after["capture_fallbacks"] == 0


def test_steps_past_the_buckets_are_counted_as_eager(pair):
    llm = make(pair[0], max_graph_tokens=4)               # a 10-token prompt runs above 4
    llm.generate([list(range(1, 11))], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    counters = llm.engine.load().runner
    assert counters["target_eager_steps"] == 1 and counters["target_graph_steps"] >= 1
