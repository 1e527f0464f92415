"""The policy A/B harness on a tiny pair: both mechanisms switched on one engine, restored
after, and reported per level."""

import json
import types

import pytest

from dspark.bench.policy_ab import run_policy_bench
from tiny import save_random_drafter, save_tiny


def args_for(tmp_path, ablate):
    save_tiny(str(tmp_path / "t"), "llama", tied=True, vocab=32, num_hidden_layers=4, seed=3)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=3, copy_prev=6.0, seed=1)
    return types.SimpleNamespace(
        model=str(tmp_path / "t"), drafter=str(tmp_path / "d"), dtype="float32", threads=None,
        sweep_concurrency="1,3", sweep_requests=3, repetitions=1, input_tokens=6, output_tokens=5,
        data=None, cost_table=None, min_gain=0.05, max_kept_plans=16, graph="eager", device="cpu",
        ablate=ablate, temperatures="0,0.7", output_spread=0.0, prompt_source=lambda data, tok, n: {"chat": [[3, 4, 5]], "code": [[7, 8, 9, 10]]})


@pytest.mark.parametrize("ablate", ["kept-plans", "draft-overhead", "trial-cap"])
def test_each_mechanism_is_compared_on_and_off_at_every_level(tmp_path, capsys, ablate):
    report = run_policy_bench(args_for(tmp_path, ablate))
    assert report["mechanism"] == ablate
    assert [(r["concurrency"], r["temperature"]) for r in report["levels"]] == [(1, 0), (1, 0.7), (3, 0), (3, 0.7)]
    for row in report["levels"]:
        assert set(row["tokens_per_s"]) == {"plain", "on", "off"} and min(row["tokens_per_s"].values()) > 0
        assert row["on_over_off"] == pytest.approx(row["tokens_per_s"]["on"] / row["tokens_per_s"]["off"], rel=0.01)
        assert all(0.0 <= share <= 1.0 for share in row["drafted_share"].values())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report


def test_a_mechanism_is_needed(tmp_path):
    with pytest.raises(SystemExit, match="--ablate"):
        run_policy_bench(args_for(tmp_path, None))
