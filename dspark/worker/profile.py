"""`dspark profile`: measure the step costs the speculation policy prices its plans with
(docs/speculation.md, "The cost model"): the target's forward at every graph bucket per request
count, a drafting step's own work per request count, and one held context row. Shapes are timed
in rounds at a realistic context length, then made monotone so that the planner never chases a
phantom dip. The engine must be idle: profiling writes scratch K/V into blocks no request owns.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dspark.sampling_params import SamplingParams
from dspark.kernels.cpu import greedy_tokens
from dspark.runner.choice import interleaved_medians_ms
from dspark.spec.planner import CostTable, allocate
from dspark.spec.sampler import SamplingTensors
from dspark.spec.verify import accept_greedy
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.worker.worker import Worker


PROFILE_VERSION = 5       # what a step's costs include; a table measured otherwise is measured again


@dataclass
class ProfileConfig:
    max_tokens: int = 64          # verify costs for 1..max_tokens
    max_requests: int = 8         # draft costs for 1..max_requests
    context_len: int = 256        # tokens already in every profiled request's KV
    repeats: int = 5
    warmup: int = 2
    token_stride: int = 1         # measure t = 1, s, 2s, ...; a size in between costs the next one


def _timed_in_rounds(fns: list, cfg: ProfileConfig, bar, sync=lambda: None) -> list[float]:
    """Median ms of each of `fns`, timed in rounds (`interleaved_medians_ms`): on a shared machine
    load comes and goes over seconds; timed back to back, one size's repeats can sit inside a
    burst and the table gets a step that is not there (docs/measurements.md); in rounds a burst
    reaches every size alike, and the table's shape, which the planner compares, survives it.
    `sync` waits for the device's queued work (a GPU runs a step after the host has launched it)."""
    ends = itertools.cycle((False, True))          # the clock is read at a call's start, then its end

    def clock() -> float:
        sync()
        now = time.perf_counter()
        if next(ends):
            bar.update(1)                           # after the call's end is read: not timed
        return now
    ms = interleaved_medians_ms({str(i): fn for i, fn in enumerate(fns)}, cfg.repeats, cfg.warmup, clock)
    return list(ms.values())


def _tables(worker: Worker, num_requests: int, context_len: int, rows: int) -> list[list[int]]:
    """Block tables over scratch blocks (shared modulo the cache size: cost, not content, counts)."""
    per = -(-(context_len + rows) // worker.block_size)
    total = worker.kv_caches[0][0].shape[0] // worker.block_size        # blocks (the cache is [slots, ...])
    return [[(r * per + i) % total for i in range(per)] for r in range(num_requests)]


def _verify_fn(worker: Worker, requests: int, tokens: int, gamma: int, context_len: int):
    rows = step_rows(requests, tokens, gamma, longest=context_len + gamma + 1)
    tables = _tables(worker, len(rows), context_len, max(rows))
    chunks = [RequestChunk([1] * q, context_len, t, q) if i < requests else RequestChunk([1] * q, 0, t, 1)
              for i, (q, t) in enumerate(zip(rows, tables))]

    def run():          # the step's inputs built and its forward run at its graph bucket, as the engine does
        worker.forward(build_inputs(chunks, worker.block_size, worker.device, worker.config.sliding_window))
    return run


def step_rows(requests: int, tokens: int, gamma: int, longest: int) -> list[int]:
    """Rows per chunk of a step of `tokens` tokens over `requests` decoding requests: spread
    evenly (a verify budget's drafts go to several requests), at most γ+1 each; tokens past that
    are prompts joining the step, in chunks of at most `longest` (from position 0)."""
    decode = min(tokens, requests * (gamma + 1))
    rows = [decode // requests + (i < decode % requests) for i in range(requests)]
    rest = tokens - decode
    return rows + [longest] * (rest // longest) + ([rest % longest] if rest % longest else [])


def request_counts(max_requests: int) -> list[int]:
    """The request counts verify costs are measured at: powers of two, and the largest."""
    return sorted({max_requests, *(1 << i for i in range(max_requests.bit_length()))})


def _draft_fn(worker: Worker, num_requests: int, context_len: int, logits: torch.Tensor):
    """A drafting step's own work: the drafter pass, the verify lengths read back, the greedy
    acceptance of every block's rows and the context append; `logits` [≥ R·(γ+1), V] stand in
    for the target's."""
    dev = worker.device
    rows = worker.drafter.config.block_size + 1                       # a verify block: anchor + γ
    table_lists = _tables(worker, num_requests, context_len,             # pages for both passes
                          max(rows, worker.drafter.config.num_block_slots))
    chunks = [RequestChunk([1] * rows, context_len, t, rows) for t in table_lists]
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * num_requests,
                               [None] * num_requests, worker.config.vocab_size, dev)
    verified = build_inputs(chunks, worker.block_size, dev, worker.config.sliding_window)
    aux = _aux_hidden(worker, num_requests * rows)
    spec_idx = list(range(num_requests))
    caps = torch.full((num_requests,), rows - 1, device=dev)
    block_rows = torch.arange(num_requests * rows, device=dev).view(num_requests, rows)
    block_logits = logits[:num_requests * rows]

    def run():          # as a step drafts: at the request bucket, when there are draft graphs
        proposal = worker._draft(chunks, spec_idx, st)
        lens = caps
        if proposal.confidence_logits is not None:
            lens = allocate(worker._survival(proposal, caps), num_requests * (rows - 1))
        lens.tolist()
        accept_greedy(greedy_tokens(block_logits)[block_rows], lens, proposal)
        attn = verified.attn            # the drafting step's rows into the drafter's context
        worker.runner.append_context(worker.draft_kv, aux, verified.positions, attn.write_rows,
                                     attn.write_slots)
    return run


def _append_fn(worker: Worker, rows: int):
    """Appending `rows` held context rows of one request to the drafter's cache, as the first
    drafting step after steps that drafted nothing does."""
    dev = worker.device
    table = _tables(worker, 1, 0, rows)[0]
    attn = build_inputs([RequestChunk([1] * rows, 0, table, 0)], worker.block_size, dev,
                        worker.config.sliding_window).attn
    aux, positions = _aux_hidden(worker, rows), torch.arange(rows, device=dev)
    return lambda: worker.runner.append_context(worker.draft_kv, aux, positions, attn.write_rows,
                                                attn.write_slots)


def _aux_hidden(worker: Worker, rows: int) -> torch.Tensor:
    """[rows, m*d] stand-in aux hidden states of the target, in the caches' dtype."""
    width = len(worker.runner.graphs.aux_layer_ids) * worker.config.hidden_size
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(
        worker.device, worker.kv_caches[0][0].dtype)


def _token_sizes(worker: Worker, cfg: ProfileConfig) -> list[int]:
    """The token counts to time: every graph bucket (a step costs what its bucket costs, so the
    staircase is exact), then every `token_stride`-th count past the largest bucket."""
    buckets = worker.runner.graphs.buckets
    inside = [b for b in buckets if b <= cfg.max_tokens]
    beyond = range(max(inside, default=0) + cfg.token_stride, cfg.max_tokens + 1, cfg.token_stride)
    return sorted({1, cfg.max_tokens, *inside, *beyond})


def monotone(costs: list[float]) -> list[float]:
    """Cost never decreases with size: each entry the least of its own and every larger size's.
    Load on a shared machine only adds time, so a spike at one size is cut down to the sizes
    above it; a running maximum carried one slow small size into every larger one
    (docs/measurements.md)."""
    return list(itertools.accumulate(reversed(costs), min))[::-1]


@torch.inference_mode()
def profile_worker(worker: Worker, cfg: ProfileConfig, fingerprint: dict) -> CostTable:
    if worker.drafter is None:
        raise ValueError("profiling prices speculative steps: the engine needs a drafter")
    gamma = worker.drafter.config.block_size
    sizes, counts = _token_sizes(worker, cfg), request_counts(min(cfg.max_requests, cfg.max_tokens))
    shapes = [(r, t) for r in counts for t in sizes if r <= t <= _decode_top(r, gamma, sizes)]
    bar = tqdm(total=(len(shapes) + cfg.max_requests + 2) * cfg.repeats,      # timed calls
               desc="measuring step costs (target, drafter, context)")
    sync = torch.cuda.synchronize if worker.device.type == "cuda" else (lambda: None)
    timed = _timed_in_rounds([_verify_fn(worker, r, t, gamma, cfg.context_len) for r, t in shapes],
                             cfg, bar, sync)
    verify = _verify_rows(dict(zip(shapes, timed)), counts, sizes, cfg.max_tokens, gamma)
    logits = torch.randn(cfg.max_requests * (gamma + 1), worker.config.vocab_size,
                         generator=torch.Generator().manual_seed(0)).to(worker.device)
    draft = _timed_in_rounds([_draft_fn(worker, r, cfg.context_len, logits)
                              for r in range(1, cfg.max_requests + 1)], cfg, bar, sync)
    held = (max(1, cfg.context_len // 8), cfg.context_len)       # rows: the slope is one row's cost
    few, many = _timed_in_rounds([_append_fn(worker, rows) for rows in held], cfg, bar, sync)
    bar.close()
    return CostTable(fingerprint=fingerprint, verify_ms=verify, verify_requests=counts,
                     draft_ms=[0.0] + monotone(draft), context_len=cfg.context_len,
                     held_row_ms=max(0.0, (many - few) / max(1, held[1] - held[0])),
                     method=f"median of {cfg.repeats} rounds after {cfg.warmup} warm-up, every "
                            f"{cfg.token_stride} tokens at each request count, made monotone; "
                            f"draft cost with the context append")


def _decode_top(requests: int, gamma: int, sizes: list[int]) -> int:
    """The largest size timed for `requests` requests: the one holding every draft of them.
    One request is timed at every size (past its drafts, prompts joining its step); more only
    up to their drafts, since a joining prompt adds to a step of many about what it adds to a
    step of one, and timing every size at every count would slow start-up."""
    if requests == 1:
        return sizes[-1]
    return min((m for m in sizes if m >= requests * (gamma + 1)), default=sizes[-1])


def _verify_rows(measured: dict[tuple[int, int], float], counts: list[int], sizes: list[int],
                 max_tokens: int, gamma: int) -> list[list[float]]:
    """[N][T_max + 1] per request count: each token count at the next measured size (a step
    costs its bucket), a step smaller than its request count at that count's first size, one
    past the sizes timed for its count at its top size plus what one request's step adds from
    there (never less: under load a larger step of one request can time below a smaller one);
    made monotone in tokens and in requests."""
    rows, above = [], [math.inf] * max_tokens
    for r in reversed(counts):
        top = _decode_top(r, gamma, sizes)

        def cost(size: int) -> float:
            if size <= top:
                return measured[(r, size)]
            return measured[(r, top)] + max(0.0, measured[(1, size)] - measured[(1, top)])
        row = [cost(min(m for m in sizes if m >= max(t, r))) for t in range(1, max_tokens + 1)]
        above = [min(a, b) for a, b in zip(monotone(row), above)]
        rows.append([0.0] + above)
    return rows[::-1]
