"""The drafter's fused block pass (decoder_layer_bf16 in block mode) against its modules."""

import pytest
import torch

from dspark.models.drafter_loader import load_drafter
from dspark.runner.fused_cpu import fuse_draft_blocks
from dspark.models.layers.attention import gather_blocks
from dspark.runner.setup import pack_for_inference
from dspark.models.loader import load_target
from dspark.sampling_params import SamplingParams
from dspark.spec.draft import propose
from dspark.spec.sampler import SamplingTensors
from tiny import save_random_drafter, save_tiny

BF16 = torch.bfloat16
BLOCK = 4


def _drafter(tmp_path, dtype):
    target = load_target(str(tmp_path / "t"), dtype)
    drafter = load_drafter(str(tmp_path / "d"), target.config, target.model.embed_tokens,
                           target.model.lm_head, dtype)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():            # the checkpoint's norms are ones
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return target, drafter


def _pair(tmp_path, num_layers=2):
    """A packed bf16 drafter, its fused layers and the same drafter unpacked in fp32 (the reference)."""
    save_tiny(str(tmp_path / "t"), "llama", True)
    save_random_drafter(str(tmp_path / "d"), str(tmp_path / "t"), gamma=4, num_layers=num_layers, std=0.15,
                        layer_ids=(-1, 0))
    target, drafter = _drafter(tmp_path, BF16)
    pack_for_inference(target.model, drafter)
    fused = fuse_draft_blocks(drafter)
    assert fused is not None
    return drafter, fused, _drafter(tmp_path, torch.float32)[1]


def _context(drafter, num_blocks=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    shape = (num_blocks * BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.randn(shape, generator=g).to(BF16), torch.randn(shape, generator=g).to(BF16))
            for _ in range(cfg.num_layers)]


def _blocks(drafter, starts):
    cfg = drafter.config
    r, s = len(starts), cfg.num_block_slots
    g = torch.Generator().manual_seed(5)
    ids = torch.full((r, s), cfg.mask_token_id)
    ids[:, 0] = torch.randint(0, cfg.vocab_size - 1, (r,), generator=g)
    starts = torch.tensor(starts)
    return ids, starts[:, None] + torch.arange(s)[None, :], starts


def _module_pass(drafter, ids, pos, kv, tables, st, dtype):
    length = max(int(st.max()), 1)
    ctx_k = [gather_blocks(k.to(dtype), tables, BLOCK, length).transpose(1, 2) for k, _ in kv]
    ctx_v = [gather_blocks(v.to(dtype), tables, BLOCK, length).transpose(1, 2) for _, v in kv]
    valid = torch.arange(length)[None, :] < st[:, None]
    return drafter.block_forward(ids, pos, ctx_k, ctx_v, valid).float()


@pytest.mark.parametrize("starts", [[9], [13, 0], [2, 7, 11], [1, 4, 6, 3, 9]])   # the last: 20 rows
def test_fused_block_pass_is_as_close_to_fp32_as_the_bf16_modules(tmp_path, starts, amx):
    drafter, blocks, reference = _pair(tmp_path)
    kv = _context(drafter)
    tables = torch.tensor([[3, 0, 7, 1], [5, 8, 2, 6], [10, 4, 11, 9], [1, 2, 3, 4], [6, 5, 0, 8]])[:len(starts)]
    ids, pos, st = _blocks(drafter, starts)
    before = [(k.clone(), v.clone()) for k, v in kv]
    with torch.inference_mode():
        fused = blocks.block_forward(drafter, ids, pos, kv, tables, st, BLOCK).float()
        modules = _module_pass(drafter, ids, pos, kv, tables, st, BF16)
        exact = _module_pass(reference, ids, pos, kv, tables, st, torch.float32)
    assert fused.shape == exact.shape
    fused_err, module_err = (fused - exact).abs(), (modules - exact).abs()
    assert fused_err.mean() <= 1.25 * module_err.mean() and fused_err.max() <= 2 * module_err.max()
    assert module_err.mean() < 0.05 * exact.abs().mean()        # bf16 rounding, not another function
    for (k, v), (k0, v0) in zip(kv, before):              # the block pass writes no context K/V
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_the_block_keys_and_the_context_both_count(tmp_path, amx):
    drafter, blocks, _ = _pair(tmp_path)
    tables = torch.tensor([[3, 0, 7, 1]])
    ids, pos, st = _blocks(drafter, [9])
    with torch.inference_mode():
        base = blocks.block_forward(drafter, ids, pos, _context(drafter), tables, st, BLOCK)
        other_ctx = blocks.block_forward(drafter, ids, pos, _context(drafter, seed=2), tables,
                                      st, BLOCK)
        ids2 = ids.clone()
        ids2[0, 0] = (ids[0, 0] + 1) % (drafter.config.vocab_size - 1)
        other_anchor = blocks.block_forward(drafter, ids2, pos, _context(drafter), tables,
                                         st, BLOCK)
    assert not torch.allclose(base, other_ctx, atol=1e-2)
    assert not torch.allclose(base[0, 1:], other_anchor[0, 1:], atol=1e-2)   # mask rows see the anchor


def test_propose_runs_the_fused_pass_and_drafts_what_the_modules_draft(tmp_path, amx):
    drafter, blocks, _ = _pair(tmp_path)
    kv = _context(drafter)
    tables = torch.tensor([[3, 0, 7, 1], [5, 8, 2, 6]])
    anchors, starts = torch.tensor([17, 40]), torch.tensor([9, 5])
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * 2, [None, None], drafter.config.vocab_size,
                               torch.device("cpu"))
    with torch.inference_mode(), torch.profiler.profile() as prof:
        fused = propose(drafter, kv, anchors, starts, tables, BLOCK, st, fused=blocks)
    assert "dspark_cpu::decoder_layer_bf16" in {e.key for e in prof.key_averages()}
    with torch.inference_mode():
        ref = propose(drafter, kv, anchors, starts, tables, BLOCK, st)
    assert fused.tokens.shape == ref.tokens.shape == (2, drafter.config.block_size)
    assert (fused.tokens == ref.tokens).float().mean() >= 0.75
    assert torch.allclose(fused.confidence_logits, ref.confidence_logits, atol=0.1)


@pytest.mark.parametrize("requests", [1, 3])
def test_the_greedy_markov_kernel_gives_the_module_loop_bit_for_bit(tmp_path, requests, amx):
    from dspark.spec.draft import _markov_loop
    drafter, blocks, _ = _pair(tmp_path)
    cfg = drafter.config
    g = torch.Generator().manual_seed(11)
    h = torch.randn(requests, cfg.block_size, cfg.hidden_size, generator=g).to(BF16)
    base = torch.randn(requests, cfg.block_size, cfg.draft_vocab_size, generator=g)
    anchors = torch.randint(0, cfg.vocab_size, (requests,), generator=g)
    with torch.inference_mode():                 # a tie at draft 1: U + B = 64 exactly at 5 and 9
        bias = drafter.markov_bias(drafter.markov_embed(anchors), h[:, 0], None)[0]
    base[0, 0, 5], base[0, 0, 9] = 64.0 - bias[0, 5], 64.0 - bias[0, 9]
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * requests, [None] * requests,
                               cfg.vocab_size, torch.device("cpu"))
    with torch.inference_mode(), torch.profiler.profile() as prof:
        fused = _markov_loop(drafter, h, base, anchors, None, st, blocks)
    assert "dspark_cpu::markov_greedy_bf16" in {e.key for e in prof.key_averages()}
    with torch.inference_mode():
        ref = _markov_loop(drafter, h, base, anchors, None, st)
    assert fused.tokens[0, 0] == 5                            # the first maximum, as torch's argmax
    assert torch.equal(fused.tokens, ref.tokens)
    assert torch.equal(fused.confidence_logits, ref.confidence_logits)
    assert fused.probs is None and ref.probs is None


@pytest.mark.parametrize("skip_rows", [False, True])
def test_fused_context_append_writes_what_the_modules_write(tmp_path, skip_rows, amx):
    from dspark.spec.draft import append_context
    drafter, blocks, _ = _pair(tmp_path)
    cfg = drafter.config
    g = torch.Generator().manual_seed(13)
    t = 7
    aux = torch.randn(t, len(cfg.target_layer_ids) * cfg.target_hidden_size, generator=g).to(BF16)
    positions = torch.tensor([4, 5, 6, 7, 0, 1, 2])
    slots = torch.tensor([9, 10, 11, 12, 30, 31, 32])
    rows = torch.tensor([0, 1, 3, 5]) if skip_rows else None                 # rows 2, 4, 6 store nothing
    written_slots = slots if rows is None else slots[rows]
    fused_kv, module_kv = _context(drafter), _context(drafter)
    with torch.inference_mode(), torch.profiler.profile() as prof:
        append_context(drafter, fused_kv, aux, positions, rows, written_slots, blocks)
    assert "dspark_cpu::context_kv_bf16" in {e.key for e in prof.key_averages()}
    with torch.inference_mode():
        append_context(drafter, module_kv, aux, positions, rows, written_slots)
    written = torch.zeros(fused_kv[0][0].shape[0], dtype=torch.bool)
    written[written_slots] = True
    for (fk, fv), (mk, mv), (k0, _) in zip(fused_kv, module_kv, _context(drafter)):
        assert torch.equal(fk[~written], mk[~written]) and torch.equal(fv[~written], mv[~written])
        assert not torch.equal(fk[written], k0[written])
        assert torch.allclose(fk[written].float(), mk[written].float(), rtol=2 ** -7, atol=1e-2)
        assert torch.allclose(fv[written].float(), mv[written].float(), rtol=2 ** -7, atol=1e-2)
