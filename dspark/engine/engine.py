"""The engine loop: schedule -> execute -> commit, plus request intake, abort and outputs."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import time

import torch

from dspark.config import EngineConfig
from dspark.engine.block_manager import BlockManager
from dspark.engine.isolation import FailureIsolation
from dspark.engine.output_processor import OutputProcessor
from dspark.engine.parallel_sampling import fan_out
from dspark.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from dspark.engine.sequence import Sequence
from dspark.engine.spec_setup import cost_fingerprint, load_sts, spec_policy
from dspark.models.loader import load_target
from dspark.outputs import RequestOutput, SpecStats
from dspark.sampling_params import SamplingParams
from dspark.spec.planner import CostTable
from dspark.spec.sampler import NoiseKey
from dspark.worker.inputs import RequestChunk
from dspark.runner.draft_graphs import DUMMY_REQUEST_PREFIX, is_reserved_request_id
from dspark.runner.setup import build_runner
from dspark.models.kv_cache import bytes_per_block, num_blocks_for_budget
from dspark.worker.logprobs import prompt_logprob_rows
from dspark.worker.penalties import token_history
from dspark.worker.profile import ProfileConfig
from dspark.runner.step_key import StepKey
from dspark.worker.step import StepResult, WorkerBatch
from dspark.worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine can run no more steps (a data-parallel rank failed): its server stops serving,
    where a step that merely failed only fails its requests."""


@dataclasses.dataclass
class EngineLoad:
    """Queue and cache occupancy, for metrics (summed over ranks under data parallelism)."""
    waiting: int
    running: int
    free_blocks: int
    num_blocks: int
    runner: dict[str, int] = dataclasses.field(default_factory=dict)   # RunnerStats.counters(), so far

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclasses.dataclass
class PreparedStep:
    sched: SchedulerOutput
    batch: WorkerBatch


class Engine:
    heartbeat_s: float | None = None    # one engine has no peers to lose while idle (a group has)
    step_limit_s: float | None = None   # a step may take long (a long prefill on a CPU): no limit

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)          # graphs and streams follow the current device
        loaded = load_target(config.model, config.torch_dtype, device=config.device,
                             max_positions=config.max_model_len or 8192)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or 8192, loaded.config.max_position_embeddings)
        cache = config.cache
        self.drafter = None
        if config.spec.drafter is not None:
            from dspark.models.drafter_loader import load_drafter
            self.drafter = load_drafter(config.spec.drafter, loaded.config, loaded.model.embed_tokens,
                                        loaded.model.lm_head, config.torch_dtype)
        runner = build_runner(loaded.model, self.drafter, config, self.device)   # packs the weights
        draft_bytes = 0 if self.drafter is None else bytes_per_block(
            self.drafter.config, cache.block_size, config.torch_dtype)
        needed = config.scheduler.max_num_seqs * (self.max_model_len + cache.block_size)
        num_blocks = num_blocks_for_budget(loaded.config, cache, config.torch_dtype, self.device, needed,
                                           extra_bytes_per_block=draft_bytes)
        if num_blocks * cache.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache budget holds {num_blocks * cache.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; raise the budget or lower max_model_len")
        self.block_manager = BlockManager(num_blocks, cache.block_size)
        gamma = self.drafter.config.block_size if self.drafter is not None else 0
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, gamma)
        self.worker = Worker(loaded.model, loaded.config, num_blocks, cache.block_size,
                             config.torch_dtype, self.device, runner, drafter=self.drafter)
        self.spec_stats = SpecStats(accepted_per_position=[0] * gamma)
        self.sts = load_sts(config, self.drafter, gamma)
        self.policy = self.scheduler.policy = spec_policy(
            config, self.drafter, gamma, self.sts, self.max_model_len, self.cost_fingerprint(), self.profile)
        if self.policy is not None and self.sts is not None:      # the STS applied on the device too
            self.worker.sts_temperatures = torch.tensor(self.sts.temperatures, device=self.device)
            self.worker.sts_offsets = torch.tensor(self.sts.offset_list(), device=self.device)
        # (raw confidence logits z_1..z_γ, accepted drafts) of verify-all rounds, when recording
        self.confidence_records: list[tuple[list[float], int]] | None = None
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else []
        self.eos_token_ids = sorted({*loaded.config.eos_token_ids, *tokenizer_eos})
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        self.isolation = FailureIsolation()
        self._ids = itertools.count()

    def cost_fingerprint(self) -> dict:
        """What a cost table must have been measured on to price this engine's steps."""
        return cost_fingerprint(self.config, self.drafter, self.worker.runner.graphs, self.device)

    def profile(self, cfg: ProfileConfig) -> CostTable:
        """Measure the cost table of this engine (it must be idle)."""
        from dspark.worker.profile import profile_worker
        if self.has_unfinished:
            raise RuntimeError("profile an idle engine: scratch K/V would overwrite live requests")
        rows = self.drafter.config.block_size + 1 if self.drafter else 1
        if cfg.context_len + rows > self.max_model_len:
            raise ValueError(f"profiling a context of {cfg.context_len} tokens plus {rows} new ones "
                             f"exceeds max_model_len={self.max_model_len}; lower --context-len")
        runner = self.worker.runner
        graphs = [g for g in (runner.graphs, runner.draft_graphs) if g is not None]
        counted = [copy.deepcopy(g.stats) for g in graphs]
        table = profile_worker(self.worker, cfg, self.cost_fingerprint())
        for g, stats in zip(graphs, counted):       # the profile's steps are no served steps
            g.stats = stats
        return table

    @contextlib.contextmanager
    def planning_with(self, policy):
        """`policy` plans the steps inside (None: every draft of every request verified), the
        engine's own neither planning nor learning, and back after: calibration needs whole
        blocks verified, and the sweep compares verify-all and fixed plans with the policy on
        one engine."""
        own = self.policy
        self.policy = self.scheduler.policy = policy
        try:
            yield
        finally:
            self.policy = self.scheduler.policy = own

    def reset_spec_stats(self) -> None:
        self.spec_stats = SpecStats(accepted_per_position=[0] * len(self.spec_stats.accepted_per_position))

    # ---- intake -------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        text, ids = self.check_request(prompt, params, request_id)
        request_id = request_id if request_id is not None else str(next(self._ids))
        seqs = fan_out(request_id, ids, params, text, arrival_time, self.block_manager.block_size)
        if request_id in self.requests or any(s.request_id in self.requests for s in seqs):
            raise ValueError(f"request id {request_id!r} is already running")
        for seq in seqs:              # n > 1: one per completion (parallel_sampling.py)
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)
        return request_id

    def check_request(self, prompt: str | list[int], params: SamplingParams,
                      request_id: str | None = None) -> tuple[str | None, list[int]]:
        """(prompt text, prompt ids) of a request this engine accepts; ValueError/TypeError naming
        the problem otherwise. A data-parallel front end checks here before routing."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._encode(prompt)
        if len(ids) == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params.check_vocab(vocab)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the context allows "
                             f"(max_model_len={self.max_model_len}, at least one token to generate)")
        if request_id is not None and is_reserved_request_id(request_id):
            raise ValueError(f"request id {request_id!r} starts with {DUMMY_REQUEST_PREFIX!r}, a "
                             "prefix reserved for the engine's padding (dummy) requests")
        return text, ids

    def _encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError("a prompt is a string or a list of token ids")

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its completions) or one completion (by its child id)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return any([self.abort(child) for child in self.scheduler.parallel.child_ids(request_id)])
        self._finish(seq, "abort")
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def close(self) -> None:
        """Nothing to release for one engine (a data-parallel group stops its ranks here)."""

    def heartbeat(self) -> None:
        """Nothing to check for one engine (a data-parallel group checks its ranks here)."""

    def stalled(self, age_s: float) -> BaseException:
        """Give up on a step that has run `age_s` seconds; the error to report for it."""
        return RuntimeError(f"the engine step has run {age_s:.1f} s")

    def load(self) -> EngineLoad:
        blocks = self.block_manager
        return EngineLoad(self.scheduler.num_waiting, len(self.scheduler.running),
                          blocks.num_free_blocks, blocks.num_blocks, self.worker.runner.stats().counters())

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; an error in it fails only the request that causes it (isolation.py)."""
        self.worker.runner.check_threads()        # before anything is scheduled: no request fails
        suspect = self.isolation.next_suspect(self.requests)
        prepared = self.prepare_step(only=suspect)
        if prepared is None:
            return []
        seqs = [s.seq for s in prepared.sched.scheduled]
        try:
            result = self._execute(prepared)
        except EngineStopped:
            raise
        except Exception as exc:                  # noqa: BLE001 (traced to a request below)
            if suspect is not None:
                self.isolation.done_with(suspect, failed=True)
                return [self._fail_request(suspect, exc)]
            if self.isolation.begin([seq.request_id for seq in seqs], exc):
                return []
            logger.error("a step failed; failing its %d request(s)", len(seqs), exc_info=exc)
            return [self._fail_request(seq, exc) for seq in seqs]
        if suspect is not None:
            self.isolation.done_with(suspect, failed=False)
        else:
            self.isolation.step_succeeded()
        return self._commit(prepared.sched, result)

    def _fail_request(self, seq: Sequence, error: BaseException) -> RequestOutput:
        """End one request with finish_reason "error"; its KV blocks are freed at once."""
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        logger.error("request %s failed: %s", seq.request_id, message)
        self._finish(seq, "error")
        return dataclasses.replace(self.output_processor.output(seq), error=message)

    def prepare_step(self, only: Sequence | None = None) -> PreparedStep | None:
        """Schedule and plan the next step without running it (None: nothing to run); `only`:
        that running request alone. Data parallel ranks agree on the shapes of their prepared
        steps before running them."""
        sched = self.scheduler.schedule(only=only)
        if not sched.scheduled:
            return None
        batch = self._worker_batch(sched)
        plan = sched.plan
        if plan is not None:
            batch.verify_budget = plan.budget
            self.spec_stats.undrafted_steps += plan.drafted.count(False)
            self.spec_stats.predicted_accepted_tokens += plan.predicted_accepted
        return PreparedStep(sched, batch)

    def run_step(self, prepared: PreparedStep, key: StepKey | None = None) -> list[RequestOutput]:
        """Run a prepared step (at the group's agreed key under data parallelism) and commit it."""
        return self._commit(prepared.sched, self._execute(prepared, key))

    def _execute(self, prepared: PreparedStep, key: StepKey | None = None) -> StepResult:
        start = time.perf_counter()
        result = self.worker.execute(prepared.batch, key)       # ends in the step's one host copy
        sched = prepared.sched
        if sched.plan is not None and all(s.sample and (s.spec or s.num_new_tokens == 1) for s in sched.scheduled):
            tokens = sum(1 + v for v in result.verify_lens)       # decode steps alone are priced by the table
            self.policy.observe_step(sched.plan, len(sched.scheduled), tokens, time.perf_counter() - start)
        return result

    def _worker_batch(self, sched: SchedulerOutput) -> WorkerBatch:
        chunks, params, keys, spec, prompt_lp = [], [], [], [], []
        for s in sched.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            if s.spec:      # the anchor, then ℓ rows the drafter fills on the device
                ids = [seq.token_at(start)] + [0] * s.verify_len
            else:
                ids = [seq.token_at(p) for p in range(start, start + s.num_new_tokens)]
            num_logits = (1 + s.verify_len if s.spec else 1) if s.sample else 0
            want = prompt_logprob_rows(len(chunks), seq.prompt_token_ids, seq.prompt_logprobs, start,
                                       len(ids), seq.params.prompt_logprobs)
            prompt_lp += [want] if want else []
            rows = want.rows if want else range(0)          # prompt log-probs, when asked
            history = token_history(seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                    self.eos_token_ids) if s.sample else None     # penalties
            chunks.append(RequestChunk(ids, start, seq.block_table, num_logits, rows, history))
            if s.sample:
                params.append(seq.params)
                seeded = seq.params.seed is not None and not seq.params.greedy
                position = start + (1 if s.spec else len(ids))        # the position it samples
                keys.append(NoiseKey(seq.params.seed, position) if seeded else None)    # its noise
                spec.append(s.spec)
        return WorkerBatch(chunks, params, keys, spec, released_blocks=self.block_manager.take_released(),
                           prompt_logprobs=prompt_lp)

    def _commit(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        outputs, now, k = [], time.perf_counter(), 0
        for c, s in enumerate(sched.scheduled):
            if result.prompt_logprobs and c in result.prompt_logprobs:
                s.seq.prompt_logprobs += result.prompt_logprobs[c]
            if not s.sample:
                s.seq.num_computed_tokens += s.num_new_tokens
                continue
            try:
                outputs.append(self._commit_sampled(s, result, k, now))
            except Exception as exc:           # noqa: BLE001 (this request's alone, e.g. decoding)
                outputs.append(self._fail_request(s.seq, exc))
            k += 1
        return outputs

    def _commit_sampled(self, s: ScheduledRequest, result: StepResult, k: int, now: float) -> RequestOutput:
        """Sampling request k of the step's results into its request."""
        seq, tokens = s.seq, result.tokens[k]
        if s.spec:
            for stats in (seq.spec, self.spec_stats):
                stats.add_round(self.drafter.config.block_size, result.verify_lens[k], result.num_accepted[k])
            if result.confidence_logits[k] is not None:
                self._record_confidence(seq, result.confidence_logits[k], result.verify_lens[k],
                                        result.num_accepted[k])
            seq.num_computed_tokens += len(tokens)          # anchor + accepted drafts
            self.block_manager.truncate(seq.block_table, seq.num_computed_tokens + 1)
        else:
            seq.num_computed_tokens += s.num_new_tokens
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        reason = self.output_processor.append(seq, tokens, result.logprobs and result.logprobs.get(k))
        if reason is not None:
            self._finish(seq, reason)
        return self.output_processor.output(seq)

    def _record_confidence(self, seq: Sequence, z: list[float], verified: int, accepted: int) -> None:
        """For the budget planner (every round) and calibration (rounds that verified the whole
        block: only they give a label for every position)."""
        if self.policy is not None:
            self.policy.record(seq.request_id, z, verified, accepted)
        if self.confidence_records is not None and verified == self.drafter.config.block_size:
            self.confidence_records.append((z, accepted))

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.output_processor.release(seq)
        self.requests.pop(seq.request_id, None)
