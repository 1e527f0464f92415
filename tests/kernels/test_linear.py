"""amx_pack (the tile-by-tile weight copy) and linear_bf16 (projections of a few rows, through AMX
tiles or AVX512-BF16 dot products) against torch, and how the Linear layer routes to them."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.profiler import ProfilerActivity, profile

from dspark.kernels import cpu as kernels
from dspark.models.layers.linear import Linear, linear, pack_linears
from dspark.models.loader import load_target
from dspark.runner.setup import pack_for_inference
from kernel_paths import PATH_MARKS
from tiny import save_tiny

BF16 = torch.bfloat16


def pack_reference(w):
    """[out, in] zero-padded to whole 16 x 32 tiles; tile (o, k) holds input pairs as rows of 16
    output columns, the two values of a pair side by side."""
    out, cols = w.shape
    ob, kb = -(-out // 16), -(-cols // 32)
    padded = torch.zeros(ob * 16, kb * 32, dtype=w.dtype)
    padded[:out, :cols] = w
    return padded.view(ob, 16, kb, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


@PATH_MARKS[False]
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (7, 100), (33, 1536), (1, 64)])
def test_amx_pack_lays_the_weight_out_tile_by_tile(out_f, in_f):
    w = torch.randn(out_f, in_f).to(BF16)
    assert torch.equal(kernels.pack_tiles(w), pack_reference(w))


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
    tiles = kernels.pack_tiles(w)
    for rows in range(1, kernels.MAX_ROWS + 1):
        x = torch.randn(rows, in_f, generator=g).to(BF16)
        got, ref = kernels.tile_linear(x, tiles, out_f, b, amx).float(), _reference(x, w, b).float()
        # only the fp32 summation order differs: within one bf16 step of the reference
        assert torch.all((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2), (rows, out_f, in_f)


@pytest.mark.parametrize("in_f", [200, 576])           # x copied into whole tiles; x read in place
def test_a_row_gives_the_same_bits_alone_and_beside_others(in_f, amx):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, in_f, generator=g).to(BF16)
    b = torch.randn(130, generator=g).to(BF16)
    tiles = kernels.pack_tiles(w)
    x = torch.randn(kernels.MAX_ROWS, in_f, generator=g).to(BF16)
    alone = torch.cat([kernels.tile_linear(x[i:i + 1], tiles, 130, b, amx) for i in range(x.shape[0])])
    for rows in range(2, kernels.MAX_ROWS + 1):
        assert torch.equal(kernels.tile_linear(x[:rows], tiles, 130, b, amx), alone[:rows])


def test_tile_linear_refuses_what_it_cannot_take(amx):
    tiles = kernels.pack_tiles(torch.randn(8, 32).to(BF16))
    with pytest.raises(RuntimeError, match=f"1 to {kernels.MAX_ROWS} bf16 rows"):
        kernels.tile_linear(torch.randn(kernels.MAX_ROWS + 1, 32).to(BF16), tiles, 8, None, amx)
    with pytest.raises(RuntimeError, match=f"1 to {kernels.MAX_ROWS} bf16 rows"):
        kernels.tile_linear(torch.randn(1, 32), tiles, 8, None, amx)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernels.tile_linear(torch.randn(1, 64).to(BF16), tiles, 8, None, amx)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernels.tile_linear(torch.randn(1, 32).to(BF16), tiles, 17, None, amx)


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
    small, large = torch.randn(2, 8, 96).to(BF16), torch.randn(kernels.tile_rows(amx) + 1, 96).to(BF16)
    assert "dspark_cpu::linear_bf16" in _ops(lambda: lin(small))
    assert "dspark_cpu::linear_bf16" not in _ops(lambda: lin(large))
    expected = kernels.tile_linear(small.view(16, 96), kernels.pack_tiles(dense), 80, lin.bias, amx)
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
    monkeypatch.setattr(kernels, "available", lambda: False)
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
