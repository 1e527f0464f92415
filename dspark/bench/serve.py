"""`dspark bench --mode serve`: a streaming load generator for any OpenAI-compatible endpoint.

Each concurrency level runs that many closed-loop clients, each sending `--repetitions` streaming
completions with a fixed prompt length and a fixed output length (ignore_eos), and measures per
request the time to the first token, the time per output token after it, and the total latency.
Prompts are built token-exactly through /tokenize when the server is dspark, and approximated
with one common word per token otherwise; `--chat` sends the built-in chat prompts to
/v1/chat/completions instead, the traffic a chat model serves.  dspark servers also report
speculative counters per request (the `dspark` field), from which the acceptance columns are
computed ("-" elsewhere).  `--compare-no-drafter` hands over to serve_compare.py.

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

from dspark.bench.prompts import CHAT, bench_prompts
from dspark.bench.server_process import ServerProcess

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

    @property
    def output_tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.ok) / self.seconds


@dataclass
class Workload:
    """What every request of a run sends; clients cycle through the prompts."""
    prompts: list[str | list[int]]     # chat: user messages; else completion prompts
    chat: bool
    output_tokens: int
    ignore_eos: bool
    timeout: float


@dataclass
class _Streamed:
    first: float | None = None         # perf_counter of the first and last chunk with text
    last: float | None = None
    text_chunks: int = 0
    usage: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None


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
                      timeout: float, chat: bool = False) -> RequestResult:
    """One streamed request; `chat` sends `prompt` as the user's message to /chat/completions.
    The output is counted from the usage chunk (exact), else one token per chunk with text."""
    body: dict[str, Any] = {"model": endpoint.model, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    if ignore_eos:
        body["ignore_eos"] = True
    url = f"{endpoint.base_url}/{'chat/completions' if chat else 'completions'}"
    start, seen = time.perf_counter(), _Streamed()
    try:
        with urllib.request.urlopen(_request(url, endpoint.api_key, body), timeout=timeout) as resp:
            _read_events(resp, seen)
    except (urllib.error.URLError, OSError, RuntimeError, ValueError) as exc:
        detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
        return RequestResult(time.perf_counter() - start, error=f"{exc} {detail}".strip())
    tokens = seen.usage["completion_tokens"] if seen.usage else seen.text_chunks
    first, last = seen.first, seen.last
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return RequestResult(time.perf_counter() - start, None if first is None else first - start, tpot,
                         tokens, seen.spec)


def _read_events(resp: Any, seen: _Streamed) -> None:
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
        if any(_chunk_text(c) for c in chunk.get("choices") or []):
            seen.last = time.perf_counter()
            seen.first = seen.first or seen.last
            seen.text_chunks += 1
        seen.usage = chunk.get("usage") or seen.usage
        seen.spec = chunk.get("dspark") or seen.spec


def _chunk_text(choice: dict[str, Any]) -> str:
    """A completion chunk's text, or a chat chunk's content delta."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


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


def make_workload(args: argparse.Namespace, endpoint: Endpoint, count: int, chat: bool) -> Workload:
    """The built-in chat prompts, or `count` completion prompts of --input-tokens each."""
    needed = args.output_tokens if chat else args.input_tokens + args.output_tokens
    limit = endpoint.max_model_len
    if limit is not None and needed > limit:
        what = "--output-tokens" if chat else "--input-tokens + --output-tokens"
        raise ValueError(f"{what} = {needed} exceeds the model's context ({limit})")
    prompts = list(CHAT) if chat else build_prompts(endpoint, count, args.input_tokens)
    return Workload(prompts, chat, args.output_tokens, not args.no_ignore_eos, args.request_timeout)


# ---- running ------------------------------------------------------------------------------------

def send(endpoint: Endpoint, workload: Workload, index: int, max_tokens: int | None = None) -> RequestResult:
    prompt = workload.prompts[index % len(workload.prompts)]
    return stream_completion(endpoint, prompt, max_tokens or workload.output_tokens, workload.ignore_eos,
                             workload.timeout, workload.chat)


def warm_up(endpoint: Endpoint, workload: Workload, count: int) -> None:
    """Short requests first, so that first-use costs stay out of the measured levels; they take
    prompts from the end, which the levels reach last."""
    for index in range(count):
        send(endpoint, workload, -1 - index, min(8, workload.output_tokens))


def run_level(endpoint: Endpoint, workload: Workload, concurrency: int, per_client: int) -> LevelResult:
    def client(index: int) -> list[RequestResult]:
        return [send(endpoint, workload, index * per_client + k) for k in range(per_client)]

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
    summary["output_tokens_per_s"] = round(level.output_tokens_per_s, 2)
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


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]] = COLUMNS) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = [" | ".join(title for _, title in columns), " | ".join("---" for _ in columns)]
    lines += [" | ".join(cell(row.get(key)) for key, _ in columns) for row in rows]
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------------

def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """The serve benchmark on its own: the engine flags (used with --launch; --model also names
    the model), --repetitions and the client's flags."""
    from dspark.config_flags import add_engine_flags
    add_engine_flags(parser)
    parser.add_argument("--repetitions", type=int, default=3,
                        help="requests each client sends per concurrency level")
    add_serve_client_flags(parser)


def add_serve_client_flags(parser: argparse.ArgumentParser) -> None:
    """The flags only the serve benchmark reads (`dspark bench` gives --repetitions for all)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="OpenAI-compatible endpoint (ignored with --launch)")
    parser.add_argument("--launch", action="store_true",
                        help="start a dspark server (a process of its own) on a free loopback port first")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    parser.add_argument("--concurrency", default="1,2,4,8",
                        help="comma-separated numbers of concurrent clients")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2, help="requests before measuring")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send ignore_eos (for servers that reject it)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="send the built-in chat prompts to /v1/chat/completions instead of "
                             "--input-tokens prompts to /v1/completions (default: on with "
                             "--compare-no-drafter, off otherwise)")
    parser.add_argument("--compare-no-drafter", action="store_true",
                        help="launch two servers from the same engine arguments, one as given and one "
                             "with --no-drafter, and alternate their rounds at each level "
                             "(implies --launch; --repetitions: rounds per server and level)")
    parser.add_argument("--requests-per-round", type=int, default=32,
                        help="with --compare-no-drafter: requests per round at least (each of c "
                             "clients sends ceil(max(c, this) / c))")


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(c) for c in str(text).split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list positive integers, got {text!r}")
    return levels


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    levels = parse_levels(args.concurrency)
    if args.compare_no_drafter:
        from dspark.bench.serve_compare import run_compare_bench
        return run_compare_bench(args, levels)
    chat = bool(args.chat)
    server = launch(args) if args.launch else None
    try:
        endpoint = probe(server.base_url if server else args.base_url, args.api_key,
                         None if server else args.model)
        workload = make_workload(args, endpoint, max(levels) * args.repetitions + args.warmup, chat)
        warm_up(endpoint, workload, args.warmup)
        rows = [summarize(run_level(endpoint, workload, c, args.repetitions), endpoint.ours) for c in levels]
    finally:
        if server is not None:
            server.stop()
    prompts = "the built-in chat prompts" if chat else f"input={args.input_tokens}"
    print(f"{endpoint.base_url} model={endpoint.model} {prompts} output={args.output_tokens} tokens, "
          f"{args.repetitions} requests per client")
    print(format_table(rows))
    report = {"bench": "serve", "base_url": endpoint.base_url, "model": endpoint.model,
              "dspark_server": endpoint.ours, "chat": chat, "input_tokens": None if chat else args.input_tokens,
              "output_tokens": args.output_tokens, "repetitions": args.repetitions, "levels": rows}
    print(json.dumps(report))
    return report


def launch(args: argparse.Namespace, no_drafter: bool | None = None) -> ServerProcess:
    """A dspark server in a process of its own on a free loopback port, from the engine arguments
    in `args`; `no_drafter` overrides theirs, so one set of arguments yields both servers to compare."""
    if no_drafter is not None:
        args = argparse.Namespace(**{**vars(args), "no_drafter": no_drafter})
    return ServerProcess(args, max_queue=max(256, max(parse_levels(args.concurrency)))).start()


__all__ = ["add_serve_bench_args", "add_serve_client_flags", "launch", "run_serve_bench"]
