"""Online correction of predicted survival: what the rounds actually accepted, per position.

STS is fitted offline on one prompt distribution; served traffic can be another (the same head
can promise 0.4 at position 1 and deliver 0.1). A planner that trusts such a promise drafts when
plain decoding would be faster. So every verified round compares, for each position it verified,
the survival it was predicted (STS applied) with whether the draft there was accepted, in
exponentially decayed sums; predictions are scaled by realised / predicted per position (kept
non-increasing along the block, never above 1). With no rounds yet the factor is 1.

The same rounds give the population's realised survival per position (accepted / verified):
what a request with no confidences of its own can expect. It starts at 1 (a request with no
history counts as certain) from a single pseudo-round, so it takes the rounds' word after a few
of them: a prior as heavy as the correction's would promise several accepted drafts per request
for a hundred rounds, and a step that prefills many requests drafts for all of them on that word.
"""

from __future__ import annotations

import numpy as np


class OnlineSurvivalCorrection:
    def __init__(self, gamma: int, decay: float = 0.995, prior_rounds: float = 8.0):
        if not 0.0 < decay <= 1.0 or prior_rounds <= 0:
            raise ValueError(f"decay must be in (0, 1] and prior_rounds > 0, got {decay}, {prior_rounds}")
        self.decay = decay
        self.predicted = np.full(gamma, prior_rounds)            # Σ predicted survival per position
        self.realised = np.full(gamma, prior_rounds)             # Σ accepted (0/1) per position
        self.hits = np.ones(gamma)                               # population: Σ accepted (0/1)
        self.verified = np.ones(gamma)                           # population: Σ rounds verified
        self._derived: tuple[np.ndarray, np.ndarray] | None = None   # (factors, realised) until observed

    def observe(self, survival, verified: int, accepted: int) -> None:
        """survival [γ] predicted for a round that verified `verified` drafts and accepted `accepted`."""
        if verified == 0:
            return
        survival = np.asarray(survival, dtype=np.float64)
        self.predicted[:verified] = self.decay * self.predicted[:verified] + survival[:verified]
        hits = (np.arange(verified) < accepted).astype(np.float64)
        self.realised[:verified] = self.decay * self.realised[:verified] + hits
        self.hits[:verified] = self.decay * self.hits[:verified] + hits
        self.verified[:verified] = self.decay * self.verified[:verified] + 1.0
        self._derived = None

    def _derive(self) -> tuple[np.ndarray, np.ndarray]:
        """Both read-only views of the sums, computed once between observations: the planner
        reads them every step, and under load most steps observe nothing."""
        if self._derived is None:
            factors = self.realised / np.maximum(self.predicted, 1e-6)
            rate = np.clip(self.hits / np.maximum(self.verified, 1e-6), 0.0, 1.0)
            realised = np.minimum.accumulate(rate, axis=-1)
            factors.setflags(write=False)
            realised.setflags(write=False)
            self._derived = (factors, realised)
        return self._derived

    @property
    def factors(self) -> np.ndarray:
        """[γ] realised / predicted."""
        return self._derive()[0]

    @property
    def realised_survival(self) -> np.ndarray:
        """[γ] the share of verified drafts accepted at each position, non-increasing, in [0, 1]."""
        return self._derive()[1]

    def apply(self, survival) -> np.ndarray:
        """[..., γ] -> corrected survival, non-increasing along the block and within [0, 1]."""
        corrected = np.clip(np.asarray(survival, dtype=np.float64) * self.factors, 0.0, 1.0)
        return np.minimum.accumulate(corrected, axis=-1)
