"""Repetition, presence and frequency penalties, logit biases and min_tokens, applied to every
row that produces a token, on the device.

Row j of a speculative block extends the committed output plus the block's first j drafts, so
its counts include those drafts: each row's adjusted logits are exactly what plain decoding
would see after the same prefix, and verification against them stays lossless. The drafter
samples from its own unadjusted q (rejection sampling corrects for any proposal). The semantics
and their order are vLLM's (the repetition penalty's, transformers'); log-probabilities are
taken from the raw logits, never from these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.host_copy import device_tensor
from dspark.sampling_params import SamplingParams


@dataclass
class TokenHistory:
    """What a request's adjustments read, given by the engine only to requests that have one."""
    output_ids: list[int]              # committed output tokens (a block's anchor among them)
    prompt_ids: list[int]              # the prompt, for the repetition penalty (else empty)
    stop_ids: list[int]                # tokens min_tokens bans: EOS (unless ignored) and stop ids


def token_history(params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                  eos_token_ids: list[int]) -> TokenHistory | None:
    """The history a sampling chunk carries to the worker; None when nothing is adjusted."""
    if not params.adjusts_logits:
        return None
    stops = [] if params.min_tokens == 0 else sorted(
        set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))
    prompt = prompt_ids if params.repetition_penalty != 1.0 else []
    return TokenHistory(output_ids=output_ids, prompt_ids=prompt, stop_ids=stops)


@dataclass
class _Rows:
    """Host-built index lists of the adjusted rows: per adjusted request a (0..A-1), per row."""
    rows: list[int] = field(default_factory=list)          # [P] logits row of each adjusted row
    owner: list[int] = field(default_factory=list)         # [P] its request a
    counts: list[int] = field(default_factory=list)        # a * V + token of every output token
    prompt: list[int] = field(default_factory=list)        # a * V + token of every prompt token
    draft_rows: list[int] = field(default_factory=list)    # row * V of each draft a row counts,
    draft_src: list[int] = field(default_factory=list)     #   and its index in the flat drafts
    banned: list[int] = field(default_factory=list)        # row * V + token banned by min_tokens
    bias_index: list[int] = field(default_factory=list)    # a * V + token of every bias
    bias_value: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)  # [A]
    presence: list[float] = field(default_factory=list)    # [A]
    frequency: list[float] = field(default_factory=list)   # [A]


def penalised_logits(logits: torch.Tensor, histories: list[TokenHistory | None],
                     params: list[SamplingParams], num_rows: list[int], spec: list[bool],
                     drafts: torch.Tensor | None) -> torch.Tensor:
    """logits [S, V] of the sampling chunks (num_rows[i] consecutive rows each; a speculative
    block's row j follows j drafts) -> the logits they sample from. The same tensor when no
    chunk carries a history, else a copy with the adjusted rows replaced (the raw logits stay
    for log-probabilities), changed in vLLM's order (counts built by scatters, never per token).
    drafts [R_spec, γ] in the order of the speculative chunks."""
    if all(h is None for h in histories):
        return logits
    v = logits.shape[-1]
    plan = _plan(histories, params, num_rows, spec, v, drafts.shape[1] if drafts is not None else 0)
    dev = logits.device
    to = lambda xs, dt=torch.long: device_tensor(xs, dt, dev)  # noqa: E731
    owner = to(plan.owner)                                                         # [P]
    flat = to(plan.counts)          # [A, V] occurrences of each token in each request's output
    counts = torch.zeros(len(plan.repetition) * v, dtype=torch.float32, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32)).view(-1, v)[owner]     # [P, V]
    if plan.draft_rows:
        tokens = drafts.flatten()[to(plan.draft_src)]                               # [D]
        ones = torch.ones_like(tokens, dtype=counts.dtype)
        counts.view(-1).index_add_(0, to(plan.draft_rows) + tokens, ones)
    rows = to(plan.rows)
    x = logits.index_select(0, rows)                                               # [P, V]
    if plan.banned:
        x.view(-1).index_fill_(0, to(plan.banned), float("-inf"))
    if plan.bias_index:
        bias = torch.zeros(len(plan.repetition) * v, device=dev)
        bias.index_put_((to(plan.bias_index),), to(plan.bias_value, torch.float32), accumulate=True)
        x += bias.view(-1, v)[owner]
    x = _repetition(x, counts, plan, owner, v)
    if any(plan.frequency):
        x -= to(plan.frequency, torch.float32)[owner, None] * counts
    if any(plan.presence):
        x -= to(plan.presence, torch.float32)[owner, None] * (counts > 0)
    return logits.index_copy(0, rows, x.to(logits.dtype))


def _repetition(x: torch.Tensor, counts: torch.Tensor, plan: _Rows, owner: torch.Tensor,
                v: int) -> torch.Tensor:
    """x [P, V]: divide positive, multiply negative logits of every token seen in prompt or output."""
    if all(r == 1.0 for r in plan.repetition):
        return x
    dev = x.device
    seen = torch.zeros(len(plan.repetition) * v, dtype=torch.bool, device=dev)
    if plan.prompt:
        seen[device_tensor(plan.prompt, torch.long, dev)] = True
    seen = seen.view(-1, v)[owner] | (counts > 0)                                    # [P, V]
    penalty = device_tensor(plan.repetition, torch.float32, dev)[owner, None]
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def _plan(histories: list[TokenHistory | None], params: list[SamplingParams], num_rows: list[int],
          spec: list[bool], v: int, gamma: int) -> _Rows:
    """Which rows are adjusted and by what, as flat index lists (one transfer each)."""
    plan = _Rows()
    row = spec_index = 0
    for i, (history, n) in enumerate(zip(histories, num_rows)):
        if history is not None:
            _add_request(plan, history, params[i], range(row, row + n), spec_index if spec[i] else None,
                         v, gamma)
        row += n
        spec_index += int(spec[i])
    return plan


def _add_request(plan: _Rows, h: TokenHistory, p: SamplingParams, rows: range, block: int | None,
                 v: int, gamma: int) -> None:
    """One request's rows; row j of a speculative `block` also counts its drafts before j."""
    a = len(plan.repetition)
    plan.repetition.append(p.repetition_penalty)
    plan.presence.append(p.presence_penalty)
    plan.frequency.append(p.frequency_penalty)
    plan.counts += [a * v + t for t in h.output_ids]
    plan.prompt += [a * v + t for t in h.prompt_ids]
    biased = [(t, b) for t, b in p.logit_bias.items() if t < v]
    plan.bias_index += [a * v + t for t, _ in biased]
    plan.bias_value += [float(b) for _, b in biased]
    stops = [t for t in h.stop_ids if t < v]
    for j, row in enumerate(rows):
        r = len(plan.rows)
        plan.rows.append(row)
        plan.owner.append(a)
        if block is not None:
            plan.draft_rows += [r * v] * j
            plan.draft_src += [block * gamma + k for k in range(j)]
        if len(h.output_ids) + j < p.min_tokens:
            plan.banned += [r * v + t for t in stops]
