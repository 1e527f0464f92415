"""Starting the server: `dspark serve` arguments, uvicorn in the foreground or a background thread."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import TYPE_CHECKING

from dspark.server.limits import ServerLimits

if TYPE_CHECKING:                       # keep `dspark --help` free of the server dependencies
    from fastapi import FastAPI

    from dspark.config import EngineConfig

logger = logging.getLogger(__name__)

# (flag, argparse keywords): the engine options every `dspark` command shares.  They are added
# only where the parser does not have them yet, so these helpers compose with the CLI's own.
ENGINE_ARGS: list[tuple[str, dict]] = [
    ("--model", dict(default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")),
    ("--dtype", dict(default="bfloat16", choices=["bfloat16", "float32", "float16"])),
    ("--device", dict(default="cpu", help="cpu, cuda or cuda:N")),
    ("--max-model-len", dict(type=int, default=None)),
    ("--max-num-seqs", dict(type=int, default=64)),
    ("--max-num-batched-tokens", dict(type=int, default=2048)),
    ("--kv-cache-bytes", dict(type=int, default=None, help="KV cache memory budget in bytes")),
    ("--threads", dict(type=int, default=None)),
    ("--drafter", dict(default="auto", help="DSpark drafter folder (speculators or DeepSpec format); "
                                          "default: the shipped drafter for the embedded model")),
    ("--no-drafter", dict(action="store_true", help="decode plainly (no speculation)")),
    ("--graph", dict(default="auto", choices=["auto", "cuda", "compile", "eager"],
                     help="how bucketed steps run: CUDA graphs, torch.compile per bucket or eager "
                          "(auto: CUDA graphs on NVIDIA; on CPU whichever of compile and eager "
                          "measured faster, measured once per model and cached)")),
    ("--dp", dict(type=int, default=1, help="data-parallel ranks (engine replicas in lockstep); "
                                            "spawned here, or the ranks torchrun started")),
    ("--dp-timeout", dict(type=float, default=30.0, help="seconds a rank may stall before the "
                                                         "group stops, naming it")),
    ("--max-graph-tokens", dict(type=int, default=512, help="largest graph bucket (tokens per step)")),
    ("--graph-fallback", dict(action="store_true", help="run a bucket whose capture fails eagerly "
                                                        "(warned and counted) instead of failing")),
    ("--sts", dict(default=None, help="STS calibration JSON for the drafter's confidence head "
                                      "(the shipped drafter brings its own)")),
    ("--spec-schedule", dict(default="confidence", choices=["confidence", "verify-all"],
                             help="verify only the drafts worth their cost (default), or every draft")),
    ("--cost-table", dict(default=None, help="the step costs the schedule prices drafts by: a "
                                             "`dspark profile` JSON, or 'auto' to measure at start-up "
                                             "(default: measured once per setup and cached)")),
    ("--min-gain", dict(type=float, default=0.05,
                        help="trim verification only for this predicted gain in tokens/s")),
    ("--confidence-lag", dict(type=int, default=2, help="rounds between a confidence and its use")),
    ("--generation-config", dict(default="auto", choices=["auto", "vllm"],
                                 help="auto: request fields left unset take the model's recommended "
                                      "sampling (generation_config.json, or the GGUF's "
                                      "general.sampling.* metadata); vllm: the built-in defaults")),
]
UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def add_missing_argument(parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    if flag not in parser._option_string_actions:      # argparse has no public lookup
        parser.add_argument(flag, **kwargs)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in ENGINE_ARGS:
        add_missing_argument(parser, flag, **kwargs)
    add_missing_argument(parser, "--host", default="127.0.0.1")
    add_missing_argument(parser, "--port", type=int, default=8000)
    add_missing_argument(parser, "--served-model-name", nargs="+", default=None,
                         help="model names clients may send; responses report the first "
                              "(default: the model file or folder name)")
    add_missing_argument(parser, "--api-key", default=None,
                         help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                              "/detokenize (401 otherwise); /health, /metrics, /version stay open")
    add_missing_argument(parser, "--chat-template", default=None,
                         help="a Jinja chat template file, or the template itself, replacing "
                              "the model's")
    add_missing_argument(parser, "--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                         help="uvicorn's own log level (its access log shows at info)")
    add_missing_argument(parser, "--max-queue", type=int, default=256,
                         help="waiting requests beyond this are refused with HTTP 429")
    add_missing_argument(parser, "--shutdown-timeout", type=_seconds, default=30.0,
                         help="on SIGTERM or SIGINT, seconds the requests in flight get to finish "
                              "(new ones are refused) before they end with an error and the server "
                              "exits")
    limits = ServerLimits()
    add_missing_argument(parser, "--max-request-bytes", type=int, default=limits.max_request_bytes,
                         help="larger request bodies are refused with HTTP 413")
    add_missing_argument(parser, "--max-prompts", type=int, default=limits.max_prompts,
                         help="prompts in one /v1/completions request")
    add_missing_argument(parser, "--max-stop", type=int, default=limits.max_stop,
                         help="stop strings, and stop token ids, in one request")
    add_missing_argument(parser, "--max-stop-chars", type=int, default=limits.max_stop_chars,
                         help="characters in one stop string")
    add_missing_argument(parser, "--max-pending-outputs", type=int, default=limits.max_pending_outputs,
                         help="engine outputs a streaming client may leave unread before it is "
                              "cut off and its request aborted")


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_request_bytes=args.max_request_bytes, max_prompts=args.max_prompts,
                        max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                        max_pending_outputs=args.max_pending_outputs)


def engine_config_from_args(args: argparse.Namespace) -> "EngineConfig":
    from dspark.llm import build_config
    drafter = None if getattr(args, "no_drafter", False) else getattr(args, "drafter", "auto")
    return build_config(model=getattr(args, "model", None), dtype=getattr(args, "dtype", "bfloat16"),
                        device=getattr(args, "device", "cpu"),
                        drafter=drafter, sts=getattr(args, "sts", None),
                        max_model_len=getattr(args, "max_model_len", None),
                        max_num_seqs=getattr(args, "max_num_seqs", 64),
                        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 2048),
                        kv_cache_bytes=getattr(args, "kv_cache_bytes", None),
                        num_threads=getattr(args, "threads", None),
                        graph=getattr(args, "graph", "auto"),
                        max_graph_tokens=getattr(args, "max_graph_tokens", 512),
                        graph_fallback=getattr(args, "graph_fallback", False),
                        spec_schedule=getattr(args, "spec_schedule", "confidence"),
                        cost_table=getattr(args, "cost_table", None),
                        min_gain=getattr(args, "min_gain", 0.05),
                        confidence_lag=getattr(args, "confidence_lag", 2),
                        generation_config=getattr(args, "generation_config", "auto"),
                        data_parallel_size=getattr(args, "dp", 1),
                        dp_timeout_s=getattr(args, "dp_timeout", 30.0))


def run_serve(args: argparse.Namespace) -> int:
    """`dspark serve`: load the engine first (errors surface before binding), then serve.

    Under torchrun every process runs this; rank 0 serves HTTP, the others only step. The exit
    status is non-zero when the engine died under the server (a data-parallel rank failed); a
    SIGTERM or SIGINT drains the requests in flight (--shutdown-timeout) and exits 0."""
    from dspark.distributed.torchrun import torchrun_rank
    from dspark.server.api_server import build_app
    from dspark.server.shutdown import DrainingServer, graceful_config
    config = engine_config_from_args(args)
    rank = torchrun_rank(config)
    if rank is not None and rank.rank != 0:
        return rank.serve_forever()
    holder: dict = {}
    engine = rank.start() if rank is not None else None
    app = build_app(engine if engine is not None else config, served_model_name=args.served_model_name,
                    max_queue=args.max_queue, on_fatal=lambda exc: _exit_server(holder),
                    limits=limits_from_args(args), api_key=getattr(args, "api_key", None),
                    chat_template=getattr(args, "chat_template", None))
    grace_s = getattr(args, "shutdown_timeout", 30.0)
    server_config = graceful_config(app, grace_s, host=args.host, port=args.port,
                                    log_level=getattr(args, "uvicorn_log_level", "info"))
    server = DrainingServer(server_config, lambda: app.state.server.async_engine.drain(grace_s))
    holder["server"] = server
    server.run()
    fatal = app.state.server.async_engine.fatal
    if fatal is not None:
        logger.error("the server stopped because the engine failed: %s", fatal)
        return 1
    return 0


def _exit_server(holder: dict) -> None:
    server = holder.get("server")
    if server is not None:
        server.should_exit = True


class ServerThread:
    """uvicorn serving `app` from a background thread on a loopback port (port 0: any free one)."""

    def __init__(self, app: "FastAPI", host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self.app = app
        self.host = host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="dspark-uvicorn", daemon=True)
        self.port = port

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        logger.info("serving on %s", self.url)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
