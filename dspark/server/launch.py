"""Starting the server: `dspark serve` arguments, uvicorn in the foreground or a background thread."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import TYPE_CHECKING

from dspark.config_flags import add_engine_flags, engine_config_from_args
from dspark.server.limits import ServerLimits

if TYPE_CHECKING:                       # keep `dspark --help` free of the server dependencies
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Everything `dspark serve` takes: the engine flags and the server's own."""
    add_engine_flags(parser)
    add_server_flags(parser)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags (the engine's come from its config, dspark/config_flags.py)."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind")
    group.add_argument("--port", type=int, default=8000, help="port to bind")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model names clients may send; responses report the first "
                            "(default: the model file or folder name)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                            "/detokenize (401 otherwise); /health, /metrics, /version stay open")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file, or the template itself, replacing the model's")
    group.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                       help="uvicorn's own log level (its access log shows at info)")
    group.add_argument("--max-queue", type=int, default=256,
                       help="waiting requests beyond this are refused with HTTP 429")
    group.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                       help="on SIGTERM or SIGINT, seconds the requests in flight get to finish "
                            "(new ones are refused) before they end with an error and the server exits")
    _add_limit_flags(parser)


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one request or client may ask of the server (ServerLimits)."""
    limits = ServerLimits()
    group = parser.add_argument_group("server limits")
    group.add_argument("--max-request-bytes", type=int, default=limits.max_request_bytes,
                       help="larger request bodies are refused with HTTP 413")
    group.add_argument("--max-prompts", type=int, default=limits.max_prompts,
                       help="prompts in one /v1/completions request")
    group.add_argument("--max-choices", type=int, default=limits.max_choices,
                       help="choices in one request (prompts x n)")
    group.add_argument("--max-stop", type=int, default=limits.max_stop,
                       help="stop strings, and stop token ids, in one request")
    group.add_argument("--max-stop-chars", type=int, default=limits.max_stop_chars,
                       help="characters in one stop string")
    group.add_argument("--max-pending-outputs", type=int, default=limits.max_pending_outputs,
                       help="engine outputs a streaming client may leave unread before it is "
                            "cut off and its request aborted")


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_request_bytes=args.max_request_bytes, max_prompts=args.max_prompts,
                        max_choices=args.max_choices,
                        max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                        max_pending_outputs=args.max_pending_outputs)


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
                    limits=limits_from_args(args), api_key=args.api_key, chat_template=args.chat_template)
    grace_s = args.shutdown_timeout
    server_config = graceful_config(app, grace_s, host=args.host, port=args.port,
                                    log_level=args.uvicorn_log_level)
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


class LoopbackServer:
    """A server on `host`:`port` and the URLs clients use."""
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


class ServerThread(LoopbackServer):
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

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
