"""`dspark bench --mode serve`: a streaming load generator for any OpenAI-compatible endpoint.

Each concurrency level runs that many closed-loop clients, each sending `--repetitions` streaming
completions with a fixed prompt length and a fixed output length (ignore_eos), and measures per
request the time to the first token, the time per output token after it, and the total latency.
Prompts are built token-exactly through /tokenize when the server is dspark, and approximated
with one common word per token otherwise.  dspark servers also report speculative counters per
request (the `dspark` field), from which the acceptance columns are computed ("-" elsewhere).

Only the standard library talks HTTP (urllib in threads), so the benchmark runs wherever
dspark does.  The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dspark.bench.prompts import bench_prompts

logger = logging.getLogger(__name__)

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea").split()


@dataclass
class Endpoint:
    base_url: str                      # ends with /v1
    api_key: str
    model: str
    ours: bool                         # a dspark server: /tokenize and `dspark` stats available
    max_model_len: int | None


@dataclass
class RequestResult:
    latency: float
    ttft: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    spec: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    seconds: float
    results: list[RequestResult] = field(default_factory=list)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.error is None]


# ---- HTTP (stdlib) ------------------------------------------------------------------------------

def _request(url: str, api_key: str, body: dict | None = None) -> urllib.request.Request:
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")


def _get_json(url: str, api_key: str, body: dict | None = None, timeout: float = 30) -> Any:
    with urllib.request.urlopen(_request(url, api_key, body), timeout=timeout) as resp:
        return json.loads(resp.read())


def probe(base_url: str, api_key: str, model: str | None) -> Endpoint:
    """Which model to ask for, and whether the server is ours (then prompts can be token-exact)."""
    base_url = base_url.rstrip("/")
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    try:
        cards = _get_json(f"{base_url}/models", api_key).get("data", [])
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ValueError(f"cannot list the models of {base_url}: {exc}") from exc
    if model is None:
        if not cards:
            raise ValueError(f"{base_url}/models lists no model; pass --model")
        model = cards[0]["id"]
    card = next((c for c in cards if c.get("id") == model), {})
    ours = card.get("owned_by") == "dspark"
    return Endpoint(base_url, api_key, model, ours, card.get("max_model_len"))


def stream_completion(endpoint: Endpoint, prompt: str | list[int], max_tokens: int, ignore_eos: bool,
                      timeout: float) -> RequestResult:
    body: dict[str, Any] = {"model": endpoint.model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    first = last = None
    text_chunks, usage, spec = 0, None, None
    try:
        with urllib.request.urlopen(_request(f"{endpoint.base_url}/completions", endpoint.api_key, body),
                                    timeout=timeout) as resp:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "error event"))
                if any(c.get("text") for c in chunk.get("choices") or []):
                    last = time.perf_counter()
                    first = first or last
                    text_chunks += 1
                usage = chunk.get("usage") or usage
                spec = chunk.get("dspark") or spec
    except (urllib.error.URLError, OSError, RuntimeError, ValueError) as exc:
        detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
        return RequestResult(time.perf_counter() - start, error=f"{exc} {detail}".strip())
    tokens = usage["completion_tokens"] if usage else text_chunks
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return RequestResult(time.perf_counter() - start, None if first is None else first - start, tpot,
                         tokens, spec)


# ---- prompts ------------------------------------------------------------------------------------

def build_prompts(endpoint: Endpoint, count: int, num_tokens: int) -> list[str | list[int]]:
    """Distinct prompts of `num_tokens` tokens (exact on dspark, approximate elsewhere)."""
    if endpoint.ours:
        text = "\n".join(bench_prompts(16))
        ids = _get_json(endpoint.base_url.removesuffix("/v1") + "/tokenize", endpoint.api_key,
                        {"model": endpoint.model, "prompt": text})["tokens"]
        ring = ids * (num_tokens // len(ids) + 2)
        return [ring[(i * 13) % len(ids):][:num_tokens] for i in range(count)]
    return [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(num_tokens)) for i in range(count)]


# ---- running ------------------------------------------------------------------------------------

def run_level(endpoint: Endpoint, prompts: list, concurrency: int, per_client: int, output_tokens: int,
              ignore_eos: bool, timeout: float) -> LevelResult:
    def client(index: int) -> list[RequestResult]:
        return [stream_completion(endpoint, prompts[(index * per_client + k) % len(prompts)],
                                  output_tokens, ignore_eos, timeout) for k in range(per_client)]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        batches = list(pool.map(client, range(concurrency)))
    level = LevelResult(concurrency, time.perf_counter() - start, [r for b in batches for r in b])
    for result in level.results:
        if result.error:
            logger.warning("request failed at concurrency %d: %s", concurrency, result.error)
    return level


def summarize(level: LevelResult, ours: bool) -> dict[str, Any]:
    ok = level.ok
    summary: dict[str, Any] = {"concurrency": level.concurrency, "requests": len(level.results),
                               "errors": len(level.results) - len(ok), "seconds": round(level.seconds, 3)}
    summary["output_tokens_per_s"] = round(sum(r.output_tokens for r in ok) / level.seconds, 2)
    for name, values in (("ttft_ms", [r.ttft * 1e3 for r in ok if r.ttft is not None]),
                         ("tpot_ms", [r.tpot * 1e3 for r in ok if r.tpot is not None]),
                         ("latency_s", [r.latency for r in ok])):
        summary[name] = round(statistics.mean(values), 3) if values else None
    specs = [r.spec for r in ok if r.spec is not None]
    if ours and specs:
        rounds = sum(s["draft_rounds"] for s in specs)
        accepted = sum(s["accepted_tokens"] for s in specs)
        summary.update(
            accepted_per_request=round(accepted / len(specs), 3),
            drafted_per_request=round(sum(s["drafted_tokens"] for s in specs) / len(specs), 3),
            rounds_per_request=round(rounds / len(specs), 3),
            accepted_per_round=round(accepted / rounds, 3) if rounds else None,
            acceptance_rate=round(statistics.mean(s["acceptance_rate"] for s in specs), 4))
    return summary


COLUMNS = [("concurrency", "conc"), ("requests", "reqs"), ("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"),
           ("latency_s", "latency s"), ("accepted_per_request", "accepted/req"),
           ("drafted_per_request", "drafted/req"), ("rounds_per_request", "rounds/req"),
           ("accepted_per_round", "accepted/round"), ("acceptance_rate", "acceptance"),
           ("output_tokens_per_s", "out tok/s")]


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = [" | ".join(title for _, title in COLUMNS), " | ".join("---" for _ in COLUMNS)]
    lines += [" | ".join(cell(row.get(key)) for key, _ in COLUMNS) for row in rows]
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------------

def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    from dspark.server.launch import ENGINE_ARGS, add_missing_argument
    for flag, kwargs in ENGINE_ARGS:            # used with --launch; --model also names the model
        add_missing_argument(parser, flag, **kwargs)
    add_missing_argument(parser, "--base-url", default="http://127.0.0.1:8000/v1",
                         help="OpenAI-compatible endpoint (ignored with --launch)")
    add_missing_argument(parser, "--launch", action="store_true",
                         help="start a dspark server in-process on a free loopback port first")
    add_missing_argument(parser, "--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    add_missing_argument(parser, "--concurrency", default="1,2,4,8",
                         help="comma-separated numbers of concurrent clients")
    add_missing_argument(parser, "--input-tokens", type=int, default=128)
    add_missing_argument(parser, "--output-tokens", type=int, default=128)
    add_missing_argument(parser, "--warmup", type=int, default=2, help="requests before measuring")
    add_missing_argument(parser, "--repetitions", type=int, default=3,
                         help="requests each client sends per concurrency level")
    add_missing_argument(parser, "--no-ignore-eos", action="store_true",
                         help="do not send ignore_eos (for servers that reject it)")
    add_missing_argument(parser, "--request-timeout", type=float, default=600.0)


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list positive integers, got {args.concurrency!r}")
    server = _launch(args) if args.launch else None
    try:
        base_url = server.base_url if server else args.base_url
        endpoint = probe(base_url, args.api_key, None if server else args.model)
        limit = endpoint.max_model_len
        if limit is not None and args.input_tokens + args.output_tokens > limit:
            raise ValueError(f"--input-tokens + --output-tokens = {args.input_tokens + args.output_tokens} "
                             f"exceeds the model's context ({limit})")
        prompts = build_prompts(endpoint, max(levels) * args.repetitions + args.warmup, args.input_tokens)
        ignore_eos = not args.no_ignore_eos
        for prompt in prompts[-args.warmup:] if args.warmup else []:
            stream_completion(endpoint, prompt, min(8, args.output_tokens), ignore_eos, args.request_timeout)
        rows = [summarize(run_level(endpoint, prompts, c, args.repetitions, args.output_tokens, ignore_eos,
                                    args.request_timeout), endpoint.ours) for c in levels]
    finally:
        if server is not None:
            server.stop()
    print(f"{endpoint.base_url} model={endpoint.model} input={args.input_tokens} "
          f"output={args.output_tokens} tokens, {args.repetitions} requests per client")
    print(format_table(rows))
    report = {"bench": "serve", "base_url": endpoint.base_url, "model": endpoint.model,
              "dspark_server": endpoint.ours, "input_tokens": args.input_tokens,
              "output_tokens": args.output_tokens, "repetitions": args.repetitions, "levels": rows}
    print(json.dumps(report))
    return report


def _launch(args: argparse.Namespace):
    from dspark.server.api_server import build_app
    from dspark.server.launch import ServerThread, engine_config_from_args
    max_clients = max(int(c) for c in str(args.concurrency).split(",") if c.strip())
    app = build_app(engine_config_from_args(args), max_queue=max(256, max_clients))
    return ServerThread(app).start()


__all__ = ["add_serve_bench_args", "run_serve_bench"]
