""".ci/gpu-check, as far as a machine without a GPU can check it: it stops at once, loudly, where
torch sees no GPU; the test files it collects hold every `cuda` test; and on a device other than
the CPU the layers, the sampler and the weight packing never build or load dspark's x86 kernels
(the meta device stands in for CUDA)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu-check"


def test_without_a_gpu_it_stops_before_anything_runs(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "python3"               # torch as it is, told that no GPU is visible
    fake.write_text(f'#!/bin/sh\necho call >>"{calls}"\nCUDA_VISIBLE_DEVICES= exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    env.pop("PYTHON", None)
    (tmp_path / "out").mkdir()
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device" in done.stderr and "stopped" in done.stderr, done.stderr
    assert len(calls.read_text().splitlines()) == 1            # the probe alone: no test, no benchmark
    assert not list((tmp_path / "out").iterdir())


GRAPHS_REPORT = ('{"bench": "graphs", "results": {"plain_cuda_b1": {"tokens_per_s": 300.0}, '
                 '"dspark_cuda_b1": {"tokens_per_s": 600.0, "vs_plain": 2.0}}}')
SWEEP_REPORT = '{"bench": "sweep", "levels": [1, 64], "default_over_best_other": [1.1, 0.98]}'
FAKE_GPU = f"""#!/bin/sh
case "$*" in
  -)                       exec "{sys.executable}" -;;
  *cuda.is_available*)     echo "Fake H200, compute capability 9.0, 139 GiB, torch 9.9";;
  *default_model_path*)    echo "embedded model: /models/smollm2.gguf";;
  *"-m pytest"*)           echo "$*" >"$OUT/pytest-args"; echo "== 7 passed, 40 deselected in 3.1s ==";;
  *"--mode graphs"*)       echo "attention runs through SDPA over padded contexts, not FlashAttention's \
variable-length kernel: a test reason (counted in varlen_attention.STATS)"
                           echo 'GRAPHS_REPORT';;
  *"--mode sweep"*)        "$CXX" -c kernels.cpp; echo 'SWEEP_REPORT';;
  *)                       exit 9;;
esac
""".replace("GRAPHS_REPORT", GRAPHS_REPORT).replace("SWEEP_REPORT", SWEEP_REPORT)


def test_its_table_and_json_line_combine_the_parts(tmp_path):
    """Every part stood in for by a fake interpreter on a fake GPU: the parts run in order, the
    pytest run collects no conftest, and the summary names a part that tried to build the x86
    kernels and an attention fallback."""
    import json
    fake = tmp_path / "python3"
    fake.write_text(FAKE_GPU)
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(out)}
    env.pop("PYTHON", None)
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr              # the sweep tried a build
    report = json.loads(done.stdout.strip().splitlines()[-1])
    parts = report["parts"]
    assert report["device"].startswith("Fake H200") and not report["ok"]
    assert [parts[p]["rc"] for p in ("probe", "tests", "graphs", "sweep")] == [0, 0, 0, 0]
    assert parts["graphs"]["report"]["results"]["dspark_cuda_b1"]["vs_plain"] == 2.0
    assert parts["graphs"]["varlen_fallbacks"] == ["a test reason"]
    assert parts["sweep"]["built_x86_kernels"] and not parts["graphs"]["built_x86_kernels"]
    assert parts["tests"]["summary"] == "7 passed, 40 deselected in 3.1s"
    table = done.stdout.split("part | status | time | notes")[1]
    assert "cuda_b1 2.00x" in table and "c64 0.98x" in table and "tried to build the x86 kernels" in table
    pytest_args = (out / "pytest-args").read_text()
    assert "--noconftest" in pytest_args and "tests/models/test_varlen_attention.py" in pytest_args
    assert {p.name for p in out.iterdir()} >= {"gpu-probe.log", "gpu-tests.log", "gpu-graphs.log", "gpu-sweep.log"}


def _cuda_marked(path: Path) -> bool:
    """Whether a test module marks anything `cuda` (decorators or pytestmark), parsed."""
    for node in ast.walk(ast.parse(path.read_text())):
        marks = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            marks = node.decorator_list
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            marks = [node.value]
        if any("mark.cuda" in ast.unparse(m) for m in marks):
            return True
    return False


def test_it_collects_every_file_that_holds_cuda_tests():
    line = next(ln for ln in SCRIPT.read_text().splitlines() if "grep -rlE" in ln)
    command = re.search(r"<\((grep .*)\)", line).group(1)
    listed = set(subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if _cuda_marked(p)}
    assert marked and marked <= listed, marked - listed


def test_its_limits_keep_it_within_eight_minutes():
    text = SCRIPT.read_text()
    first = int(re.search(r"device=\$\(timeout (\d+)", text).group(1))
    grace = int(re.search(r"--kill-after=(\d+)", text).group(1))
    parts = [int(n) for n in re.findall(r"^\s*part \w+ (\d+) (?!sh -c)", text, re.M)]
    assert len(parts) == 4                    # probe, tests, graphs, sweep
    worst = first + sum(parts) + len(parts) * grace
    assert worst <= 8 * 60, worst


@pytest.fixture
def kernels_forbidden(monkeypatch):
    """Any question to the x86 kernels fails the test."""
    from dspark.kernels import cpu

    def refuse(*args, **kwargs):
        raise AssertionError("dspark's x86 kernels were asked for on a non-CPU device")

    for name in ("available", "tiles_available"):
        monkeypatch.setattr(cpu, name, refuse)


def _meta_model():
    from dspark.models.llama import CausalLM
    from dspark.models.model_config import ModelConfig
    from tiny import tiny_config
    with torch.device("meta"):
        return CausalLM(ModelConfig.from_hf(tiny_config("llama")))


def test_layers_sampling_and_packing_leave_the_kernels_alone_off_the_cpu(kernels_forbidden):
    from dspark.kernels import cpu
    from dspark.runner.setup import pack_for_inference
    q = torch.empty(3, 4, 16, device="meta", dtype=torch.bfloat16)
    k_cache = torch.empty(32, 2, 16, device="meta", dtype=torch.bfloat16)
    assert not cpu.takes_attention(q, k_cache, 1)
    cpu.greedy_tokens(torch.empty(2, 50, device="meta"))
    assert pack_for_inference(_meta_model(), None) == 0


def test_the_runner_leaves_the_kernels_alone_off_the_cpu(kernels_forbidden):
    from dspark.runner.fused_cpu import fuse_small_steps
    assert fuse_small_steps(_meta_model()) is None
