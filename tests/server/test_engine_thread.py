"""The server's engine thread runs what it is given in order, on one thread, and hands back
results and errors; the server builds its engine there and steps it there."""

import threading

import pytest

from dspark.server.engine_thread import EngineThread


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    worker = EngineThread()
    seen = []
    first = worker.submit(lambda: seen.append(threading.get_ident()) or "built")
    second = worker.submit(lambda x: seen.append(threading.get_ident()) or x * 2, 21)
    assert first.result(timeout=5) == "built" and second.result(timeout=5) == 42
    assert seen == [worker.thread.ident] * 2 and worker.thread.ident != threading.get_ident()
    with pytest.raises(ValueError, match="bad"):
        worker.submit(lambda: (_ for _ in ()).throw(ValueError("bad"))).result(timeout=5)
    worker.close()
    worker.thread.join(timeout=5)
    assert not worker.thread.is_alive()


def test_the_server_steps_its_engine_on_the_thread_that_built_it(monkeypatch, tmp_path):
    from dspark.server import api_server
    from tiny_server import make_target, post, serve
    built_on, stepped_on = [], set()
    real = api_server._started

    def started(engine, template):
        built_on.append(threading.get_ident())
        engine = real(engine, template)
        step = engine.step
        engine.step = lambda: stepped_on.add(threading.get_ident()) or step()
        return engine

    monkeypatch.setattr(api_server, "_started", started)
    with serve(make_target(str(tmp_path / "t"))) as served:
        status, _ = post(served, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3})
        assert status == 200
    assert len(built_on) == 1 and stepped_on == set(built_on) and built_on[0] != threading.get_ident()
