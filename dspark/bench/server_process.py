"""A `dspark serve` in a process of its own, for the serve benchmark's --launch.

A server a user runs has a process to itself; the benchmark's clients run elsewhere. Served
from the benchmark's own process, the server would share its interpreter lock and its torch
thread pool with the client threads (and, comparing two servers, with the other engine), and
would measure that sharing rather than the server.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from dspark.config_flags import engine_argv
from dspark.server.launch import LoopbackServer

logger = logging.getLogger(__name__)


class ServerProcess(LoopbackServer):
    """`python -m dspark.cli serve` with the engine flags of `args` on a free loopback port; its
    log goes to this process's stderr, so a slow start says what it is doing."""

    def __init__(self, args: argparse.Namespace, max_queue: int, host: str = "127.0.0.1"):
        self.host = host
        self.port = _free_port(host)
        self.argv = [sys.executable, "-m", "dspark.cli", "serve", *engine_argv(args), "--host", host,
                     "--port", str(self.port), "--max-queue", str(max_queue), "--uvicorn-log-level", "warning"]
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 1800.0) -> "ServerProcess":
        """Start the server and wait until /health answers; the first start of a combination
        measures its cost model, which takes minutes on a small CPU (the child shows a progress bar)."""
        logger.info("starting %s", " ".join(self.argv))
        self.process = subprocess.Popen(self.argv, preexec_fn=_interruptible)
        try:
            self._wait_ready(timeout)
        except BaseException:                  # Ctrl-C or a timeout: no server outlives its start
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._healthy():
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"the server exited with status {code} before it was ready "
                                   f"(see its log above): {' '.join(self.argv)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {timeout:.0f} s: {' '.join(self.argv)}")
            time.sleep(0.25)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT, as a user's Ctrl-C: the server drains and exits; killed if it does not."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the server did not exit %.0f s after SIGINT; killing it", timeout)
            self.process.kill()
            self.process.wait()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False


def _interruptible() -> None:
    """In the child before exec: a benchmark started in the background (`cmd &` in a script)
    ignores SIGINT and its server would inherit that, so `stop` would wait out its timeout and
    kill a server it meant to drain. The default lets Python turn SIGINT into Ctrl-C again."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free_port(host: str) -> int:
    """A port no one listens on now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


__all__ = ["ServerProcess"]
