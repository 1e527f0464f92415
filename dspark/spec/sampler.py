"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Everything stays on the device; the caller copies the chosen tokens to the host once per step.
Sampling is the Gumbel race on the processed logits (argmax z + G, G = -log E, E ~ Exp(1)),
which draws exactly from softmax(z) without computing it: the exponentials of a low temperature's
logits underflow into subnormal floats, which CPUs compute far more slowly than normal ones. A
seeded request's noise for the token at position t is a function of (seed, t) alone
(`NoiseKey`), so its text depends on its seed and nothing else: not on the batch it shares, not
on a failed step retried, and not on whether or how many of its drafts were verified (verify.py
couples draft and target through the same noise).

It lives in spec/ because draft and verify must sample from the same processed distribution as
plain rows do; the worker imports it from here for those plain rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from dspark.host_copy import device_tensor
from dspark.kernels.cpu import greedy_tokens
from dspark.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    temperature: torch.Tensor              # [N] (1.0 on greedy rows)
    top_k: torch.Tensor | None             # [N] int, V where disabled; None if no row uses it
    top_p: torch.Tensor | None             # [N]
    min_p: torch.Tensor | None             # [N]
    greedy: torch.Tensor                   # [N] bool
    all_greedy: bool
    keys: list["NoiseKey | None"]          # [N] seeded rows: where their noise comes from
    greedy_host: list[bool]                # the same flags on the host (no sync to read them)

    @classmethod
    def build(cls, params: list[SamplingParams], keys: list["NoiseKey | None"],
              vocab_size: int, device: torch.device) -> "SamplingTensors":
        greedy = [p.greedy for p in params]
        t = lambda xs, dt: device_tensor(xs, dt, device)  # noqa: E731
        use_k = any(p.top_k > 0 and not p.greedy for p in params)
        use_p = any(p.top_p < 1 and not p.greedy for p in params)
        use_min_p = any(p.min_p > 0 and not p.greedy for p in params)
        return cls(
            temperature=t([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=t([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.long)
            if use_k else None,
            top_p=t([p.top_p for p in params], torch.float32) if use_p else None,
            min_p=t([p.min_p for p in params], torch.float32) if use_min_p else None,
            greedy=t(greedy, torch.bool), all_greedy=all(greedy), keys=keys,
            greedy_host=greedy)

    def repeat(self, n: int) -> "SamplingTensors":
        """Each request's parameters for n consecutive rows (a verify block); row j of a seeded
        request's block samples the token j places after its key's."""
        rep = lambda x: None if x is None else x.repeat_interleave(n, dim=0)  # noqa: E731
        return SamplingTensors(temperature=rep(self.temperature), top_k=rep(self.top_k),
                               top_p=rep(self.top_p), min_p=rep(self.min_p),
                               greedy=rep(self.greedy), all_greedy=self.all_greedy,
                               keys=[None if k is None else k.at(j) for k in self.keys for j in range(n)],
                               greedy_host=[g for g in self.greedy_host for _ in range(n)])

    def select(self, rows: list[int]) -> "SamplingTensors":
        """The parameters of a subset of rows (e.g. the speculative requests of a mixed step)."""
        if rows == list(range(len(self.keys))):
            return self
        index = device_tensor(rows, torch.long, self.temperature.device)
        pick = lambda x: None if x is None else x.index_select(0, index)  # noqa: E731
        greedy = pick(self.greedy)
        return SamplingTensors(temperature=pick(self.temperature), top_k=pick(self.top_k),
                               top_p=pick(self.top_p), min_p=pick(self.min_p), greedy=greedy,
                               all_greedy=self.all_greedy or all(self.greedy_host[i] for i in rows),
                               keys=[self.keys[i] for i in rows],
                               greedy_host=[self.greedy_host[i] for i in rows])


def processed_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The scores a request races on after temperature and truncation: [N, V], -inf outside its
    top-k / top-p / min-p set; their softmax is the distribution it samples from."""
    logits = logits / st.temperature[:, None]
    if st.top_k is not None or st.top_p is not None:
        logits = _top_k_top_p(logits, st.top_k, st.top_p)
    return _min_p(logits, st)


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution a request samples from: [N, V] (rejection sampling needs it; a race
    needs only `processed_logits`)."""
    return torch.softmax(processed_logits(logits, st), dim=-1)


def candidate_logits(logits: torch.Tensor, st: SamplingTensors
                     ) -> tuple[torch.Tensor, torch.Tensor, list[bool]] | None:
    """`processed_logits` restricted to each row's top CANDIDATES tokens: (scores [N, K], their
    token ids [N, K], whether each row's top-k / top-p kept set lies inside them). Rows that fit
    race on K noise values instead of V; None when no row is truncated or V <= K, and on a GPU,
    where the full sort is cheap and deciding whether rows fit would wait for the device."""
    if (st.top_k is None and st.top_p is None) or logits.device.type == "cuda":
        return None
    truncated = _candidate_truncation(logits / st.temperature[:, None], st.top_k, st.top_p, st.greedy)
    if truncated is None:
        return None
    cand, index, fits = truncated
    return _min_p(cand, st), index, fits.tolist()


def _min_p(z: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p times the top one's: z < max z + log min_p."""
    if st.min_p is None:
        return z
    floor = z.max(dim=-1, keepdim=True).values + st.min_p.log()[:, None]
    return z.masked_fill(z < floor, float("-inf"))


CANDIDATES = 256   # truncation first looks at the top candidates only; exact when they suffice


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens outside top-k / top-p with -inf. Sorting the whole vocabulary dominates a
    sampled decode step, so the top CANDIDATES logits are tried first (exact when every row's
    kept set ends inside them); a GPU sorts at once, since asking would wait for the device."""
    truncated = None if logits.device.type == "cuda" else _candidate_truncation(logits, top_k, top_p)
    if truncated is not None and bool(truncated[2].all()):
        cand, index, _ = truncated
        return torch.full_like(logits, float("-inf")).scatter_(-1, index, cand)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    norm = torch.logsumexp(_rank_drop(sorted_logits, top_k), dim=-1, keepdim=True)
    drop = _truncation(sorted_logits, norm, top_k, top_p)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _candidate_truncation(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                          exempt: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The top CANDIDATES logits [N, K] with those outside top-k / top-p at -inf, their ids
    [N, K], and [N] whether each row's kept set surely ends inside them (`exempt` rows, greedy
    ones that never sample, count as fitting); None when the vocabulary is not larger than K."""
    v = logits.shape[-1]
    if v > CANDIDATES:
        cand, index = logits.topk(CANDIDATES, dim=-1)
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        if top_k is not None:
            within = (top_k <= CANDIDATES)[:, None]
            top_norm = torch.logsumexp(_rank_drop(cand, top_k), dim=-1, keepdim=True)
            norm = torch.where(within, top_norm, norm)
        drop = _truncation(cand, norm, top_k, top_p)
        exact = drop[:, -1] | ((top_k <= CANDIDATES) if top_k is not None and top_p is None else False)
        if top_k is not None:        # a top-k beyond the candidates: its normaliser is unknown here
            exact &= (top_k <= CANDIDATES) | (top_k >= v)
        if exempt is not None:
            exact = exact | exempt
        return cand.masked_fill(drop, float("-inf")), index, exact
    return None


def _rank_drop(sorted_logits: torch.Tensor, top_k: torch.Tensor | None) -> torch.Tensor:
    if top_k is None:
        return sorted_logits
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device)[None, :]
    return sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))


def _truncation(sorted_logits: torch.Tensor, norm: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None) -> torch.Tensor:
    """sorted (descending) logits [N, K], log-normaliser of the top-k distribution [N, 1] ->
    drop mask [N, K]: rank >= top_k, or the mass strictly above the token already >= top_p."""
    kept = _rank_drop(sorted_logits, top_k)
    drop = torch.isneginf(kept) & ~torch.isneginf(sorted_logits)
    if top_p is not None:
        probs = torch.exp(kept - norm)
        before = probs.cumsum(dim=-1) - probs        # the first token is always kept
        drop |= before >= top_p[:, None]
    return drop


@dataclass(frozen=True)
class NoiseKey:
    """A seeded request's row: its seed and the position of the token the row samples."""
    seed: int
    position: int

    def at(self, offset: int) -> "NoiseKey":
        return NoiseKey(self.seed, self.position + offset)


_MASK = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """A 64-bit generator seed for (seed, position): splitmix64's finaliser, so that nearby seeds
    and positions (n > 1 uses seed + i) give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def keyed_exponentials(key: NoiseKey, count: int, size: int, device: torch.device,
                       columns: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) [count, size] (or its `columns` [count, C]): the noise of positions key.position ..
    + count - 1 of a seeded request, each drawn from a generator of its own (on the device where
    it is used: a GPU's stream differs from the CPU's)."""
    rows = torch.stack([_position_noise(key.seed, key.position + k, size, device) for k in range(count)])
    return rows if columns is None else rows.index_select(1, columns.to(rows.device))


@functools.lru_cache(maxsize=128)
def _position_noise(seed: int, position: int, size: int, device: torch.device) -> torch.Tensor:
    """[size] one position's noise, kept for a while: a round's drafts race on the noise its
    verification races on again, and a position a round rejects is drawn again next round.
    Callers never write into it."""
    mixed = _mix(seed, position)
    gen = torch.Generator(device=device) if device.type != "cpu" else torch.Generator()
    return seeded_exponentials(gen.manual_seed(mixed), 1, size, device)[0]


def keyed_gumbels(key: NoiseKey, count: int, size: int, device: torch.device,
                  columns: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel noise -log E [count, size] (or its `columns`) of a seeded request's positions
    key.position .. + count - 1: what its rows race on, drafter and target alike."""
    rows = [_position_gumbel(key.seed, key.position + k, size, device) for k in range(count)]
    if columns is not None:                    # pick the columns row by row: no [count, size] copy
        rows = [row.index_select(0, columns.to(row.device)) for row in rows]
    return torch.stack(rows)


@functools.lru_cache(maxsize=128)
def _position_gumbel(seed: int, position: int, size: int, device: torch.device) -> torch.Tensor:
    return _position_noise(seed, position, size, device).log().neg_()


def gumbel_noise(rows: int, vocab_size: int, keys: list[NoiseKey | None], device: torch.device,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel noise [N, V] (or at candidate ids `index` [N, K]): seeded rows from their keys, so
    a candidate race reads the noise the full one would; the others from the global generator
    in one call."""
    width = vocab_size if index is None else index.shape[1]
    free = [row for row in range(rows) if keys[row] is None]
    if len(free) == rows:
        return global_exponentials((rows, width), device).log_().neg_()
    noise = torch.empty(rows, width, device=device)
    if free:
        noise[free] = global_exponentials((len(free), width), device).log_().neg_()
    for row in sorted(set(range(rows)) - set(free)):
        noise[row] = keyed_gumbels(keys[row], 1, vocab_size, device, None if index is None else index[row])[0]
    return noise


def global_exponentials(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """What `empty(shape, device=device).exponential_()` returns from the global generator, bit
    for bit; on the CPU drawn as `seeded_exponentials` draws, whose vectorised logarithm spares
    the per-element one of `exponential_`."""
    if device.type != "cpu":
        return torch.empty(shape, device=device).exponential_()
    rows = math.prod(shape[:-1])
    return seeded_exponentials(torch.default_generator, rows, shape[-1], device).view(shape)


def seeded_exponentials(generator: torch.Generator, count: int, size: int, device: torch.device) -> torch.Tensor:
    """What `count` calls of `empty(size).exponential_(generator=generator)` return, bit for bit,
    [count, size]. torch draws Exp(1) on the CPU as -log1p(-U) of a double uniform U, serially;
    drawn as one block, with the logarithm vectorised, the same stream costs a fraction."""
    u = torch.rand((count, size), generator=generator, dtype=torch.float64, device=generator.device)
    return (-torch.log1p(-u)).float().to(device)


def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [N, V] fp32 -> tokens [N] (on the device)."""
    greedy = greedy_tokens(logits)
    if st.all_greedy:
        return greedy
    sparse = candidate_logits(logits, st)
    fits = sparse[2] if sparse is not None else [False] * logits.shape[0]
    sampled = greedy.clone()
    rows = [i for i, fit in enumerate(fits) if fit]
    if rows:
        scores, index = sparse[0][rows], sparse[1][rows]
        noise = gumbel_noise(len(rows), logits.shape[1], [st.keys[i] for i in rows], logits.device, index)
        sampled[rows] = index.gather(1, greedy_tokens(scores + noise)[:, None]).squeeze(1)
    rest = [i for i, fit in enumerate(fits) if not fit]
    if rest:                        # all rows (the usual case): no [N, V] copy of the logits
        sub_logits, sub = (logits, st) if not rows else (logits[rest], st.select(rest))
        scores = processed_logits(sub_logits, sub)
        sampled[rest] = greedy_tokens(scores + gumbel_noise(len(rest), logits.shape[1], sub.keys, logits.device))
    return torch.where(st.greedy, greedy, sampled)
