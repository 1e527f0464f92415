"""Acceptance rules: greedy prefix match and lossless rejection sampling."""

import math

import torch

from dspark.sampling_params import SamplingParams
from dspark.spec.sampler import SamplingTensors
from dspark.spec.types import DraftProposal
from dspark.spec.verify import accept


def st_for(params):
    return SamplingTensors.build(params, [None] * len(params), 8, torch.device("cpu"))


def one_hot_logits(rows):
    out = torch.full((len(rows), len(rows[0]), 8), -5.0)
    for r, row in enumerate(rows):
        for j, tok in enumerate(row):
            out[r, j, tok] = 5.0
    return out


def test_greedy_accepts_the_matching_prefix():
    logits = one_hot_logits([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])     # target argmax per row
    drafts = torch.tensor([[3, 4, 7], [3, 4, 5], [1, 4, 5]])
    res = accept(logits, torch.tensor([3, 2, 3]), DraftProposal(drafts, None, None),
                 st_for([SamplingParams(temperature=0)] * 3))
    assert res.num_accepted.tolist() == [2, 2, 0]
    assert res.tokens[0, :3].tolist() == [3, 4, 5]          # recovered token after 2 accepts
    assert res.tokens[1, :3].tolist() == [3, 4, 5]          # ℓ=2: bonus from row 2, draft 3 unverified
    assert res.tokens[2, 0].item() == 3


def test_zero_verify_length_commits_only_the_target_token():
    logits = one_hot_logits([[2, 2, 2]])
    res = accept(logits, torch.tensor([0]), DraftProposal(torch.tensor([[2, 2]]), None, None),
                 st_for([SamplingParams(temperature=0)]))
    assert res.num_accepted.item() == 0 and res.tokens[0, 0].item() == 2


def test_rejection_sampling_is_lossless():
    """First emitted token ~ p_0 and, given it, second ~ p_1, whatever q is."""
    n, v = 40000, 8
    torch.manual_seed(0)
    p_logits = torch.randn(3, v)
    q = torch.softmax(torch.randn(2, v) * 2, -1)
    drafts = torch.stack([torch.multinomial(q[k], n, replacement=True) for k in range(2)], 1)
    probs = q[None].expand(n, 2, v).contiguous()
    res = accept(p_logits[None].expand(n, 3, v).contiguous(), torch.full((n,), 2),
                 DraftProposal(drafts, probs, None), st_for([SamplingParams(temperature=1.0)] * n))
    p0 = torch.softmax(p_logits[0], -1)
    emp = torch.bincount(res.tokens[:, 0], minlength=v).float() / n
    bound = 4 * 0.5 * sum(math.sqrt(x * (1 - x) / n) for x in p0.tolist())
    assert 0.5 * (emp - p0).abs().sum().item() < bound
    took = res.num_accepted >= 1
    assert torch.equal(res.tokens[took, 0], drafts[took, 0])
    assert 0 < res.num_accepted.float().mean().item() < 2
