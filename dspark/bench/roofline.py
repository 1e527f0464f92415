"""Memory-bandwidth roofline: how close a batch-1 decode step comes to reading the weights once."""

from __future__ import annotations

import statistics
import time

import torch

from dspark.models.layers.linear import Linear


def read_bandwidth(megabytes: int = 256, repeats: int = 7, device: str = "cpu") -> float:
    """Bytes/s of a streaming fp32 sum over a buffer far larger than the caches (median), on the
    device the weights live on."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    x.sum()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every projection's weight (plain or packed, tied ones once)
    and the other parameters, but of an embedding table only the rows it looks up (nothing)."""
    seen, total = set(), 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, torch.nn.Embedding):
                seen.add(p.data_ptr())
                continue
            key = ("packed", id(module)) if name == "weight" and isinstance(module, Linear) else p.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            total += linear_weight_bytes(module) if isinstance(key, tuple) else p.numel() * p.element_size()
    return total


def linear_weight_bytes(linear: Linear) -> int:
    """Bytes one forward reads from the weight, whichever copy it uses: packing may have dropped
    the plain weight's storage, so the size comes from the shape."""
    return linear.in_features * linear.out_features * linear.weight.element_size()
