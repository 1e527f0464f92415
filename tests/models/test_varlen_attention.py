"""Attention through torch's variable-length FlashAttention gives what the padded SDPA path gives,
for steps that mix prefill chunks, decode rows and verify blocks of several requests, grouped
query heads and a sliding window. On the CPU `varlen_attn` is replaced by a reference written
here (per request SDPA, causal masks aligned to the bottom right, over the packed keys or the
block table it is given), which also checks the arguments the kernel would refuse; the `cuda`
test runs the real kernel in bf16 against SDPA."""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from dspark.models.layers import varlen_attention as varlen
from dspark.models.layers.attention import attend
from dspark.models.layers.varlen_attention import refusal as real_refusal
from dspark.worker.inputs import RequestChunk, build_inputs

HEADS, KV_HEADS = 4, 2


def _check_arguments(query, key, value, cu_seq_q, cu_seq_k, max_q, seqused_k, block_table):
    """What the kernel checks (or silently needs), so a mistake here fails on the CPU too."""
    assert query.dtype == key.dtype == value.dtype
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    assert cu_seq_q.is_contiguous() and cu_seq_k.is_contiguous()
    assert cu_seq_q.numel() == cu_seq_k.numel() and int(cu_seq_q[-1]) == query.shape[0]
    assert max_q == int(cu_seq_q.diff().max())
    if block_table is not None:
        assert block_table.dtype == seqused_k.dtype == torch.int32 and block_table.is_contiguous()
        assert key.dim() == 4 and key.shape[1] % varlen.PAGE_MULTIPLE == 0
        return seqused_k.long()
    assert key.dim() == 3 and key.shape[0] == int(cu_seq_k[-1])
    return cu_seq_k.diff().long()


def _attend_one(q, k, v, left: int, right: int, scale):
    """One request: q [nq, H, D] over k/v [nk, KVH, D], row j at key position nk - nq + j."""
    nq, nk = q.shape[0], k.shape[0]
    row = torch.arange(nq)[:, None] + nk - nq
    col = torch.arange(nk)[None, :]
    allowed = torch.ones(nq, nk, dtype=torch.bool)
    if right >= 0:
        allowed &= col <= row + right
    if left >= 0:
        allowed &= col >= row - left
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=allowed, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                          scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                          block_table=None, num_splits=None):
    """torch.nn.attention.varlen.varlen_attn's contract, written out."""
    assert isinstance(window_size, tuple) and len(window_size) == 2     # (-1, 0) is compared as a tuple
    k_lens = _check_arguments(query, key, value, cu_seq_q, cu_seq_k, max_q, seqused_k, block_table)
    assert max_k == int(k_lens.max())
    assert enable_gqa == (query.shape[1] != key.shape[-2])
    out = torch.empty_like(query)
    for i in range(cu_seq_q.numel() - 1):
        rows = slice(int(cu_seq_q[i]), int(cu_seq_q[i + 1]))
        nk = int(k_lens[i])
        if block_table is None:
            k = key[int(cu_seq_k[i]):int(cu_seq_k[i + 1])]
            v = value[int(cu_seq_k[i]):int(cu_seq_k[i + 1])]
        else:
            pages = block_table[i, :-(-nk // key.shape[1])].long()
            k, v = key[pages].flatten(0, 1)[:nk], value[pages].flatten(0, 1)[:nk]
        out[rows] = _attend_one(query[rows], k, v, *window_size, scale)
    return out


def first_release_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                              return_aux=None, scale=None):
    """The first releases' signature: no window, no GQA switch, no pages."""
    _check_arguments(query, key, value, cu_seq_q, cu_seq_k, max_q, None, None)
    return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                 window_size=(-1, 0) if is_causal else (-1, -1),
                                 enable_gqa=query.shape[1] != key.shape[1])


def mixed_step(block_size: int) -> list[RequestChunk]:
    """A fresh prompt, a prompt's second chunk, decode rows and verify blocks, each request on
    its own scattered pages."""
    per = -(-64 // block_size)
    shapes = [(0, 19, 1), (9, 18, 1), (30, 1, 1), (5, 4, 4), (0, 1, 1), (13, 5, 5), (40, 1, 1)]
    chunks = []
    for r, (start, q, logits) in enumerate(shapes):
        table = [(r * per + b) * 5 % (len(shapes) * per) for b in range(per)]     # a permutation
        chunks.append(RequestChunk(list(range(3, 3 + q)), start, table, logits))
    return chunks


def decode_step(block_size: int) -> list[RequestChunk]:
    per = -(-64 // block_size)
    return [RequestChunk([5], start, list(range(r * per, (r + 1) * per)), 1)
            for r, start in enumerate([0, 7, 33, 18])]


def run_both(chunks, block_size, window, dtype=torch.float32, device="cpu", padded=False, seed=0):
    """(SDPA output, varlen output, SDPA caches, varlen caches) of one layer's step."""
    g = torch.Generator(device=device).manual_seed(seed)
    slots = 7 * (-(-64 // block_size)) * block_size
    caches = [torch.randn(slots, KV_HEADS, 16 if device == "cpu" else 64, generator=g, device=device,
                          dtype=dtype) for _ in range(2)]
    d = caches[0].shape[-1]
    t = sum(len(c.token_ids) for c in chunks)
    rows = t + 3 if padded else t                                # bucket padding after the live rows
    q = torch.randn(rows, HEADS, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(rows, KV_HEADS, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(rows, KV_HEADS, d, generator=g, device=device, dtype=dtype)
    outs = []
    for use_varlen in (False, True):
        meta = build_inputs(chunks, block_size, torch.device(device), window, varlen=use_varlen).attn
        assert (meta.varlen is not None) == use_varlen
        if padded:
            meta = dataclasses.replace(meta, num_tokens=t)
        kv = tuple(c.clone() for c in caches)
        outs.append((attend(q, k, v, kv, meta, d ** -0.5), kv))
    (sdpa, sdpa_kv), (flash, flash_kv) = outs
    return sdpa, flash, sdpa_kv, flash_kv


@pytest.fixture
def reference(monkeypatch):
    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen_attn)
    monkeypatch.setattr(varlen, "refusal", lambda q, k_cache, meta: None)   # the CPU takes the path
    monkeypatch.setattr(varlen, "STATS", varlen.VarlenStats())
    return varlen


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("step", [mixed_step, decode_step])
def test_varlen_path_matches_sdpa(reference, monkeypatch, paged, window, step):
    block_size = 4
    if paged:                          # the page-size rule scaled down to a tiny cache
        monkeypatch.setattr(varlen, "PAGE_MULTIPLE", block_size)
    chunks = step(block_size)
    meta = build_inputs(chunks, block_size, torch.device("cpu"), window, varlen=True).attn.varlen
    assert (meta.block_table is not None) == paged and (meta.kv_index is None) == paged
    sdpa, flash, sdpa_kv, flash_kv = run_both(chunks, block_size, window)
    assert varlen.STATS.calls == 1 and not varlen.STATS.fallbacks
    torch.testing.assert_close(flash, sdpa, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(sdpa_kv, flash_kv))


def test_bucket_padding_rows_stay_out_of_the_kernel(reference):
    sdpa, flash, _, _ = run_both(mixed_step(4), 4, None, padded=True)
    torch.testing.assert_close(flash, sdpa, atol=1e-5, rtol=1e-5)
    assert not flash[-3:].any()


def test_first_release_signature(reference, monkeypatch):
    monkeypatch.setattr(varlen, "varlen_attn", first_release_varlen_attn)
    assert not varlen.paged_layout(varlen.PAGE_MULTIPLE)            # no pages in that signature
    sdpa, flash, _, _ = run_both(mixed_step(4), 4, None)
    torch.testing.assert_close(flash, sdpa, atol=1e-5, rtol=1e-5)
    windowed = build_inputs(mixed_step(4), 4, torch.device("cpu"), 7, varlen=True).attn.varlen
    assert "sliding window" in real_refusal(torch.zeros(1, HEADS, 16), torch.zeros(4, KV_HEADS, 16), windowed)


def test_a_refused_step_runs_sdpa_warned_once_and_counted(monkeypatch, caplog):
    monkeypatch.setattr(varlen, "STATS", varlen.VarlenStats())
    reason = "a reason only this test gives"
    monkeypatch.setattr(varlen, "refusal", lambda q, k_cache, meta: reason)
    monkeypatch.setattr(varlen, "varlen_attn", None)                 # never called
    with caplog.at_level(logging.WARNING, logger=varlen.__name__):
        sdpa, flash, _, _ = run_both(mixed_step(4), 4, None)
        run_both(decode_step(4), 4, None)
    assert torch.equal(flash, sdpa)
    assert varlen.STATS.fallbacks == {reason: 2} and varlen.STATS.calls == 0
    warned = [r.getMessage() for r in caplog.records if r.name == varlen.__name__]
    assert len(warned) == 1 and reason in warned[0]


def test_the_cpu_refuses_the_kernel():
    meta = build_inputs(decode_step(4), 4, torch.device("cpu"), varlen=True).attn.varlen
    assert real_refusal(torch.zeros(4, HEADS, 16, dtype=torch.bfloat16),
                        torch.zeros(4, KV_HEADS, 16, dtype=torch.bfloat16), meta) == "queries on cpu"


def test_cpu_steps_build_no_varlen_metadata():
    attn = build_inputs(mixed_step(4), 4, torch.device("cpu")).attn
    assert attn.varlen is None and attn.parts is not None


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("step", [mixed_step, decode_step])
def test_flash_varlen_matches_sdpa_on_the_gpu(monkeypatch, block_size, window, step):
    if not torch.cuda.is_available():
        pytest.fail("the cuda tests need an NVIDIA GPU (deselect them with -m 'not cuda')")
    monkeypatch.setattr(varlen, "STATS", varlen.VarlenStats())
    chunks = step(block_size)
    meta = build_inputs(chunks, block_size, torch.device("cuda"), window).attn
    assert meta.varlen is not None and meta.token_keys is None
    assert (meta.varlen.block_table is not None) == varlen.paged_layout(block_size)
    sdpa, flash, sdpa_kv, flash_kv = run_both(chunks, block_size, window, torch.bfloat16, "cuda")
    assert varlen.STATS.fallbacks == {} and varlen.STATS.calls == 1, varlen.STATS
    torch.testing.assert_close(flash.float(), sdpa.float(), atol=3e-2, rtol=3e-2)     # bf16 roundings
    assert (flash.float() - sdpa.float()).abs().mean() < 4e-3
    assert all(torch.equal(a, b) for a, b in zip(sdpa_kv, flash_kv))
