"""`--graph auto`: the faster CPU backend is chosen from a measurement made once per fingerprint."""

import json
import logging

import pytest
import torch

from dspark.runner.choice import (GraphChoice, auto_mode, choose_cpu_mode,
                                        interleaved_medians_ms, one_token_step)
from tiny import save_tiny

FINGERPRINT = {"model": "/models/a", "dtype": "bfloat16", "torch": "2.13.0", "num_threads": 2}


class FakeMeasure:
    """measure() -> (eager ms, compile ms) from a table, counting the calls."""

    def __init__(self, eager_ms: float, compile_ms: float):
        self.ms = (eager_ms, compile_ms)
        self.calls = 0

    def __call__(self) -> tuple[float, float]:
        self.calls += 1
        return self.ms


@pytest.mark.parametrize("eager_ms, compile_ms, expected", [
    (10.0, 7.0, "compile"),       # compile clearly faster
    (7.0, 10.0, "eager"),         # eager faster
    (10.0, 9.8, "eager"),         # compile faster by less than min_gain: not worth compiling
])
def test_the_faster_backend_is_chosen(tmp_path, eager_ms, compile_ms, expected):
    measure = FakeMeasure(eager_ms, compile_ms)
    choice = choose_cpu_mode(FINGERPRINT, tmp_path / "choice.json", measure, min_gain=0.05)
    assert choice == GraphChoice(expected, eager_ms, compile_ms, cached=False)
    assert measure.calls == 1


def test_a_verdict_is_cached_per_fingerprint(tmp_path):
    path = tmp_path / "sub" / "choice.json"
    first = choose_cpu_mode(FINGERPRINT, path, FakeMeasure(10.0, 5.0))
    assert first.mode == "compile" and path.exists()
    again = FakeMeasure(1.0, 50.0)              # would pick eager if it were asked
    reused = choose_cpu_mode(dict(reversed(FINGERPRINT.items())), path, again)
    assert reused == GraphChoice("compile", 10.0, 5.0, cached=True) and again.calls == 0
    other = FakeMeasure(1.0, 50.0)
    assert choose_cpu_mode({**FINGERPRINT, "num_threads": 8}, path, other).mode == "eager"
    assert other.calls == 1
    assert len(json.loads(path.read_text())["verdicts"]) == 2


def test_an_unreadable_cache_is_measured_again_and_rewritten(tmp_path):
    path = tmp_path / "choice.json"
    path.write_text("{not json")
    measure = FakeMeasure(3.0, 1.0)
    assert choose_cpu_mode(FINGERPRINT, path, measure).mode == "compile" and measure.calls == 1
    key = json.dumps(FINGERPRINT, sort_keys=True)
    path.write_text(json.dumps({"verdicts": {key: {"mode": "cuda", "eager_ms": 1, "compile_ms": 1}}}))
    assert choose_cpu_mode(FINGERPRINT, path, FakeMeasure(3.0, 1.0)).cached is False
    assert choose_cpu_mode(FINGERPRINT, path, FakeMeasure(3.0, 1.0)).cached is True


def test_the_cache_keeps_only_the_newest_verdicts(tmp_path):
    path = tmp_path / "choice.json"
    for i in range(40):
        choose_cpu_mode({**FINGERPRINT, "model": f"/m/{i}"}, path, FakeMeasure(2.0, 1.0))
    verdicts = json.loads(path.read_text())["verdicts"]
    assert len(verdicts) == 32 and all(f"/m/{i}\"" in "".join(verdicts) for i in range(8, 40))


def test_median_step_time_uses_a_fake_timer():
    ticks = iter([0.0, 0.004, 1.0, 1.001, 2.0, 2.010])      # three timed runs: 4, 1, 10 ms
    runs = []
    ms = interleaved_medians_ms({"run": lambda: runs.append(1)}, replays=3, warmup=2,
                                timer=lambda: next(ticks))["run"]
    assert ms == pytest.approx(4.0) and len(runs) == 5


def test_auto_is_cuda_on_nvidia_without_measuring(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.runner.choice"):
        assert auto_mode(None, torch.device("cuda"), (), {}, tmp_path / "c.json") == "cuda"
    assert "graph auto: cuda" in caplog.text and not (tmp_path / "c.json").exists()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from dspark.models.loader import load_target
    path = tmp_path_factory.mktemp("choice_target")
    save_tiny(str(path), "llama", tied=True, vocab=32, num_hidden_layers=2, seed=1)
    return load_target(str(path), torch.float32, device="cpu", max_positions=64).model


def test_auto_on_cpu_reuses_the_cached_verdict_and_says_why(tmp_path, tiny_model, caplog):
    fingerprint = {"model": "/tiny", "dtype": "float32"}
    key = {**fingerprint, "torch": torch.__version__, "device": "cpu",
           "num_threads": torch.get_num_threads(), "weights": "dense"}
    path = tmp_path / "c.json"
    choose_cpu_mode(key, path, FakeMeasure(5.0, 1.0))
    with caplog.at_level(logging.INFO, logger="dspark.runner.choice"):
        assert auto_mode(tiny_model, torch.device("cpu"), (0,), fingerprint, path) == "compile"
    assert "graph auto: compile" in caplog.text and "cached" in caplog.text


def test_the_eager_one_token_step_is_timed(tiny_model):
    step = one_token_step(tiny_model, "eager", torch.device("cpu"), (0, 1))
    ms = interleaved_medians_ms({"step": step}, replays=3)["step"]
    assert 0 < ms < 1000


def test_backends_are_timed_alternately_so_drift_reaches_both():
    """A load that grows over the measurement must not decide between the backends: each run's
    calls are spread over the whole measurement, not one run's before the other's."""
    clock, order = [0.0], []

    def run(name):
        def call():
            order.append(name)
            clock[0] += 1.0 + len(order)       # every call slower than the one before
        return call

    ms = interleaved_medians_ms({"eager": run("eager"), "compile": run("compile")}, replays=5,
                                warmup=1, timer=lambda: clock[0])
    assert order == ["eager", "compile"] * 6
    assert ms["compile"] - ms["eager"] == pytest.approx(1000.0)     # one call later, not five


@pytest.mark.slow
def test_auto_on_cpu_measures_both_backends_once(tmp_path, tiny_model, caplog):
    path = tmp_path / "c.json"
    with caplog.at_level(logging.INFO, logger="dspark.runner.choice"):
        mode = auto_mode(tiny_model, torch.device("cpu"), (0,), {"model": "/tiny"}, path)
    assert mode in ("compile", "eager") and "measured now" in caplog.text
    (verdict,) = json.loads(path.read_text())["verdicts"].values()
    assert verdict["mode"] == mode and verdict["eager_ms"] > 0 and verdict["compile_ms"] > 0
    assert auto_mode(tiny_model, torch.device("cpu"), (0,), {"model": "/tiny"}, path) == mode
