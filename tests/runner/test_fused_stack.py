"""The fused decoder layer (one kernel call per layer for small bf16 steps) against the modules."""

import dataclasses

import pytest
import torch

from dspark.runner.fused_cpu import fuse_small_steps, row_slots
from dspark.kernels import cpu as cpu_kernels
from dspark.runner.setup import pack_for_inference
from dspark.models.loader import load_target
from dspark.worker.inputs import RequestChunk, build_inputs
from tiny import save_tiny

BF16 = torch.bfloat16
BLOCK = 4


def _target(tmp_path, family):
    save_tiny(str(tmp_path), family, tied=family != "qwen2")
    target = load_target(str(tmp_path), BF16)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():            # the checkpoint's norms are ones and its biases zeros
        for name, p in target.model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.copy_(1.0 * name.endswith("weight") + 0.3 * torch.randn(p.shape, generator=g))
    pack_for_inference(target.model, None)
    fused = fuse_small_steps(target.model)
    assert fused is not None
    return target.model, fused


def _caches(model, num_blocks, seed):
    """Random K/V everywhere: context keys the step reads and slots it must not touch."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    shape = (num_blocks * BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.randn(shape, generator=g).to(BF16), torch.randn(shape, generator=g).to(BF16))
            for _ in range(cfg.num_layers)]


def _step(chunks, pad_to=None):
    inp = build_inputs(chunks, BLOCK, torch.device("cpu"))
    ids, pos, meta = inp.input_ids, inp.positions, inp.attn
    live = ids.shape[0]
    if pad_to is not None:                  # a graph bucket's dummy rows past the live ones
        ids = torch.cat([ids, ids.new_zeros(pad_to - live)])
        pos = torch.cat([pos, pos.new_zeros(pad_to - live)])
        meta = dataclasses.replace(meta, num_tokens=live)
    return ids, pos, meta, live


def _ops(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


STEPS = {
    "decode": [RequestChunk([5], 13, [3, 0, 7, 1], 1), RequestChunk([9], 2, [5], 1),
               RequestChunk([17], 8, [2, 6, 4], 1)],
    "verify": [RequestChunk([5, 8, 2, 11, 30], 9, [3, 0, 7, 1], 5), RequestChunk([9, 1, 4], 2, [5, 8], 3)],
    "dummy_request": [RequestChunk([5, 8, 2], 6, [3, 0, 7], 3), RequestChunk([0, 0], 0, [-1], 1)],
    # 16 rows: two chunks of 8 rows in every vector projection
    "full_verify": [RequestChunk([7 + i, 8, 2, 11, 30, 6, 1, 3], i, [8 + 3 * i, 9 + 3 * i, 10 + 3 * i], 8)
                    for i in range(2)],
    # 30 rows: two blocks of 16 rows in every AMX projection, two column tiles at a time without
    "wide_verify": [RequestChunk([7 + i, 8, 2, 11, 30], i, [8 + 3 * i, 9 + 3 * i, 10 + 3 * i], 5) for i in range(6)],
}
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("pad", [False, True])
def test_fused_layers_agree_with_the_modules_and_write_the_same_kv(tmp_path, amx, family, step, pad):
    model, fused = _target(tmp_path, family)
    assert fused.amx == amx
    rows = sum(len(c.token_ids) for c in STEPS[step])
    ids, pos, meta, live = _step(STEPS[step], (16 if rows <= 16 else 64) if pad else None)
    assert fused.takes(ids.shape[0], meta)
    aux_ids = (-1, 0, 1)
    fused_caches, module_caches = _caches(model, 32, seed=1), _caches(model, 32, seed=1)
    with torch.inference_mode():
        ops = _ops(lambda: fused.run(model, ids, pos, meta, fused_caches, aux_ids))
        assert "dspark_cpu::decoder_layer_bf16" in ops and "aten::rsqrt" not in ops   # no module norm
        fused_caches = _caches(model, 32, seed=1)
        x, aux = fused.run(model, ids, pos, meta, fused_caches, aux_ids)
        ref_meta = dataclasses.replace(meta, num_tokens=None)
        ref_x, ref_aux = model.run_stack(ids[:live], pos[:live], ref_meta, module_caches, aux_ids)
    assert x.shape[0] == ids.shape[0] and torch.isfinite(x).all()
    assert torch.allclose(x[:live].float(), ref_x.float(), rtol=2 ** -6, atol=2e-2)
    assert torch.allclose(aux[:live].float(), ref_aux.float(), rtol=2 ** -6, atol=2e-2)
    written = torch.zeros(fused_caches[0][0].shape[0], dtype=torch.bool)
    written[meta.write_slots] = True
    for (fk, fv), (mk, mv) in zip(fused_caches, module_caches):
        assert torch.equal(fk[~written], mk[~written]) and torch.equal(fv[~written], mv[~written])
        assert torch.allclose(fk[written].float(), mk[written].float(), rtol=2 ** -7, atol=1e-2)
        assert torch.allclose(fv[written].float(), mv[written].float(), rtol=2 ** -7, atol=1e-2)
        assert not torch.equal(fk[written], _caches(model, 32, seed=1)[0][0][written])


def test_a_row_gives_the_same_bits_alone_and_in_a_padded_bucket(tmp_path, amx):
    model, fused = _target(tmp_path, "llama")
    chunk = RequestChunk([5], 13, [3, 0, 7, 1], 1)
    outs = []
    for pad_to in (None, 8):
        ids, pos, meta, _ = _step([chunk], pad_to)
        with torch.inference_mode():
            outs.append(fused.run(model, ids, pos, meta, _caches(model, 9, seed=2), ())[0][:1])
    assert torch.equal(outs[0], outs[1])


def test_steps_the_fused_layers_do_not_take(tmp_path, amx):
    _, fused = _target(tmp_path, "llama")
    assert fused.max_rows == cpu_kernels.MAX_ROWS
    _, _, meta, _ = _step([RequestChunk(list(range(17)), 0, [0, 1, 2, 3, 4], 1)])
    assert not fused.takes(17, meta)                                    # a longer query than it serves
    _, _, meta, _ = _step(STEPS["decode"])
    assert fused.takes(fused.max_rows, meta) and not fused.takes(fused.max_rows + 1, meta)   # bucket rows
    assert fused.takes(3, meta)
    assert not fused.takes(3, dataclasses.replace(meta, token_keys=None))
    assert not fused.takes(3, dataclasses.replace(meta, num_tokens=0))   # an all-dummy step
    assert not fused.takes(3, dataclasses.replace(meta, max_q=cpu_kernels.MAX_QUERY + 1))


def test_row_slots_mark_rows_that_store_nothing():
    _, _, meta, live = _step(STEPS["dummy_request"])
    assert meta.write_rows is not None
    # positions 6, 7, 8 -> blocks 0, 0, 7 of the table; the dummy's two rows store nothing
    assert row_slots(meta, live).tolist() == [0 * BLOCK + 2, 0 * BLOCK + 3, 7 * BLOCK + 0, -1, -1]
    _, _, meta, live = _step(STEPS["decode"])
    assert row_slots(meta, live).tolist() == [1 * BLOCK + 1, 5 * BLOCK + 2, 4 * BLOCK + 0]


def test_the_kernel_refuses_keys_outside_the_block_table(tmp_path, amx):
    model, fused = _target(tmp_path, "llama")
    ids, pos, meta, _ = _step(STEPS["decode"])
    bad = meta.token_keys.clone()
    bad[1, 2] = 99
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside its request's block table"):
        fused.run(model, ids, pos, dataclasses.replace(meta, token_keys=bad), _caches(model, 9, seed=3), ())


def test_without_the_kernels_there_is_no_fused_stack(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    save_tiny(str(tmp_path), "llama", True)
    target = load_target(str(tmp_path), BF16)
    pack_for_inference(target.model, None)
    assert fuse_small_steps(target.model) is None
