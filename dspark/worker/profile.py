"""`dspark profile`: measure the step costs the verify-budget planner prices budgets with.

Verify cost is timed at every graph bucket up to T_max (and every Nth count past the largest)
as the target forward a speculative step runs (requests of γ+1 rows each, logits for every
row, padded to the bucket as the engine pads it); draft cost for every request
count 1..R_max as one drafter proposal plus the drafter's context append of those requests'
verify rows (γ+1 each): both are what a step that drafts pays and a plain step does not (the
append is about a fifth of the drafter's share of a one-request step on a 2-core CPU). Both
at a realistic context length, median of N rounds that time every size once each, after
warm-up, then made monotone (a larger step never costs less: the noise of a shared machine must
not make the planner chase phantom dips). The engine must be idle: profiling writes scratch K/V into blocks no request
owns yet.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dspark.sampling_params import SamplingParams
from dspark.spec.draft import append_context, propose
from dspark.spec.planner import CostTable
from dspark.worker.inputs import RequestChunk, build_inputs
from dspark.worker.sampler import SamplingTensors
from dspark.worker.worker import Worker


@dataclass
class ProfileConfig:
    max_tokens: int = 64          # verify costs for 1..max_tokens
    max_requests: int = 8         # draft costs for 1..max_requests
    context_len: int = 256        # tokens already in every profiled request's KV
    repeats: int = 5
    warmup: int = 2
    token_stride: int = 1         # measure t = 1, s, 2s, ...; a size in between costs the next one


def _timed_in_rounds(fns: list, cfg: ProfileConfig, bar) -> list[float]:
    """The median time of each of `fns` over `cfg.repeats` rounds that call every one once, in
    turn, after `cfg.warmup` calls each. On a shared machine load comes and goes over seconds:
    timed back to back, one size's repeats can sit inside a burst and the table gets a step that
    is not there (64 tokens measured at 33.5, 55.6 and 40.1 ms in three runs of one hour here);
    in rounds a burst reaches every size alike, and the table's shape, which is what the planner
    compares, survives it."""
    for fn in fns:
        for _ in range(cfg.warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(cfg.repeats):
        for fn, times in zip(fns, samples):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        bar.update(1)
    return [statistics.median(times) for times in samples]


def _tables(worker: Worker, num_requests: int, context_len: int, rows: int) -> list[list[int]]:
    """Block tables over scratch blocks (shared modulo the cache size: cost, not content, counts)."""
    per = -(-(context_len + rows) // worker.block_size)
    total = worker.kv_caches[0][0].shape[0] // worker.block_size        # blocks (the cache is [slots, ...])
    return [[(r * per + i) % total for i in range(per)] for r in range(num_requests)]


def _verify_fn(worker: Worker, tokens: int, gamma: int, context_len: int):
    sizes = [gamma + 1] * (tokens // (gamma + 1)) + ([tokens % (gamma + 1)] if tokens % (gamma + 1) else [])
    tables = _tables(worker, len(sizes), context_len, gamma + 1)
    chunks = [RequestChunk([1] * q, context_len, t, q) for q, t in zip(sizes, tables)]
    inputs = build_inputs(chunks, worker.block_size, worker.device, worker.config.sliding_window)

    def run():
        worker.forward(inputs)              # at the step's graph bucket, as the engine runs it
    return run


def _draft_fn(worker: Worker, num_requests: int, context_len: int):
    dev = worker.device
    rows = worker.drafter.config.block_size + 1                       # a verify block: anchor + γ
    table_lists = _tables(worker, num_requests, context_len,             # pages for both passes
                          max(rows, worker.drafter.config.num_block_slots))
    tables = torch.tensor(table_lists, device=dev)
    anchors = torch.ones(num_requests, dtype=torch.long, device=dev)
    starts = torch.full((num_requests,), context_len, dtype=torch.long, device=dev)
    st = SamplingTensors.build([SamplingParams(temperature=0.0)] * num_requests,
                               [None] * num_requests, worker.config.vocab_size, dev)
    verified = build_inputs([RequestChunk([1] * rows, context_len, t, 0) for t in table_lists],
                            worker.block_size, dev, worker.config.sliding_window)
    aux = torch.randn(num_requests * rows, len(worker.aux_layer_ids) * worker.config.hidden_size,
                      generator=torch.Generator().manual_seed(0)).to(dev, worker.kv_caches[0][0].dtype)

    def run():          # at the request bucket the engine drafts at, when it has draft graphs
        if worker.draft_graphs is not None:
            worker.draft_graphs.run(worker.draft_kv, anchors, starts, tables, st)
        else:
            propose(worker.drafter, worker.draft_kv, anchors, starts, tables, worker.block_size, st)
        attn = verified.attn            # the drafting step's rows into the drafter's context
        append_context(worker.drafter, worker.draft_kv, aux, verified.positions, attn.write_rows,
                       attn.write_slots)
    return run


def _token_sizes(worker: Worker, cfg: ProfileConfig) -> list[int]:
    """The token counts to time: every graph bucket (a step costs what its bucket costs, so the
    staircase is exact), then every `token_stride`-th count past the largest bucket."""
    buckets = worker.graphs.buckets if worker.graphs is not None else []
    inside = [b for b in buckets if b <= cfg.max_tokens]
    start = max(inside, default=0)
    beyond = range(start + cfg.token_stride, cfg.max_tokens + 1, cfg.token_stride) if inside else \
        range(cfg.token_stride, cfg.max_tokens + 1, cfg.token_stride)
    return sorted({1, cfg.max_tokens, *inside, *beyond})


def monotone(costs: list[float]) -> list[float]:
    """Running maximum: cost never decreases with size."""
    out, top = [], 0.0
    for c in costs:
        top = max(top, c)
        out.append(top)
    return out


@torch.inference_mode()
def profile_worker(worker: Worker, cfg: ProfileConfig, fingerprint: dict,
                   use_tqdm: bool = True) -> CostTable:
    if worker.drafter is None:
        raise ValueError("profiling prices speculative steps: the engine needs a drafter")
    gamma = worker.drafter.config.block_size
    sizes = _token_sizes(worker, cfg)
    bar = tqdm(total=2 * cfg.repeats, desc="measuring step costs (target, drafter)", disable=not use_tqdm)
    timed = _timed_in_rounds([_verify_fn(worker, t, gamma, cfg.context_len) for t in sizes], cfg, bar)
    measured = dict(zip(sizes, timed))
    verify = [measured[min(m for m in sizes if m >= t)] for t in range(1, cfg.max_tokens + 1)]
    draft = _timed_in_rounds([_draft_fn(worker, r, cfg.context_len) for r in range(1, cfg.max_requests + 1)],
                             cfg, bar)
    bar.close()
    return CostTable(fingerprint=fingerprint, verify_ms=[0.0] + monotone(verify),
                     draft_ms=[0.0] + monotone(draft), context_len=cfg.context_len,
                     method=f"median of {cfg.repeats} rounds after {cfg.warmup} warm-up, every "
                            f"{cfg.token_stride} tokens, made monotone; draft cost with the "
                            f"context append")
