"""A run that does not name `cuda` in -m deselects `cuda` tests on a machine without a GPU;
selecting them there fails at once. Each case runs pytest (in process, `pytester`) over a tiny
generated test file, with `torch.cuda.is_available` pinned, so these tests mean the same on a
machine with a GPU."""

import pytest
import torch

TESTS = '''
import pytest

@pytest.mark.cuda
def test_on_the_gpu():
    pass

@pytest.mark.cuda
@pytest.mark.slow
def test_slow_on_the_gpu():
    pass

def test_anywhere():
    pass

@pytest.mark.slow
def test_slow_anywhere():
    pass
'''


def run_pytest(pytester, monkeypatch, *args: str, gpu: bool = False) -> pytest.RunResult:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    pytester.makepyfile(test_sample=TESTS)
    pytester.makeini("[pytest]\nmarkers =\n    cuda: needs an NVIDIA GPU\n    slow: takes a while\n")
    return pytester.runpytest("-p", "cuda_selection", "-p", "no:cacheprovider", *args)


@pytest.mark.parametrize("args,summary", [
    ((), "2 passed, 2 deselected"),
    (("-m", "not cuda"), "2 passed, 2 deselected"),        # .ci/run
    (("-m", "slow"), "1 passed, 3 deselected"),            # the slow cuda test too
    (("-m", "not slow"), "1 passed, 3 deselected"),
    (("-k", "gpu"), "4 deselected"),
])
def test_without_a_gpu_cuda_tests_are_deselected(pytester, monkeypatch, args, summary):
    done = run_pytest(pytester, monkeypatch, *args)
    assert done.ret in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED), \
        done.stdout.str() + done.stderr.str()
    assert summary in done.stdout.str(), done.stdout.str()


@pytest.mark.parametrize("markexpr", ["cuda", "cuda and slow", "cuda or slow"])
def test_selecting_cuda_tests_without_a_gpu_fails(pytester, monkeypatch, markexpr):
    done = run_pytest(pytester, monkeypatch, "-m", markexpr)
    assert done.ret == pytest.ExitCode.USAGE_ERROR, done.stdout.str() + done.stderr.str()
    err = done.stderr.str()
    assert "cuda tests selected" in err and "but no CUDA device is available" in err, err
    assert "passed" not in done.stdout.str()


@pytest.mark.parametrize("args,summary", [((), "4 passed"), (("-m", "cuda"), "2 passed, 2 deselected")])
def test_with_a_gpu_nothing_changes(pytester, monkeypatch, args, summary):
    done = run_pytest(pytester, monkeypatch, *args, gpu=True)
    assert done.ret == pytest.ExitCode.OK, done.stdout.str() + done.stderr.str()
    assert summary in done.stdout.str(), done.stdout.str()
