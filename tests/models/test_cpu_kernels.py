"""dspark's bf16 kernel for projections of one to eight rows (AVX512-BF16 CPUs)."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from dspark.models.layers import cpu_kernels
from dspark.models.layers.linear import Linear, linear, pack_for_inference, pack_linears
from dspark.models.loader import load_target
from tiny import save_tiny

BF16 = torch.bfloat16
needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="needs AVX512-BF16 and a C++ compiler")


def _reference(x, w, b):
    """fp32 product of the same bf16 values, rounded once to bf16."""
    out = x.float() @ w.float().t()
    return (out if b is None else out + b.float()).to(BF16)


@needs_kernel
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (7, 100), (33, 1536), (4, 31), (1, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_an_fp32_product_for_every_row_count(out_f, in_f, bias):
    g = torch.Generator().manual_seed(out_f * in_f)
    w = torch.randn(out_f, in_f, generator=g).to(BF16)
    b = torch.randn(out_f, generator=g).to(BF16) if bias else None
    for rows in range(1, cpu_kernels.MAX_ROWS + 1):
        x = torch.randn(rows, in_f, generator=g).to(BF16)
        got, ref = cpu_kernels.gemv(x, w, b).float(), _reference(x, w, b).float()
        # only the fp32 summation order differs: within one bf16 step of the reference
        assert torch.all((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2), (rows, out_f, in_f)


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_beside_others():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 200, generator=g).to(BF16)
    b = torch.randn(130, generator=g).to(BF16)
    x = torch.randn(cpu_kernels.MAX_ROWS, 200, generator=g).to(BF16)
    alone = torch.cat([cpu_kernels.gemv(x[i:i + 1], w, b) for i in range(x.shape[0])])
    for rows in range(2, cpu_kernels.MAX_ROWS + 1):
        assert torch.equal(cpu_kernels.gemv(x[:rows], w, b), alone[:rows])


@needs_kernel
def test_kernel_refuses_what_it_cannot_take():
    w = torch.randn(8, 32).to(BF16)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        cpu_kernels.gemv(torch.randn(9, 32).to(BF16), w)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.gemv(torch.randn(1, 32), w)
    with pytest.raises(RuntimeError, match=r"x \[M, I\]"):
        cpu_kernels.gemv(torch.randn(1, 16).to(BF16), w)


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_a_native_linear_routes_small_steps_to_the_kernel_and_large_ones_to_onednn(bias):
    torch.manual_seed(0)
    lin = Linear(96, 80, bias=bias).to(BF16).requires_grad_(False)
    dense = lin.weight.clone()
    assert pack_linears(lin, drop_dense=True, native=True) == 1
    assert lin.native and torch.equal(lin.weight, dense)          # the kernel needs the plain rows
    small, large = torch.randn(2, 4, 96).to(BF16), torch.randn(9, 96).to(BF16)
    assert "dspark_cpu::gemv_bf16" in _ops(lambda: lin(small))
    assert "dspark_cpu::gemv_bf16" not in _ops(lambda: lin(large))
    assert torch.equal(lin(small), cpu_kernels.gemv(small.view(8, 96), dense, lin.bias).view(2, 4, 80))
    assert torch.equal(lin(large), linear(large, dense, None, lin.bias))


@needs_kernel
def test_compiled_graph_calls_the_kernel_and_matches_eager():
    torch.manual_seed(0)
    lin = Linear(64, 48 + 3, bias=False).to(BF16).requires_grad_(False)   # a shape of its own
    pack_linears(lin, drop_dense=True, native=True)
    compiled = torch.compile(lambda x: torch.relu(lin(x)) * 2, fullgraph=True, dynamic=False)
    x = torch.randn(1, 64).to(BF16)
    out, code = run_and_get_code(compiled, x)
    assert torch.equal(out, torch.relu(lin(x)) * 2)
    assert "dspark_cpu.gemv_bf16" in "\n".join(code)


def test_without_the_kernel_packing_drops_the_plain_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    save_tiny(str(tmp_path), "llama", True)
    target = load_target(str(tmp_path), BF16)
    pack_for_inference(target.model, None)
    down = target.model.layers[0].mlp.down_proj
    assert not down.native and down.weight.numel() == 0 and down.packed is not None
    x = torch.randn(1, down.in_features).to(BF16)
    assert "dspark_cpu::gemv_bf16" not in _ops(lambda: down(x))


@needs_kernel
def test_one_token_logits_through_the_kernel_agree_with_onednn(tmp_path):
    save_tiny(str(tmp_path), "qwen2", False)                      # q/k/v biases too
    ids = torch.tensor([[5, 9, 17, 3, 44, 2]])
    outs = []
    for native in (True, False):
        target = load_target(str(tmp_path), BF16)
        for layer in target.model.layers:
            pack_linears(layer, drop_dense=True, native=native)
        pack_linears(target.model.lm_head, drop_dense=False, native=native)
        x = target.model.embed_tokens(ids[0, -1:])
        layer = target.model.layers[0]
        outs.append((layer.mlp(x), layer.self_attn.qkv_proj(x), target.model.lm_head(x)))
    for a, b in zip(*outs):
        assert a.shape == b.shape
        assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-2)


def _paged(r, kv_heads, d, block_size, kv_len, seed):
    """Random caches and shuffled block tables for r requests of kv_len keys."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-kv_len // block_size)
    slots = (r * nb + 3) * block_size
    k_cache = torch.randn(slots, kv_heads, d, generator=g).to(BF16)
    v_cache = torch.randn(slots, kv_heads, d, generator=g).to(BF16)
    tables = torch.randperm(r * nb + 3, generator=g)[:r * nb].view(r, nb)
    return k_cache, v_cache, tables, g


def _attention_reference(q, k_cache, v_cache, tables, mask, block_size, kv_len, scale):
    """fp32 softmax attention of each request over its keys, read slot by slot."""
    r, h, d = q.shape
    pos = torch.arange(kv_len)
    slots = tables[:, pos // block_size] * block_size + pos % block_size           # [R, L]
    group = h // k_cache.shape[1]
    keys = k_cache[slots].float().repeat_interleave(group, 2)                       # [R, L, H, D]
    values = v_cache[slots].float().repeat_interleave(group, 2)
    scores = torch.einsum("rhd,rlhd->rhl", q.float(), keys) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("rhl,rlhd->rhd", scores.softmax(-1), values)


@needs_kernel
@pytest.mark.parametrize("r,heads,kv_heads,d,block_size,kv_len,masked", [
    (1, 9, 3, 64, 16, 100, False), (4, 8, 2, 80, 4, 37, True), (3, 4, 4, 16, 8, 5, True),
    (2, 6, 1, 128, 16, 300, True)])
def test_decode_attention_matches_an_fp32_reference(r, heads, kv_heads, d, block_size, kv_len, masked):
    k_cache, v_cache, tables, g = _paged(r, kv_heads, d, block_size, kv_len, seed=r * d + kv_len)
    q = torch.randn(r, heads, d, generator=g).to(BF16)
    mask = None
    if masked:          # requests of different lengths, and a sliding window's hole at the start
        lens = torch.randint(1, kv_len + 1, (r,), generator=g)
        lens[0] = kv_len
        mask = torch.arange(kv_len)[None, :] < lens[:, None]
        mask[-1, :kv_len // 3] = kv_len < 3
    out = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, mask, block_size, kv_len, d ** -0.5)
    ref = _attention_reference(q, k_cache, v_cache, tables, mask, block_size, kv_len, d ** -0.5)
    assert out.shape == q.shape and out.dtype == BF16
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=2e-3)


@needs_kernel
def test_bf16_decode_steps_take_the_kernel_and_agree_with_the_torch_path():
    from dspark.models.layers.attention import AttentionMetadata, decode_attention, gather_blocks, paged_attention
    k_cache, v_cache, tables, g = _paged(3, 2, 32, 4, 19, seed=5)
    mask = torch.arange(19)[None, :] < torch.tensor([19, 7, 12])[:, None]
    meta = AttentionMetadata(num_reqs=3, max_q=1, write_rows=None, write_slots=torch.zeros(0, dtype=torch.long),
                             block_tables=tables, block_size=4, kv_len=19, q_index=None,
                             mask=mask[:, None, None, :])
    q = torch.randn(3, 6, 32, generator=g).to(BF16)
    ops = _ops(lambda: paged_attention(q, k_cache, v_cache, meta, 0.2))
    assert "dspark_cpu::decode_attention_bf16" in ops and "aten::bmm" not in ops
    torch_path = decode_attention(q, gather_blocks(k_cache, tables, 4, 19), gather_blocks(v_cache, tables, 4, 19),
                                  meta.mask, 0.2).reshape(3, -1)
    assert torch.allclose(paged_attention(q, k_cache, v_cache, meta, 0.2).float(), torch_path.float(),
                          rtol=2 ** -6, atol=1e-2)
    assert "dspark_cpu::decode_attention_bf16" not in _ops(          # fp32 stays on torch's path
        lambda: paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.2))
