"""Our target modules through the paged cache against Hugging Face transformers (fp32)."""

import pytest
import torch

from dspark.engine.block_manager import BlockManager
from dspark.models.loader import load_target
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.models.kv_cache import allocate_kv_cache
from tiny import save_tiny

CASES = [("llama", True), ("llama", False), ("llama_rope_llama3", True), ("llama_rope_linear", False),
         ("mistral", True), ("qwen2", False), ("qwen2", True), ("qwen3", True), ("qwen3", False)]


class PagedRunner:
    """Drives our model one chunk at a time for several requests sharing one paged cache."""

    def __init__(self, model, cfg, block_size=4, num_blocks=64):
        self.model, self.cfg, self.bs = model, cfg, block_size
        self.bm = BlockManager(num_blocks, block_size)
        self.kv = allocate_kv_cache(cfg, num_blocks, block_size, torch.float32, torch.device("cpu"))

    def step(self, chunks):
        """chunks: list of (block_table, start, token_ids); returns last-row logits per chunk."""
        reqs = []
        for table, start, ids in chunks:
            assert self.bm.ensure(table, start + len(ids))
            reqs.append(RequestChunk(ids, start, table, 1))
        inp = build_inputs(reqs, self.bs, torch.device("cpu"), self.cfg.sliding_window)
        with torch.inference_mode():
            return self.model(inp.input_ids, inp.positions, inp.attn, self.kv, inp.logits_indices).logits


@pytest.mark.parametrize("family,tied", CASES)
def test_prefill_and_decode_match_transformers(tmp_path, family, tied):
    hf = save_tiny(str(tmp_path), family, tied)
    ours = load_target(str(tmp_path), torch.float32)
    runner = PagedRunner(ours.model, ours.config)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (11, 5, 23)]
    tables = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]
    worst = 0.0
    # prefill all three in one mixed batch, then 20 batched decode steps
    logits = runner.step([(t, 0, p) for t, p in zip(tables, prompts)])
    for step in range(21):
        with torch.no_grad():
            ref = [hf(torch.tensor([s])).logits[0, -1] for s in seqs]
        for r, s in enumerate(seqs):
            worst = max(worst, (logits[r] - ref[r]).abs().max().item())
            s.append(int(ref[r].argmax()))
        if step < 20:
            logits = runner.step([(t, len(s) - 1, [s[-1]]) for t, s in zip(tables, seqs)])
    assert worst <= 1e-4, f"max |dlogit| {worst:.2e}"


def test_chunked_prefill_matches_single_prefill(tmp_path):
    save_tiny(str(tmp_path), "qwen3", True)
    ours = load_target(str(tmp_path), torch.float32)
    prompt = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = PagedRunner(ours.model, ours.config).step([([], 0, prompt)])
    chunked_runner, table = PagedRunner(ours.model, ours.config), []
    for start in range(0, 30, 7):
        out = chunked_runner.step([(table, start, prompt[start:start + 7])])
    assert (out - whole).abs().max().item() <= 1e-4


def test_aux_hidden_states_are_layer_outputs(tmp_path):
    hf = save_tiny(str(tmp_path), "llama", True, num_hidden_layers=3)
    ours = load_target(str(tmp_path), torch.float32)
    prompt = list(range(3, 15))
    runner = PagedRunner(ours.model, ours.config)
    table = []
    runner.bm.ensure(table, len(prompt))
    inp = build_inputs([RequestChunk(prompt, 0, table, len(prompt))], 4, torch.device("cpu"))
    with torch.inference_mode():
        out = ours.model(inp.input_ids, inp.positions, inp.attn, runner.kv, inp.logits_indices,
                         aux_layer_ids=(0, 2))
        ref = hf(torch.tensor([prompt]), output_hidden_states=True)
    assert out.logits.shape == (len(prompt), 128)
    assert out.aux_hidden.shape == (len(prompt), 2 * 64)
    assert torch.allclose(out.aux_hidden[:, :64], ref.hidden_states[1][0], atol=1e-5)
    # HF's last hidden state is after the final norm; layer 2's raw output is hidden_states[2+1]
    # only before the norm, so compare logits instead for the last layer
    assert torch.allclose(out.logits, ref.logits[0], atol=1e-4)
