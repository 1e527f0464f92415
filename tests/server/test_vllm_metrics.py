"""The `vllm:*` series: vLLM's names, types and model_name label, with counts that match the
requests made and the `dspark_` series fed by the same hooks."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiny_server import serve

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
          "vllm:kv_cache_usage_perc"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds"]
COUNTERS = ["vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"]
SPEC_COUNTERS = ["vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos"]
GAMMA = 4


def scrape(url: str) -> dict:
    """{family name: family} of one /metrics scrape."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict, sample_name: str, **labels: str) -> float:
    family = families[sample_name.removesuffix("_total").removesuffix("_count")]
    return sum(s.value for s in family.samples
               if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()))


def complete(url: str, body: dict, path: str = "/v1/completions") -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


@pytest.fixture(scope="module", params=["plain", "dspark"])
def served(request, target_dir, drafter_dir):
    with serve(target_dir, drafter_dir if request.param == "dspark" else None) as served:
        yield served, request.param


def test_families_have_vllm_types_and_the_model_label(served):
    server, mode = served
    families = scrape(server.url)
    expected = {**{n: "gauge" for n in GAUGES}, **{n: "histogram" for n in HISTOGRAMS},
                **{n: "counter" for n in COUNTERS}}
    if mode == "dspark":
        expected.update({n: "counter" for n in SPEC_COUNTERS})
    for name, kind in expected.items():
        assert families[name].type == kind, name
        assert all(s.labels["model_name"] == "tiny" for s in families[name].samples), name
    assert (SPEC_COUNTERS[0] in families) == (mode == "dspark")      # only with a drafter, as vLLM
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    if mode == "dspark":
        positions = {s.labels["position"] for s in families[SPEC_COUNTERS[3]].samples}
        assert positions == {str(p) for p in range(GAMMA)}            # 0-based, as vLLM


def test_counts_match_the_requests(served):
    server, mode = served
    before = scrape(server.url)
    answers = [complete(server.url, {"prompt": "w1 w2 w3", "max_tokens": 9, "temperature": 0, "ignore_eos": True}),
               complete(server.url, {"prompt": ["w5 w6", "w9"], "max_tokens": 5, "ignore_eos": True}),
               complete(server.url, {"messages": [{"role": "user", "content": "w7"}], "max_tokens": 4,
                                     "ignore_eos": True}, "/v1/chat/completions")]
    server.wait_idle()
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = 4
    assert delta("vllm:generation_tokens_total") == sum(a["usage"]["completion_tokens"] for a in answers)
    assert delta("vllm:prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert delta("vllm:request_success_total", finished_reason="length") == requests
    for name in HISTOGRAMS:
        assert delta(f"{name}_count") == requests, name
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == value(after, "dspark_kv_cache_usage_ratio")
    if mode == "dspark":
        _spec_counts_match(after, before, answers)


def _spec_counts_match(after: dict, before: dict, answers: list[dict]) -> None:
    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    stats = [a["dspark"] for a in answers]
    assert delta("vllm:spec_decode_num_drafts_total") == sum(s["draft_rounds"] for s in stats) > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(s["verified_tokens"] for s in stats)
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == sum(s["accepted_tokens"] for s in stats)
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(GAMMA)]
    assert sum(per_pos) == accepted
    padded = [s["accepted_per_position"] + [0] * GAMMA for s in stats]      # [] when it never drafted
    assert per_pos == [sum(row[p] for row in padded) for p in range(GAMMA)]
    assert value(after, "vllm:spec_decode_num_drafts_total") == value(after, "dspark_spec_draft_rounds_total")
