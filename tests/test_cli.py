"""The command line on the embedded model: generate and chat print what the offline API returns."""

import io

import pytest

from dspark import LLM, SamplingParams
from dspark.cli import main


@pytest.fixture(scope="module")
def llm():
    return LLM(drafter=None, graph="eager")


@pytest.mark.slow
def test_generate_prints_the_completion(llm, capsys):
    prompt = "def add(a, b):\n"
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    main(["generate", "--no-drafter", "--graph", "eager", "--prompt", prompt, "--max-tokens", "12"])
    out = capsys.readouterr()
    assert out.out == ref.text + "\n"
    assert f"[{len(ref.token_ids)} tokens, finish={ref.finish_reason}]" in out.err


@pytest.mark.slow
def test_chat_applies_the_template(llm, capsys, monkeypatch):
    ref = llm.chat([{"role": "user", "content": "Name a colour."}], SamplingParams(temperature=0, max_tokens=16))
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour.\n"))
    main(["chat", "--no-drafter", "--graph", "eager", "--max-tokens", "16"])
    assert capsys.readouterr().out == ref.text + "\n"


def test_serve_flags_reach_the_scheduler_config():
    import argparse
    from dspark.server.launch import add_serve_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert engine_config_from_args(parser.parse_args([])).spec.confidence_lag == 2
    args = parser.parse_args(["--confidence-lag", "1", "--min-gain", "0.2"])
    spec = engine_config_from_args(args).spec
    assert spec.confidence_lag == 1 and spec.min_gain == 0.2
