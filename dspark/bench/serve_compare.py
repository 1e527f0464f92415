"""`dspark bench --mode serve --compare-no-drafter`: one engine served with its drafter and without.

Both servers start from the same engine arguments, each in a process of its own as a user's
would: "default" as given, "plain" with --no-drafter. The first half of the rounds runs with the
default server started first, the second half with both restarted, plain first: on a small CPU
the server started first ran a few percent slower for as long as it lived, whichever it was
(docs/measurements.md). At each concurrency level the two take turns round by round, in the
order default, plain, plain, default, ..., so that drift in the machine's speed (clocks, other
load, a neighbour's jobs) and whatever a round inherits from the one before it fall on both
alike. Every round sends the same requests, so rounds differ only by noise; each system's
throughput at a level is the median over its rounds, and default/plain is the ratio of those
medians. Only one server is busy at a time: the idle engine sleeps until its next request.
With chat prompts (the default here) the requests go through /v1/chat/completions, as a chat
client's would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from dspark.bench.serve import (Endpoint, LevelResult, Workload, format_table, launch, make_workload, probe,
                                run_level, summarize, warm_up)
from dspark.bench.server_process import ServerProcess

SYSTEMS = ("default", "plain")
SPEC_KEYS = ("acceptance_rate", "accepted_per_round", "drafted_per_request", "rounds_per_request")
COLUMNS = [("concurrency", "concurrency"), ("plain_tokens_per_s", "plain tok/s"),
           ("default_tokens_per_s", "default tok/s"), ("default_over_plain", "default/plain"),
           ("default_tau", "default τ")]


@dataclass
class LevelRounds:
    """The rounds one concurrency level ran, per system, in the order they ran."""
    concurrency: int
    rounds: dict[str, list[LevelResult]] = field(default_factory=lambda: {name: [] for name in SYSTEMS})

    def median_tokens_per_s(self, system: str) -> float:
        return round(statistics.median(r.output_tokens_per_s for r in self.rounds[system]), 2)

    def row(self) -> dict[str, Any]:
        plain, default = self.median_tokens_per_s("plain"), self.median_tokens_per_s("default")
        spec = summarize(self._merged("default"), ours=True)
        per_round = spec.get("accepted_per_round")
        row: dict[str, Any] = {
            "concurrency": self.concurrency, "plain_tokens_per_s": plain, "default_tokens_per_s": default,
            "default_over_plain": round(default / plain, 4) if plain else None,
            "default_tau": None if per_round is None else round(1 + per_round, 3)}
        row.update({f"default_{key}": spec.get(key) for key in SPEC_KEYS})
        for system in SYSTEMS:
            merged = self._merged(system)
            row[system] = {"rounds_tokens_per_s": [round(r.output_tokens_per_s, 2) for r in self.rounds[system]],
                           "requests": len(merged.results), "errors": len(merged.results) - len(merged.ok),
                           "output_tokens": sum(r.output_tokens for r in merged.ok),
                           "draft_rounds": sum(r.spec["draft_rounds"] for r in merged.ok if r.spec)}
        return row

    def _merged(self, system: str) -> LevelResult:
        runs = self.rounds[system]
        return LevelResult(self.concurrency, sum(r.seconds for r in runs), [x for r in runs for x in r.results])


def run_compare_bench(args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    _check(args)
    chat = args.chat is not False
    rounds = {c: LevelRounds(c) for c in levels}
    first_half = -(-args.repetitions // 2)
    endpoint = workload = None
    for launch_order, repetitions in ((SYSTEMS, range(first_half)),
                                      (SYSTEMS[::-1], range(first_half, args.repetitions))):
        if not repetitions:
            continue
        servers: dict[str, ServerProcess] = {}
        try:
            for system in launch_order:
                servers[system] = _start(args, system)
            endpoints = {system: probe(s.base_url, args.api_key, None) for system, s in servers.items()}
            endpoint = endpoints["default"]
            if workload is None:
                count = max(max(levels), args.requests_per_round) * 2 + args.warmup
                workload = make_workload(args, endpoint, count, chat)
            for system in launch_order:
                print(f"warming up the {system} server ({args.warmup} requests)", flush=True)
                warm_up(endpoints[system], workload, args.warmup)
            for c in levels:
                _run_rounds(endpoints, workload, rounds[c], repetitions, args)
        finally:
            for server in servers.values():
                server.stop()
    return _report(args, endpoint, workload, [rounds[c].row() for c in levels])


def _check(args: argparse.Namespace) -> None:
    if args.no_drafter:
        raise ValueError("--compare-no-drafter serves the drafter against --no-drafter itself: "
                         "leave out --no-drafter")
    if args.repetitions < 1 or args.requests_per_round < 1:
        raise ValueError(f"--repetitions ({args.repetitions}) and --requests-per-round "
                         f"({args.requests_per_round}) must be at least 1")


def _start(args: argparse.Namespace, system: str) -> ServerProcess:
    model = args.model or "the embedded model"
    drafter = "--no-drafter" if system == "plain" else f"drafter {args.drafter}"
    print(f"launching the {system} server: {model}, {drafter}, device {args.device} "
          f"(loading, and measuring what is not cached yet)", flush=True)
    start = time.perf_counter()
    server = launch(args, no_drafter=system == "plain")
    print(f"{system} server ready at {server.base_url} after {time.perf_counter() - start:.1f} s", flush=True)
    return server


def _run_rounds(endpoints: dict[str, Endpoint], workload: Workload, level: LevelRounds,
                repetitions: range, args: argparse.Namespace) -> None:
    concurrency = level.concurrency
    per_client = -(-max(concurrency, args.requests_per_round) // concurrency)
    for index in repetitions:
        for system in SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]:
            result = run_level(endpoints[system], workload, concurrency, per_client)
            level.rounds[system].append(result)
            print(f"concurrency {concurrency}, round {index + 1}/{args.repetitions}, {system}: "
                  f"{result.output_tokens_per_s:.2f} tok/s ({len(result.ok)}/{len(result.results)} "
                  f"requests ok, {result.seconds:.1f} s)", flush=True)


def _report(args: argparse.Namespace, endpoint: Endpoint, workload: Workload,
            rows: list[dict[str, Any]]) -> dict[str, Any]:
    prompts = f"{len(workload.prompts)} chat prompts" if workload.chat else f"input={args.input_tokens} tokens"
    print(f"model={endpoint.model} default (drafter {args.drafter}) vs plain (--no-drafter), {prompts}, "
          f"output={args.output_tokens} tokens; medians over {args.repetitions} alternating rounds of "
          f">= {args.requests_per_round} requests")
    print(format_table(rows, COLUMNS))
    report = {"bench": "serve_compare", "model": endpoint.model, "drafter": args.drafter,
              "device": args.device, "chat": workload.chat,
              "input_tokens": None if workload.chat else args.input_tokens,
              "output_tokens": args.output_tokens, "repetitions": args.repetitions,
              "requests_per_round": args.requests_per_round, "levels": rows}
    print(json.dumps(report))
    return report


__all__ = ["run_compare_bench"]
