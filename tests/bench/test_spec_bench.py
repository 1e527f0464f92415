"""The spec benchmark's runs: plain and DSpark alternate prompt by prompt."""

from types import SimpleNamespace

from dspark.bench.spec import _run


class _Engine:
    def __init__(self, name: str, calls: list, length: int):
        self.name, self.calls, self.length = name, calls, length

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((self.name, prompts[0][0]))
        return [SimpleNamespace(token_ids=list(range(self.length)))]


def test_each_prompt_runs_on_both_engines_before_the_next():
    calls = []
    runs = _run({"plain": _Engine("plain", calls, 3), "dspark": _Engine("dspark", calls, 5)},
                [[10], [20], [30]], params=None)
    assert calls == [("plain", 10), ("dspark", 10), ("plain", 20), ("dspark", 20), ("plain", 30), ("dspark", 30)]
    assert runs["plain"][0] == 9 and runs["dspark"][0] == 15
    assert runs["dspark"][2] == [[0, 1, 2, 3, 4]] * 3 and runs["plain"][1] > 0


def spec_args(tmp_path, *flags):
    import argparse

    from dspark.bench import add_bench_args
    from tiny import save_random_drafter, save_tiny
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=3)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)
    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["--mode", "spec", "--model", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
                         "--dtype", "float32", "--graph", "eager", "--num-prompts", "2",
                         "--batch1-tokens", "12", "--repetitions", "2", *flags])
    args.prompt_source = lambda data, tok, n: {"chat": [[3, 4, 5], [6, 7]], "code": [[7, 8, 9, 10]]}
    return args


def test_spec_bench_over_temperatures(tmp_path, capsys):
    import json

    from dspark.bench.spec import run_spec_bench
    run_spec_bench(spec_args(tmp_path, "--temperatures", "0,0.7"))
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report) >= {"chat@0", "code@0", "chat@0.7", "code@0.7"}
    assert all(report[k]["identical_output"] is True for k in ("chat@0", "code@0", "chat@0.7", "code@0.7"))
    assert all(report[k]["tau"] >= 1.0 and report[k]["speedup"] > 0 for k in ("chat@0", "chat@0.7"))
    for kind in ("chat", "code"):          # a round's time, and against the greedy round of its kind
        assert report[f"{kind}@0"]["round_vs_greedy"] == 1.0
        sampled, greedy = report[f"{kind}@0.7"], report[f"{kind}@0"]
        assert sampled["ms_per_round"] > 0
        assert abs(sampled["round_vs_greedy"] - sampled["ms_per_round"] / greedy["ms_per_round"]) < 0.01


def test_the_engine_flags_reach_both_engines(tmp_path, monkeypatch):
    """`--spec-schedule verify-all` (any engine flag) builds the DSpark engine; the plain one is
    the same engine without its drafter."""
    from dspark.bench.engines import plain_and_spec
    plain, spec = plain_and_spec(spec_args(tmp_path, "--spec-schedule", "verify-all", "--max-num-seqs", "3"))
    assert spec.engine.policy is None and spec.engine.drafter is not None
    assert plain.engine.drafter is None
    assert spec.engine.config.scheduler.max_num_seqs == plain.engine.config.scheduler.max_num_seqs == 3
    _, spec = plain_and_spec(spec_args(tmp_path))
    assert spec.engine.policy is not None                      # the default: the adaptive policy


def test_a_mode_refuses_the_engine_flags_it_does_not_pass_on():
    import argparse

    import pytest

    from dspark.bench import add_bench_args
    from dspark.bench.engines import refuse_ignored_engine_flags
    p = argparse.ArgumentParser()
    add_bench_args(p)
    refuse_ignored_engine_flags(p.parse_args(["--mode", "sweep", "--threads", "2", "--min-gain", "0.1"]))
    refuse_ignored_engine_flags(p.parse_args(["--mode", "spec", "--spec-schedule", "verify-all"]))
    with pytest.raises(SystemExit, match="--mode sweep does not pass --max-num-seqs, --spec-schedule"):
        refuse_ignored_engine_flags(p.parse_args(["--mode", "sweep", "--spec-schedule", "verify-all",
                                                  "--max-num-seqs", "3"]))
    with pytest.raises(SystemExit, match="--mode plain does not pass --no-drafter"):
        refuse_ignored_engine_flags(p.parse_args(["--mode", "plain", "--no-drafter"]))
    refuse_ignored_engine_flags(p.parse_args(["--mode", "dp", "--no-drafter", "--dp", "2"]))
