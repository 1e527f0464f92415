"""argmax_rows_f32 (the greedy token of each logits row) against torch.argmax."""

import torch

from dspark.kernels import cpu as kernels
from kernel_paths import PATH_MARKS


@PATH_MARKS[False]
def test_greedy_tokens_answer_as_torch_argmax_does():
    """The first maximum (ties), the first NaN, an all -inf row; widths off the 16 lanes."""
    g = torch.Generator().manual_seed(11)
    for rows, width in [(8, 49152), (1, 49152), (5, 17), (3, 1), (64, 8192)]:
        x = torch.randn(rows, width, generator=g)
        assert torch.equal(torch.ops.dspark_cpu.argmax_rows_f32(x), x.argmax(-1)), (rows, width)
    x = torch.randn(5, 100, generator=g)
    x[0, 70] = x[0, 9] = x[0, 40] = 1e9                     # ties: the first wins
    x[1, 99] = 1e9                                          # in the last, partial lane block
    x[2, 30] = x[2, 60] = float("nan")                      # NaN counts as the maximum
    x[3] = -float("inf")
    x[4, 5], x[4, 80] = float("inf"), float("nan")
    got = kernels.greedy_tokens(x)
    assert got.tolist() == x.argmax(-1).tolist() == [9, 99, 30, 0, 80]
    assert kernels.greedy_tokens(x.to(torch.bfloat16)).tolist() == x.to(torch.bfloat16).argmax(-1).tolist()
