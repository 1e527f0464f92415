"""Projection weights in oneDNN's packed layout compute exactly what the plain weights do."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from dspark.bench.roofline import linear_weight_bytes, weight_bytes
from dspark.engine.block_manager import BlockManager
from dspark.llm import LLM
from dspark.kernels import cpu as cpu_kernels
from dspark.models.layers.linear import Linear, pack_linears
from dspark.models.loader import load_target
from dspark.runner.backends import lower_packed_linear
from dspark.runner.setup import pack_for_inference
from dspark.sampling_params import SamplingParams
from dspark.train.export import save_speculators
from dspark.train.prune_vocab import prune_drafter
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.models.kv_cache import allocate_kv_cache
from tiny import save_random_drafter, save_tiny

BF16 = torch.bfloat16


def _linear(n_in: int, n_out: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    return Linear(n_in, n_out, bias=bias).to(BF16).requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (8, 96), (65, 96), (2, 5, 96)])
def test_packed_forward_is_bit_identical(shape, bias):
    lin = _linear(96, 160, bias)
    x = torch.randn(*shape).to(BF16)
    dense = F.linear(x, lin.weight, lin.bias)
    assert pack_linears(lin, drop_dense=False) == 1
    assert lin.packed is not None and lin.weight.numel() == 96 * 160
    assert torch.equal(lin(x), dense)


def test_drop_dense_releases_the_plain_weight_and_repacking_is_a_no_op():
    lin = _linear(64, 48, bias=False)
    x = torch.randn(4, 64).to(BF16)
    dense = lin(x)
    assert pack_linears(lin, drop_dense=True) == 1
    assert lin.weight.numel() == 0 and lin.weight.dtype == BF16
    assert linear_weight_bytes(lin) == 64 * 48 * 2
    assert torch.equal(lin(x), dense)
    assert pack_linears(lin, drop_dense=True) == 0


def test_fp32_weights_stay_plain():
    lin = Linear(8, 8).requires_grad_(False)
    assert pack_linears(lin, drop_dense=True) == 0
    assert lin.packed is None and lin.weight.numel() == 64


@pytest.mark.parametrize("bias", [False, True])
def test_compiled_packed_linear_matches_eager_and_calls_onednn_directly(bias):
    lower_packed_linear()
    lin = _linear(96, 160 + bias, bias=bias)       # a shape of its own: no cached compile
    pack_linears(lin, drop_dense=True)

    def piece(x):
        return F.silu(lin(x)) * 2

    compiled = torch.compile(piece, fullgraph=True, dynamic=False)
    for rows in (1, 8):
        x = torch.randn(rows, 96).to(BF16)
        out, code = run_and_get_code(compiled, x)
        assert torch.equal(out, piece(x))
        if code:                                   # generated on the first call of each shape
            text = "\n".join(code)
            assert "torch.ops.mkldnn._linear_pointwise.default(" in text
            assert "torch.ops.dspark.packed_linear.default(" not in text


def _paged_logits(model, cfg, prompts):
    """Prefill `prompts` together through a fresh paged cache and return the last rows' logits."""
    bm = BlockManager(32, 4)
    kv = allocate_kv_cache(cfg, 32, 4, BF16, torch.device("cpu"))
    chunks = []
    for ids in prompts:
        table = []
        assert bm.ensure(table, len(ids))
        chunks.append(RequestChunk(ids, 0, table, 1))
    inp = build_inputs(chunks, 4, torch.device("cpu"), cfg.sliding_window)
    with torch.inference_mode():
        return model(inp.input_ids, inp.positions, inp.attn, kv, inp.logits_indices).logits


@pytest.mark.parametrize("family,tied", [("llama", True), ("qwen2", False)])
def test_packed_target_logits_equal_plain_and_keep_the_lm_head(tmp_path, family, tied):
    save_tiny(str(tmp_path), family, tied)
    target = load_target(str(tmp_path), BF16)
    prompts = [[5, 9, 17, 3, 44], list(range(3, 14))]
    before = _paged_logits(target.model, target.config, prompts)
    bytes_before = weight_bytes(target.model)
    packed = pack_for_inference(target.model, None)
    assert packed == 4 * target.config.num_layers + 1
    down = target.model.layers[0].mlp.down_proj
    assert (down.tiles is not None) == cpu_kernels.available()
    assert down.amx == (down.tiles is not None and cpu_kernels.tiles_available())
    assert down.weight.numel() == 0
    assert target.model.lm_head.weight.numel() > 0            # tied to the embeddings, or shared
    assert target.model.embed_tokens.weight.numel() > 0
    assert weight_bytes(target.model) == bytes_before
    assert torch.equal(_paged_logits(target.model, target.config, prompts), before)


@pytest.mark.parametrize("reduced_vocab", [False, True])
def test_engine_packs_bf16_target_and_drafter(tmp_path, reduced_vocab):
    target_dir, drafter_dir = str(tmp_path / "t"), str(tmp_path / "d")
    save_tiny(target_dir, "llama", True, num_hidden_layers=4)
    drafter = save_random_drafter(drafter_dir, target_dir, gamma=3)
    if reduced_vocab:
        save_speculators(prune_drafter(drafter, torch.arange(0, 128, 2)), drafter_dir)
    # verify-all: the policy may leave a 12-token request undrafted when its cost model, measured
    # on a loaded machine, says drafting does not pay, and the drafter's packed layers must run
    llm = LLM(target_dir, dtype="bfloat16", drafter=drafter_dir, graph="eager", spec_schedule="verify-all")
    worker = llm.engine.worker
    assert worker.model.layers[0].self_attn.qkv_proj.packed is not None
    assert worker.drafter.layers[0].mlp.down_proj.packed is not None
    assert (worker.drafter.draft_lm_head_packed is not None) == reduced_vocab
    out = llm.generate([[5, 9, 17, 3]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 12
    assert out[0].spec.drafted_tokens > 0
