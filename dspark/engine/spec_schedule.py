"""Confidence scheduling on the host: the verify budget of the next step, before it launches.

Each speculative request remembers the confidences of its last few rounds, as cumulative
survivals with STS applied. The budget of a step uses those from `lag` rounds back (the oldest
it has when it has fewer), corrected by what recent rounds actually accepted
(`OnlineSurvivalCorrection`), and hands them to the planner with the cost table. A request with
no history counts as certain (c = 1) as far as its own confidences go, and is priced at the
survival the population's rounds realise, which starts at 1 and learns; a request whose last
round lies `age` steps back is priced between the two, its own weight halving every `half_life`
undrafted steps, so old evidence fades instead of deciding for ever. The planner also leaves out
of the drafter pass the requests whose drafts are not worth it (they decode one plain token); a
request left out for its probe interval is due to draft again so that its confidences stay
current, and each probe that does not convince the planner doubles that request's interval (up
to 16x). A due probe runs only when the step would pay if the due requests were as good as the
population's average round (its realised survival): where drafting does not pay on average (at 4
requests and more on this project's CPU, or wherever one more drafted request lengthens the step
past a bucket) probes cost more than they find, and they wait. Pricing them as the population's
best quarter instead probed every request of a lockstep batch at once, 16 of them in one 51 ms
step where plain decoding took 15.6 ms, and in one-off A/B runs left the engine 4-14% slower at
4 requests. Only information from earlier steps enters, so the plan cannot depend on the drafts
it will admit; which drafts fill the budget is decided on the device (worker/ragged.py,
spec/allocate.py). Every step's wall time also goes back to the planner (`observe_step`), which
prices later plans by what steps of their size took lately rather than by the table alone
(spec/cost_correction.py).

A second correction checks the planner against itself: what it priced each drafted request at
(stale, faded confidences, before this correction) against what that round then accepted. The
first correction calibrates the drafter's fresh confidences; this one catches what staleness
and selection add: the planner drafts a request when its last confidences were high, and the
next round regresses toward the request's mean (measured on this project's CPU at 4 requests:
about 0.8 accepted drafts a request priced, 0.35 realised).
"""

from __future__ import annotations

import logging

import numpy as np

from dspark.engine.scheduler import ScheduledRequest
from dspark.engine.sequence import Sequence
from dspark.spec.cost_correction import CostCorrection
from dspark.spec.online_correction import OnlineSurvivalCorrection
from dspark.spec.planner import CostTable, StepPlan, plan_step
from dspark.spec.sts import STSCalibration, host_survival

logger = logging.getLogger(__name__)


class ConfidenceScheduler:
    def __init__(self, table: CostTable, sts: STSCalibration | None, gamma: int, lag: int = 2,
                 min_gain: float = 0.05, probe_interval: int = 16, half_life: float = 4.0,
                 cost_correction: bool = True):
        if lag < 1 or probe_interval < 1 or not half_life > 0:
            raise ValueError(f"the confidence lag and the probe interval must be >= 1 step and the "
                             f"half-life > 0, got {lag}, {probe_interval} and {half_life}")
        self.half_life = half_life
        self.table, self.gamma, self.lag, self.min_gain = table, gamma, lag, min_gain
        self.probe_interval = probe_interval
        self.temperatures = np.asarray(sts.temperatures if sts else [1.0] * gamma, dtype=np.float64)
        self.offsets = np.asarray(sts.offset_list() if sts else [0.0] * gamma, dtype=np.float64)
        self.correction = OnlineSurvivalCorrection(gamma)
        self.plan_correction = OnlineSurvivalCorrection(gamma)   # priced by the planner vs realised
        self.cost_correction = CostCorrection() if cost_correction else None
        self.oversize_steps = 0          # steps larger than the table: priced by extrapolation
        self.declined_probes = 0         # due probes not run: not even a good case could pay
        self._no_history = np.zeros(gamma)
        self._positions = np.arange(gamma)

    def record(self, seq: Sequence, confidence_logits: list[float], verified: int, accepted: int) -> None:
        """A verified round's raw confidences: kept as calibrated survival, the form the planner
        reads (converted once here, not at every step that prices the request)."""
        survival = self.survival_of(confidence_logits)
        seq.survival_history.append(survival)
        del seq.survival_history[:-self.lag]
        self.correction.observe(survival, verified, accepted)
        if seq.planned_survival is not None:
            self.plan_correction.observe(seq.planned_survival, verified, accepted)
            seq.planned_survival = None

    def survival_of(self, confidence_logits) -> np.ndarray:
        """[γ] raw confidences of one round -> cumulative survival, STS applied."""
        z = np.asarray(confidence_logits, dtype=np.float64)
        return host_survival(z, self.temperatures, self.offsets)

    def _stale_survival(self, spec: list[ScheduledRequest]) -> np.ndarray:
        """[R, γ] survival from `lag` rounds back, corrected and faded toward the population's
        realised survival by its age (all of it without history); 0 past each request's cap. One
        batched computation for the whole step."""
        none = self._no_history
        rows, weight = [], []
        for s in spec:
            history = s.seq.survival_history
            rows.append(history[-min(self.lag, len(history))] if history else none)
            weight.append(0.5 ** (s.seq.steps_without_draft / self.half_life) if history else 0.0)
        own = self.correction.apply(np.array(rows))
        realised = self.correction.realised_survival
        survival = realised + np.array(weight)[:, None] * (own - realised)
        if any(s.verify_len < self.gamma for s in spec):
            caps = np.array([s.verify_len for s in spec])
            survival[self._positions[None, :] >= caps[:, None]] = 0.0
        return survival

    def plan(self, scheduled: list[ScheduledRequest], joining_tokens: int = 0) -> StepPlan | None:
        """Which speculative requests draft and how many drafts are verified; None: verify all.
        `joining_tokens` of waiting requests' prefill will join the step (see `plan_step`)."""
        spec = [s for s in scheduled if s.spec]
        if not spec:
            return None
        other = sum(s.num_new_tokens for s in scheduled if not s.spec) + len(spec)
        if len(spec) > self.table.max_requests or other + joining_tokens + 1 > self.table.max_tokens:
            if self.oversize_steps == 0:
                logger.warning("a step is larger than the cost table (%d requests, %d tokens); "
                               "pricing it along the table's last slope (counted in oversize_steps)",
                               len(spec), other + joining_tokens)
            self.oversize_steps += 1
        stale = self._stale_survival(spec)
        survival = self.plan_correction.apply(stale)
        num_sampling = sum(1 for s in scheduled if s.sample)
        scale = None if self.cost_correction is None else \
            self.cost_correction.scale(other, survival.size, joining_tokens)
        probe = self._admitted_probes(spec, survival, num_sampling, other, scale, joining_tokens)
        plan = plan_step(survival, self.table, num_sampling, other, self.min_gain, probe, scale,
                         joining_tokens=joining_tokens)
        chosen = plan_step(survival, self.table, num_sampling, other, self.min_gain, cost_scale=scale,
                           joining_tokens=joining_tokens).drafted if any(probe) else plan.drafted
        plan = _pin_seeded(plan, spec)
        for s, priced, drafted, probed, wanted in zip(spec, stale, plan.drafted, probe, chosen):
            seq = s.seq
            seq.steps_without_draft = 0 if drafted else seq.steps_without_draft + 1
            seq.planned_survival = priced if drafted else None
            if probed and not wanted:
                seq.probe_backoff = min(seq.probe_backoff * 2, 16)
            elif wanted:
                seq.probe_backoff = 1
        return plan

    def observe_step(self, tokens: int, draft_requests: int, measured_ms: float) -> None:
        """A step ran `tokens` target tokens after a drafter pass over `draft_requests` requests
        (0: none) in `measured_ms`: teach the cost correction what the table missed."""
        if self.cost_correction is None:
            return
        predicted = float(self.table.verify_costs(tokens, tokens + 1)[0])
        if draft_requests:
            predicted += float(self.table.draft_costs([draft_requests])[0])
        self.cost_correction.observe(tokens, draft_requests > 0, predicted, measured_ms)

    def _admitted_probes(self, spec: list[ScheduledRequest], survival: np.ndarray, num_sampling: int,
                         other: int, scale, joining_tokens: int) -> list[bool]:
        """Which requests due a probe draft this step: those the planner would draft if every
        due request were as good as the average round the population verified lately (its
        realised survival per position). A probe buys information, but one whose round could not
        pay for the step it lengthens even at the average (a drafter pass, and on a staircase of
        buckets often the next bucket) costs more than what it finds; due requests wait until
        enough of them share a step that could pay. Declined probes are counted."""
        due = np.asarray([s.seq.steps_without_draft >= self._interval(s.seq) for s in spec])
        if not due.any():
            return due.tolist()
        caps = np.asarray([s.verify_len for s in spec])
        mean = self.correction.realised_survival                                            # [γ]
        typical = np.where(np.arange(self.gamma)[None, :] < caps[:, None], mean[None, :], 0.0)  # [R, γ]
        supposed = np.where(due[:, None], typical, survival)
        admitted = due & np.asarray(plan_step(supposed, self.table, num_sampling, other, self.min_gain,
                                              cost_scale=scale, prefer_verify_all=False,
                                              joining_tokens=joining_tokens).drafted)
        self.declined_probes += int(due.sum() - admitted.sum())
        return admitted.tolist()

    def _interval(self, seq: Sequence) -> int:
        return self.probe_interval * seq.probe_backoff


def _pin_seeded(plan: StepPlan, spec: list[ScheduledRequest]) -> StepPlan:
    """A seeded sampling request drafts and has every draft verified, whatever the plan: which
    drafts a sampled request verifies decides which tokens its seed draws, and the plan depends
    on the load and on measured step times, so only a fixed choice keeps its text a function of
    its seed (the one verify-all gives). The step then verifies every draft of every request it
    drafts (the budget is not trimmed)."""
    pinned = [s.seq.generator is not None and not s.seq.params.greedy for s in spec]
    if not any(pinned):
        return plan
    return StepPlan(drafted=[d or p for d, p in zip(plan.drafted, pinned)], budget=plan.full,
                    full=plan.full)
