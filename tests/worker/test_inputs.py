"""Slot mapping: a row whose block is -1 (a dummy) writes nothing; live rows land in their slots."""

import torch

from dspark.models.layers.attention import write_kv
from dspark.worker.inputs import RequestChunk, build_inputs


def test_minus_one_blocks_write_nothing():
    live = RequestChunk([5, 6, 7], start=2, block_table=[3, 1], num_logits=1)
    dummy = RequestChunk([9, 9], start=0, block_table=[-1], num_logits=1)
    inp = build_inputs([live, dummy], block_size=4, device=torch.device("cpu"))
    meta = inp.attn
    assert meta.write_rows.tolist() == [0, 1, 2]                 # the dummy's rows are dropped
    assert meta.write_slots.tolist() == [3 * 4 + 2, 3 * 4 + 3, 1 * 4 + 0]
    cache = torch.zeros(5 * 4, 1, 2)
    new = torch.arange(1, 6, dtype=torch.float32)[:, None, None].expand(5, 1, 2)
    write_kv(cache, meta.write_rows, meta.write_slots, new)
    written = (cache != 0).any(-1).any(-1).nonzero().flatten().tolist()
    assert written == [4, 14, 15]
    assert cache[14, 0, 0] == 1 and cache[15, 0, 0] == 2 and cache[4, 0, 0] == 3


def test_logits_rows_and_offsets():
    chunks = [RequestChunk([1, 2, 3, 4], 0, [0], 0), RequestChunk([7], 9, [1, 2, 3], 1),
              RequestChunk([8, 8, 8], 5, [4, 5], 3)]
    inp = build_inputs(chunks, block_size=4, device=torch.device("cpu"))
    assert inp.qo_indptr.tolist() == [0, 4, 5, 8]
    assert inp.logits_indices.tolist() == [4, 5, 6, 7]
    assert inp.positions.tolist() == [0, 1, 2, 3, 9, 5, 6, 7]
