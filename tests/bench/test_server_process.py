"""The serve benchmark's server process: it never outlives a failed start."""

from __future__ import annotations

import argparse

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


def test_a_server_that_exits_names_its_status(tmp_path):
    server = ServerProcess(engine_args(["--model", str(tmp_path / "missing.gguf"), "--no-drafter"]), max_queue=4)
    with pytest.raises(RuntimeError, match="exited with status [1-9]"):
        server.start(timeout=120)
    assert "--model" in server.argv and str(tmp_path / "missing.gguf") in server.argv
