"""`dspark bench --mode serve --compare-no-drafter`: two launched servers, alternating rounds, chat."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from dspark.bench import add_bench_args
from dspark.bench import serve as bench
from dspark.bench.prompts import CHAT
from tiny_server import make_drafter, make_target, serve


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target = make_target(str(tmp_path_factory.mktemp("compare_target")))
    return target, make_drafter(str(tmp_path_factory.mktemp("compare_drafter")), target)


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Both servers, their engine loops and the clients share the cores; tiny models gain nothing
    from intra-op threads that wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)                      # the wiring `dspark bench` uses
    return parser.parse_args(["--mode", "serve", *argv])


@pytest.mark.slow                       # two server processes start
def test_compare_alternates_the_two_servers_over_chat(pair, capsys, monkeypatch):
    sent = []
    real_urlopen = bench.urllib.request.urlopen

    def recording_urlopen(request, *args, **kwargs):
        if getattr(request, "data", None) is not None:         # not the /health polls (a URL string)
            sent.append((request.full_url.rsplit("/v1/", 1)[-1], json.loads(request.data)))
        return real_urlopen(request, *args, **kwargs)
    monkeypatch.setattr(bench.urllib.request, "urlopen", recording_urlopen)
    target, drafter = pair
    args = parse(["--compare-no-drafter", "--model", target, "--drafter", drafter, "--dtype", "float32",
                  "--kv-cache-bytes", str(4 << 20), "--max-model-len", "128", "--graph", "eager",
                  "--concurrency", "1,2", "--repetitions", "2", "--requests-per-round", "2",
                  "--output-tokens", "10", "--warmup", "1"])
    report = bench.run_serve_bench(args)
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == report and "default/plain" in lines[-5]
    assert report["chat"] is True and [row["concurrency"] for row in report["levels"]] == [1, 2]
    for row in report["levels"]:
        assert row["plain_tokens_per_s"] > 0 and row["default_tokens_per_s"] > 0
        assert row["default_over_plain"] == pytest.approx(row["default_tokens_per_s"] / row["plain_tokens_per_s"],
                                                          abs=1e-4)
        assert row["default_rounds_per_request"] > 0 and row["default_tau"] >= 1
        assert row["default"]["draft_rounds"] > 0 and row["plain"]["draft_rounds"] == 0
        for system in ("default", "plain"):
            assert row[system]["requests"] == 2 * 2 and row[system]["errors"] == 0
            assert row[system]["output_tokens"] == 2 * 2 * 10      # ignore_eos: every request runs out
    measured = [body for path, body in sent if body["max_tokens"] == 10]
    assert {path for path, _ in sent} == {"chat/completions"}
    assert len(measured) == 2 * 2 * 2 * 2 and len(sent) == len(measured) + 4       # a warm-up per start
    assert all(body["ignore_eos"] and body["messages"][0]["content"] in CHAT for body in measured)
    rounds = [re.match(r"concurrency (\d), round (\d)/2, (\w+):", line) for line in lines]
    first, second = [("1", "default"), ("1", "plain")], [("2", "plain"), ("2", "default")]   # round, system
    assert [m.groups() for m in rounds if m] == [(c, *o) for half in (first, second) for c in "12" for o in half]
    launched = [m.group(1) for m in (re.match(r"launching the (\w+) server", line) for line in lines) if m]
    assert launched == ["default", "plain", "plain", "default"]


def test_chat_request_counts_tokens_from_usage(pair):
    target, _ = pair
    with serve(target) as served:
        endpoint = bench.probe(served.url, "none", None)
        result = bench.stream_completion(endpoint, CHAT[0], 7, True, 30, chat=True)
    assert result.error is None and result.output_tokens == 7 and result.ttft > 0
    assert result.spec["draft_rounds"] == 0


def test_compare_refuses_no_drafter_and_bad_levels():
    with pytest.raises(ValueError, match="leave out --no-drafter"):
        bench.run_serve_bench(parse(["--compare-no-drafter", "--no-drafter"]))
    with pytest.raises(ValueError, match="concurrency"):
        bench.run_serve_bench(parse(["--compare-no-drafter", "--concurrency", "1,x"]))
