"""The serve benchmark's server process: it never outlives a failed start."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import pytest

from dspark.bench.server_process import ServerProcess
from dspark.config_flags import add_engine_flags


def engine_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return parser.parse_args(argv)


def test_a_server_not_ready_in_time_is_stopped(tmp_path):
    server = ServerProcess(engine_args(["--no-drafter"]), max_queue=4)
    assert server.argv[-8:] == ["--host", "127.0.0.1", "--port", str(server.port), "--max-queue", "4",
                                "--uvicorn-log-level", "warning"]
    with pytest.raises(RuntimeError, match="not ready after"):
        server.start(timeout=0.5)                   # still importing torch
    assert server.process.poll() is not None


def test_an_interrupted_start_stops_the_server(monkeypatch):
    def interrupted(self) -> bool:
        raise KeyboardInterrupt
    monkeypatch.setattr(ServerProcess, "_healthy", interrupted)
    server = ServerProcess(engine_args(["--no-drafter"]), max_queue=4)
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert server.process.poll() is not None


def test_a_server_started_where_sigint_is_ignored_still_stops_on_it():
    """A benchmark run in the background (`&` in a script) ignores SIGINT; its server must not
    inherit that, or every stop waits out its timeout and kills instead of draining."""
    script = ("import signal, argparse\n"
              "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
              "from dspark.bench.server_process import ServerProcess\n"
              "from dspark.config_flags import add_engine_flags\n"
              "p = argparse.ArgumentParser(); add_engine_flags(p)\n"
              "s = ServerProcess(p.parse_args(['--no-drafter']), max_queue=4)\n"
              "try:\n    s.start(timeout=0.5)\nexcept RuntimeError:\n    pass\n"
              "s.process.wait(0)\nprint('status', s.process.returncode)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert f"status {-signal.SIGINT}" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "killing it" not in done.stderr


def test_a_server_that_exits_names_its_status(tmp_path):
    server = ServerProcess(engine_args(["--model", str(tmp_path / "missing.gguf"), "--no-drafter"]), max_queue=4)
    with pytest.raises(RuntimeError, match="exited with status [1-9]"):
        server.start(timeout=120)
    assert "--model" in server.argv and str(tmp_path / "missing.gguf") in server.argv
