"""The CPU KV cache: zeros from an anonymous mapping, paid for only where blocks are written."""

from types import SimpleNamespace

import torch

from dspark.models.kv_cache import allocate_kv_cache, untouched_zeros


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_untouched_zeros_are_zeros_and_cost_memory_only_where_written():
    before = resident_bytes()
    x = untouched_zeros((1 << 18, 8, 256), torch.bfloat16, torch.device("cpu"))     # 1 GiB
    assert x.shape == (1 << 18, 8, 256) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert resident_bytes() - before < 64 << 20
    x[1000:1010] = 2.0
    assert float(x[1000:1010].float().mean()) == 2.0 and not x[:1000].any() and not x[1010:2000].any()
    assert resident_bytes() - before < 64 << 20
    assert untouched_zeros((0, 4), torch.float32, torch.device("cpu")).numel() == 0


def test_every_layer_gets_its_own_zeroed_k_and_v():
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=4)
    caches = allocate_kv_cache(cfg, num_blocks=5, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    assert len(caches) == 3 and all(t.shape == (20, 2, 4) and not t.any() for kv in caches for t in kv)
    caches[0][0].fill_(1.0)
    assert not caches[0][1].any() and not caches[1][0].any()
