"""A step's host-built tensors reach the device through `host_copy` (pinned memory, no wait): a
copy from pageable memory on CUDA waits for the work queued before it, which would stall the
host between the drafter pass, the verify forward and the sampler. Checked on the source, since
this machine has no GPU to time it on, and on values."""

import ast
from pathlib import Path

import torch

from dspark.host_copy import device_tensor

PACKAGE = Path(__file__).resolve().parents[1] / "dspark"
STEP_PATH = ["worker", "spec", "runner"]
ALLOWED = {"worker/profile.py"}      # times steps; its inputs are made before the clock starts


def _is_torch_tensor(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("tensor", "as_tensor") and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch")


def pageable_copies(source: str) -> list[int]:
    """Lines building a device tensor straight from host data: torch.tensor(..., device=...) or
    torch.tensor(...).to(...)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if _is_torch_tensor(node) and any(k.arg == "device" for k in node.keywords):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to" \
                and _is_torch_tensor(node.func.value):
            lines.append(node.lineno)
    return lines


def test_the_check_finds_both_forms():
    src = "import torch\na = torch.tensor([1], device=d)\nb = torch.tensor([1]).to(d)\nc = torch.tensor([1])\n"
    assert pageable_copies(src) == [2, 3]


def test_no_step_module_copies_from_pageable_memory():
    found = []
    for folder in STEP_PATH:
        for path in sorted((PACKAGE / folder).glob("*.py")):
            rel = f"{folder}/{path.name}"
            if rel not in ALLOWED:
                found += [f"{rel}:{line}" for line in pageable_copies(path.read_text())]
    assert not found, f"use host_copy.device_tensor or to_device: {found}"


def test_device_tensor_keeps_values_and_dtype():
    t = device_tensor([[1, 2], [3, 4]], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, 4]]
