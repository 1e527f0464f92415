"""A bare `pytest` deselects `cuda` tests on a machine without a GPU; selecting them there fails."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")

TESTS = '''
import pytest

@pytest.mark.cuda
def test_on_the_gpu():
    assert False, "ran a cuda test"

def test_anywhere():
    assert True
'''


def run_pytest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs an NVIDIA GPU\n")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cuda_selection", *args,
                           str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path)


def test_a_bare_run_deselects_cuda_tests(tmp_path):
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 deselected" in done.stdout


def test_selecting_cuda_tests_without_a_gpu_fails(tmp_path):
    done = run_pytest(tmp_path, "-m", "cuda")
    assert done.returncode != 0
    assert "no CUDA device is available" in done.stdout + done.stderr


def test_not_cuda_still_runs_the_rest(tmp_path):
    done = run_pytest(tmp_path, "-m", "not cuda")
    assert done.returncode == 0 and "1 passed, 1 deselected" in done.stdout
