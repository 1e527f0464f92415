"""paged_attention_bf16: short queries read straight from the paged cache, against an fp32
reference, and how the attention layer routes to it."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dspark.kernels import cpu as kernels
from kernel_paths import KERNEL_PATHS, PATH_MARKS
from kernel_inputs import BF16, paged

needs_kernels = PATH_MARKS[False]


def attention_reference(q, k_cache, v_cache, tables, token_keys, block_size, scale):
    """fp32 softmax attention of each token over its keys, read slot by slot."""
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for t, (r, begin, end) in enumerate(token_keys.tolist()):
        pos = torch.arange(begin, end)
        slots = tables[r, pos // block_size] * block_size + pos % block_size
        keys = k_cache[slots].float().repeat_interleave(group, 1)                  # [L, H, D]
        values = v_cache[slots].float().repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[t].float(), keys) * scale, -1)
        out.append(torch.einsum("hl,lhd->hd", p, values))
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize("tiles", KERNEL_PATHS)
@pytest.mark.parametrize("r,heads,kv_heads,d,block_size,kv_len", [
    (1, 9, 3, 64, 16, 100), (4, 8, 2, 80, 4, 37), (3, 4, 4, 16, 8, 5), (2, 6, 1, 128, 16, 300),
    (2, 16, 2, 256, 8, 40),                       # the largest group and head dimension taken
    (1, 9, 3, 64, 16, 2001)])                     # the last: 1000 pairs of bf16-weighted values and an odd one
def test_paged_attention_matches_an_fp32_reference(r, heads, kv_heads, d, block_size, kv_len, tiles):
    k_cache, v_cache, tables, g = paged(r, kv_heads, d, block_size, kv_len, seed=r * d + kv_len)
    # per request a decode row or a verify block at the end of a shorter context, one windowed
    rows = []
    for i in range(r):
        end = int(torch.randint(max(1, kv_len // 2), kv_len + 1, (1,), generator=g)) if i else kv_len
        q_len = min(end, 1 + i % 3 * 3)
        for j in range(q_len):
            stop = end - q_len + j + 1
            rows.append([i, max(0, stop - 7) if i == r - 1 and r > 1 else 0, stop])
    token_keys = torch.tensor(rows)
    q = torch.randn(len(rows), heads, d, generator=g).to(BF16)
    out = kernels.paged_attention(q, k_cache, v_cache, tables, token_keys, block_size, d ** -0.5, tiles)
    ref = attention_reference(q, k_cache, v_cache, tables, token_keys, block_size, d ** -0.5)
    assert out.shape == q.shape and out.dtype == BF16
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=2e-3)


@needs_kernels
@pytest.mark.parametrize("tiles", KERNEL_PATHS)
@pytest.mark.parametrize("block_size", [16, 5])
def test_a_token_attends_with_the_same_bits_alone_and_in_a_verify_block(block_size, tiles):
    """Greedy DSpark equals plain decoding only if a verify row computes what the decode row
    would: each token of an 8-token block (and of a padding token's neighbourhood) alone."""
    k_cache, v_cache, tables, g = paged(2, 3, 64, block_size, 45, seed=block_size)
    rows = [[1, 0, 30]] + [[0, 0, 38 + j] for j in range(8)] + [[1, 0, 0]]      # decode, verify, padding
    token_keys = torch.tensor(rows)
    q = torch.randn(len(rows), 9, 64, generator=g).to(BF16)
    together = kernels.paged_attention(q, k_cache, v_cache, tables, token_keys, block_size, 0.125, tiles)
    for t, row in enumerate(rows):
        alone = kernels.paged_attention(q[t:t + 1], k_cache, v_cache, tables, torch.tensor([row]),
                                        block_size, 0.125, tiles)
        assert torch.equal(alone[0], together[t]), f"token {t} ({row})"
    assert not together[-1].any()                              # no keys: a zero row


@needs_kernels
def test_paged_attention_refuses_keys_outside_the_block_table():
    k_cache, v_cache, tables, g = paged(2, 2, 32, 4, 8, seed=3)
    q = torch.randn(1, 4, 32, generator=g).to(BF16)
    for bad in ([2, 0, 3], [0, 0, 9], [1, 4, 3]):          # no such request; past its pages; reversed
        with pytest.raises(RuntimeError, match="outside its request"):
            kernels.paged_attention(q, k_cache, v_cache, tables, torch.tensor([bad]), 4, 0.2)


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@needs_kernels
def test_bf16_decode_steps_take_the_kernel_and_agree_with_the_torch_path(monkeypatch):
    from dspark.models.layers.attention import paged_attention
    from dspark.worker.inputs import RequestChunk, build_inputs
    k_cache, v_cache, tables, g = paged(3, 2, 32, 4, 19, seed=5)
    chunks = [RequestChunk([1], 18, tables[0].tolist(), 1), RequestChunk([2], 6, tables[1].tolist(), 1),
              RequestChunk([3], 11, tables[2].tolist(), 1)]
    meta = build_inputs(chunks, 4, torch.device("cpu")).attn
    assert meta.token_keys.tolist() == [[0, 0, 19], [1, 0, 7], [2, 0, 12]]
    q = torch.randn(3, 6, 32, generator=g).to(BF16)
    ops = _ops(lambda: paged_attention(q, k_cache, v_cache, meta, 0.2))
    assert "dspark_cpu::paged_attention_bf16" in ops and "aten::bmm" not in ops
    kernel = paged_attention(q, k_cache, v_cache, meta, 0.2)
    monkeypatch.setattr(kernels, "takes_attention", lambda *a: False)
    torch_path = paged_attention(q, k_cache, v_cache, meta, 0.2)
    assert torch.allclose(kernel.float(), torch_path.float(), rtol=2 ** -6, atol=1e-2)
    monkeypatch.undo()
    assert "dspark_cpu::paged_attention_bf16" not in _ops(          # fp32 stays on torch's path
        lambda: paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.2))
