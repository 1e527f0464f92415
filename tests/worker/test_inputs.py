"""Slot mapping: a row whose block is -1 (a dummy) writes nothing; live rows land in their slots."""

import pytest
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
    inp = build_inputs(chunks, block_size=4, device=torch.device("cpu"), varlen=True)
    assert inp.attn.varlen.cu_seq_q.tolist() == [0, 4, 5, 8]
    assert inp.logits_indices.tolist() == [4, 5, 6, 7]
    assert inp.positions.tolist() == [0, 1, 2, 3, 9, 5, 6, 7]


def _reference_attention(q, k_cache, v_cache, chunks, block_size, scale, window=None):
    """Each request alone: causal attention of its rows over its own context (the last `window`
    keys with one), in fp32."""
    out, row = [], 0
    for c in chunks:
        n = c.start + len(c.token_ids)
        slots = torch.tensor([c.block_table[p // block_size] * block_size + p % block_size for p in range(n)])
        keys, values = k_cache[slots].float(), v_cache[slots].float()      # [n, KVH, D]
        for j in range(len(c.token_ids)):
            qi = q[row + j].float()                                         # [H, D]
            group = qi.shape[0] // keys.shape[1]
            first = 0 if window is None else max(0, c.start + j + 1 - window)
            k = keys[first: c.start + j + 1].repeat_interleave(group, 1)    # [L, H, D]
            v = values[first: c.start + j + 1].repeat_interleave(group, 1)
            p = torch.softmax(torch.einsum("hd,lhd->hl", qi, k) * scale, -1)
            out.append(torch.einsum("hl,lhd->hd", p, v).flatten())
        row += len(c.token_ids)
    return torch.stack(out)


def test_a_prefill_chunk_beside_decode_rows_is_attended_in_two_groups(monkeypatch):
    from dspark.models.layers.attention import paged_attention
    from dspark.worker.inputs import SPLIT_MIN_Q
    g = torch.Generator().manual_seed(0)
    bs, heads, kv_heads, d = 4, 4, 2, 8
    chunks = [RequestChunk([1], 21, [0, 1, 2, 3, 4, 5], 1),
              RequestChunk(list(range(SPLIT_MIN_Q + 3)), 2, [6, 7, 8, 9, 10, 11], 1),
              RequestChunk([3], 6, [12, 13], 1)]
    inp = build_inputs(chunks, bs, torch.device("cpu"))
    parts = inp.attn.parts
    assert parts is not None and [p.rows.tolist() for p in parts] == [[0, 20], list(range(1, 20))]
    assert [p.meta.max_q for p in parts] == [1, SPLIT_MIN_Q + 3] and parts[0].meta.kv_len == 22
    k_cache = torch.randn(14 * bs, kv_heads, d, generator=g)
    v_cache = torch.randn(14 * bs, kv_heads, d, generator=g)
    q = torch.randn(inp.input_ids.shape[0], heads, d, generator=g)
    split = paged_attention(q, k_cache, v_cache, inp.attn, 0.3)
    monkeypatch.setattr("dspark.worker.inputs.SPLIT_MIN_Q", 10**6)    # the one padded call
    unsplit = build_inputs(chunks, bs, torch.device("cpu")).attn
    assert unsplit.parts is None and unsplit.mask.shape[2] == SPLIT_MIN_Q + 3
    whole = paged_attention(q, k_cache, v_cache, unsplit, 0.3)
    ref = _reference_attention(q, k_cache, v_cache, chunks, bs, 0.3)
    assert torch.allclose(split, ref, atol=1e-5) and torch.allclose(whole, ref, atol=1e-5)
    # verify-sized blocks beside decode rows, or a step of long queries only, stay one call
    assert build_inputs(chunks[:1] + [RequestChunk([1] * 8, 2, [6, 7, 8], 8)], bs,
                        torch.device("cpu")).attn.parts is None
    assert build_inputs(chunks[1:2], bs, torch.device("cpu")).attn.parts is None


def test_verify_blocks_beside_a_prefill_chunk_are_not_padded_to_it():
    """A prompt joining a step of speculative requests: the verify blocks form the short group
    (padded to the longest block, not to the chunk) and attention is unchanged."""
    from dspark.models.layers.attention import paged_attention
    g = torch.Generator().manual_seed(3)
    bs, heads, kv_heads, d = 4, 4, 2, 8
    chunks = [RequestChunk([1] * 8, 21, [0, 1, 2, 3, 4, 5, 6, 7], 8),        # anchor + 7 drafts
              RequestChunk(list(range(40)), 0, [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], 1),
              RequestChunk([3, 4, 5], 6, [18, 19, 20], 3)]                    # anchor + 2 drafts
    attn = build_inputs(chunks, bs, torch.device("cpu")).attn
    assert attn.parts is not None
    assert [p.rows.tolist() for p in attn.parts] == [list(range(8)) + [48, 49, 50], list(range(8, 48))]
    assert [p.meta.max_q for p in attn.parts] == [8, 40]
    k_cache = torch.randn(21 * bs, kv_heads, d, generator=g)
    v_cache = torch.randn(21 * bs, kv_heads, d, generator=g)
    q = torch.randn(51, heads, d, generator=g)
    out = paged_attention(q, k_cache, v_cache, attn, 0.3)
    assert torch.allclose(out, _reference_attention(q, k_cache, v_cache, chunks, bs, 0.3), atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_bf16_verify_and_decode_rows_read_their_keys_in_place_also_after_trimming(window):
    from dspark.kernels import cpu as cpu_kernels
    from dspark.models.layers.attention import paged_attention
    if not cpu_kernels.available():
        pytest.skip("needs AVX512-BF16 and a C++ compiler")
    g = torch.Generator().manual_seed(2)
    bs, heads, kv_heads, d = 4, 4, 2, 32
    chunks = [RequestChunk([1, 2, 3, 4, 5], 9, [0, 1, 2, 3], 5),         # anchor + 4 drafts
              RequestChunk([1], 21, [4, 5, 6, 7, 8, 9], 1),               # a plain decode row
              RequestChunk([6, 7, 8], 4, [16, 17], 3)]                    # anchor + 2 drafts
    inp = build_inputs(chunks, bs, torch.device("cpu"), window)
    assert inp.attn.parts is None and inp.attn.token_keys.shape == (9, 3)
    k_cache = torch.randn(18 * bs, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(18 * bs, kv_heads, d, generator=g).bfloat16()
    kept = [RequestChunk([1, 2], 9, [0, 1, 2, 3], 2), chunks[1], chunks[2]]   # a verify budget's cut
    trimmed = build_inputs(kept, bs, torch.device("cpu"), window)
    for attn, step in ((inp.attn, chunks), (trimmed.attn, kept)):
        q = torch.randn(sum(len(c.token_ids) for c in step), heads, d, generator=g).bfloat16()
        with torch.profiler.profile() as prof:
            out = paged_attention(q, k_cache, v_cache, attn, 0.3)
        assert "dspark_cpu::paged_attention_bf16" in {e.key for e in prof.key_averages()}
        ref = _reference_attention(q, k_cache, v_cache, step, bs, 0.3, window)
        assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=3e-3)


def test_slots_and_token_keys_follow_the_tensor_formulas():
    """The per-token slots and keys, built in Python, against the same quantities as tensor ops
    over the zero-padded block tables: decode rows, a verify block, a prefill chunk, a negative
    (no-write) block, with and without a sliding window."""
    block_size = 4
    chunks = [RequestChunk([1], 13, [3, 8, 2, 9], 1), RequestChunk([1] * 8, 5, [4, 7, 6], 8),
              RequestChunk([1] * 17, 0, [5, -1, 11, 12, 13], 1), RequestChunk([1], 0, [10], 1)]
    for window in (None, 6):
        inp = build_inputs(chunks, block_size, torch.device("cpu"), window)
        q_lens = torch.tensor([len(c.token_ids) for c in chunks])
        starts = torch.tensor([c.start for c in chunks])
        width = max(len(c.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.long)
        for r, c in enumerate(chunks):
            tables[r, :len(c.block_table)] = torch.tensor(c.block_table)
        request = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
        pos = starts[request] + torch.arange(request.shape[0]) - torch.repeat_interleave(q_lens.cumsum(0) - q_lens, q_lens)
        blocks = tables[request, pos // block_size]
        slots = torch.where(blocks < 0, -1, blocks * block_size + pos % block_size)
        assert torch.equal(inp.positions, pos)
        written = slots >= 0
        assert not written.all()                              # the negative block writes nothing
        assert torch.equal(inp.attn.write_slots, slots[written])
        assert torch.equal(inp.attn.write_rows, written.nonzero().flatten())
        end = pos + 1
        begin = (end - window).clamp(min=0) if window else torch.zeros_like(end)
        keys = torch.stack([request, begin, end], 1)
        metas = [inp.attn] if inp.attn.parts is None else [p.meta for p in inp.attn.parts]
        rows = [torch.arange(len(pos))] if inp.attn.parts is None else [p.rows for p in inp.attn.parts]
        for meta, r in zip(metas, rows):
            local = keys[r].clone()
            local[:, 0] = torch.unique_consecutive(keys[r][:, 0], return_inverse=True)[1]
            assert torch.equal(meta.token_keys, local)
        assert inp.attn.parts is not None                     # a long chunk beside decode rows


def test_packed_fields_come_back_equal():
    """The one-copy layout: tensors of every dtype and shape a step holds, packed into one byte
    buffer and viewed back out of it (as the device's copy of it is read)."""
    from dspark.host_copy import PACK_ALIGN, pack, unpack
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-9, 9, (5,), generator=g), torch.zeros(0, dtype=torch.long),
               torch.randint(0, 9, (3, 4), generator=g, dtype=torch.int32), torch.rand(2, 1, 3, 5, generator=g) > 0.5,
               torch.tensor(7), torch.zeros(0, 3, dtype=torch.long), torch.arange(3, dtype=torch.uint8),
               torch.rand(3, generator=g), torch.rand(2, 2, generator=g).bfloat16()]
    buffer, fields = pack(tensors, pin=False)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert all(f.offset % PACK_ALIGN == 0 for f in fields)
    back = unpack(buffer.clone(), fields)
    assert [t.dtype for t in back] == [t.dtype for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_a_step_moved_in_one_copy_equals_the_host_step():
    """What a CUDA step gets (every tensor of StepInputs, the attention parts and the
    variable-length metadata included, through one packed buffer) equals what was built."""
    from dspark.host_copy import map_tensors, to_device
    chunks = [RequestChunk([1], 13, [3, 8, 2, 9], 1), RequestChunk([1] * 8, 5, [4, 7, 6], 8),
              RequestChunk([1] * 17, 0, [5, -1, 11, 12, 13], 1), RequestChunk([1], 0, [10], 1)]
    host = build_inputs(chunks, 4, torch.device("cpu"), 6, varlen=True)
    assert host.attn.parts is not None and host.attn.varlen is not None and host.attn.write_rows is not None
    moved = to_device(host, torch.device("cpu"), pin=False)

    def tensors(obj):
        found = []
        map_tensors(obj, lambda t: found.append(t) or t)
        return found

    before, after = tensors(host), tensors(moved)
    assert len(before) == len(after) >= 15
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after))
    assert len({t.untyped_storage().data_ptr() for t in after}) == 1            # one buffer
    assert moved.attn.max_q == host.attn.max_q and moved.attn.varlen.max_k == host.attn.varlen.max_k


def test_varlen_metadata_packs_each_requests_keys_in_order():
    chunks = [RequestChunk([1] * 3, 5, [4, 7, 6], 3), RequestChunk([1], 0, [-1], 1),
              RequestChunk([1] * 9, 0, [2, 3, 9], 1)]
    meta = build_inputs(chunks, 4, torch.device("cpu"), varlen=True).attn.varlen
    assert meta.cu_seq_q.tolist() == [0, 3, 4, 13] and meta.cu_seq_k.tolist() == [0, 8, 9, 18]
    assert (meta.max_q, meta.max_k, meta.block_table) == (9, 9, None)
    expected = [16, 17, 18, 19, 28, 29, 30, 31] + [0] + [8, 9, 10, 11, 12, 13, 14, 15, 36]   # a dummy: block 0
    assert meta.kv_index.dtype == torch.int32 and meta.kv_index.tolist() == expected
