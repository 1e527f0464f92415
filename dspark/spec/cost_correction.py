"""Online correction of the cost table: what steps of each kind and size actually took.

A cost table is measured once, and a shared machine does not stay as it was: when neighbours
load it, memory-bound small steps and compute-bound large ones slow down by different factors
(on this project's 2-core CPU, under load, a batch-1 step took anywhere from 39 to 65 ms within
minutes). The planner weighs a plain step of R tokens against a drafted one of R + b tokens
plus a drafter pass, so a drift that scales the two differently flips its decisions. So every
step's wall time is compared with what the table predicted for its shape, per kind (plain or
drafted) and size class (the powers of two of the tokens the target ran), in exponentially
decayed sums, and the planner multiplies a plan's predicted cost by the ratio of its kind and
class. Kinds are kept apart because a step's time is measured whole: a drafter pass mispriced
by the table must not reprice plain steps of the same size. A class never seen takes the ratio
of the nearest one of its kind that was, and a kind never seen keeps the table's word: the
first drafted steps, and the probes that keep every request's confidences current, teach the
drafted classes. Only past steps enter, so a plan still cannot depend on the drafts it will
admit. A class that settles 2x or more off the table says, once, that the table is stale.

Once a class has seen a step, the next counts at most 1.5x away from its estimate, either way.
A single stalled step (a pause of the process, a neighbour's burst: a 16-row plain step measured
at 7.6x its table cost on this project's CPU) would otherwise lift its class by half for a dozen
steps, and once that makes plain steps look dear the planner drafts, so the plain class is no
longer measured and its inflated estimate stays (at 16 requests, 21% of steps drafted where
plain decoding was 1.3x faster). A lasting drift still moves the estimate by up to 5% a step.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

MAX_CLASSES = 32          # size class c holds the steps of 2^(c-1) < tokens <= 2^c
PLAIN, DRAFTED = 0, 1     # the kinds of step
STALE_RATIO = 2.0         # a class this far off the table (either way) says: profile again
STALE_STEPS = 32          # ... once it has seen this many steps
MAX_STEP_RATIO = 1.5      # one step counts at most this far from its class's estimate, either way


def size_class(tokens: int) -> int:
    """1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...: the class a step of `tokens` tokens counts in."""
    return min(MAX_CLASSES - 1, math.ceil(math.log2(max(1, tokens))))


@dataclass
class CostScale:
    """By how much a step will cost more than the table says, for one planning decision."""
    plain: float                   # the step with no drafter pass (other tokens only)
    drafted: np.ndarray            # [B] a drafted step verifying b = 0..B-1 drafts


class CostCorrection:
    def __init__(self, decay: float = 0.9, prior_steps: float = 2.0):
        if not 0.0 < decay <= 1.0 or prior_steps <= 0:
            raise ValueError(f"decay must be in (0, 1] and prior_steps > 0, got {decay}, {prior_steps}")
        self.decay = decay
        shape = (2, MAX_CLASSES)                                         # [kind, size class]
        self.ratio_sum = np.full(shape, prior_steps)                           # Σ measured/predicted
        self.weight = np.full(shape, prior_steps)                              # Σ steps
        self.steps = np.zeros(shape, dtype=np.int64)                           # steps seen
        self._ratios: np.ndarray | None = None                                 # cache of `ratios`
        self._nearest = np.tile(np.arange(MAX_CLASSES), (2, 1))                # class whose ratio it takes
        self.stale_warned = False

    def observe(self, tokens: int, drafted: bool, predicted_ms: float, measured_ms: float) -> None:
        """One step that ran `tokens` target tokens (after a drafter pass when `drafted`): the
        table said `predicted_ms`, it took `measured_ms`."""
        if tokens < 1 or not predicted_ms > 0 or not measured_ms > 0:
            return
        kind, c = int(drafted), size_class(tokens)
        ratio = measured_ms / predicted_ms
        if self.steps[kind, c]:                          # a class seen: no step moves it far
            current = self.ratio_sum[kind, c] / self.weight[kind, c]
            ratio = min(max(ratio, current / MAX_STEP_RATIO), current * MAX_STEP_RATIO)
        self.ratio_sum[kind, c] = self.decay * self.ratio_sum[kind, c] + ratio
        self.weight[kind, c] = self.decay * self.weight[kind, c] + 1.0
        self.steps[kind, c] += 1
        if self.steps[kind, c] == 1:                     # a class seen for the first time
            self._nearest = self._nearest_seen()
        self._ratios = None
        self._warn_if_stale(kind, c)

    def _warn_if_stale(self, kind: int, c: int) -> None:
        """Correcting is no substitute for a table of this machine as it is: say so, once."""
        ratio = float(self.ratio_sum[kind, c] / self.weight[kind, c])
        settled = self.steps[kind, c] >= STALE_STEPS
        if self.stale_warned or not settled or 1 / STALE_RATIO < ratio < STALE_RATIO:
            return
        self.stale_warned = True
        logger.warning("%s steps of %d-%d tokens take %.2fx what the cost table says; planning "
                       "corrects for it, but the table looks stale: measure it again (`--cost-table auto`, "
                       "or `dspark profile`)",
                       "drafted" if kind == DRAFTED else "plain", 2 ** (c - 1) + 1 if c else 1, 2 ** c, ratio)

    @property
    def ratios(self) -> np.ndarray:
        """[2, MAX_CLASSES] measured / predicted per kind and size class. A class not seen takes
        the ratio of the nearest class of its kind that was (the smaller on a tie): drift is
        smooth across sizes. A kind with no step seen keeps the table's word, 1."""
        if self._ratios is None:
            self._ratios = np.take_along_axis(self.ratio_sum / self.weight, self._nearest, axis=1)
        return self._ratios

    def _nearest_seen(self) -> np.ndarray:
        """[2, MAX_CLASSES] for each class, the nearest class of its kind that was seen (itself
        when seen or when its kind has none): changes only when a class is seen first."""
        classes = np.arange(MAX_CLASSES)
        nearest = np.tile(classes, (2, 1))
        for kind in (PLAIN, DRAFTED):
            seen = classes[self.steps[kind] > 0]
            if len(seen):
                nearest[kind] = seen[np.abs(classes[:, None] - seen[None, :]).argmin(axis=1)]
        return nearest

    def scale(self, other_tokens: int, max_budget: int, joining_tokens: int = 0) -> CostScale:
        """The factors for a step of `other_tokens` plus a verify budget of 0..max_budget (drafted
        steps also carry `joining_tokens` of prefill; the plain one is judged without them)."""
        ratios = self.ratios
        return CostScale(plain=float(ratios[PLAIN, size_class(other_tokens)]),
                         drafted=ratios[DRAFTED, _classes(other_tokens + joining_tokens, max_budget)])


@functools.lru_cache(maxsize=256)
def _classes(other_tokens: int, max_budget: int) -> np.ndarray:
    """[max_budget + 1] size_class of other_tokens + b, b = 0..max_budget (read-only; a step's
    shape repeats under steady load, so the planner asks for the same ones step after step)."""
    tokens = np.arange(other_tokens, other_tokens + max_budget + 1, dtype=np.float64)
    classes = np.minimum(np.ceil(np.log2(np.maximum(tokens, 1.0))).astype(np.int64), MAX_CLASSES - 1)
    classes.setflags(write=False)
    return classes
