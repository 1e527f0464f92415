"""`dspark bench --mode serve` against a launched dspark server and against a running one."""

from __future__ import annotations

import argparse
import json

import pytest

from dspark.bench import serve as bench
from tiny_server import serve


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_serve_bench_args(parser)
    return parser.parse_args(argv)


@pytest.mark.slow                       # a server process starts and measures
def test_launch_with_drafter(target_dir, drafter_dir, capsys):
    args = parse(["--launch", "--model", target_dir, "--drafter", drafter_dir, "--dtype", "float32",
                  "--kv-cache-bytes", str(4 << 20), "--max-model-len", "128", "--graph", "eager",
                  "--spec-schedule", "verify-all", "--concurrency", "1,3",
                  "--input-tokens", "10", "--output-tokens", "12", "--repetitions", "2", "--warmup", "1"])
    report = bench.run_serve_bench(args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == report
    assert "accepted/round" in lines[1] and len(lines) == 1 + 2 + 2 + 1
    assert report["dspark_server"] is True
    for level, c in zip(report["levels"], (1, 3)):
        assert level["concurrency"] == c and level["requests"] == 2 * c and level["errors"] == 0
        assert level["ttft_ms"] > 0 and level["tpot_ms"] > 0 and level["output_tokens_per_s"] > 0
        assert level["drafted_per_request"] > 0 and 0 <= level["acceptance_rate"] <= 1
        assert level["accepted_per_round"] is not None


def test_running_server_exact_prompt_lengths(target_dir, monkeypatch):
    monkeypatch.setattr(bench, "bench_prompts", lambda n: [" ".join(f"w{i}" for i in range(1, 12))])
    with serve(target_dir) as served:
        endpoint = bench.probe(served.url, "none", None)       # /v1 is appended
        assert endpoint.model == "tiny" and endpoint.ours and endpoint.max_model_len == 128
        prompts = bench.build_prompts(endpoint, 5, 17)
        assert len({tuple(p) for p in prompts}) == 5 and all(len(p) == 17 for p in prompts)
        result = bench.stream_completion(endpoint, prompts[0], 9, True, 30)
        assert result.error is None and result.output_tokens == 9 and result.spec["draft_rounds"] == 0
        too_long = bench.stream_completion(endpoint, [5] * 200, 9, True, 30)
        assert "400" in too_long.error and "context" in too_long.error


def test_other_servers_get_word_prompts_and_dashes():
    endpoint = bench.Endpoint("http://x/v1", "k", "m", ours=False, max_model_len=None)
    prompts = bench.build_prompts(endpoint, 3, 20)
    assert all(isinstance(p, str) and len(p.split()) == 20 for p in prompts) and len(set(prompts)) == 3
    level = bench.LevelResult(2, 1.0, [bench.RequestResult(0.5, 0.1, 0.02, 10),
                                       bench.RequestResult(0.7, 0.2, 0.03, 10)])
    row = bench.summarize(level, ours=False)
    assert row["output_tokens_per_s"] == 20 and row["ttft_ms"] == pytest.approx(150)
    table = bench.format_table([row])
    assert table.splitlines()[2].split(" | ")[5] == "-"


def test_bad_concurrency():
    with pytest.raises(ValueError, match="concurrency"):
        bench.run_serve_bench(parse(["--concurrency", "0"]))
