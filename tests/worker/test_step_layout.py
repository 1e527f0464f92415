"""The step's one index space: sampling requests in chunk order, with a prefill-only chunk between
them, a plain decode row and blocks cut to different verify lengths."""

import torch

from dspark.host_copy import to_host
from dspark.sampling_params import SamplingParams
from dspark.worker.inputs import RequestChunk
from dspark.worker.step import StepLayout, WorkerBatch


def batch() -> WorkerBatch:
    chunks = [
        RequestChunk([5, 6, 7], 0, [0], 0),          # a prefill chunk that samples nothing: rows 0-2
        RequestChunk([9, 0, 0, 0], 4, [1, 2], 4),    # a block verifying 3 drafts: rows 3-6
        RequestChunk([4, 8], 0, [3], 1),             # a prompt's last chunk, sampling its last row: 7-8
        RequestChunk([2, 0], 8, [4, 5, 6], 2),       # a block verifying 1 draft: rows 9-10
        RequestChunk([3], 6, [7, 8], 1),             # a plain decode row: row 11
    ]
    n = 4
    return WorkerBatch(chunks, [SamplingParams(temperature=0)] * n, [None] * n, [True, False, True, False])


def test_each_sampling_request_is_located_once():
    layout = StepLayout.of(batch())
    assert layout.input_rows == (3, 8, 9, 11)
    assert layout.logit_rows == (0, 4, 5, 7)
    assert layout.num_rows == (4, 1, 2, 1)
    assert layout.plain == [1, 3] and layout.blocks == [0, 2]
    assert layout.last_rows() == [4, 7]
    assert layout.block_rows(4) == [[0, 1, 2, 3], [5, 6, 6, 6]]      # a short block repeats its last
    assert layout.draft_rows() == [4, 5, 6, 10]
    assert [c.token_ids for c in batch().sampling] == [[9, 0, 0, 0], [4, 8], [2, 0], [3]]


def test_host_copies_keep_each_tensor_apart():
    tokens, conf = torch.tensor([[1, 2], [3, 4]]), torch.tensor([0.5, -1.0])
    assert to_host([tokens, conf]) == [[[1, 2], [3, 4]], [0.5, -1.0]]
    assert to_host([]) == []
