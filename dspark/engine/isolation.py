"""One request's fault fails that request alone, not every request that shared its step.

A step is one forward over every scheduled request, so an error raised inside it (building the
sampling tensors, the forward, sampling, acceptance) does not say which request caused it.
Nothing of a step is committed before it returns, and the K/V it wrote lies beyond every
request's committed length, so its requests can simply run again: one at a time, in the steps
that follow. The request that fails alone is failed; the others continue with exactly the
tokens they would have had (a seeded request's noise is a function of its seed and position,
sampler.NoiseKey, so a retried step draws it again). A failure that no request reproduces alone
is not retried a second time: the next failed step fails its requests, so a fault of the batch
as a whole cannot loop.
"""

from __future__ import annotations

import logging
from collections import deque

from dspark.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class FailureIsolation:
    def __init__(self):
        self.suspects: deque[str] = deque()      # request ids still to be run alone
        self.culprit_found = False               # the current isolation failed a request alone
        self.unexplained = False                 # the last isolation found no culprit
        self.isolations = 0                      # failed steps retried one request at a time
        self.failed_requests = 0                 # requests failed by an engine error

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def begin(self, request_ids: list[str], error: BaseException) -> bool:
        """After a failed step of several requests: isolate them (True), or fail them all
        (False) when there is one request, or the previous isolation explained nothing."""
        if len(request_ids) <= 1 or self.unexplained:
            self.unexplained = False
            return False
        logger.warning("a step of %d requests failed (%s: %s); running them one at a time to find "
                       "the one that fails", len(request_ids), type(error).__name__, error)
        self.suspects.extend(request_ids)
        self.culprit_found = False
        self.isolations += 1
        return True

    def next_suspect(self, requests: dict[str, Sequence]) -> Sequence | None:
        """The next suspect still running (finished or aborted ones are skipped)."""
        while self.suspects:
            seq = requests.get(self.suspects[0])
            if seq is not None and seq.status == SequenceStatus.RUNNING:
                return seq
            self.suspects.popleft()
        return None

    def done_with(self, seq: Sequence, failed: bool) -> None:
        if self.suspects and self.suspects[0] == seq.request_id:
            self.suspects.popleft()
        self.culprit_found |= failed
        if not self.suspects:
            self.unexplained = not self.culprit_found
            if self.unexplained:
                logger.warning("no request failed alone: the next failed step fails all its requests")

    def step_succeeded(self) -> None:
        self.unexplained = False
