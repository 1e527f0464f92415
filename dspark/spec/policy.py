"""The speculation policy: which requests draft each step and how many drafts are verified.

Inputs: each request's confidences from earlier rounds (STS calibrated), what rounds accepted,
the step times the engine measures and the cost table (spec_setup.py). Output: a `StepPlan`. Its
state is keyed by request id. Every price comes from earlier steps only, so a plan cannot depend
on the drafts it admits (`planner.allocate` picks them on the device). Why each part is there,
and the A/B runs that keep it: docs/speculation.md, "The speculation policy".
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from dspark.spec.planner import CostTable, StepPlan, plan_step
from dspark.spec.sts import STSCalibration, host_survival

logger = logging.getLogger(__name__)

MAX_BACKOFF = 16          # trials at least every 16 evidence half-lives, however many failed
MAX_TRIALS = 4            # requests without fresh evidence that try drafting in one step


@dataclass
class Candidate:
    """A running request whose next step could be a speculative round."""
    request_id: str
    verify_cap: int          # drafts it may verify this step (<= γ: max_tokens, context, budget)
    context_len: int = 0     # tokens in its KV cache (those since it last drafted are held rows)
    remaining: int = 1       # tokens it may still generate (max_tokens, the model's length)


@dataclass
class StepContext:
    """The rest of the step the plan prices its drafts against."""
    other_tokens: int        # tokens besides drafts: anchor rows, plain decode rows, prefill chunks
    num_sampling: int        # rows that produce a token this step
    joining_tokens: int = 0  # prefill of waiting requests that joins the step whatever is drafted


@dataclass
class _RequestState:
    last_drafted: int                   # the policy's step count when it last drafted
    history: deque                      # numpy [γ] calibrated survivals of the last `lag` rounds
    drafted_at: int = 0                 # its context length then (its held rows start there)
    priced: np.ndarray | None = None    # [γ] own survival the last drafted round was priced at
    trial: bool = False                 # its drafted round is a trial (see _judge_trials)


class AcceptanceModel:
    """Per position k, decayed sums over verified rounds of the price x_k (own survival, STS
    applied, `lag` rounds back) and the outcome y_k (accepted or not): the population's mean
    acceptance and a ridge regression of y on x (slope pulled toward 1, i.e. toward trusting
    the calibrated confidences, while there is little evidence)."""

    def __init__(self, gamma: int, round_decay: float = 0.995, prior_rounds: float = 1.0,
                 ridge: float = 0.25):
        self.round_decay, self.prior, self.ridge = round_decay, prior_rounds, ridge
        self.hits = np.zeros(gamma)          # population: Σ y over all verified rounds
        self.rounds = np.zeros(gamma)        # population: Σ rounds verified
        self.sums = np.zeros((5, gamma))     # regression: Σ 1, x, y, x², xy (rounds with a price)

    def observe(self, x: np.ndarray | None, verified: int, accepted: int) -> None:
        if verified <= 0:
            return
        v = slice(0, verified)
        y = (np.arange(verified) < accepted).astype(np.float64)
        self.hits[v] = self.round_decay * self.hits[v] + y
        self.rounds[v] = self.round_decay * self.rounds[v] + 1.0
        if x is not None:
            xv = np.asarray(x[:verified], dtype=np.float64)
            terms = np.stack([np.ones(verified), xv, y, xv * xv, xv * y])
            self.sums[:, v] = self.round_decay * self.sums[:, v] + terms

    def fade(self, factor: float) -> None:
        """Evidence ages with time, not only with rounds: toward the optimistic prior."""
        self.hits *= factor
        self.rounds *= factor
        self.sums *= factor

    @property
    def mean(self) -> np.ndarray:
        """[γ] the population's acceptance per position, non-increasing."""
        return np.minimum.accumulate((self.prior + self.hits) / (self.prior + self.rounds))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """[R, γ] prices -> expected acceptance per position, in [0, 1]."""
        n, sx, sy, sxx, sxy = self.sums
        m = np.maximum(n, 1e-9)
        var, cov = sxx - sx * sx / m, sxy - sx * sy / m
        slope = np.clip((cov + self.ridge) / (var + self.ridge), 0.0, 1.0)
        x_mean = (self.prior + sx) / (self.prior + n)       # a prior round at x = y = 1
        y_mean = (self.prior + sy) / (self.prior + n)
        return np.clip(y_mean + slope * (x - x_mean), 0.0, 1.0)


class SpecPolicy:
    def __init__(self, table: CostTable, sts: STSCalibration | None, gamma: int, lag: int = 2,
                 min_gain: float = 0.05, half_life: float = 4.0, evidence_half_life: float = 64.0,
                 max_kept: int = 16):
        if lag < 1 or not half_life > 0 or not evidence_half_life > 0 or max_kept < 0:
            raise ValueError(f"the confidence lag must be >= 1 round, the half-lives > 0 and "
                             f"max_kept >= 0, got {lag}, {half_life}, {evidence_half_life} and {max_kept}")
        self.table, self.gamma, self.lag, self.min_gain = table, gamma, lag, min_gain
        self.half_life, self.evidence_half_life = half_life, evidence_half_life
        self.backoff = 1                 # the evidence half-life's multiple: doubles per failed trial
        self.awaiting: set[str] = set()  # requests whose trial round was recorded: the next plan judges
        self.fade = 0.5 ** (1.0 / evidence_half_life)
        self.temperatures = np.asarray(sts.temperatures if sts else [1.0] * gamma, dtype=np.float64)
        self.offsets = np.asarray(sts.offset_list() if sts else [0.0] * gamma, dtype=np.float64)
        self.acceptance = AcceptanceModel(gamma)
        self.requests: dict[str, _RequestState] = {}
        self.oversize_steps = 0          # steps larger than the table: priced by extrapolation
        self.overhead = DraftOverhead(table)
        self.steps = 0                   # plans made, priced or kept
        self.kept_plans = 0              # plans kept without pricing (stats)
        self._steady = _Steady(longest=max_kept)
        self.max_trials = MAX_TRIALS     # 0: every request without fresh evidence may try at once (A/B runs)

    # ---- what happened ------------------------------------------------------------------------
    def record(self, request_id: str, confidence_logits: list[float], verified: int, accepted: int) -> None:
        """A verified round: its outcome teaches the acceptance model; its confidences become the
        request's price for a later round."""
        state = self._state(request_id)
        self.acceptance.observe(state.priced, verified, accepted)
        state.priced = None
        if state.trial:
            self.awaiting.add(request_id)
            state.trial = False
        z = np.asarray(confidence_logits, dtype=np.float64)
        state.history.append(host_survival(z, self.temperatures, self.offsets))

    def observe_step(self, plan: StepPlan, requests: int, tokens: int, seconds: float) -> None:
        """A decode step ran (no prefill in it): its measured time against its table price."""
        self.overhead.observe(sum(plan.drafted), requests, tokens, seconds * 1e3 - plan.held_ms)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def keep_plans(self, steps: int) -> None:
        """Keep plans at either end for up to `steps` steps from now on (0: price every step)."""
        self._steady.longest, self._steady.until = steps, 0

    # ---- the decision -------------------------------------------------------------------------
    def plan(self, candidates: list[Candidate], step: StepContext) -> StepPlan:
        """Which candidates draft and the verify budget over them."""
        self.acceptance.fade(self.fade)
        self.steps += 1
        if not candidates:
            return StepPlan(drafted=[], budget=0, full=0)
        kept = self._steady.plan(self.steps, candidates, step, self.gamma)
        if kept is not None:
            self.kept_plans += 1
            self._judge_trials(candidates, kept.drafted)
            if kept.budget:
                self._drafted(candidates, kept.drafted)
            return kept
        self._check_size(len(candidates), step)
        self.overhead.price_load(step.num_sampling)
        states = [self._state(c.request_id) for c in candidates]
        weight, survival = self._prices(candidates, states)
        held = self._held_rows(candidates, states)                                      # [R]
        _trials(candidates, weight, held, survival, step.joining_tokens > 0, self.max_trials)
        held_ms = self.table.held_row_ms * held                                         # [R]
        rounds_left = np.array([max(1, c.remaining) for c in candidates]) / (1.0 + survival.sum(1))
        plan = plan_step(survival, self.table, step.num_sampling, step.other_tokens, self.min_gain,
                         joining_tokens=step.joining_tokens, step_ms=self.overhead.step_ms,
                         draft_extra=held_ms / np.maximum(rounds_left, 1.0))
        plan.predicted_accepted = expected_accepted(survival, plan)
        plan.held_ms = float(held_ms[plan.drafted].sum())
        self._judge_trials(candidates, plan.drafted)
        for state, d in zip(states, plan.drafted):
            state.trial = d and state.last_drafted != self.steps - 1
        self._drafted(candidates, plan.drafted)
        self._steady.after(self.steps, candidates, plan)
        return plan

    def _drafted(self, candidates: list[Candidate], drafted: list[bool]) -> None:
        """A drafted request's own price is what its round will be judged against."""
        for c, d in zip(candidates, drafted):
            state = self._state(c.request_id)
            if d:
                state.last_drafted, state.drafted_at = self.steps, c.context_len
            state.priced = state.history[0] if d and state.history else None

    def _judge_trials(self, candidates: list[Candidate], drafted: list[bool]) -> None:
        """A trial (a request's first drafted round after a step without one) pays when the next
        plan drafts the request again; one that does not doubles the evidence half-life, up to
        `MAX_BACKOFF` times, so trials grow rare where drafting keeps not paying."""
        if not self.awaiting:
            return
        for c, d in zip(candidates, drafted):
            if c.request_id in self.awaiting:
                self.backoff = 1 if d else min(MAX_BACKOFF, 2 * self.backoff)
        self.fade = 0.5 ** (1.0 / (self.evidence_half_life * self.backoff))
        self.awaiting.clear()                  # a request that left before its verdict has none

    def _state(self, request_id: str) -> _RequestState:
        if (state := self.requests.get(request_id)) is None:
            state = self.requests[request_id] = _RequestState(self.steps, deque(maxlen=self.lag))
        return state

    def _prices(self, candidates: list[Candidate], states: list[_RequestState]
                ) -> tuple[np.ndarray, np.ndarray]:
        """[R] the weight of each request's own evidence (0 without history) and [R, γ] the
        survival the plan uses: the regression's prediction faded toward the population mean by
        that weight; 0 past each request's cap."""
        mean = self.acceptance.mean
        own = [s.history[0] if s.history else None for s in states]
        rows = np.array([x if x is not None else mean for x in own])                      # [R, γ]
        weight = np.array([0.5 ** ((self.steps - s.last_drafted) / self.half_life) if x is not None else 0.0
                           for s, x in zip(states, own)])
        predicted = self.acceptance.predict(rows)
        survival = np.minimum.accumulate(mean + weight[:, None] * (predicted - mean), axis=1)
        caps = np.array([c.verify_cap for c in candidates])
        survival[np.arange(self.gamma)[None, :] >= caps[:, None]] = 0.0
        return weight, survival

    def _held_rows(self, candidates: list[Candidate], states: list[_RequestState]) -> np.ndarray:
        """[R] each request's context rows held since it last drafted (none if it drafted last
        step); the plan spreads their append over the rounds the request has left."""
        held = [0 if s.last_drafted == self.steps - 1 and s.drafted_at else c.context_len - s.drafted_at
                for c, s in zip(candidates, states)]
        return np.maximum(np.asarray(held, dtype=np.float64), 0.0)

    def _check_size(self, num_requests: int, step: StepContext) -> None:
        """A decode step past the table is priced by extrapolation: say so once. A joining prefill
        is not counted: drafts on top of it are priced along the table's last slope by design."""
        tokens = step.other_tokens + num_requests * self.gamma
        if num_requests <= self.table.max_requests and tokens <= self.table.max_tokens:
            return
        if self.oversize_steps == 0:
            logger.warning("a step is larger than the cost table (%d requests, %d tokens with every "
                           "draft); pricing it along the table's last slope (counted in "
                           "oversize_steps)", num_requests, tokens)
        self.oversize_steps += 1


class DraftOverhead:
    """What a step costs beyond its table price, learned from decode steps, per load (steps of
    1, 2-3, 4-7, ... requests; an unseen load starts from the nearest lighter one): recent plain
    steps' excess (`step_ms`, added to every plan) and a drafting step's excess over that, net
    of load, added to every drafter pass's price (docs/speculation.md, "What a drafting step
    really costs"). The excess grows with the step: one figure for all loads priced drafting
    under load at what it costs a lone request."""

    plain_weight, draft_weight = 0.05, 0.1     # the two moving averages' weights
    min_plain_steps, resolution_ms = 8, 0.05   # learn nothing before; re-price the table past

    def __init__(self, table: CostTable):
        self.table, self.base = table, list(table.draft_ms)
        self.loads: dict[int, _LoadCost] = {}    # by requests.bit_length()
        self.priced = _LoadCost()                # the load the table is priced at now
        self.applied_ms = 0.0        # what the table's drafter passes carry now
        self.enabled = True          # off: the table's own prices, nothing learned (A/B runs)

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled
        self.applied_ms = -1.0                                    # re-price at once
        self._apply()

    def price_load(self, requests: int) -> None:
        """Price the coming plan at what steps of `requests` requests were seen to cost."""
        load = max(1, requests).bit_length()
        seen = [k for k in self.loads if k <= load]
        self._price(self.loads[max(seen)] if seen else _LoadCost())

    def _price(self, cost: "_LoadCost") -> None:
        self.priced = cost
        self._apply()

    @property
    def plain_steps(self) -> int:
        return self.priced.plain_steps

    @property
    def extra_ms(self) -> float:
        return self.priced.extra_ms

    def observe(self, drafted: int, requests: int, tokens: int, measured_ms: float) -> None:
        if not self.enabled:
            return
        cost = self.loads.setdefault(max(1, requests).bit_length(), _LoadCost())
        price = float(self.table.verify_costs(tokens, tokens + 1, requests)[0])
        if drafted == 0:
            w = max(self.plain_weight, 1.0 / (cost.plain_steps + 1))
            cost.plain_excess += w * (measured_ms - price - cost.plain_excess)
            cost.plain_steps += 1
            self._price(cost)
            return
        if cost.plain_steps < self.min_plain_steps:
            return
        draft = self.base[min(drafted, len(self.base) - 1)]
        excess = measured_ms - price - draft - cost.plain_excess
        excess = min(max(excess, -draft), 3.0 * draft)         # one stalled step moves it little
        cost.extra_ms += self.draft_weight * (excess - cost.extra_ms)
        self._price(cost)

    @property
    def step_ms(self) -> float:
        """What every decode step costs beyond its table price (recent plain steps' excess)."""
        if not self.enabled or self.priced.plain_steps < self.min_plain_steps:
            return 0.0
        return max(0.0, self.priced.plain_excess)

    def _apply(self) -> None:
        extra = max(0.0, self.priced.extra_ms) if self.enabled else 0.0
        if abs(extra - self.applied_ms) >= self.resolution_ms:
            self.table.draft_ms = [self.base[0]] + [c + extra for c in self.base[1:]]
            self.applied_ms = extra


@dataclass
class _LoadCost:
    """What steps of one load cost beyond the table (moving averages, ms)."""
    plain_excess: float = 0.0    # plain decode steps' time over their price
    plain_steps: int = 0         # plain decode steps seen
    extra_ms: float = 0.0        # a drafting step's extra beyond that, net of load


@dataclass
class _Steady:
    """A plan at either end kept unpriced for a stretch of 1, 2, 4 ... `longest` steps, doubling
    while priced plans agree: drafting nothing (ended by fewer candidates) or verifying all of a
    request alone (ended by a second candidate or a joining prefill)."""
    longest: int            # the longest stretch (0: price every step)
    kind: str = ""          # "none", "all" or "" (nothing kept)
    until: int = 0          # last step of the stretch
    length: int = 0         # its length; doubles while priced plans give the same answer
    candidates: int = 0     # candidates of the priced plan
    expected: float = 0.0   # drafts it expected accepted per candidate ("all")

    def plan(self, step: int, candidates: list[Candidate], ctx: StepContext, gamma: int) -> StepPlan | None:
        n = len(candidates)
        if step > self.until or not self.kind:
            return None
        full = n * gamma
        if self.kind == "none" and n >= self.candidates:
            return StepPlan(drafted=[False] * n, budget=0, full=full)
        if self.kind == "all" and n == 1 and ctx.joining_tokens == 0:
            return StepPlan(drafted=[True] * n, budget=full, full=full, predicted_accepted=self.expected * n)
        return None

    def after(self, step: int, candidates: list[Candidate], plan: StepPlan) -> None:
        """A priced plan: at an end, a stretch twice the last at the same end; else none."""
        kind = "none" if not any(plan.drafted) else "all" if plan.verify_all and len(candidates) == 1 else ""
        same = kind and kind == self.kind
        self.length = min(self.longest, 2 * self.length if same else 1) if kind else 0
        self.kind, self.until, self.candidates = kind, step + self.length, len(candidates)
        self.expected = plan.predicted_accepted / max(1, len(candidates))


def _trials(candidates: list[Candidate], weight: np.ndarray, held: np.ndarray, survival: np.ndarray,
            prefill: bool, cap: int) -> None:
    """Requests without fresh evidence of their own (weight under one half-life's), priced at the
    population's acceptance, may try drafting together, but none in a step a prefill joins, and
    at most `cap` of them (0: no cap): those priced highest, then holding the fewest context rows.
    Trying together paid among a few requests of different lengths; under load, a step of every
    request trying at once cost more than its evidence was worth (docs/speculation.md, "The
    speculation policy")."""
    stale = [i for i in range(len(candidates)) if weight[i] < 0.5]
    if not stale or prefill:
        survival[stale] = 0.0
        return
    if cap <= 0 or len(stale) <= cap:
        return
    price = survival.sum(1)
    tried = set(sorted(stale, key=lambda i: (-price[i], held[i]))[:cap])
    survival[[i for i in stale if i not in tried]] = 0.0


def expected_accepted(survival: np.ndarray, plan: StepPlan) -> float:
    """The drafts the plan expects to be accepted: its budget's best survivals among the drafted."""
    drafted = survival[np.asarray(plan.drafted, dtype=bool)]
    best = np.sort(drafted, axis=None)[::-1][:plan.budget]
    return float(best.sum())
