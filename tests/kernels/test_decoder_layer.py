"""decoder_layer_bf16 (a whole Llama-family layer) and context_kv_bf16 (a drafter layer's context
K/V) against pure-torch references that round to bf16 where the kernels do."""

import pytest
import torch

from kernel_inputs import BF16, Layer, context_kv_args, decoder_layer_args


def _rms(x, w, eps):
    """Normalised in fp32, rounded, then scaled by the bf16 weight (as RMSNorm in bf16)."""
    xf = x.float()
    return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(BF16) * w).to(BF16)


def _rotate(x, cos, sin):
    """Rotate-half rotary embedding of x [T, H, D] with cos, sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]       # each product rounded, then the sum


def _linear(x, w, b=None):
    out = x.float() @ w.float().t()
    return (out if b is None else out + b.float()).to(BF16)


def _attend(q, keys, values, scale):
    """q [H, D] over keys, values [L, KVH, D] -> [H, D] (fp32 softmax)."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q)
    group = q.shape[0] // keys.shape[1]
    k, v = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("hd,lhd->hl", q.float(), k) * scale, -1)
    return torch.einsum("hl,lhd->hd", p, v).to(BF16)


def _cache_rows(cache, tables, block_size, r, begin, end):
    pos = torch.arange(begin, end)
    return cache[tables[r, pos // block_size] * block_size + pos % block_size]


def decoder_layer_reference(layer, x, cos, sin, k_cache, v_cache, slots, tables, keys, block_size, live,
                            block_rows):
    t, L = x.shape[0], layer
    qkv = _linear(_rms(x, L.input_norm, L.eps), L.qkv, L.qkv_bias)
    q = qkv[:, :L.q_size].view(t, L.heads, L.dim)
    k = qkv[:, L.q_size:L.q_size + L.kv_size].view(t, L.kv_heads, L.dim)
    v = qkv[:, L.q_size + L.kv_size:].view(t, L.kv_heads, L.dim)
    if L.q_norm is not None:
        q, k = _rms(q, L.q_norm, L.eps), _rms(k, L.k_norm, L.eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    for row, s in enumerate(slots.tolist()):
        if s >= 0:
            k_cache[s], v_cache[s] = k[row], v[row]
    attn = torch.zeros(t, L.q_size, dtype=BF16)
    for row, (r, begin, end) in enumerate(keys[:live].tolist()):
        ks = _cache_rows(k_cache, tables, block_size, r, begin, end)
        vs = _cache_rows(v_cache, tables, block_size, r, begin, end)
        if block_rows:
            group = slice(row // block_rows * block_rows, (row // block_rows + 1) * block_rows)
            ks, vs = torch.cat([ks, k[group]]), torch.cat([vs, v[group]])
        attn[row] = _attend(q[row], ks, vs, L.scale).flatten()
    x = x + _linear(attn, L.o)
    gate, up = _linear(_rms(x, L.post_norm, L.eps), L.gate_up).chunk(2, -1)
    return x + _linear(torch.nn.functional.silu(gate) * up, L.down)


def _close(a, b):
    return torch.allclose(a.float(), b.float(), rtol=2 ** -6, atol=2e-2)


@pytest.mark.parametrize("qk_norm,bias", [(True, False), (False, True)])       # Qwen3-like; Qwen2-like
@pytest.mark.parametrize("block_rows", [0, 2])                                # verify step; draft blocks
def test_decoder_layer_matches_a_torch_layer_and_writes_the_same_kv(amx, qk_norm, bias, block_rows):
    layer = Layer(seed=3, qk_norm=qk_norm, bias=bias)
    args = decoder_layer_args(layer, amx, block_rows)
    x, cos, sin, k_cache, v_cache, slots, tables, keys, block_size, live = (
        args[0], args[1], args[2], args[12], args[13], args[14], args[15], args[16], args[17], args[18])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = decoder_layer_reference(layer, x, cos, sin, ref_k, ref_v, slots, tables, keys, block_size, live,
                                  block_rows)
    written = slots.tolist()
    out = torch.ops.dspark_cpu.decoder_layer_bf16(*args)
    assert out.shape == x.shape and out.dtype == BF16
    assert _close(out, ref)
    untouched = [s for s in range(k_cache.shape[0]) if s not in written]
    assert torch.equal(k_cache[untouched], ref_k[untouched]) and torch.equal(v_cache[untouched], ref_v[untouched])
    assert _close(k_cache[written], ref_k[written]) and _close(v_cache[written], ref_v[written])


def context_kv_reference(layer, h, cos, sin, k_cache, v_cache, slots):
    kv = _linear(h, layer.qkv[layer.q_size:])
    k = kv[:, :layer.kv_size].view(-1, layer.kv_heads, layer.dim)
    v = kv[:, layer.kv_size:].view(-1, layer.kv_heads, layer.dim)
    if layer.k_norm is not None:
        k = _rms(k, layer.k_norm, layer.eps)
    k = _rotate(k, cos, sin)
    for row, s in enumerate(slots.tolist()):
        if s >= 0:
            k_cache[s], v_cache[s] = k[row], v[row]


@pytest.mark.parametrize("k_norm", [True, False])
def test_context_kv_matches_torch_and_stores_only_its_slots(amx, k_norm):
    layer = Layer(seed=4, qk_norm=k_norm)
    args = context_kv_args(layer, amx)
    h, cos, sin, _, _, k_cache, v_cache, slots = args[:8]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    context_kv_reference(layer, h, cos, sin, ref_k, ref_v, slots)
    assert torch.ops.dspark_cpu.context_kv_bf16(*args) is None
    written = [s for s in slots.tolist() if s >= 0]
    untouched = [s for s in range(k_cache.shape[0]) if s not in written]
    assert torch.equal(k_cache[untouched], ref_k[untouched]) and torch.equal(v_cache[untouched], ref_v[untouched])
    assert _close(k_cache[written], ref_k[written]) and _close(v_cache[written], ref_v[written])
