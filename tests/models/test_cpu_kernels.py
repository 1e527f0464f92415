"""dspark's CPU kernels: bf16 projections of a few rows (AMX or AVX512-BF16) and short-query attention."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from dspark.models.layers import cpu_kernels
from dspark.models.layers.linear import Linear, linear, pack_for_inference, pack_linears
from dspark.models.loader import load_target
from conftest import KERNEL_PATHS, PATH_MARKS
from tiny import save_tiny

BF16 = torch.bfloat16
needs_kernels = PATH_MARKS[False]


def _reference(x, w, b):
    """fp32 product of the same bf16 values, rounded once to bf16."""
    out = x.float() @ w.float().t()
    return (out if b is None else out + b.float()).to(BF16)


@pytest.mark.parametrize("out_f,in_f", [(960, 576), (7, 100), (33, 1536), (4, 31), (1, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_linear_matches_an_fp32_product_for_every_row_count(out_f, in_f, bias, amx):
    g = torch.Generator().manual_seed(out_f * in_f)
    w = torch.randn(out_f, in_f, generator=g).to(BF16)
    b = torch.randn(out_f, generator=g).to(BF16) if bias else None
    tiles = cpu_kernels.pack_tiles(w)
    assert tiles.shape == (-(-out_f // 16), -(-in_f // 32), 16, 16, 2)
    for rows in range(1, cpu_kernels.MAX_ROWS + 1):
        x = torch.randn(rows, in_f, generator=g).to(BF16)
        got, ref = cpu_kernels.tile_linear(x, tiles, out_f, b, amx).float(), _reference(x, w, b).float()
        # only the fp32 summation order differs: within one bf16 step of the reference
        assert torch.all((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2), (rows, out_f, in_f)


@pytest.mark.parametrize("in_f", [200, 576])           # x copied into whole tiles; x read in place
def test_a_row_gives_the_same_bits_alone_and_beside_others(in_f, amx):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, in_f, generator=g).to(BF16)
    b = torch.randn(130, generator=g).to(BF16)
    tiles = cpu_kernels.pack_tiles(w)
    x = torch.randn(cpu_kernels.MAX_ROWS, in_f, generator=g).to(BF16)
    alone = torch.cat([cpu_kernels.tile_linear(x[i:i + 1], tiles, 130, b, amx) for i in range(x.shape[0])])
    for rows in range(2, cpu_kernels.MAX_ROWS + 1):
        assert torch.equal(cpu_kernels.tile_linear(x[:rows], tiles, 130, b, amx), alone[:rows])


def test_tile_linear_refuses_what_it_cannot_take(amx):
    tiles = cpu_kernels.pack_tiles(torch.randn(8, 32).to(BF16))
    with pytest.raises(RuntimeError, match="1 to 64 bf16 rows"):
        cpu_kernels.tile_linear(torch.randn(cpu_kernels.MAX_ROWS + 1, 32).to(BF16), tiles, 8, None, amx)
    with pytest.raises(RuntimeError, match="1 to 64 bf16 rows"):
        cpu_kernels.tile_linear(torch.randn(1, 32), tiles, 8, None, amx)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_kernels.tile_linear(torch.randn(1, 64).to(BF16), tiles, 8, None, amx)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_kernels.tile_linear(torch.randn(1, 32).to(BF16), tiles, 17, None, amx)


def _ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("bias", [False, True])
def test_small_steps_take_the_tiles_and_large_ones_onednn(bias, amx):
    torch.manual_seed(0)
    lin = Linear(96, 80, bias=bias).to(BF16).requires_grad_(False)
    dense = lin.weight.clone()
    assert pack_linears(lin, drop_dense=True, tiles=True) == 1
    assert lin.tiles is not None and lin.weight.numel() == 0 and lin.amx == amx
    small, large = torch.randn(2, 8, 96).to(BF16), torch.randn(cpu_kernels.tile_rows(amx) + 1, 96).to(BF16)
    assert "dspark_cpu::linear_bf16" in _ops(lambda: lin(small))
    assert "dspark_cpu::linear_bf16" not in _ops(lambda: lin(large))
    expected = cpu_kernels.tile_linear(small.view(16, 96), cpu_kernels.pack_tiles(dense), 80, lin.bias, amx)
    assert torch.equal(lin(small), expected.view(2, 8, 80))
    assert torch.equal(lin(large), linear(large, dense, None, lin.bias))


def test_compiled_graph_calls_the_tile_kernel_and_matches_eager(amx):
    torch.manual_seed(0)
    lin = Linear(64, 48 + 3, bias=False).to(BF16).requires_grad_(False)   # a shape of its own
    pack_linears(lin, drop_dense=True, tiles=True)
    compiled = torch.compile(lambda x: torch.relu(lin(x)) * 2, fullgraph=True, dynamic=False)
    x = torch.randn(1, 64).to(BF16)
    out, code = run_and_get_code(compiled, x)
    assert torch.equal(out, torch.relu(lin(x)) * 2)
    assert "dspark_cpu.linear_bf16" in "\n".join(code)


def test_without_the_kernels_packing_keeps_only_onednn(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    save_tiny(str(tmp_path), "llama", True)
    target = load_target(str(tmp_path), BF16)
    pack_for_inference(target.model, None)
    down = target.model.layers[0].mlp.down_proj
    assert down.tiles is None and down.weight.numel() == 0 and down.packed is not None
    x = torch.randn(1, down.in_features).to(BF16)
    assert "dspark_cpu::linear_bf16" not in _ops(lambda: down(x))


def test_one_token_outputs_through_the_tiles_agree_with_onednn(tmp_path, amx):
    save_tiny(str(tmp_path), "qwen2", False)                      # q/k/v biases too
    ids = torch.tensor([5, 9, 17, 3, 44, 2])
    outs = []
    for tiles in (True, False):
        target = load_target(str(tmp_path), BF16)
        for layer in target.model.layers:
            pack_linears(layer, drop_dense=True, tiles=tiles)
        pack_linears(target.model.lm_head, drop_dense=False, tiles=tiles)
        x = target.model.embed_tokens(ids)
        layer = target.model.layers[0]
        outs.append((layer.mlp(x[:1]), layer.self_attn.qkv_proj(x), target.model.lm_head(x[:3])))
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


def _attention_reference(q, k_cache, v_cache, tables, token_keys, block_size, scale):
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
    (1, 9, 3, 64, 16, 2001)])                     # the last: 1000 pairs of bf16-weighted values and an odd one
def test_paged_attention_matches_an_fp32_reference(r, heads, kv_heads, d, block_size, kv_len, tiles):
    k_cache, v_cache, tables, g = _paged(r, kv_heads, d, block_size, kv_len, seed=r * d + kv_len)
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
    out = cpu_kernels.paged_attention(q, k_cache, v_cache, tables, token_keys, block_size, d ** -0.5, tiles)
    ref = _attention_reference(q, k_cache, v_cache, tables, token_keys, block_size, d ** -0.5)
    assert out.shape == q.shape and out.dtype == BF16
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=2e-3)


@needs_kernels
@pytest.mark.parametrize("tiles", KERNEL_PATHS)
@pytest.mark.parametrize("block_size", [16, 5])
def test_a_token_attends_with_the_same_bits_alone_and_in_a_verify_block(block_size, tiles):
    """Greedy DSpark equals plain decoding only if a verify row computes what the decode row
    would: each token of an 8-token block (and of a padding token's neighbourhood) alone."""
    k_cache, v_cache, tables, g = _paged(2, 3, 64, block_size, 45, seed=block_size)
    rows = [[1, 0, 30]] + [[0, 0, 38 + j] for j in range(8)] + [[1, 0, 0]]      # decode, verify, padding
    token_keys = torch.tensor(rows)
    q = torch.randn(len(rows), 9, 64, generator=g).to(BF16)
    together = cpu_kernels.paged_attention(q, k_cache, v_cache, tables, token_keys, block_size, 0.125, tiles)
    for t, row in enumerate(rows):
        alone = cpu_kernels.paged_attention(q[t:t + 1], k_cache, v_cache, tables, torch.tensor([row]),
                                            block_size, 0.125, tiles)
        assert torch.equal(alone[0], together[t]), f"token {t} ({row})"
    assert not together[-1].any()                              # no keys: a zero row


@needs_kernels
def test_paged_attention_refuses_keys_outside_the_block_table():
    k_cache, v_cache, tables, g = _paged(2, 2, 32, 4, 8, seed=3)
    q = torch.randn(1, 4, 32, generator=g).to(BF16)
    for bad in ([2, 0, 3], [0, 0, 9], [1, 4, 3]):          # no such request; past its pages; reversed
        with pytest.raises(RuntimeError, match="outside its request"):
            cpu_kernels.paged_attention(q, k_cache, v_cache, tables, torch.tensor([bad]), 4, 0.2)


@needs_kernels
def test_bf16_decode_steps_take_the_kernel_and_agree_with_the_torch_path(monkeypatch):
    from dspark.models.layers.attention import paged_attention
    from dspark.worker.inputs import RequestChunk, build_inputs
    k_cache, v_cache, tables, g = _paged(3, 2, 32, 4, 19, seed=5)
    chunks = [RequestChunk([1], 18, tables[0].tolist(), 1), RequestChunk([2], 6, tables[1].tolist(), 1),
              RequestChunk([3], 11, tables[2].tolist(), 1)]
    meta = build_inputs(chunks, 4, torch.device("cpu")).attn
    assert meta.token_keys.tolist() == [[0, 0, 19], [1, 0, 7], [2, 0, 12]]
    q = torch.randn(3, 6, 32, generator=g).to(BF16)
    ops = _ops(lambda: paged_attention(q, k_cache, v_cache, meta, 0.2))
    assert "dspark_cpu::paged_attention_bf16" in ops and "aten::bmm" not in ops
    kernel = paged_attention(q, k_cache, v_cache, meta, 0.2)
    monkeypatch.setattr(cpu_kernels, "takes_attention", lambda *a: False)
    torch_path = paged_attention(q, k_cache, v_cache, meta, 0.2)
    assert torch.allclose(kernel.float(), torch_path.float(), rtol=2 ** -6, atol=1e-2)
    monkeypatch.undo()
    assert "dspark_cpu::paged_attention_bf16" not in _ops(          # fp32 stays on torch's path
        lambda: paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.2))


@needs_kernels
def test_greedy_tokens_answer_as_torch_argmax_does():
    """The first maximum (ties), the first NaN, an all -inf row; widths off the 16 lanes."""
    g = torch.Generator().manual_seed(11)
    for rows, width in [(8, 49152), (1, 49152), (5, 17), (3, 1), (64, 8192)]:
        x = torch.randn(rows, width, generator=g)
        assert torch.equal(cpu_kernels.greedy_tokens(x), x.argmax(-1)), (rows, width)
    x = torch.randn(5, 100, generator=g)
    x[0, 70] = x[0, 9] = x[0, 40] = 1e9                     # ties: the first wins
    x[1, 99] = 1e9                                          # in the last, partial lane block
    x[2, 30] = x[2, 60] = float("nan")                      # NaN counts as the maximum
    x[3] = -float("inf")
    x[4, 5], x[4, 80] = float("inf"), float("nan")
    got = cpu_kernels.greedy_tokens(x)
    assert got.tolist() == x.argmax(-1).tolist() == [9, 99, 30, 0, 80]
    assert cpu_kernels.greedy_tokens(x.to(BF16)).tolist() == x.to(BF16).argmax(-1).tolist()   # torch's path
